"""Resuming a run: the same data, the same dropout draws, the same counts as a run never stopped.

One module-scoped set of runs on shards with corrupt JPEGs, a model with dropout (open_clip's
patch dropout), loader workers on, several Inf-CL tiles per rank and 3-step logging windows:
reference runs that are never stopped, and runs stopped by SIGUSR1 (sent by the process to
itself from inside a chosen step) and restarted with the same command.
"""

from __future__ import annotations

import shutil
import signal

import pytest

from tests.helpers.tiny_runs import DROPOUT_MODEL
from tests.helpers.trainer_harness import checked, launch, max_difference, newest_checkpoint, shard_run, step_checkpoints, training_records, write_shards

pytestmark = pytest.mark.slow

STEPS = 12
LOG_EVERY = 3


def _overrides(shards, output_dir, name, signal_call=None):
    faults = f", signal_calls: [{signal_call}], signal_marker: {output_dir / name}.signalled" if signal_call else ""
    return shard_run(
        shards, output_dir, name, DROPOUT_MODEL, f"train.steps={STEPS}", "train.batch_size=48", f"train.log_every={LOG_EVERY}",
        "train.checkpoint_every=100", "data.workers=2", "data.shuffle_buffer=20",
        "loss.name=scripted_faults", f"loss.options={{inner: infcl, inner_options: {{backend: reference, tile_size: 16}}{faults}}}",
    )


# name: the step whose SIGUSR1 stops the first launch (None: never stopped). The model has
# dropout: a resume must also restore the RNG the masks are drawn from.
RUNS = {
    "reference": None,
    "on_window": 6,  # stopped right after a record (log_every=3)
    "off_window": 7,  # stopped between two records
}


@pytest.fixture(scope="module")
def runs(module_tmp):
    """{name: (first exit status, run folder, step of the newest checkpoint after the first launch,
    its stderr)}; a stopped run is then launched again with the same command, to the end."""
    root = module_tmp("resume")
    shards = write_shards(root / "shards", shards=6, per_shard=40, corrupt_every=7)
    out = {}
    for name, call in RUNS.items():
        first = launch(_overrides(shards, root, name, call))
        stopped_at = max(step_checkpoints(root / name), default=None)
        if name == "on_window":  # run "faster" is this one as it stopped, resumed with SPEED_ONLY changed
            shutil.copytree(root / name, root / "faster")
        if call is not None:
            checked(launch(_overrides(shards, root, name, call)))
        out[name] = (first.returncode, root / name, stopped_at, first.stderr)
    # on_window's own options: its signal marker is spent, as the marker of a run of its own would be
    faster = checked(launch([*_overrides(shards, root, "on_window", RUNS["on_window"]), "run.name=faster", *SPEED_ONLY]))
    out["faster"] = (faster.returncode, root / "faster", None, faster.stdout)
    return out


SPEED_ONLY = ["train.checkpoint_every=4", "model.compile=false"]  # what the resume of run "faster" changes


def test_sigusr1_finishes_the_step_writes_a_checkpoint_and_exits_138(runs):
    for name, call in RUNS.items():
        returncode, _, stopped_at, stderr = runs[name]
        assert returncode == (0 if call is None else 128 + signal.SIGUSR1), stderr[-3000:]
        assert stopped_at == (call or STEPS), name


def _check_same_curve_and_weights(reference, run_dir):
    expected = {m["step"]: m["loss"] for m in training_records(reference)}
    resumed = {m["step"]: m["loss"] for m in training_records(run_dir)}
    assert sorted(resumed) == sorted(expected) == [*range(LOG_EVERY, STEPS + 1, LOG_EVERY)]
    for step in sorted(resumed):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    final = newest_checkpoint(run_dir)
    assert final["step"] == STEPS
    assert max_difference(final["state_dict"], newest_checkpoint(reference)["state_dict"]) < 1e-6


def test_a_resumed_run_reads_exactly_the_samples_of_the_uninterrupted_run(runs):
    """Two loader workers, shuffle buffer, corrupt samples skipped: a resumed stream that
    replays from another place than where the run stopped changes every later loss. (A stream
    that drops samples in every run alike is caught by tests/data/test_shards.py's independent
    count.)"""
    _check_same_curve_and_weights(runs["reference"][1], runs["on_window"][1])


def test_a_resumed_run_with_dropout_draws_the_uninterrupted_runs_masks(runs):
    """open_clip's patch dropout draws from the global RNG: the checkpoint's RNG state must
    be the one the next step starts from, or every loss after the resume changes."""
    _check_same_curve_and_weights(runs["reference"][1], runs["off_window"][1])


def test_a_resume_that_changes_only_speed_goes_on_the_same_curve_and_says_so(runs):
    _, run_dir, _, stdout = runs["faster"]
    assert ("resuming model.compile: 'auto' -> False, train.checkpoint_every: 100 -> 4: the data order goes on "
            "from the checkpoint") in stdout
    _check_same_curve_and_weights(runs["reference"][1], run_dir)


def _counts(run_dir):
    return [(m["step"], m["skipped_samples"], m["skipped_samples_total"], m["shard_errors"], m["shard_errors_total"])
            for m in training_records(run_dir)]


def _check_counts_since_previous_record(reference, run_dir):
    counts = _counts(run_dir)
    assert counts == _counts(reference)
    previous = (0, 0)
    for _, skipped, skipped_total, errors, errors_total in counts:
        assert (skipped, errors) == (skipped_total - previous[0], errors_total - previous[1])
        previous = (skipped_total, errors_total)
    assert counts[-1][2] >= STEPS * 48 // 7 - 2  # every 7th sample is corrupt: the counts are not trivially 0
    assert counts[1][2] > 0  # and corrupt samples were counted before the resume


def test_data_error_counts_since_the_previous_record_survive_a_resume(runs):
    """`skipped_samples` counts since the previous record, `_total` since the run began: across
    a resume at a logging step they equal the uninterrupted run's."""
    _check_counts_since_previous_record(runs["reference"][1], runs["on_window"][1])


def test_data_error_counts_since_the_previous_record_survive_a_resume_between_records(runs):
    _check_counts_since_previous_record(runs["reference"][1], runs["off_window"][1])
