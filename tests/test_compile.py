"""Compiled towers (`model.compile`, clipscale/compile.py) in Gradient Cache's two passes.

torch.compile with the "aot_eager" backend runs here without a GPU or a C compiler: dynamo
traces the towers and AOTAutograd splits forward and backward, as with Inductor, and the graphs
run ATen's own kernels. So the gradients must equal the eager step's to float32 rounding, dropout
and patch dropout included (the RNG replay must reach the compiled graphs), and the graphs made in
the first step must serve every later one. The same check with Inductor on a GPU is
tests/test_gpu_compile.py.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from clipscale.compile import PORTABLE_CACHE, CompilePolicy, compile_enabled, compile_towers, seconds_compiling
from clipscale.config import load_config
from clipscale.gradcache import GradCache

from tests.helpers.gradients import float64_clip_loss, grads_of, make_batch, plain_grads, relative_error, tiny_clip
from tests.helpers.tiny_runs import REPO


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def step_grads(model, images, texts, chunk_size, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = GradCache(model, float64_clip_loss, chunk_size)(images, texts)
    return loss, grads_of(model)


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_the_compiled_gradient_cache_step_equals_the_eager_one(tmp_path, dropout):
    eager = tiny_clip(dropout)
    compiled = copy.deepcopy(eager)
    compile_towers(compiled, tmp_path / "cache", backend="aot_eager")
    images, texts = make_batch(10, seed=0)  # chunks of 4: 4, 4 and a short last chunk of 2
    for seed in (1, 2, 3):  # three steps: the first compiles, the others reuse its graphs
        # The reference: one graph over the batch, the eager towers called chunk by chunk (no replay
        # needed): Gradient Cache equals it only if pass 2 re-draws pass 1's masks.
        want_loss, want = plain_grads(eager, float64_clip_loss, images, texts, chunk_size=4, seed=seed)
        got_loss, got = step_grads(compiled, images, texts, chunk_size=4, seed=seed)
        assert abs(got_loss.item() - want_loss.item()) < 1e-6
        assert relative_error(got, want) < 1e-5, f"step with seed {seed}"
        if seed == 1:
            graphs_after_first_step = counters["stats"]["unique_graphs"]
    assert graphs_after_first_step > 0, "nothing was compiled"
    assert counters["stats"]["unique_graphs"] == graphs_after_first_step, "a later step compiled new graphs"


def test_the_time_compiling_counts_the_backward_compiled_when_it_first_runs(tmp_path):
    """AOTAutograd compiles a graph's backward when the backward first runs, outside the forward's
    compilation: the first step's "compiling the towers took" line counts both (it missed about
    30 s of a first step at 65,536 on an H200)."""
    model = tiny_clip()
    compile_towers(model, tmp_path / "cache", backend="aot_eager")
    images, _ = make_batch(4, seed=0)
    features = model.encode_image(images)
    after_forward = seconds_compiling()
    features.sum().backward()
    assert after_forward > 0 and seconds_compiling() > after_forward


def test_compilation_is_on_by_default_on_a_gpu_only():
    assert compile_enabled("auto", torch.device("cuda")) and not compile_enabled("auto", torch.device("cpu"))
    assert compile_enabled(True, torch.device("cpu")) and not compile_enabled(False, torch.device("cuda"))


def test_one_policy_decides_what_the_trainer_and_its_benchmarks_compile(tmp_path):
    """The shipped config's auto settings: compiled towers and CUDA graphs on a GPU with Gradient
    Cache (several chunks), not under FSDP, not in a plain step, nothing on a CPU; the cache in the
    caller's folder unless model.compile_cache names one."""
    model_cfg = load_config("configs/vit_b16_infcl.yaml", []).model
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert CompilePolicy.of(model_cfg, cuda, "ddp", chunks=4) == CompilePolicy(True, True, None)
    assert CompilePolicy.of(model_cfg, cuda, "fsdp", chunks=4) == CompilePolicy(True, False, None)
    assert CompilePolicy.of(model_cfg, cuda, "ddp", chunks=1) == CompilePolicy(True, False, None)
    on_cpu = CompilePolicy.of(model_cfg, cpu, "ddp", chunks=4)
    assert on_cpu == CompilePolicy(False, False, None) and on_cpu.apply(torch.nn.Linear(2, 2), tmp_path) == []
    assert CompilePolicy(True, False, None).cache_dir(tmp_path / "run") == tmp_path / "run"
    named = load_config("configs/vit_b16_infcl.yaml", [f"model.compile_cache={tmp_path / 'shared'}"]).model
    assert CompilePolicy.of(named, cuda, "ddp", chunks=4).cache_dir(tmp_path / "run") == tmp_path / "shared"


