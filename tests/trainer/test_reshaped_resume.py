"""A run that changes shape keeps its place in the epoch: train.py stopped by SIGTERM (sent to the
rank's whole process group, its loader workers too, as Slurm sends it) and started again on
another shape each time: 2 processes x 2 loader workers -> 3 x 0 -> 1 x 3 -> 2 x 2. Each rank
records the (epoch, key) of every sample its steps used; over the run, the samples of the
first epoch are those of one epoch, each once, on webdataset shards. The other sources and
draws (CSV tables, `a::b` drawn with replacement) change shape in the loader's own test,
tests/data/test_reshaped_resume.py, without train.py's processes. The console says where each
resume goes on. A same-shape resume's loss curve
is the uninterrupted one's: tests/trainer/test_resume.py.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from itertools import islice

import pytest
import torchvision.transforms as T

from clipscale.config import load_config
from clipscale.data import prepare_data
from clipscale.data.shards import ShardStream
from clipscale.distributed import World

from tests.helpers.tiny_runs import DIGITS_YAML
from tests.helpers.trainer_harness import checked, launch, shard_run, step_checkpoints, write_shards
from tests.helpers.trainer_plugins import USED_TO

pytestmark = pytest.mark.slow

BATCH, STEPS, EPOCH = 24, 10, 192  # an epoch is 8 steps: the run ends 2 steps into the second
# (processes, data.workers) of each launch; each but the last stopped after 2 steps.
SHAPES = [(2, 2), (3, 0), (1, 3), (2, 2)]


def _overrides(root, shards, workers, stops) -> list[str]:
    faults = (f"signal_calls: [2], signal_rank: 0, signal_name: SIGTERM, signal_group: true, "
              f"signal_times: {stops}, signal_marker: {root / 'signalled'}")
    return shard_run(shards, root, "reshaped", f"train.steps={STEPS}",
                     f"train.batch_size={BATCH}", "train.checkpoint_every=100", "train.log_every=2",
                     "data.shuffle_buffer=2", f"data.workers={workers}", "loss.name=scripted_faults",
                     f"loss.options={{inner: vanilla, {faults}}}")


@pytest.fixture(scope="module")
def reshaped(module_tmp):
    """(the run's shards: 192 samples, [(epoch, key) of each used sample], each launch's stdout)."""
    root = module_tmp("reshaped")
    shards = write_shards(root / "shards", shards=8, per_shard=24)
    used = root / "used"
    used.mkdir()
    said = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv(USED_TO, str(used))
        for launch_number, (processes, workers) in enumerate(SHAPES):
            run = launch(_overrides(root, shards, workers, len(SHAPES) - 1), nproc=processes, timeout=300)
            if launch_number < len(SHAPES) - 1:  # stopped after its second step (torchrun exits 1 for any rank's stop)
                checked(run, 128 + signal.SIGTERM if processes == 1 else 1)
                assert max(step_checkpoints(root / "reshaped")) == 2 * (launch_number + 1), run.stderr[-3000:]
            else:
                checked(run)
            said.append(run.stdout)
    samples = [tuple(sample) for path in used.iterdir() for line in path.read_text().splitlines()
               for sample in json.loads(line)]
    return shards, samples, said


def _one_consumers_epochs(shards) -> dict[int, Counter]:
    """{epoch: Counter of keys} of the first two epochs as one consumer never stopped reads them."""
    source = prepare_data(load_config(DIGITS_YAML, ["data.kind=webdataset", f"data.train_shards={shards}"]).data, World()).train_shards
    stream = ShardStream(source, piece_size=BATCH, rank=0, world_size=1, num_workers=0, seed=0,
                         image_transform=T.ToTensor(), tokenizer=list, shuffle_buffer=2, keep_keys=True)
    epochs: dict[int, Counter] = {}
    for piece in islice(stream, 2 * EPOCH // BATCH):
        for epoch, key in piece["sample_keys"]:
            epochs.setdefault(epoch, Counter())[key] += 1
    return epochs


def test_every_sample_of_the_epoch_is_used_once_across_three_changes_of_shape(reshaped):
    shards, samples, _ = reshaped
    assert len(samples) == STEPS * BATCH, "the steps used other than a batch each"
    used = {epoch: Counter(key for e, key in samples if e == epoch) for epoch in (0, 1)}
    expected = _one_consumers_epochs(shards)
    assert used[0] == expected[0], f"epoch 0: missing {expected[0] - used[0]}, extra {used[0] - expected[0]}"
    assert not used[1] - expected[1], f"used more often than epoch 1 holds them: {used[1] - expected[1]}"
    assert set(used[0].values()) == {1} and len(used[0]) == EPOCH


def test_each_resume_says_how_far_into_the_epoch_it_goes_on(reshaped):
    _, _, said = reshaped
    for launch_number, (processes, workers) in enumerate(SHAPES[1:], start=1):
        ranks = f"{processes} rank{'s' * (processes != 1)}, {workers} worker{'s' * (workers != 1)} each"
        assert f"resuming at sample {2 * launch_number * BATCH} of epoch 0 on {ranks}" in said[launch_number]
