"""Seeds per rank, as open_clip sets them: the model is built from run.seed (the same initial
weights on every rank), dropout and everything random after it from run.seed + rank, so two
ranks do not drop the same patches; a resumed two-rank run replays every rank's draws."""

from __future__ import annotations

import pytest
import torch
from open_clip.transformer import PatchDropout

from tests.helpers.tiny_runs import DROPOUT_MODEL
from tests.helpers.trainer_harness import checked, launch, max_difference, newest_checkpoint, shard_run, training_records, write_shards

pytestmark = pytest.mark.slow

STEPS = 4


def _overrides(shards, root, name, signal_call=None):
    faults = f", signal_calls: [{signal_call}], signal_rank: 0, signal_marker: {root / name}.signalled" if signal_call else ""
    return shard_run(shards, root, name, DROPOUT_MODEL, f"train.steps={STEPS}", "train.batch_size=16", "train.log_every=1",
                     "train.checkpoint_every=100", "data.workers=0", "loss.name=scripted_faults",
                     f"loss.options={{inner: vanilla{faults}}}")


@pytest.fixture(scope="module")
def runs(module_tmp):
    root = module_tmp("rank_seeds")
    shards = write_shards(root / "shards", shards=2, per_shard=32)
    checked(launch(_overrides(shards, root, "reference"), nproc=2))
    stopped = launch(_overrides(shards, root, "resumed", signal_call=2), nproc=2)
    assert stopped.returncode != 0 and newest_checkpoint(root / "resumed")["step"] == 2, stopped.stderr[-3000:]
    checked(launch(_overrides(shards, root, "resumed", signal_call=2), nproc=2))
    return root


def _kept_patches(rng_state: torch.Tensor) -> list[list[int]]:
    """The patches open_clip's patch dropout keeps, drawn from this generator state, for 4 images of 16 patches."""
    torch.set_rng_state(rng_state)
    tokens = torch.arange(17, dtype=torch.float32).view(1, 17, 1).expand(4, 17, 1)  # the class token, then 16 patches
    return PatchDropout(0.5).train()(tokens)[:, 1:, 0].long().tolist()


def test_two_ranks_draw_different_dropout_masks(runs):
    rng = newest_checkpoint(runs / "reference")["rng"]
    assert len(rng) == 2
    with torch.random.fork_rng(devices=[]):
        masks = [_kept_patches(rank["cpu"]) for rank in rng]
    assert masks[0] != masks[1]


def test_a_resumed_two_rank_run_replays_every_ranks_masks(runs):
    expected, resumed = training_records(runs / "reference"), training_records(runs / "resumed")
    assert [m["step"] for m in resumed] == [m["step"] for m in expected] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in expected], rel=1e-6, abs=1e-6)
    final, reference = newest_checkpoint(runs / "resumed"), newest_checkpoint(runs / "reference")
    assert max_difference(final["state_dict"], reference["state_dict"]) < 1e-6
    assert all(torch.equal(a["cpu"], b["cpu"]) for a, b in zip(final["rng"], reference["rng"]))
