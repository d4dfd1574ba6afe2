"""A run killed (SIGKILL) at any point of a save resumes to the uninterrupted run's weights and metrics.

One run on shards, with patch dropout (the resume must replay the random draws) and a loader
worker, is killed by the kill points of trainer_plugins.install_kill_point, each launch at
the next point of a save, and started again with the same command until it ends:

    before the save (its metrics written)   create:step_        no checkpoint, no temporary file
    during the save                         before_rename:step_ the temporary file, no checkpoint
    after the file, before the pointer      after_rename:step_  step_2.pt, no `latest`
    after the pointer                       after_rename:latest `latest` names step_4.pt
    during the metrics write                metrics_line        half a line at the end of metrics.jsonl
    during the resume's metrics rewrite     before_rename:metrics.jsonl   the file as it was
    between the final weights and the end   before_rename:ended the weights, no end marker
"""

from __future__ import annotations

import signal

import pytest
import torch

from clipscale.models import OPEN_CLIP_WEIGHTS

from tests.helpers.tiny_runs import DROPOUT_MODEL
from tests.helpers.trainer_harness import checked, launch, load, max_difference, newest_checkpoint, shard_run, step_checkpoints, training_records, write_shards
from tests.helpers.trainer_plugins import KILL_AT

pytestmark = pytest.mark.slow

STEPS = 8


def _overrides(shards, root, name):
    return shard_run(shards, root, name, DROPOUT_MODEL, f"train.steps={STEPS}", "train.batch_size=16", "train.log_every=1",
                     "train.checkpoint_every=2", "data.workers=1", "data.shuffle_buffer=10")


def _killed(overrides, point, monkeypatch):
    monkeypatch.setenv(KILL_AT, point)
    result = launch(overrides)
    monkeypatch.delenv(KILL_AT)
    assert result.returncode == -signal.SIGKILL, f"{point}: exit status {result.returncode}\n{result.stderr[-3000:]}"
    return result


def test_a_run_killed_at_every_point_of_a_save_resumes_to_the_uninterrupted_runs_weights_and_metrics(tmp_path, monkeypatch):
    shards = write_shards(tmp_path / "shards", shards=4, per_shard=24)
    reference = tmp_path / "reference"
    checked(launch(_overrides(shards, tmp_path, "reference")))
    run_dir = tmp_path / "killed"
    overrides = _overrides(shards, tmp_path, "killed")
    checkpoints = run_dir / "checkpoints"

    def temporary_files(prefix):
        return list(checkpoints.glob(f".{prefix}*.tmp")) + list(run_dir.glob(f".{prefix}*.tmp"))

    _killed(overrides, "create:step_", monkeypatch)
    assert not step_checkpoints(run_dir) and not temporary_files("step_")
    assert [m["step"] for m in training_records(run_dir)] == [1, 2]  # the metrics of the step it was saving

    _killed(overrides, "before_rename:step_", monkeypatch)  # resumed from step 0
    assert not step_checkpoints(run_dir) and len(temporary_files("step_00000002.pt")) == 1

    _killed(overrides, "after_rename:step_", monkeypatch)
    assert list(step_checkpoints(run_dir)) == [2] and not (checkpoints / "latest").exists()
    assert not temporary_files("step_")  # the killed save's, removed when the run was claimed again

    _killed(overrides, "after_rename:latest", monkeypatch)  # resumed from step_2.pt, the newest, without a pointer
    assert sorted(step_checkpoints(run_dir)) == [2, 4] and (checkpoints / "latest").read_text() == "step_00000004.pt\n"

    _killed(overrides, "metrics_line", monkeypatch)  # resumed from step 4
    metrics_text = (run_dir / "metrics.jsonl").read_text()
    assert not metrics_text.endswith("\n") and '"step": 5' in metrics_text.rsplit("\n", 1)[1]

    _killed(overrides, "before_rename:metrics.jsonl", monkeypatch)  # the resume's rewrite of metrics.jsonl
    assert (run_dir / "metrics.jsonl").read_text() == metrics_text

    _killed(overrides, "before_rename:ended", monkeypatch)  # trained to the end, the weights written
    assert (run_dir / OPEN_CLIP_WEIGHTS).is_file() and not (run_dir / "ended").exists()

    ended = checked(launch(overrides))
    assert f"{run_dir} has trained and checkpointed its {STEPS} steps but stopped before" in ended.stdout + ended.stderr
    assert (run_dir / "ended").read_text() == f"{STEPS}\n"

    expected, resumed = training_records(reference), training_records(run_dir)
    assert [m["step"] for m in resumed] == [m["step"] for m in expected] == list(range(1, STEPS + 1))
    for mine, theirs in zip(resumed, expected):
        for key in ("loss", "lr", "grad_norm", "logit_scale"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-6), (mine["step"], key)
    final = newest_checkpoint(run_dir)
    assert final["step"] == STEPS
    assert max_difference(final["state_dict"], newest_checkpoint(reference)["state_dict"]) < 1e-6
    weights = torch.load(run_dir / OPEN_CLIP_WEIGHTS, weights_only=True)
    assert max_difference(weights, final["state_dict"]) == 0

    again = checked(launch(overrides))
    assert f"{run_dir} has already trained its {STEPS} steps" in again.stdout + again.stderr
    assert load(checkpoints / f"step_{STEPS:08d}.pt")["step"] == STEPS
