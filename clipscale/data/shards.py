"""An endless, exactly resumable stream of training samples from webdataset shards, in pieces (`ShardStream`),
and where one rank's stream stands (`StreamState`: its cursors and data-error counts).

Each (rank, loader worker) pair is a consumer reading its own share of each epoch's shards (drawn
with replacement with resampled shards), shuffled through a buffer (`clipscale.data.epoch`); the
DataLoader hands pieces out round-robin, piece k of a rank from logical worker (k + first) mod W. A
piece holds uint8 pixels (or the whole transform's floats), token ids, its worker's cursor and the
samples and shards it skipped; with `keep_encoded` also the images' bytes and crops
(`EncodedImages`), without `decode` only those. Nothing in the data stops a run or shrinks a batch.
docs/architecture.md tells the order and how a resumed stream finds its place.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch
import webdataset as wds

from clipscale.caption_length import captions_cut
from clipscale.data.encoded import EncodedImages, decodes_at_reduced_scale, is_whole_jpeg
from clipscale.data.epoch import EpochPlan, ShuffledEpoch
from clipscale.data.members import DATA_ERRORS, decode_text, first_member, open_image
from clipscale.data.sources import IMAGE_KEYS, TEXT_KEYS, ShardSource
from clipscale.data.transforms import SplitTransform


@dataclass
class StreamState:
    """Where each logical worker of one rank stands: {worker: (epoch, *ShuffledEpoch.position())}."""

    cursors: dict = field(default_factory=dict)
    pieces: int = 0  # pieces consumed by the trainer; decides the worker rotation on resume
    batches: int = 0  # batches the trainer used: the run's steps on this rank, so its stream gathers no more
    skipped_samples: int = 0  # undecodable samples in those pieces' stretch of the stream
    shard_errors: int = 0  # shards that could not be read to their end
    captions_cut: int = 0  # captions in those pieces longer than the context length, cut by the tokenizer

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def update(self, piece: dict) -> None:
        worker, *cursor = piece["cursor"]
        self.cursors[worker] = tuple(cursor)
        self.pieces += 1
        self.skipped_samples += piece["skipped_samples"]
        self.shard_errors += piece["shard_errors"]
        self.captions_cut += piece["captions_cut"]


class ShardErrors:
    """webdataset error handler that counts the shards cut short, names them, and carries on with
    the next shard (the trainer's console says so, `metrics.DataProblems`).

    It counts shards, not exceptions: webdataset reports a tar file cut short
    once or twice (from the member read and again from the archive iterator)."""

    def __init__(self):
        self.count = 0
        self.shards: list[str] = []  # those cut short since the last piece
        self.current_shard = ""
        self.current_shard_failed = False

    def __call__(self, exn: Exception) -> bool:
        if not self.current_shard_failed:
            self.count += 1
            self.shards.append(self.current_shard)
            self.current_shard_failed = True
        return True

    def read(self, url: str):
        """The samples of one shard, up to the first error."""
        self.current_shard, self.current_shard_failed = str(url), False
        yield from wds.tarfile_to_samples(handler=self)(iter([{"url": url}]))


def load_sample(raw: dict, transform: Callable, split: Optional[SplitTransform], keep_encoded: bool,
                decode: bool = True, max_pixels: Optional[int] = None) -> Optional[tuple]:
    """(pixels, (bytes, crop) or None, caption), or None when the sample is unusable.

    Only the image and caption members are decoded (`clipscale.data.members`). Pixels are uint8
    when the transform splits (`SplitTransform`), else the whole transform's float tensor. With
    `keep_encoded` (offload) the image's bytes and the crop it drew are kept too, so the batch can
    be decoded again later without the loader. Without `decode` (the device decodes) a whole JPEG
    is opened for the size its crop is drawn from and decoded at 1/8 scale only, to be judged, and
    pixels is None; anything else is still decoded whole, to be judged. An image whose header
    claims more than `max_pixels` pixels (None: PIL's bound) is unusable, judged from the header
    alone on both paths, before any decoding."""
    image_key = first_member(raw, IMAGE_KEYS)
    text_key = first_member(raw, TEXT_KEYS)
    if image_key is None or text_key is None:
        return None
    try:
        data = raw[image_key]
        with open_image(data, max_pixels) as img:
            if not decode and is_whole_jpeg(data):
                params, pixels = split.draw(img), None  # the crop is drawn from the header's size
                decodes_at_reduced_scale(img)  # the device decodes it; undecodable data is skipped here
            else:
                img = img.convert("RGB")  # PIL decodes lazily; this forces it, so bad bytes fail here
                if split is None:
                    params, pixels = (), transform(img)
                else:
                    params = split.draw(img)
                    pixels = split.apply(img, params)
        caption = decode_text(raw[text_key])
    except DATA_ERRORS:  # undecodable or oversized: skipped and counted; any other error is a bug and stops the run
        return None
    if not caption:
        return None
    return pixels, ((bytes(data), params) if keep_encoded else None), caption


class ShardStream(torch.utils.data.IterableDataset):
    """Pieces of `piece_size` samples from one rank's share of the shards (see the module doc).

    A piece is a dict: "images" (uint8 [n, 3, H, W] with `split`, else the transform's float
    tensor; absent without `decode`), "texts" (token ids), "encoded" (offload, or without
    `decode`: an `EncodedImages` of the same samples),
    "cursor" (worker, epoch, raw samples consumed), "skipped_samples", "shard_errors"."""

    def __init__(
        self,
        shards: Sequence[str] | ShardSource,
        *,
        piece_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        image_transform: Callable,
        tokenizer: Callable,
        shuffle_buffer: int = 1000,
        state: Optional[StreamState] = None,
        split: Optional[SplitTransform] = None,
        keep_encoded: bool = False,
        decode: bool = True,
        max_image_pixels: Optional[int] = None,
    ):
        if (keep_encoded or not decode) and split is None:
            raise ValueError("keeping images encoded needs a split transform (the crop drawn apart from the decode)")
        self.source = shards if isinstance(shards, ShardSource) else ShardSource(list(shards))
        self.piece_size = piece_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = max(1, num_workers)
        self.seed = seed
        self.image_transform = image_transform
        self.tokenizer = tokenizer
        self.shuffle_buffer = shuffle_buffer
        self.split = split
        self.keep_encoded = keep_encoded or not decode
        self.decode = decode
        self.max_image_pixels = max_image_pixels  # None: PIL's Image.MAX_IMAGE_PIXELS
        self.state = state or StreamState()  # read when iterated: it may be restored after this is built

    def _plan(self, epoch: int, consumer: int, consumers: int) -> EpochPlan:
        """The shards `consumer` reads in `epoch`, and which of their samples are its own."""
        shards = self.source.shards
        if self.source.resampled:  # drawn with replacement, weighted by the sources' upsampling factors
            draw = random.Random(f"{self.seed}/resampled/{epoch}/{consumer}")
            return EpochPlan(draw.choices(shards, weights=self.source.weights, k=max(1, len(shards) // consumers)))
        order = list(shards)
        random.Random(f"{self.seed}/shards/{epoch}").shuffle(order)
        if len(order) >= consumers:
            return EpochPlan(order[consumer::consumers])
        return EpochPlan(order, stride=consumers, phase=consumer)

    def shuffled_epoch(self, epoch: int, consumer: int, consumers: int, errors: ShardErrors) -> ShuffledEpoch:
        return ShuffledEpoch(self.source, self._plan(epoch, consumer, consumers), self.shuffle_buffer,
                             f"{self.seed}/{epoch}/{consumer}", errors)

    def _piece(self, samples: list[tuple], cursor: tuple, skipped: int, errors: ShardErrors, problem_shards: list) -> dict:
        pixels, encoded, captions = zip(*samples)
        texts = self.tokenizer(list(captions))
        piece = {
            "texts": texts,
            "cursor": cursor,
            "skipped_samples": skipped,
            "captions_cut": captions_cut(self.tokenizer, list(captions), texts),  # longer than the context length
            "shard_errors": errors.count,
            "problem_shards": [shard for shard in dict.fromkeys(problem_shards + errors.shards) if shard],  # where skips and cuts were met
        }
        if self.decode:
            piece["images"] = torch.stack(pixels)
        if self.keep_encoded:
            piece["encoded"] = EncodedImages.from_samples(*zip(*encoded))
        return piece

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        slot = info.id if info is not None else 0
        worker = (slot + self.state.pieces) % self.num_workers  # the first loader slot serves the next worker
        consumer = self.rank * self.num_workers + worker
        consumers = self.world_size * self.num_workers
        epoch, *position = self.state.cursors.get(worker, (0,))
        samples, skipped, errors, problem_shards = [], 0, ShardErrors(), []
        epochs_without_a_sample = 0
        while True:
            usable = 0
            shuffled = self.shuffled_epoch(epoch, consumer, consumers, errors)
            for raw in shuffled.samples(*position):
                # Augmentation randomness is a function of the sample's place in the
                # stream, so a resumed run draws the same crops as an uninterrupted one.
                # Only the CPU generator: torch.manual_seed also queues a CUDA reseed, whose stack capture
                # cost a third of a sample's loading time, and reseeded a GPU's RNG under an in-process loader.
                sample_seed = zlib.crc32(f"{self.seed}/{epoch}/{consumer}/{shuffled.draws}".encode())
                with torch.random.fork_rng(devices=[]):
                    torch.random.default_generator.manual_seed(sample_seed)
                    sample = None if raw is None else load_sample(raw, self.image_transform, self.split,
                                                                   self.keep_encoded, self.decode, self.max_image_pixels)
                if sample is None:
                    skipped += 1
                    problem_shards.append((raw or {}).get("__url__") or errors.current_shard)
                    continue
                usable += 1
                samples.append(sample)
                if len(samples) == self.piece_size:
                    yield self._piece(samples, (worker, epoch, *shuffled.position()), skipped, errors, problem_shards)
                    samples, skipped, errors.count, errors.shards, problem_shards = [], 0, 0, [], []
            if shuffled.draws == 0:
                raise RuntimeError(f"consumer {consumer} found no samples in its shards: {self.source.shards}")
            # Shards move between consumers every epoch, so one bad pass can be bad luck;
            # several in a row mean the data itself is broken, and waiting would hang the run.
            epochs_without_a_sample = 0 if usable else epochs_without_a_sample + 1
            if epochs_without_a_sample == 3:
                raise RuntimeError(f"consumer {consumer} decoded no sample in 3 passes over its shards ({skipped} skipped)")
            epoch, position = epoch + 1, ()
