"""Session setup, and the fixtures that test modules in several folders share (helpers/ holds the
functions they share)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

# One thread per test process, inherited by the runs it starts: pytest-xdist runs a worker per
# core, and OpenMP threads spinning for a core that another worker holds cost more than they give.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from _pytest.mark.expression import Expression  # noqa: E402

from tests.helpers.triton_interpreter import interpreter_env  # noqa: E402

GPU_SUITE = "python -m pytest -m gpu -n 0 tests"


def is_gpu_session(config) -> bool:
    """`-m gpu` (the GPU suite alone) on a machine with CUDA: Triton compiles for the GPU."""
    markexpr = config.getoption("markexpr") or ""
    if not markexpr or not torch.cuda.is_available():
        return False
    selects = Expression.compile(markexpr).evaluate
    return selects(lambda name, **_: name == "gpu") and not selects(lambda name, **_: False)


def pytest_ignore_collect(collection_path, config):
    """The GPU suite's session imports only its own modules (test_gpu_*.py, in any folder): the
    others run the Triton programs in the interpreter (tests/losses/infcl/test_kernels.py,
    tests/data/test_crop_resize.py), which needs Triton's library imported for it."""
    name = collection_path.name
    if getattr(config, "gpu_session", False) and name.startswith("test_") and not name.startswith("test_gpu_"):
        return True
    return None


def pytest_configure(config):
    """Triton decides when it is first imported whether its own @jit library functions are
    interpreted, and torch, timm or open_clip may import it before the kernel tests set
    TRITON_INTERPRET=1; kernels run later would then fail. So it is imported here, before any
    test module: in interpreter mode for the CPU tests, compiled for the GPU suite (one mode a
    process: the two never run in one session)."""
    config.gpu_session = is_gpu_session(config)
    if not config.gpu_session:
        with interpreter_env():
            import triton.language  # noqa: F401


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    """The digits shards, written once per test session."""
    # Imported here, not at the top: clipscale.data imports torchvision, which imports Triton, and
    # Triton must first be imported in pytest_configure, in the session's mode.
    from clipscale.data.digits import write_digits_shards

    root = tmp_path_factory.mktemp("digits")
    write_digits_shards(root, image_size=32)
    return root


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory):
    """mktemp(name) for a module's fixtures. What it made is removed when the module ends with no
    failure, as pytest's "failed" retention (pyproject) does for tmp_path: the trainer modules keep
    a checkpoint per step, and a whole session's of them filled CI's disk."""
    made, failed_before = [], request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def hf_folder(module_tmp) -> Path:
    """A two-layer BERT and its word-piece tokenizer, written with save_pretrained."""
    from tests.helpers.towers import write_tiny_bert

    return write_tiny_bert(module_tmp("tiny-bert"))


@pytest.fixture
def colour_model():
    """A RiggedModel whose captions "a red", "a green", "a blue" are the pictures' colours."""
    from tests.helpers.rigged import FEATURE, RiggedModel

    return RiggedModel({f"a {name}": feature for name, feature in FEATURE.items()})


@pytest.fixture
def templates(tmp_path) -> str:
    from tests.helpers.rigged import write_lines

    return write_lines(tmp_path / "templates.txt", ["a {c}"])


# Runs that tests in several modules read (the modules of one pytest-xdist worker share one run).


@pytest.fixture(scope="session")
def digits_run(digits_root, tmp_path_factory):
    """4 steps, evaluated at step 2 and at the end, with the held-out digits also listed under
    eval.sets (the same data, class names and prompts as the built-in zero-shot hook), a checkpoint
    at steps 2 and 4; (the run folder, the held-out shards' pattern)."""
    from tests.helpers.tiny_runs import run_train, tiny_run

    output = tmp_path_factory.mktemp("digits_run")
    manifest = json.loads((digits_root / "manifest.json").read_text())
    val = str(digits_root / f"val-{{0000..{len(manifest['val_shards']) - 1:04d}}}.tar")
    digits_set = (f"eval.sets=[{{task: wds, data: '{val}', classnames: {digits_root / 'classnames.txt'}, "
                  f"templates: {digits_root / 'templates.txt'}}}]")
    result = run_train(tiny_run(digits_root, output, "train.steps=4", "train.checkpoint_every=2", "eval.every_n_steps=2",
                                "train.log_every=2", digits_set))
    assert result.returncode == 0, result.stderr[-3000:]
    return output / "tiny", val


@pytest.fixture(scope="session")
def knob_run(digits_root, tmp_path_factory) -> Path:
    """open_clip_train's knobs in one train.py run: a const-cooldown schedule over a run length of
    384 samples (6 steps of 64), TensorBoard beside metrics.jsonl."""
    from tests.helpers.tiny_runs import run_train, tiny_run

    output = tmp_path_factory.mktemp("knobs")
    result = run_train(tiny_run(digits_root, output, "train.steps=null", "train.samples=384", "train.checkpoint_every=100",
                                "optim.lr_scheduler=const-cooldown", "optim.lr_cooldown_steps=3",
                                "optim.lr_cooldown_end=1e-4", "tensorboard.enabled=true", "eval.zeroshot=false"))
    assert result.returncode == 0, result.stderr[-3000:]
    return output / "tiny"


@pytest.fixture
def mounted(tmp_path):
    """mount(size, read_only=False): a fresh tmpfs of `size` under tmp_path, unmounted afterwards:
    a disk that fills up, or a read-only one (root ignores file modes, not a read-only mount)."""
    mounts = []

    def mount(size: str, read_only: bool = False) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        point = tmp_path / f"fs{len(mounts)}"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounts.append(point)
        if read_only:
            (point / "runs").mkdir()
            subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        return point

    yield mount
    for point in reversed(mounts):
        subprocess.run(["umount", str(point)], check=True)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject): one worker more than the cores. Much of the suite is real runs whose
    processes wait on one another (a torchrun world starting, a Slurm requeue, a kill point), and a
    third worker fills those waits: on two cores, as CI has, the whole suite took 1,521 s with three
    workers against 1,614 s with two (2026-12-07)."""
    return len(os.sched_getaffinity(0)) + 1


def pytest_collection_modifyitems(config, items):
    """Modules that are slow as a whole (chains of real runs, the Slurm cluster) first: with
    `--dist loadfile` pytest-xdist hands modules out in this order, so the longest start early
    and the short ones fill in the end. Tests marked `gpu` are skipped, saying why, outside the
    GPU suite's own session."""
    items.sort(key=lambda item: getattr(item.module, "pytestmark", None) != pytest.mark.slow)
    if config.gpu_session:
        return
    reason = (f"needs a CUDA device: the GPU suite runs on the GPU machine ({GPU_SUITE})" if not torch.cuda.is_available()
              else f"a GPU test runs in the GPU suite's own session, where Triton compiles ({GPU_SUITE})")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=reason))
