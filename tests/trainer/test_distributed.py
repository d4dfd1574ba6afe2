"""Multi-process training is one-process training of the same global batch: the model is wrapped
in DDP (gradients averaged), ranks agree on the step a signal stops them at, and a run resumes
on another number of processes.

The data are shards of flat-colour images (any random crop gives the same pixels), one shard of
`MIN_SLOTS` samples: each slot of the epochs' order holds one sample, so with 1, 2 or 3 processes
each step's global batch is the same set of samples (the next 24 of the order), before and after
a resume on another number of processes, and the weights must agree up to float rounding. Inf-CL
with a tile of 4 runs several tiles per rank.
"""

from __future__ import annotations

import pytest

from clipscale.data.epoch import MIN_SLOTS

from tests.helpers.trainer_harness import checked, launch, load, max_difference, newest_checkpoint, shard_run, step_checkpoints, training_records, write_shards

pytestmark = pytest.mark.slow

STEPS, BATCH = 6, 24


def _overrides(shards, root, name, **faults):
    options = "".join(f", {k}: {v}" for k, v in faults.items())
    return shard_run(shards, root, name, f"train.steps={STEPS}", f"train.batch_size={BATCH}", "train.checkpoint_every=2",
                     "train.log_every=1", "data.workers=1", "data.shuffle_buffer=1", "loss.name=scripted_faults",
                     f"loss.options={{inner: infcl, inner_options: {{backend: reference, tile_size: 4}}{options}}}")


@pytest.fixture(scope="module")
def runs(module_tmp):
    """'single': one process. 'split': two processes, only rank 1 signalled (SIGUSR1 in step 4),
    then the same command on three processes, which resumes from step 4 and goes on in the same
    order."""
    root = module_tmp("ddp")
    shards = write_shards(root / "shards", shards=1, per_shard=MIN_SLOTS, uniform=True)
    checked(launch(_overrides(shards, root, "single")))
    faults = dict(signal_calls=[4], signal_rank=1, signal_marker=root / "signalled")
    two = launch(_overrides(shards, root, "split", **faults), nproc=2, timeout=240)
    after_two = {step: load(path) for step, path in step_checkpoints(root / "split").items()}
    three = checked(launch(_overrides(shards, root, "split", **faults), nproc=3, timeout=300))
    return root, two, after_two, three


def test_ranks_stop_at_the_same_step_when_only_one_is_signalled(runs):
    root, two, after_two, _ = runs
    assert two.returncode != 0, "the signalled world should exit with 128+SIGUSR1"
    assert (root / "signalled").exists()
    assert sorted(after_two) == [2, 4], two.stderr[-3000:]
    assert len(after_two[4]["data"]) == 2  # both ranks' data cursors: both reached the checkpoint


def test_two_processes_train_the_weights_of_one_process(runs):
    """Without DDP's gradient averaging each rank steps on its own gradients and rank 0's
    weights drift from the one-process run's by about the learning rate per step."""
    root, _, after_two, _ = runs
    single = {step: load(path) for step, path in step_checkpoints(root / "single").items()}
    for step in (2, 4):
        assert max_difference(after_two[step]["state_dict"], single[step]["state_dict"]) < 2e-5, step


def test_resuming_on_three_processes_continues_the_one_process_training(runs):
    root, _, _, three = runs
    final = newest_checkpoint(root / "split")
    assert final["step"] == STEPS and len(final["data"]) == 3, three.stderr[-3000:]
    assert max_difference(final["state_dict"], newest_checkpoint(root / "single")["state_dict"]) < 4e-5
    single_losses = [m["loss"] for m in training_records(root / "single")]
    assert [m["loss"] for m in training_records(root / "split")] == pytest.approx(single_losses, rel=1e-4)


def test_two_and_three_processes_log_the_global_batchs_rate(runs):
    """samples_per_s counts train.batch_size (the global batch) a step, whatever the number of processes."""
    root, *_ = runs
    records = training_records(root / "split")
    assert len(records) >= STEPS
    for record in records:
        assert record["samples_per_s"] * record["step_s"] == pytest.approx(BATCH, rel=1e-6), record


def test_each_ranks_data_wait_is_logged(runs):
    """Several processes: each record has every rank's `data_wait_s` in rank order (rank 0's is the
    record's own), two before the resume and three after it; one process: no such key."""
    root, *_ = runs
    records = training_records(root / "split")
    assert [len(record["data_wait_s_by_rank"]) for record in records] == [2] * 4 + [3] * (len(records) - 4), records
    for record in records:
        assert record["data_wait_s_by_rank"][0] == record["data_wait_s"] and min(record["data_wait_s_by_rank"]) >= 0
    assert all("data_wait_s_by_rank" not in record for record in training_records(root / "single"))

