"""Checkpoints are atomic: a process killed while it writes one leaves every checkpoint file loadable,
and a file is on the disk before it is renamed into place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from clipscale.checkpoint import save_checkpoint

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


def test_a_checkpoint_reaches_the_disk_before_it_takes_the_final_name(tmp_path, monkeypatch):
    """A kill cannot show a missing fsync (the page cache outlives the process); a power loss
    can: the rename may reach the disk before the data, leaving an empty file under the final
    name. Only the order of the calls shows it: each file renamed into place was fsynced first."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    folder = tmp_path / "checkpoints"
    save_checkpoint(folder, 1, {"step": 1, "state_dict": {"w": torch.ones(3)}})
    renamed = {call[2] for call in calls if call[0] == "replace"}
    assert os.path.realpath(folder / "step_00000001.pt") in renamed
    for i, call in enumerate(calls):
        if call[0] == "replace":
            assert ("fsync", call[1]) in calls[:i], f"{call[2]} was renamed into place before its data was fsynced"
