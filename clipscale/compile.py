"""Compiled towers (`model.compile`): on by default on a GPU, block by block, with a cache that travels.

torch.compile turns each transformer block's forward (and, through AOTAutograd, its backward)
into fused Triton kernels. Regional compilation: the blocks of a tower share one code object, so
dynamo compiles one block and every other block of that tower reuses its graph (torch's "regional
compilation" recipe); the patch embedding, the token embedding and the heads stay eager, a few
kernels a chunk. With `model.patch_embed: matmul` the patch embedding is compiled too, without CUDA
graphs (which would first copy each chunk's pixels into their own memory): its unfold and autocast
cast then are one kernel before the matrix product. Gradient Cache calls each tower alone, without
autograd (pass 1) and with it (pass 2), so a tower's block has two graphs. Image blocks are
compiled for static shapes (the full chunk, and a short last chunk once); text blocks with dynamic
shapes, because length-sorted text chunks (`caption_length.py`) come in several lengths, which
static shapes would compile once each (14 text graphs of the whole tower took most of a
four-minute first step).

The compiled code is cached in `cache_dir` (the run folder's, or `model.compile_cache`): Inductor's
FX graph and AOTAutograd caches and the Triton kernels, and, after the first step,
`portable_cache.bin`, torch.compiler's cache artifacts: copied with the folder to another machine of
the same kind (a Slurm node, a second machine), they load before the first step, which then
compiles nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from clipscale.errors import UserError

# Graphs of a block's forward: {image: full and last chunk, text: dynamic} x {no grad, grad}, and
# evaluation's batch sizes in eval mode. Past the limit dynamo runs the block eagerly.
RECOMPILE_LIMIT = 64
# torch._dynamo's timers of a graph's compilation: the forward (with its backward where compiled at
# once) and a backward compiled when it first runs, outside the forward's (lazily, torch's default):
# py-spy saw about 30 s of the first step at 65,536 on an H200 there, which its line did not count.
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")
PORTABLE_CACHE = "portable_cache.bin"
# The attention kernels F.scaled_dot_product_attention may choose from (torch.backends.cuda's
# switches): all of them, torch's choice, unless CLIPSCALE_ATTENTION names some, comma-separated.
# A benchmark's switch (issue 49): at ViT-B/32's 50 tokens, cuDNN's flash kernels took 17% of the
# ceiling's kernel time for about 1% of its FLOPs (results/bench_ceiling_h200_kernel_account_b32_b16.json);
# none of them beat it, and such sequences now take clipscale's own kernel (model.attention, clipscale/attention.py).
ATTENTION_BACKENDS = {"flash": "enable_flash_sdp", "cudnn": "enable_cudnn_sdp", "efficient": "enable_mem_efficient_sdp",
                      "math": "enable_math_sdp"}


@dataclass(frozen=True)
class CompilePolicy:
    """What a run compiles (model.compile, model.cuda_graphs, model.compile_cache), decided once for
    the trainer and every benchmark that measures its step:

        policy = CompilePolicy.of(cfg.model, device, cfg.train.parallel, chunks=per_rank_batch // chunk)
        step = TrainStep(..., cuda_graphs=policy.cuda_graphs)
        notes = policy.apply(model, default_cache=run_dir / "compile_cache")
    """

    compiled: bool
    cuda_graphs: bool
    cache: str | None  # model.compile_cache; None: the caller's default folder

    @classmethod
    def of(cls, model_cfg, device: torch.device, parallel: str, chunks: int) -> "CompilePolicy":
        compiled = compile_enabled(model_cfg.compile, device)
        return cls(compiled, cuda_graphs_enabled(model_cfg.cuda_graphs, compiled, device, parallel, chunks),
                   model_cfg.compile_cache)

    def cache_dir(self, default_cache: Path) -> Path:
        return Path(self.cache or default_cache)

    def apply(self, model: nn.Module, default_cache: Path) -> list[str]:
        """Compile `model`'s towers in place when the policy compiles (`compile_towers`); the lines
        the run says of the cache."""
        if not self.compiled:
            return []
        return compile_towers(model, self.cache_dir(default_cache), cuda_graphs=self.cuda_graphs)


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """model.compile as it applies on `device`: "auto" compiles on a GPU only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def cuda_graphs_enabled(setting: bool | str, compiled: bool, device: torch.device, parallel: str, chunks: int) -> bool:
    """model.cuda_graphs as it applies: "auto" where the towers are compiled on a GPU, not under FSDP,
    and a batch is encoded in several chunks (Gradient Cache). In a plain step each block runs once
    a step, so CUDA graph trees warm up and record over the first steps, and at ViT-B/16 512 on an
    H100 the steady step was no faster (results/bench_e2e_h100_b16_512_cuda_graphs_or_not.json)."""
    if setting == "auto":
        return compiled and device.type == "cuda" and parallel != "fsdp" and chunks > 1
    return bool(setting) and compiled


def compile_towers(model: nn.Module, cache_dir: Path, backend: str = "inductor", cuda_graphs: bool = False) -> list[str]:
    """Compile each block of `model`'s two towers in place (its state_dict keys stay open_clip's;
    under FSDP the blocks are the sharded units), caching under `cache_dir` and loading its
    portable cache first. A model without lists of blocks is compiled whole. `backend`:
    torch.compile's (the tests use "aot_eager", which needs no compiler). `cuda_graphs`: each
    block replayed as CUDA graphs ("reduce-overhead"), where the model has lists of blocks (their
    outputs feed the towers' eager heads, so no feature lives in the graphs' memory); the step must
    know it (`TrainStep(cuda_graphs=True)`). Returns the lines the run says of the cache."""
    from clipscale.models import PatchMatmul
    from clipscale.parallel import ParallelError, tower_blocks  # the blocks FSDP shards are the ones compiled

    allow_attention_backends(os.environ.get("CLIPSCALE_ATTENTION"))  # before tracing: Inductor fixes the kernel then
    cache_dir = cache_dir.resolve()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # Inductor's FX graph, AOTAutograd and Triton caches
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # A block compiled inside DDP's forward would be split at DDP's gradient buckets (Dynamo's
    # DDPOptimizer, so each bucket's all-reduce overlaps the rest of the backward): ViT-B/32's
    # blocks into two graphs each. Gradient Cache reduces once a step, in its last chunk's
    # backward, so the split buys no overlap and costs the fusions across it.
    torch._dynamo.config.optimize_ddp = False
    notes = load_portable_cache(cache_dir / PORTABLE_CACHE)
    try:
        towers = tower_blocks(model)
    except ParallelError:
        model.compile(backend=backend, dynamic=False)
        return notes
    mode = "reduce-overhead" if cuda_graphs else None
    for tower, blocks in towers:
        for block in blocks:
            block.compile(backend=backend, dynamic=tower == "text", mode=mode)
    patch_embedding = getattr(model.visual, "conv1", None)
    if isinstance(patch_embedding, PatchMatmul):  # model.patch_embed: matmul (see the module docstring)
        patch_embedding.compile(backend=backend, dynamic=False)
    return notes


def allow_attention_backends(names: str | None) -> None:
    """Let F.scaled_dot_product_attention choose only among `names` ("flash,cudnn", say; None or
    empty: leave torch's switches as they are), for the whole process."""
    if not names:
        return
    allowed = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in allowed if name not in ATTENTION_BACKENDS]
    if unknown or not allowed:
        raise UserError(f"CLIPSCALE_ATTENTION={names}: name attention backends among {', '.join(ATTENTION_BACKENDS)}")
    for name, switch in ATTENTION_BACKENDS.items():
        getattr(torch.backends.cuda, switch)(name in allowed)


