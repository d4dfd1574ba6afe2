"""Tiny training runs for tests: a model that learns digits in a few seconds, launched for real."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DIGITS_YAML = str(REPO / "configs" / "digits.yaml")
TRAIN = str(REPO / "train.py")

# A model small enough for a few seconds of CPU training. The override merges into digits.yaml's
# model.custom, so every key that file sets is set here too (its pooling and patch dropout).
TINY_MODEL = (
    "model.custom={embed_dim: 32, "
    "vision_cfg: {image_size: 32, patch_size: 8, width: 64, layers: 2, head_width: 32, mlp_ratio: 2.0, "
    "pool_type: tok, patch_dropout: 0.0}, "
    "text_cfg: {context_length: 16, vocab_size: 49408, width: 64, heads: 2, layers: 2, mlp_ratio: 2.0}}"
)
# The same with open_clip's patch dropout: a resumed run must replay its random draws.
DROPOUT_MODEL = TINY_MODEL.replace("patch_dropout: 0.0}", "patch_dropout: 0.5}")
assert DROPOUT_MODEL != TINY_MODEL


def tiny_run(digits_root: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        TINY_MODEL,
        f"data.root={digits_root}",
        f"run.output_dir={output_dir}",
        "run.name=tiny",
        "train.batch_size=64",
        "train.log_every=1",
        "optim.warmup_steps=5",
        "optim.lr=2e-3",
        "eval.every_n_steps=0",
        *extra,
    ]


def run_train(overrides: list[str], *, nproc: int = 1, timeout: float = 240, script: str = TRAIN) -> subprocess.CompletedProcess:
    """`script` (train.py) in its own process group, under torchrun for nproc > 1 (standalone: a
    free port of its own, so runs in parallel test workers never meet); on a timeout every
    process below it is killed, then it raises."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    # PYTHONFAULTHANDLER: a run that never ends shows where each of its processes' threads stood.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([*launcher, script, "--config", DIGITS_YAML, *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = communicate_or_dump(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def communicate_or_dump(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """proc's output once it ends; if it has not ended within `timeout`, every Python process below
    it writes its threads' stacks (PYTHONFAULTHANDLER, SIGABRT), all are killed and the assertion
    shows the last output and the stacks."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: killing the launcher's group would
        # leave them running, holding the output pipes open, and the test would wait forever.
        kill_tree(proc.pid, signal.SIGABRT)
        time.sleep(3)
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"run did not end within {timeout} s (a hang?); its last output:\n{(stdout or '')[-1500:]}\n"
                             f"and its stacks:\n{(stderr or '')[-8000:]}") from None


def kill_tree(pid: int, sent: int = signal.SIGKILL) -> None:
    """`sent` (SIGKILL) to `pid` and every process below it, found through /proc's parent links."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [pid], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    for each in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, sent)
