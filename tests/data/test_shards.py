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

from clipscale.data.shards import ShardStream, StreamState

from tests.helpers.trainer_harness import caption, write_shards

SAMPLES, BATCH, WORLD, WORKERS = 60, 5, 2, 3  # 6 consumers of 10 samples each per epoch: 2 batches per worker


def _keep_captions(captions):
    return list(captions)


def _rank_batches(pattern_shards, rank, count):
    stream = ShardStream(pattern_shards, piece_size=BATCH, rank=rank, world_size=WORLD, num_workers=WORKERS, seed=11,
                         image_transform=T.ToTensor(), tokenizer=_keep_captions, shuffle_buffer=7)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=WORKERS)
    return [batch["texts"] for batch in islice(loader, count)]


@pytest.mark.parametrize("shards", [6, 2], ids=["a shard per consumer", "fewer shards than consumers"])
def test_every_sample_is_seen_once_per_epoch_across_ranks_and_workers(tmp_path, shards):
    write_shards(tmp_path, shards=shards, per_shard=SAMPLES // shards)
    paths = sorted(str(p) for p in tmp_path.glob("*.tar"))
    per_epoch = SAMPLES // (WORLD * BATCH)  # batches per rank in one epoch
    seen = [_rank_batches(paths, rank, 2 * per_epoch) for rank in range(WORLD)]
    expected = Counter(caption(i) for i in range(SAMPLES))
    for epoch in range(2):
        captions = Counter(c for batches in seen for batch in batches[epoch * per_epoch:(epoch + 1) * per_epoch] for c in batch)
        assert captions == expected, f"epoch {epoch}: missing {expected - captions}, extra {captions - expected}"
    assert seen[0][:per_epoch] != seen[0][per_epoch:], "the second epoch is shuffled differently"


def _stream(digits_root, workers, state=None):
    manifest = json.loads((digits_root / "manifest.json").read_text())
    return ShardStream(
        [str(digits_root / s) for s in manifest["train_shards"]],
        piece_size=50, rank=0, world_size=1, num_workers=workers, seed=3,
        image_transform=T.Compose([T.RandomResizedCrop(32, scale=(0.5, 1.0)), T.ToTensor()]),
        tokenizer=lambda captions: captions, shuffle_buffer=100, state=state,
    )


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
