"""The shard stream (clipscale/data/shards.py): every sample once per epoch across ranks and loader
workers, counted independently of the stream's code (each sample's caption names it, and an
epoch's batches of all ranks must hold every caption exactly once); a resumed stream gives the
uninterrupted stream's batches, crops and worker order included."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice

import pytest
import torch
import torchvision.transforms as T

from clipscale.data.shards import Cursor, ShardStream, StreamState

from tests.helpers.trainer_harness import caption, write_shards

SAMPLES, BATCH, WORLD, WORKERS = 60, 5, 2, 3  # 6 consumers of 10 samples each per epoch: 2 batches per worker


def _keep_captions(captions):
    return list(captions)


def _rank_pieces(pattern_shards, rank, count):
    stream = ShardStream(pattern_shards, piece_size=BATCH, rank=rank, world_size=WORLD, num_workers=WORKERS, seed=11,
                         image_transform=T.ToTensor(), tokenizer=_keep_captions, shuffle_buffer=7,
                         keep_keys=True)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=WORKERS)
    return list(islice(loader, count))


def _by_epoch(pieces) -> dict[int, Counter]:
    """{epoch: Counter of captions} over pieces, each sample counted in the epoch its piece says it came from."""
    seen: dict[int, Counter] = {}
    for piece in pieces:
        for (epoch, _), text in zip(piece["sample_keys"], piece["texts"], strict=True):
            seen.setdefault(epoch, Counter())[text] += 1
    return seen


@pytest.mark.parametrize("shards", [6, 2], ids=["a shard per consumer", "fewer shards than consumers"])
def test_every_sample_is_seen_once_per_epoch_across_ranks_and_workers(tmp_path, shards):
    """Consumers cross into the next epoch one by one, so three epochs' worth of pieces hold the
    first two epochs whole: each caption exactly once in each."""
    write_shards(tmp_path, shards=shards, per_shard=SAMPLES // shards)
    paths = sorted(str(p) for p in tmp_path.glob("*.tar"))
    per_epoch = SAMPLES // (WORLD * BATCH)  # pieces per rank in one epoch
    seen = _by_epoch(piece for rank in range(WORLD) for piece in _rank_pieces(paths, rank, 3 * per_epoch))
    expected = Counter(caption(i) for i in range(SAMPLES))
    for epoch in range(2):
        assert seen[epoch] == expected, f"epoch {epoch}: missing {expected - seen[epoch]}, extra {seen[epoch] - expected}"


def _stream(digits_root, workers, state=None):
    manifest = json.loads((digits_root / "manifest.json").read_text())
    return ShardStream(
        [str(digits_root / s) for s in manifest["train_shards"]],
        piece_size=50, rank=0, world_size=1, num_workers=workers, seed=3,
        image_transform=T.Compose([T.RandomResizedCrop(32, scale=(0.5, 1.0)), T.ToTensor()]),
        tokenizer=lambda captions: captions, shuffle_buffer=100, state=state,
    )


def test_a_checkpointed_stream_state_loads_as_it_was_saved_and_from_older_checkpoints(tmp_path):
    """Cursors go into a checkpoint as plain dicts (read with weights_only=True) and come back as
    the same `Cursor`s; a checkpoint written before the class held (item, epoch, *position)."""
    position = (17, (40, 38), (3, 9, 12))  # ShuffledEpoch.position(): draws, shard sizes, buffered indices
    state = StreamState(cursors={1: Cursor(1, 5, position)}, workers=2, pieces=9, batches=3)
    torch.save(state.state_dict(), tmp_path / "state.pt")
    loaded = StreamState()
    loaded.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert loaded == state and isinstance(loaded.cursors[1], Cursor)
    older = {**state.state_dict(), "cursors": {1: (5, 0, *position)}}
    assert StreamState(**older) == state
    assert StreamState.work_left([older, older]) == StreamState.work_left([state.state_dict()] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_resumes_exactly(digits_root, workers):
    """Batches after a resume equal the uninterrupted stream's, crops and worker order included."""

    def batches(state, count):
        loader = torch.utils.data.DataLoader(_stream(digits_root, workers, state), batch_size=None, num_workers=workers)
        out = []
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                return out

    uninterrupted = batches(StreamState(), 40)  # 40 x 50 samples: crosses an epoch boundary
    state = StreamState()
    for batch in uninterrupted[:23]:  # odd: the resumed loader must rotate its workers
        state.update(batch)
    resumed = batches(state, 17)
    for a, b in zip(uninterrupted[23:], resumed):
        assert a["cursor"] == b["cursor"]
        assert a["texts"] == b["texts"]
        assert torch.equal(a["images"], b["images"])