def load_portable_cache(path: Path) -> list[str]:
    """Load torch.compiler's cache artifacts from `path` if it is there; one line when they do not
    load (another torch version wrote them, or the file is damaged): the run then compiles anew.
    torch's own report of that is a traceback in a warning, kept off the console."""
    if not path.is_file():
        return []
    cache_log = logging.getLogger("torch.compiler._cache")
    level = cache_log.level
    cache_log.setLevel(logging.ERROR)
    try:
        loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
    finally:
        cache_log.setLevel(level)
    if loaded is None:
        return [f"model.compile_cache: {path} does not load in this torch {torch.__version__} (written by another "
                "version, or damaged); compiling anew, and the first step writes it again"]
    return [f"model.compile_cache: compiled code loaded from {path}"]


def begin_graph_step() -> None:
    """The towers' next call begins and what their previous calls returned has been used (copied out
    of the towers, or backpropagated): towers replayed as CUDA graphs may reuse their graphs' memory
    (torch.compiler's step marker). Called before each chunk's encoding and each evaluation batch;
    without CUDA graphs it does nothing. A process that has not used CUDA has no graphs to mark, and
    the marker's first call imports torch's CUDA-graph trees: a second or two of every CPU run."""
    if torch.cuda.is_initialized():
        torch.compiler.cudagraph_mark_step_begin()


def save_portable_cache(cache_dir: Path) -> None:
    """Write what this process compiled as torch.compiler's cache artifacts into `cache_dir`
    (atomically), for a first step elsewhere that compiles nothing."""
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    written = cache_dir / f".{PORTABLE_CACHE}.{os.getpid()}"
    written.write_bytes(artifacts[0])
    written.replace(cache_dir / PORTABLE_CACHE)


def seconds_compiling() -> float:
    """Seconds this process has spent compiling graphs so far (torch._dynamo's own timers)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(name, ())) for name in COMPILE_TIMERS)