def test_compiled_code_is_cached_in_the_folder_given(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compile_towers(tiny_clip(0.0), tmp_path / "runs" / "x" / "compile_cache", backend="aot_eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "runs" / "x" / "compile_cache").resolve())


def test_a_portable_cache_that_does_not_load_is_one_line_and_the_towers_compile_anew(tmp_path):
    """model.compile_cache copied from elsewhere: torch.compiler's artifacts written by another torch,
    or damaged, are refused with one line (not torch's traceback), and the towers still compile."""
    (tmp_path / PORTABLE_CACHE).write_bytes(b"written by another torch")
    model = tiny_clip(0.0)
    notes = compile_towers(model, tmp_path, backend="aot_eager")
    assert len(notes) == 1 and "does not load" in notes[0] and str(tmp_path / PORTABLE_CACHE) in notes[0]
    images, texts = make_batch(4, seed=0)
    assert model(images, texts)[0].shape[0] == 4
    assert compile_towers(tiny_clip(0.0), tmp_path / "none", backend="aot_eager") == []  # no cache there: nothing to say


def test_a_cpu_step_does_not_import_the_cuda_graph_machinery():
    """Gradient Cache marks each chunk's call for CUDA graphs; on a CPU there are none, and the
    marker's first call would import torch's CUDA-graph trees (a second or two of every CPU run)."""
    probe = ("import sys, torch\n"
             "from clipscale.gradcache import GradCache\n"
             "from tests.helpers.gradients import float64_clip_loss, make_batch, tiny_clip\n"
             "GradCache(tiny_clip(), float64_clip_loss, chunk_size=4)(*make_batch(6, seed=0))\n"
             "print('torch._inductor.cudagraph_trees' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


@pytest.fixture
def attention_switches():
    """torch's attention switches, put back as they were after the test."""
    from clipscale.compile import ATTENTION_BACKENDS

    before = {name: getattr(torch.backends.cuda, switch.replace("enable_", "") + "_enabled")()
              for name, switch in ATTENTION_BACKENDS.items()}
    yield
    for name, switch in ATTENTION_BACKENDS.items():
        getattr(torch.backends.cuda, switch)(before[name])


def attention_kernels(model) -> set[str]:
    """The ATen attention and softmax operations one forward of `model` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.__name__ or "softmax" in func.__name__:
                seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    images, texts = make_batch(4, seed=0)
    with Recording():
        model(images, texts)
    return seen


def test_the_attention_kernels_named_in_the_environment_are_the_only_ones_the_towers_may_use(tmp_path, monkeypatch,
                                                                                             attention_switches):
    """CLIPSCALE_ATTENTION (a benchmark's switch) leaves F.scaled_dot_product_attention only the
    backends it names, set before the towers are traced; a name it does not know is one error line
    and changes nothing."""
    from clipscale.errors import UserError

    model = tiny_clip(0.0)
    assert attention_kernels(model) == {"_scaled_dot_product_flash_attention_for_cpu"}  # torch's choice on a CPU
    monkeypatch.setenv("CLIPSCALE_ATTENTION", "fast")
    with pytest.raises(UserError, match="CLIPSCALE_ATTENTION=fast: name attention backends among flash, cudnn"):
        compile_towers(model, tmp_path, backend="aot_eager")
    assert torch.backends.cuda.flash_sdp_enabled()
    monkeypatch.setenv("CLIPSCALE_ATTENTION", "math")
    compile_towers(model, tmp_path, backend="aot_eager")
    assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    assert attention_kernels(model) == {"_safe_softmax"}  # the math backend: matrix products and a softmax
