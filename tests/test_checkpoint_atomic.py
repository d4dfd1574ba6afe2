"""Checkpoints are atomic: a process killed while it writes one leaves every checkpoint file loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from tiny_runs import REPO
from trainer_harness import load, step_checkpoints

# Step 1 small; step 2 about 400 MB in 4,000 tensors, long enough to be caught half-written.
WRITER = """
import sys, torch
from pathlib import Path
from clipscale.checkpoint import save_checkpoint
folder = Path(sys.argv[1])
save_checkpoint(folder, 1, {"step": 1, "state_dict": {"w": torch.ones(3)}})
print("first saved", flush=True)
sys.stdin.readline()
save_checkpoint(folder, 2, {"step": 2, "state_dict": {f"w{i}": torch.full((25_000,), float(i)) for i in range(4_000)}})
print("second saved", flush=True)
"""


def test_a_process_killed_while_saving_leaves_every_checkpoint_loadable(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert writer.stdout.readline().strip() == "first saved"
    first = set(folder.iterdir())
    writer.stdin.write("go\n")
    writer.stdin.flush()
    deadline, caught = time.time() + 120, None
    while caught is None:
        assert writer.poll() is None and time.time() < deadline, "the second save ended before it could be killed"
        growing = [p for p in folder.iterdir() if p not in first and p.is_file() and p.stat().st_size > 0]
        caught = growing[0].stat().st_size if growing else None
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=60)
    assert 0 < caught < 100_000_000, "not killed in the middle of the write"
    checkpoints = step_checkpoints(folder.parent)
    assert 1 in checkpoints
    for step, path in checkpoints.items():
        assert load(path)["step"] == step, path  # a truncated file would fail to load
    assert torch.equal(load(checkpoints[1])["state_dict"]["w"], torch.ones(3))
