"""An endless, exactly resumable stream of training batches from webdataset shards.

Every (rank, loader worker) pair is one *consumer*. In epoch e the shard list
is permuted with a seed derived from (seed, e); consumer c reads every
C-th shard of that order (or, with fewer shards than consumers, every C-th
sample of all shards), shuffles through a buffer seeded by (seed, e, c),
decodes and batches. The stream never ends, so every rank takes exactly
`train.steps` steps whatever the shard sizes.

Resumption is exact: every batch carries its worker's cursor (epoch and the
number of raw samples consumed in that epoch). The trainer records the cursor
of the last batch it used from each worker; a resumed stream skips whole
epochs for free and replays only the current epoch's raw samples without
decoding them. DataLoader hands out batches round-robin over its workers, so
a resumed loader also rotates which logical worker its first slot serves.

Nothing in the data stops a run or shrinks a batch. Samples that cannot be
decoded (corrupt image bytes, no caption) are skipped and counted; a shard
that cannot be read to its end (a truncated or missing tar file) gives the
samples before the damage, the rest is skipped and the event counted. Both
counts travel with the batch; StreamState keeps this rank's totals, so they
survive a resume (replayed samples are not counted twice).
"""

from __future__ import annotations

import io
import random
import warnings
import zlib
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Optional

import torch
import webdataset as wds
from PIL import Image

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
TEXT_KEYS = ("txt", "text", "caption")


@dataclass
class StreamState:
    """Where each logical worker of one rank stands: {worker: (epoch, raw samples consumed)}."""

    cursors: dict = field(default_factory=dict)
    batches: int = 0  # batches consumed by the trainer; decides the worker rotation on resume
    skipped_samples: int = 0  # undecodable samples in those batches' stretch of the stream
    shard_errors: int = 0  # shards that could not be read to their end

    def update(self, batch: dict) -> None:
        worker, epoch, position = batch["cursor"]
        self.cursors[worker] = (epoch, position)
        self.batches += 1
        self.skipped_samples += batch["skipped_samples"]
        self.shard_errors += batch["shard_errors"]


class ShardErrors:
    """webdataset error handler that warns, counts and carries on with the next shard.

    It counts shards, not exceptions: webdataset reports a tar file cut short
    once or twice (from the member read and again from the archive iterator)."""

    def __init__(self):
        self.count = 0
        self.current_shard_failed = False

    def __call__(self, exn: Exception) -> bool:
        if not self.current_shard_failed:
            self.count += 1
            self.current_shard_failed = True
            warnings.warn(f"skipping the rest of a shard: {exn!r}")
        return True

    def read(self, url: str):
        """The samples of one shard, up to the first error."""
        self.current_shard_failed = False
        yield from wds.tarfile_to_samples(handler=self)(iter([{"url": url}]))


def decode_sample(raw: dict, image_transform: Callable) -> Optional[tuple]:
    """(image tensor, caption) or None when the sample is unusable."""
    image_key = next((k for k in IMAGE_KEYS if k in raw), None)
    text_key = next((k for k in TEXT_KEYS if k in raw), None)
    if image_key is None or text_key is None:
        return None
    try:
        with Image.open(io.BytesIO(raw[image_key])) as img:
            image = image_transform(img.convert("RGB"))
        caption = raw[text_key].decode("utf-8").strip()
    except Exception:  # noqa: BLE001 - any undecodable sample is skipped and counted
        return None
    return (image, caption) if caption else None


class ShardStream(torch.utils.data.IterableDataset):
    def __init__(
        self,
        shards: list[str],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        image_transform: Callable,
        tokenizer: Callable,
        shuffle_buffer: int = 1000,
        state: Optional[StreamState] = None,
    ):
        if not shards:
            raise ValueError("no training shards given")
        self.shards = list(shards)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = max(1, num_workers)
        self.seed = seed
        self.image_transform = image_transform
        self.tokenizer = tokenizer
        self.shuffle_buffer = shuffle_buffer
        state = state or StreamState()
        self.cursors = dict(state.cursors)
        self.first_worker = state.batches % self.num_workers

    def _raw_samples(self, epoch: int, consumer: int, consumers: int, errors: ShardErrors):
        order = list(self.shards)
        random.Random(f"{self.seed}/shards/{epoch}").shuffle(order)
        if len(order) >= consumers:
            mine, keep = order[consumer::consumers], None
        else:
            mine, keep = order, consumer
        samples = chain.from_iterable(errors.read(url) for url in mine)
        if keep is not None:
            samples = (s for i, s in enumerate(samples) if i % consumers == keep)
        return wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, seed=f"{self.seed}/{epoch}/{consumer}")(samples)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        slot = info.id if info is not None else 0
        worker = (slot + self.first_worker) % self.num_workers
        consumer = self.rank * self.num_workers + worker
        consumers = self.world_size * self.num_workers
        epoch, position = self.cursors.get(worker, (0, 0))
        images, captions, skipped, errors = [], [], 0, ShardErrors()
        epochs_without_a_sample = 0
        while True:
            usable = 0
            for index, raw in enumerate(self._raw_samples(epoch, consumer, consumers, errors)):
                if index < position:  # consumed before a resume: its errors were counted then
                    errors.count = 0
                    continue
                position = index + 1
                # Augmentation randomness is a function of the sample's place in the
                # stream, so a resumed run draws the same crops as an uninterrupted one.
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(zlib.crc32(f"{self.seed}/{epoch}/{consumer}/{position}".encode()))
                    decoded = decode_sample(raw, self.image_transform)
                if decoded is None:
                    skipped += 1
                    continue
                usable += 1
                images.append(decoded[0])
                captions.append(decoded[1])
                if len(images) == self.batch_size:
                    yield {
                        "images": torch.stack(images),
                        "texts": self.tokenizer(captions),
                        "cursor": (worker, epoch, position),
                        "skipped_samples": skipped,
                        "shard_errors": errors.count,
                    }
                    images, captions, skipped, errors.count = [], [], 0, 0
            if position == 0:
                raise RuntimeError(f"consumer {consumer} found no samples in its shards: {self.shards}")
            # Shards move between consumers every epoch, so one bad pass can be bad luck;
            # several in a row mean the data itself is broken, and waiting would hang the run.
            epochs_without_a_sample = 0 if usable else epochs_without_a_sample + 1
            if epochs_without_a_sample == 3:
                raise RuntimeError(f"consumer {consumer} decoded no sample in 3 passes over its shards ({skipped} skipped)")
            epoch, position = epoch + 1, 0
