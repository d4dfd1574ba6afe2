"""A stream resumed on another shape goes on where it stopped: loader worker processes and ranks
(each rank's stream in turn, as the trainer's would run side by side) go 2 ranks x 2 workers ->
3 x 0 -> 1 x 3 -> 1 x 2 -> 2 x 2, each shape taking a few steps and handing its saved states to the next
(`StreamState.resumed`, as a checkpoint does). Over the run, every sample of an epoch is used
exactly once: the same multiset of captions per epoch as a run on one shape never stopped, on
webdataset shards and CSV tables, one source and `a::b` sources drawn by upsampling factors
(resampled), whose mix is then the uninterrupted run's. Captions name their samples, so the count does not
trust the stream's own bookkeeping."""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest
import torch
import torchvision.transforms as T

from clipscale.config import load_config
from clipscale.data import prepare_data
from clipscale.data.shards import ShardStream, StreamState
from clipscale.distributed import World

from tests.helpers.tiny_runs import DIGITS_YAML
from tests.helpers.user_data import write_csv, write_img2dataset_shards

PIECE = 6  # each rank's batch, one piece a step
# (ranks, data.workers, steps): 954 samples, epochs of 640; the fourth changes only the workers
SHAPES = [(2, 2, 12), (3, 0, 10), (1, 3, 15), (1, 2, 10), (2, 2, 40)]


def _source(tmp_path, kind: str, resampled: bool):
    """640 samples: one source, or sources a and b drawn 1::3."""
    if kind == "webdataset":
        halves = [write_img2dataset_shards(tmp_path / name, shards=4, per_shard=80, prefix=f"{name} ") for name in "ab"]
        data = halves if resampled else [write_img2dataset_shards(tmp_path / "one", shards=8, per_shard=80)]
    else:
        data = [str(write_csv(tmp_path / name, rows=320 if resampled else 640)) for name in ("ab" if resampled else "o")]
    factors = ["data.resampled=true", "data.upsampling_factors=1::3"] if resampled else []
    cfg = load_config(DIGITS_YAML, [f"data.kind={kind}", f"data.train_shards={'::'.join(data)}", *factors])
    return prepare_data(cfg.data, World()).train_shards


def _run(source, shapes) -> dict[int, Counter]:
    """{epoch: Counter of the (key, caption) of the samples used} over a run that takes `shapes` in
    turn (a key names a CSV row, a caption names a shard sample)."""
    used: dict[int, Counter] = {}
    saved = None
    for ranks, workers, steps in shapes:
        states = []
        for rank in range(ranks):
            state = (StreamState.resumed(saved, rank, ranks, max(1, workers)) if saved
                     else StreamState(workers=max(1, workers)))
            stream = ShardStream(source, piece_size=PIECE, rank=rank, world_size=ranks, num_workers=workers, seed=3,
                                 image_transform=T.ToTensor(), tokenizer=list, shuffle_buffer=4, state=state,
                                 keep_keys=True)
            loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
            for piece in islice(loader, steps):  # what the loader read beyond them is read again after the resume
                state.update(piece)
                for (epoch, key), text in zip(piece["sample_keys"], piece["texts"], strict=True):
                    used.setdefault(epoch, Counter())[key, text] += 1
            state.batches += steps
            states.append(state.state_dict())
        saved = states
    return used


# tests/trainer/test_reshaped_resume.py runs train.py on shards and on `a::b` CSV tables drawn 1::3.
@pytest.mark.parametrize("kind, resampled", [("webdataset", True), ("csv", False)], ids=["shards a::b resampled", "csv"])
def test_a_run_that_changes_shape_uses_every_sample_of_the_epoch_once(tmp_path, kind, resampled):
    source = _source(tmp_path, kind, resampled)
    never_stopped = _run(source, [(1, 0, 2 * 640 // PIECE)])  # one consumer: two whole epochs
    reshaped = _run(source, SHAPES)
    first = reshaped[0]
    assert first == never_stopped[0], f"epoch 0: missing {never_stopped[0] - first}, extra {first - never_stopped[0]}"
    assert not reshaped[1] - never_stopped[1], "a sample of epoch 1 used more often than the epoch holds it"
    if not resampled:  # drawn with replacement, an epoch holds some samples twice and others not (the sources'
        assert set(first.values()) == {1} and len(first) == 640  # mix is that of its draws, kept above)
