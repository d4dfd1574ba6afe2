"""One rank's process killed mid-step (SIGKILL, as the OOM killer or a lost machine does it) under
`python -m clipscale.torchrun`: the job ends in bounded time with one line that names that worker and
the status a shell expects (137), no traceback from the ranks that lost it, and the same command resumes from the last checkpoint onto the
curve of a run never interrupted. In a gloo world on the CPU, and under NCCL on two GPUs (`-m gpu`),
where the surviving rank waits inside a collective that never completes until torchrun stops it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.trainer_harness import checked, launch, shard_run, step_checkpoints, training_records, write_shards

pytestmark = pytest.mark.slow
STEPS, BATCH, CHECKPOINT_EVERY = 8, 48, 2
KILLED_AT = 5  # rank 1 dies in its 5th loss call, mid-step 5: the resume starts after step 4's checkpoint


def _overrides(shards: str, root: Path, name: str, device: str) -> list[str]:
    """The run; its loss SIGKILLs rank 1 at call KILLED_AT once per marker file, so the uninterrupted
    run (marker written beforehand) and the resumed one train the same loss."""
    faults = f"signal_calls: [{KILLED_AT}], signal_rank: 1, signal_name: SIGKILL, signal_marker: {root / (name + '.killed')}"
    extra = ["model.compile=false", "loss.name=scripted_faults", f"loss.options={{inner: vanilla, {faults}}}"]
    return shard_run(shards, root, name, f"train.steps={STEPS}", f"train.batch_size={BATCH}", "train.chunk_size=8",
                     f"train.checkpoint_every={CHECKPOINT_EVERY}", "train.log_every=1", "data.shuffle_buffer=1",
                     f"run.device={device}", *extra)


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a resumed run's records of the steps it trains again replace the first ones."""
    return {m["step"]: m["loss"] for m in training_records(run_dir)}


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]),
])
def test_a_rank_killed_mid_step_ends_the_job_in_one_line_and_the_same_command_resumes_on_the_curve(tmp_path, device):
    shards = write_shards(tmp_path / "shards", shards=2, per_shard=BATCH, uniform=True)
    (tmp_path / "uninterrupted.killed").write_text("signalled\n")  # its kill already spent: it never comes
    checked(launch(_overrides(shards, tmp_path, "uninterrupted", device), nproc=2, launcher="clipscale.torchrun"))

    killed = launch(_overrides(shards, tmp_path, "killed", device), nproc=2, launcher="clipscale.torchrun", timeout=240)
    lines = killed.stderr.rstrip().splitlines()
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr[-3000:]
    assert lines[-1].startswith("torchrun: worker 1 was killed by signal 9"), killed.stderr[-3000:]
    assert "Traceback" not in killed.stderr and "ChildFailedError" not in killed.stderr, killed.stderr[-3000:]
    assert "leaked semaphore" not in killed.stderr, killed.stderr[-3000:]  # the killed worker's resource tracker, quiet
    assert max(step_checkpoints(tmp_path / "killed")) == KILLED_AT - 1, killed.stderr[-3000:]

    checked(launch(_overrides(shards, tmp_path, "killed", device), nproc=2, launcher="clipscale.torchrun"))
    assert max(step_checkpoints(tmp_path / "killed")) == STEPS
    assert _losses(tmp_path / "killed") == pytest.approx(_losses(tmp_path / "uninterrupted"), rel=1e-6)
