"""Session setup and fixtures shared by the test modules."""

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

from triton_interpreter import interpreter_env  # noqa: E402

GPU_SUITE = "python -m pytest -m gpu -n 0 tests"


def is_gpu_session(config) -> bool:
    """`-m gpu` (the GPU suite alone) on a machine with CUDA: Triton compiles for the GPU."""
    markexpr = config.getoption("markexpr") or ""
    if not markexpr or not torch.cuda.is_available():
        return False
    selects = Expression.compile(markexpr).evaluate
    return selects(lambda name, **_: name == "gpu") and not selects(lambda name, **_: False)


def pytest_ignore_collect(collection_path, config):
    """The GPU suite's session imports only its own modules (tests/test_gpu_*.py): the others
    run the Triton programs in the interpreter (test_kernels, test_crop_resize), which needs
    Triton's library imported for it."""
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
