"""Tiny training runs for tests: a model that learns digits in a few seconds, launched for real."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
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


JOB_MARK = "CLIPSCALE_TEST_JOB"  # in the environment of every process a test launches: found even once orphaned


def job_env(**extra: str) -> dict:
    """The environment a test's launched run gets: one thread a process, no wandb, stacks on SIGABRT
    (PYTHONFAULTHANDLER: a run that never ends shows where each of its threads stood) and a mark of
    its own, inherited by every process below it (`job_processes`)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONFAULTHANDLER": "1",
            JOB_MARK: uuid.uuid4().hex, **extra}


def run_train(overrides: list[str], *, nproc: int = 1, timeout: float = 240, script: str = TRAIN,
              launcher: str = "torch.distributed.run") -> subprocess.CompletedProcess:
    """`script` (train.py) in its own process group, under `launcher` (torchrun, or clipscale's
    `clipscale.torchrun`) for nproc > 1 (standalone: a free port of its own, so runs in parallel
    test workers never meet); on a timeout every process of the run is killed, then it raises."""
    launcher = [sys.executable, "-m", launcher, "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 \
        else [sys.executable]
    env = job_env()
    proc = subprocess.Popen([*launcher, script, "--config", DIGITS_YAML, *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = communicate_or_dump(proc, timeout, env[JOB_MARK])
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def communicate_or_dump(proc: subprocess.Popen, timeout: float, mark: str) -> tuple[str, str]:
    """proc's output once it and every process holding its pipes have ended. If that takes longer
    than `timeout`, each process of the job (`job_processes`: below it, or marked with `mark` by
    `job_env`, as an orphan still holding its pipes is) writes its threads' stacks (SIGABRT), all are killed and the assertion shows
    the last output and the stacks, and whether the launcher itself had ended."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher = "had not ended" if proc.poll() is None else f"had ended with {proc.returncode}, its processes not"
        for sent in (signal.SIGABRT, signal.SIGKILL):
            for pid in job_processes(proc.pid, mark):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sent)
            time.sleep(3)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"run did not end within {timeout} s (a hang?): the launcher {launcher}; its last output:\n"
                             f"{(stdout or '')[-1500:]}\nand its stacks:\n{(stderr or '')[-8000:]}") from None


def job_processes(pid: int, mark: str = "") -> list[int]:
    """`pid`, every process below it (through /proc's parent links), and every process whose
    environment holds `mark` (`job_env`): a process whose parent died is no longer below it."""
    children: dict[int, list[int]] = {}
    marked = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):  # a process that ended meanwhile
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
            children.setdefault(parent, []).append(int(stat.parent.name))
            if mark and f"{JOB_MARK}={mark}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                marked.append(int(stat.parent.name))
    found, todo = [pid], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found + [each for each in marked if each not in found]


def kill_tree(pid: int, sent: int = signal.SIGKILL) -> None:
    """`sent` (SIGKILL) to `pid` and every process below it."""
    for each in job_processes(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, sent)
