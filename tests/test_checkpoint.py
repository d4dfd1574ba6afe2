"""Checkpoints that recover: a damaged newest checkpoint, a lost or damaged `latest` pointer,
retention, killed saves, the umask, a full disk and a read-only folder, on real files and
file systems (tmpfs mounts where the test runs as root). Checkpoints are atomic: a process killed
while it writes one leaves every checkpoint file loadable, and a file is on the disk before it is
renamed into place. An intermediate checkpoint loads in open_clip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import open_clip
import pytest
import torch

from clipscale.checkpoint import (
    LATEST,
    CheckpointError,
    check_writable,
    latest_checkpoint,
    load_latest,
    remove_partial_saves,
    resolve_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from clipscale.errors import StorageError

from tests.helpers.tiny_runs import REPO
from tests.helpers.trainer_harness import load, max_difference
from tests.helpers.trainer_harness import step_checkpoints as checkpoint_files  # {step: path}, by file name


def _state(step: int, numel: int = 1000) -> dict:
    return {"step": step, "state_dict": {"w": torch.full((numel,), float(step))}}


def _checkpoints(folder: Path, steps, **retention) -> Path:
    for step in steps:
        save_checkpoint(folder, step, _state(step), **retention)
    return folder


def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_it_loads(tmp_path):
    folder = _checkpoints(tmp_path / "checkpoints", [10, 20, 30])
    newest = folder / "step_00000030.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a copy that died half-way
    said = []
    path, checkpoint = load_latest(folder, report=said.append)
    assert path == folder / "step_00000020.pt" and checkpoint["step"] == 20
    assert str(newest) in said[0] and "does not load" in said[0] and "Error" in said[0], said
    assert said[1] == f"falling back to {path}, the newest checkpoint that loads"


def test_damage_to_latest_cannot_reach_a_checkpoint(tmp_path):
    folder = _checkpoints(tmp_path / "checkpoints", [10, 20])
    assert (folder / LATEST).read_text() == "step_00000020.pt\n"
    intact = (folder / "step_00000020.pt").read_bytes()
    with open(folder / LATEST, "r+b") as f:  # damage in place: a hard link would pass it on
        f.write(b"\xff\x00garbage" * 10)
    assert (folder / "step_00000020.pt").read_bytes() == intact
    assert latest_checkpoint(folder) == folder / "step_00000020.pt"
    assert load_latest(folder, report=pytest.fail)[1]["step"] == 20


def test_a_deleted_latest_still_resumes_from_the_newest_checkpoint(tmp_path):
    folder = _checkpoints(tmp_path / "run" / "checkpoints", [10, 20])
    (folder / LATEST).unlink()
    assert load_latest(folder, report=pytest.fail)[1]["step"] == 20
    resolved = {"run": "step_00000020.pt", "run/checkpoints": "step_00000020.pt",
                "run/checkpoints/latest.pt": "step_00000020.pt", "run/checkpoints/step_00000010.pt": "step_00000010.pt"}
    for given, name in resolved.items():
        assert resolve_checkpoint(tmp_path / given) == folder / name, given


def test_when_no_checkpoint_loads_the_error_names_the_newest(tmp_path):
    folder = _checkpoints(tmp_path / "checkpoints", [10, 20])
    for _, path in step_checkpoints(folder):
        path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints in .* loads \(the newest, step_00000020.pt: "):
        load_latest(folder, report=lambda line: None)
    assert load_latest(tmp_path / "nothing-here") is None


def test_retention_keeps_the_newest_and_every_kth(tmp_path):
    kept = _checkpoints(tmp_path / "a", range(10, 80, 10), keep=2, keep_every=20)
    assert [step for step, _ in step_checkpoints(kept)] == [70, 60, 40, 20]
    everything = _checkpoints(tmp_path / "b", range(10, 80, 10), keep=None)
    assert len(step_checkpoints(everything)) == 7


def test_a_killed_save_leaves_a_temporary_file_that_the_next_start_removes(tmp_path):
    """A real save killed with SIGKILL while it writes (its pickling blocks, after the file is open)."""
    folder = tmp_path / "run" / "checkpoints"
    _checkpoints(folder, [10])
    killed_save = (
        "import sys, time, torch\n"
        "from pathlib import Path\n"
        "from clipscale.checkpoint import save_checkpoint\n"
        "class Slow:\n"
        "    def __reduce__(self):\n"
        "        print('writing', flush=True); time.sleep(60); return (int, ())\n"
        "save_checkpoint(Path(sys.argv[1]), 20, {'step': 20, 'w': torch.zeros(10), 'slow': Slow()})\n"
    )
    save = subprocess.Popen([sys.executable, "-c", killed_save, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert save.stdout.readline() == "writing\n"
    save.send_signal(signal.SIGKILL)
    save.wait(timeout=30)
    (tmp_path / "run" / ".open_clip_pytorch_model.bin.1-beef.tmp").write_bytes(b"partial")  # the final weights' save
    stale = sorted(p.name for p in (tmp_path / "run").rglob(".*.tmp"))
    assert len(stale) == 2 and stale[1].startswith(".step_00000020.pt."), stale
    assert sorted(p.name for p in remove_partial_saves(tmp_path / "run")) == stale
    assert not list((tmp_path / "run").rglob(".*.tmp"))
    assert latest_checkpoint(folder) == folder / "step_00000010.pt"


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_checkpoints_are_created_with_the_users_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        folder = _checkpoints(tmp_path / "checkpoints", [10])
        control = tmp_path / "plain"
        control.write_text("")  # what any program creates under this umask
    finally:
        os.umask(previous)
    expected = control.stat().st_mode & 0o777
    assert expected == 0o666 & ~umask
    for name in ("step_00000010.pt", LATEST):
        assert (folder / name).stat().st_mode & 0o777 == expected, name


def test_a_full_disk_is_one_line_naming_the_file_and_the_previous_checkpoint_stays(mounted):
    folder = mounted("400k") / "run" / "checkpoints"
    save_checkpoint(folder, 10, _state(10, numel=50_000))  # 200 kB: a second one does not fit beside it
    with pytest.raises(StorageError) as raised:
        save_checkpoint(folder, 20, _state(20, numel=50_000))
    assert str(raised.value) == f"cannot write {folder / 'step_00000020.pt'}: no space left on the device"
    assert load_latest(folder, report=pytest.fail)[1]["step"] == 10
    assert not list(folder.glob(".*.tmp"))  # the failed save cleaned up after itself


def test_the_preflight_finds_a_full_disk_and_a_read_only_folder(mounted):
    full = mounted("64k")
    with pytest.raises(OSError):  # fill it up
        (full / "filler").write_bytes(bytes(128 * 1024))
    with pytest.raises(StorageError, match=f"cannot write to {full}: no space left on the device"):
        check_writable(full / "runs" / "tiny")
    read_only = mounted("64k", read_only=True)
    with pytest.raises(StorageError, match=f"cannot write to {read_only / 'runs'}: the file system is read-only"):
        check_writable(read_only / "runs" / "tiny")
    check_writable(full.parent / "elsewhere" / "runs" / "tiny")  # a writable one passes, created or not


# --- atomic writes ---------------------------------------------------------------------------

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
    checkpoints = checkpoint_files(folder.parent)
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


# --- open_clip's layout ------------------------------------------------------------------------


def test_an_intermediate_checkpoint_loads_in_open_clip(digits_run):
    """step_2's weights, not the final ones: the loaded model must equal the checkpoint and differ from the run's end."""
    run_dir, _ = digits_run
    model = open_clip.create_model(f"local-dir:{run_dir}")  # the run folder: the final weights
    final = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint = load(checkpoint_files(run_dir)[2])
    open_clip.load_checkpoint(model, str(checkpoint_files(run_dir)[2]))
    loaded = model.state_dict()
    assert max_difference({k: loaded[k] for k in checkpoint["state_dict"]}, checkpoint["state_dict"]) == 0.0
    assert max_difference({k: final[k] for k in checkpoint["state_dict"]}, checkpoint["state_dict"]) > 1e-4
