"""An endless, exactly resumable stream of training samples from webdataset shards, in pieces (`ShardStream`),
and where one rank's stream stands (`StreamState`: its cursors, how far each epoch was drawn, its
data-error counts).

The epochs' order is the same on any number of ranks and loader workers (`clipscale.data.epoch`):
a global sequence of slots (shards or parts of them), each shuffled through a buffer of its own.
Each (rank, loader worker) pair is a consumer taking every C-th slot of what is left of it; the
DataLoader hands pieces out round-robin, piece k of a rank from logical worker (k + first) mod W. A
piece holds uint8 pixels (or the whole transform's floats), token ids, its worker's cursor, how
many samples it drew from each epoch, and the samples and shards it skipped (the first few of
those samples named, with why: `SKIPS_NAMED`); with `keep_encoded` also the images' bytes and crops (`EncodedImages`), without `decode`
only those. Nothing in the data stops a run or shrinks a batch. docs/architecture.md tells the
order and how a resumed stream, on any shape, finds its place.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch
from PIL import UnidentifiedImageError

from clipscale.caption_length import captions_cut
from clipscale.errors import UserError
from clipscale.data.chunks import WorkerArenas
from clipscale.data.decoders import EncodedImages, device_decodes, jpeg_frame, size_only
from clipscale.data.epoch import SAMPLE_SEEDS, EpochOrder, EpochPlan, ShuffledEpoch, WorkList
from clipscale.data.sources import (DATA_ERRORS, IMAGE_KEYS, TEXT_KEYS, ShardSource, check_pixel_bound, decode_text,
                                    first_member, open_image, tar_samples)
from clipscale.data.transforms import SplitTransform

EPOCHS_COUNTED = 4  # how many of the latest epochs `StreamState.drawn` keeps
SKIPS_NAMED = 3  # skipped samples a piece names, with why (the console's data lines say the first few)
REASON_CHARS = 120  # a skip's reason is cut to this many characters


class NoUsableSample(UserError):
    """The data holds no sample the run can train on: an error line, not a traceback. Raised in a
    loader worker, it reaches the trainer wrapped by the DataLoader (`BatchStream` unwraps it)."""


@dataclass(frozen=True)
class Cursor:
    """Where a logical loader worker stands after a piece: the work-list `item` it reads (`WorkList`)
    and the `position` in that item's shuffled slot to go on from (`ShuffledEpoch.position()`;
    empty: the item's start). A checkpoint holds it as a dict of these fields."""

    worker: int
    item: int
    position: tuple = ()

    @classmethod
    def loaded(cls, worker: int, saved) -> "Cursor":
        """From a checkpoint: this class's fields, or the tuple (item, its epoch, *position) that
        checkpoints written before this class held (the epoch was never read)."""
        if isinstance(saved, Cursor):
            return saved
        if isinstance(saved, dict):
            return cls(saved["worker"], saved["item"], tuple(saved["position"]))
        item, _, *position = saved
        return cls(worker, item, tuple(position))


@dataclass
class StreamState:
    """Where one rank's stream stands. `cursors`: {logical worker: its `Cursor`} after the last piece
    used from each; `work`: the work list its consumers take their items from (`WorkList`, the same
    on every rank), `workers`: the logical workers of each rank that took them (the world size is
    the number of ranks saved)."""

    cursors: dict = field(default_factory=dict)
    work: dict = field(default_factory=lambda: asdict(WorkList()))
    workers: int = 1
    drawn: dict = field(default_factory=dict)  # {epoch: raw samples drawn by the used pieces}, the latest epochs
    pieces: int = 0  # pieces consumed by the trainer; decides the worker rotation on resume
    batches: int = 0  # batches the trainer used: the run's steps on this rank, so its stream gathers no more
    skipped_samples: int = 0  # undecodable samples in those pieces' stretch of the stream
    shard_errors: int = 0  # shards that could not be read to their end
    captions_cut: int = 0  # captions in those pieces longer than the context length, cut by the tokenizer
    images_trained_black: int = 0  # images of the used batches that no decoder took, trained black (the GPU decoder's)

    def __post_init__(self):
        self.cursors = {worker: Cursor.loaded(worker, saved) for worker, saved in self.cursors.items()}

    def state_dict(self) -> dict:
        return asdict(self)  # the cursors as dicts: a checkpoint holds plain containers

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(vars(StreamState(**state)))

    def update(self, piece: dict) -> None:
        cursor = piece["cursor"]
        self.cursors[cursor.worker] = cursor
        self.pieces += 1
        for epoch, drawn in piece["drawn"].items():
            self.drawn[epoch] = self.drawn.get(epoch, 0) + drawn
        self.drawn = {epoch: n for epoch, n in self.drawn.items() if epoch > max(self.drawn) - EPOCHS_COUNTED}
        self.skipped_samples += piece["skipped_samples"]
        self.shard_errors += piece["shard_errors"]
        self.captions_cut += piece["captions_cut"]

    @staticmethod
    def work_left(saved: list[dict]) -> WorkList:
        """The work list left by the ranks that saved `saved` (one state each): their consumers'
        cursors folded in."""
        workers = saved[0]["workers"]
        cursors = {rank * workers + cursor.worker: (cursor.item, *cursor.position) for rank, state in enumerate(saved)
                   for cursor in (Cursor.loaded(worker, saved) for worker, saved in state["cursors"].items())}
        return WorkList(**saved[0]["work"]).after(len(saved) * workers, cursors)

    @classmethod
    def resumed(cls, saved: list[dict], rank: int, world_size: int, workers: int) -> "StreamState":
        """Rank `rank`'s state, of `world_size` ranks with `workers` logical loader workers each,
        from the states every rank of a checkpoint saved: its own where the shape is the saved one
        (the same batches as an uninterrupted run), else its share of the work they left."""
        if len(saved) == world_size and saved[0]["workers"] == workers:
            return cls(**saved[rank])
        return cls.reshaped(saved, rank, workers)

    @classmethod
    def reshaped(cls, saved: list[dict], rank: int, workers: int) -> "StreamState":
        """Rank `rank`'s state on a new shape from every saved rank's: the work left, the steps done;
        the counts that the run logs as sums over ranks go to rank 0."""
        totals = {key: sum(state.get(key, 0) for state in saved) if rank == 0 else 0
                  for key in ("skipped_samples", "shard_errors", "captions_cut", "images_trained_black")}
        drawn = Counter()
        for state in saved:
            drawn.update(state["drawn"])
        return cls(work=asdict(cls.work_left(saved)), workers=workers, drawn=dict(drawn) if rank == 0 else {},
                   batches=saved[0]["batches"], **totals)


class ShardErrors:
    """webdataset error handler that counts the shards cut short, names them, and carries on with
    the next shard (the trainer's console says so, `metrics.DataProblems`).

    It counts shards, not exceptions: webdataset reports a tar file cut short
    once or twice (from the member read and again from the archive iterator). A shard read in
    parts (fewer shards than `MIN_SLOTS`) counts in the read of its first part only (`counting`)."""

    def __init__(self):
        self.count = 0
        self.shards: list[str] = []  # those cut short since the last piece
        self.current_shard = ""
        self.current_shard_failed = False
        self.counting = True

    def __call__(self, exn: Exception) -> bool:
        if not self.current_shard_failed:
            self.count += self.counting
            self.shards.append(self.current_shard)
            self.current_shard_failed = True
        return True

    def read(self, url: str):
        """The samples of one shard, up to the first error."""
        self.current_shard, self.current_shard_failed = str(url), False
        yield from tar_samples(url, self)


class UnusableSample(Exception):
    """A sample that cannot be trained on; its message says why, in a few words."""


def load_sample(raw: dict, transform: Callable, split: Optional[SplitTransform], keep_encoded: bool,
                decode: bool = True, max_pixels: Optional[int] = None) -> Optional[tuple]:
    """`read_sample`'s (pixels, (bytes, crop) or None, caption), or None when the sample is unusable."""
    try:
        return read_sample(raw, transform, split, keep_encoded, decode, max_pixels)
    except UnusableSample:
        return None


def read_sample(raw: dict, transform: Callable, split: Optional[SplitTransform], keep_encoded: bool,
                decode: bool = True, max_pixels: Optional[int] = None, device_resizes: bool = False) -> tuple:
    """(pixels, (bytes, crop) or None, caption); `UnusableSample` saying why when the sample is unusable.

    Only the image and caption members are decoded (`clipscale.data.sources`). Pixels are uint8
    when the transform splits (`SplitTransform`), else the whole transform's float tensor. With
    `keep_encoded` (offload) the image's bytes and the crop it drew are kept too, so the batch can
    be decoded again later without the loader. Without `decode` (the device decodes) a JPEG that
    the device takes (`device_decodes`, judged from its header) is not decoded here: its crop is
    drawn from the header's size and pixels is None; anything else is decoded here, to be judged
    and handed over as pixels: with `device_resizes` (the device decoder's path), its crop region
    unresized (`SplitTransform.crop_region`). On that path a JPEG the device takes that the worker
    decodes all the same (`decode`: its share) is decoded by libjpeg-turbo without PIL
    (`SplitTransform.jpeg_region`), its crop drawn from the header. An image whose header claims more than `max_pixels`
    pixels (None: PIL's bound) is unusable, judged from the header alone on both paths, before any
    decoding."""
    image_key = first_member(raw, IMAGE_KEYS)
    text_key = first_member(raw, TEXT_KEYS)
    if image_key is None or text_key is None:
        raise UnusableSample("no image member (data.image_key)" if image_key is None else "no caption member (data.caption_key)")
    try:
        data = raw[image_key]
        frame = jpeg_frame(data) if device_resizes or not decode else None
        jpeg, pixels = frame is not None and device_decodes(frame, data), None
        if jpeg:
            check_pixel_bound(frame.width, frame.height, max_pixels)
            params = split.draw(size_only(frame.height, frame.width))
            if decode:  # the worker's share; None for a large region or bytes libjpeg-turbo refuses: PIL's, below
                pixels = split.jpeg_region(data, params)
        if not jpeg or (decode and pixels is None):
            with open_image(data, max_pixels) as img:
                img = img.convert("RGB")  # PIL decodes lazily; this forces it, so bad bytes fail here
                if split is None:
                    params, pixels = (), transform(img)
                else:
                    if not jpeg:  # a JPEG's crop is drawn from its header's size, the same as PIL's
                        params = split.draw(img)
                    pixels = split.crop_region(img, params) if device_resizes else split.apply(img, params)
        caption = decode_text(raw[text_key])
    except DATA_ERRORS as err:  # undecodable or oversized: skipped and counted; any other error is a bug and stops the run
        raise UnusableSample(reason_of(err)) from None
    if not caption:
        raise UnusableSample("an empty caption")
    return pixels, ((bytes(data), params) if keep_encoded else None), caption


def reason_of(err: BaseException) -> str:
    """Why bad bytes are unusable, on one line: the error's type and message."""
    if isinstance(err, UnidentifiedImageError):  # PIL's message names only a BytesIO object
        return f"{type(err).__name__}: not a JPEG, PNG or WebP image, or cut short before its size"
    message = " ".join(str(err).split())
    reason = f"{type(err).__name__}: {message}" if message else type(err).__name__
    return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 3] + "..."


class ShardStream(torch.utils.data.IterableDataset):
    """Pieces of `piece_size` samples from one rank's share of the order (see the module doc).

    A piece is a dict: "images" (uint8 [n, 3, H, W] with `split`, else the transform's float
    tensor; absent without `decode`), "texts" (token ids), "encoded" (offload, or without
    `decode`: an `EncodedImages` of the same samples), "cursor" (its worker's `Cursor` after it),
    with `keep_keys` "sample_keys" ((epoch, key) of each sample: a Python object a sample, for
    tests and tools, never on the trainer's path), "drawn" ({epoch: raw
    samples drawn for the piece, skipped ones included}), "skipped_samples", "skips" ((where, why) of
    the first `SKIPS_NAMED` skipped samples: a shard and key, or a CSV table's image file),
    "shard_errors", "problem_shards"."""

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
        worker_decode_share: float = 0.0,
        max_image_pixels: Optional[int] = None,
        keep_keys: bool = False,
        arenas: Optional[WorkerArenas] = None,
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
        # Without `decode`: the samples whose seed falls in this share are decoded here all the same.
        self.decoded_here_below = round(worker_decode_share * SAMPLE_SEEDS)
        self.max_image_pixels = max_image_pixels  # None: PIL's Image.MAX_IMAGE_PIXELS
        self.keep_keys = keep_keys
        self.arenas = arenas  # where the workers write the pixels they decode for the device (WorkerArenas)
        self.state = state or StreamState(workers=self.num_workers)  # read when iterated: it may be restored after this is built
        self.order = EpochOrder(self.source, seed)

    def shuffled_slot(self, number: int, errors: ShardErrors) -> ShuffledEpoch:
        """The samples of slot `number` of the order, through a shuffle buffer of their own."""
        slot = self.order.slot(number)
        errors.counting = slot.phase == 0
        return ShuffledEpoch(self.source, EpochPlan([slot.shard], stride=slot.parts, phase=slot.phase),
                             self.shuffle_buffer, f"{self.seed}/{number}", errors)

    def skipped_sample(self, raw: Optional[dict], error: Optional[UnusableSample], shard: str) -> tuple[str, str]:
        """(where, why) of a skipped sample, as its user finds it: a shard and key, or a CSV table's
        image file (`CsvTable`'s samples are keyed by their row; a file it could not read has no image)."""
        if raw is None:
            return shard or "a shard", "a buffered sample no longer readable (the shard changed since the checkpoint)"
        rows = getattr(self.source, "rows", None)
        if raw.get("__url__") is None and rows is not None:
            path = rows[int(raw["__key__"])][0]
            if first_member(raw, IMAGE_KEYS) is None:
                return path, "cannot read the file" + ("" if Path(path).exists() else ": no such file")
            return path, str(error)
        return f"{raw.get('__url__') or shard}: sample {raw.get('__key__')}", str(error)

    def _piece(self, samples: list[tuple], cursor: Cursor, drawn: Counter, skipped: int, skips: list, errors: ShardErrors,
               problem_shards: list, loader_worker: int) -> dict | None:
        """The piece of `samples`; None when the trainer closed while this worker waited for room in
        its arena (`loader_worker`: the DataLoader's number of this worker)."""
        pixels, encoded, captions, keys = zip(*samples)
        texts = self.tokenizer(list(captions))
        piece = {
            "texts": texts,
            "cursor": cursor,
            "drawn": dict(drawn),
            "skipped_samples": skipped,
            "skips": skips,
            "captions_cut": captions_cut(self.tokenizer, list(captions), texts),  # longer than the context length
            "shard_errors": errors.count,
            "problem_shards": [shard for shard in dict.fromkeys(problem_shards + errors.shards) if shard],  # where skips and cuts were met
        }
        if self.keep_keys:
            piece["sample_keys"] = list(keys)
        if self.decode:
            piece["images"] = torch.stack(pixels)
        if self.keep_encoded:  # without `decode`, the images the device will not decode come as pixels
            parts = EncodedImages.parts_of_samples(*zip(*encoded), None if self.decode else pixels)
            tensors = {"texts": texts, **parts}
            if self.arenas is not None and not self.decode and self.arenas.takes(tensors, len(samples)):
                piece["in_arena"] = self.arenas.carry(loader_worker, tensors)  # the queue carries where they are
                del piece["texts"]
                if piece["in_arena"] is None:
                    return None
            else:
                piece["encoded"] = EncodedImages.of_parts(parts)
        return piece

    @staticmethod
    def taken_from(arenas: WorkerArenas, piece: dict) -> dict:
        """In the trainer: a piece whose tensors a worker wrote into its arena (`_piece`) with them
        as views of it again, "texts" and "encoded" as a piece without arenas has them."""
        if "in_arena" in piece:
            carried = piece.pop("in_arena")
            tensors = arenas.take(carried)
            piece["texts"] = tensors.pop("texts")
            piece["encoded"] = EncodedImages.in_arena(tensors, carried)
        return piece

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        slot = info.id if info is not None else 0
        worker = (slot + self.state.pieces) % self.num_workers  # the first loader slot serves the next worker
        consumer = self.rank * self.num_workers + worker
        consumers = self.world_size * self.num_workers
        work = WorkList(**self.state.work)
        cursor = self.state.cursors.get(worker, Cursor(worker, consumer))
        item, position = cursor.item, cursor.position
        samples, drawn, skipped, skips, errors, problem_shards = [], Counter(), 0, [], ShardErrors(), []
        barren, drew = 0, False  # items in a row without a usable sample; whether they held any sample
        while True:
            number, saved = work.item(item)
            epoch = self.order.slot(number).epoch
            usable = 0
            shuffled = self.shuffled_slot(number, errors)
            for raw in shuffled.samples(*(position or saved)):
                drawn[epoch] += 1
                # Only the CPU generator: torch.manual_seed also queues a CUDA reseed, whose stack capture
                # cost a third of a sample's loading time, and reseeded a GPU's RNG under an in-process loader.
                sample, unusable = None, None
                seed = shuffled.sample_seed()
                decode = self.decode or seed < self.decoded_here_below
                with torch.random.fork_rng(devices=[]):
                    torch.random.default_generator.manual_seed(seed)
                    try:
                        sample = None if raw is None else read_sample(raw, self.image_transform, self.split,
                                                                       self.keep_encoded, decode, self.max_image_pixels,
                                                                       device_resizes=not self.decode)
                    except UnusableSample as err:
                        unusable = err
                if sample is None:
                    skipped += 1
                    problem_shards.append((raw or {}).get("__url__") or errors.current_shard)
                    if len(skips) < SKIPS_NAMED:
                        skips.append(self.skipped_sample(raw, unusable, errors.current_shard))
                    continue
                usable += 1
                samples.append((*sample, (epoch, raw["__key__"])))
                if len(samples) == self.piece_size:
                    piece = self._piece(samples, Cursor(worker, item, shuffled.position()), drawn, skipped, skips, errors,
                                        problem_shards, slot)
                    if piece is None:
                        return
                    yield piece
                    samples, drawn, skipped, skips, errors.count, errors.shards, problem_shards = [], Counter(), 0, [], 0, [], []
            # Slots move between consumers every epoch, so a barren stretch can be bad luck; an epoch's
            # worth of them in a row means the data itself is broken, and waiting would hang the run.
            barren, drew = (0, False) if usable else (barren + 1, drew or shuffled.draws > 0)
            if barren == self.order.per_epoch and not drew:
                raise NoUsableSample(f"the training data holds no samples (loader {consumer} read its share of "
                                     f"{len(self.source.shards)} shard(s), first {self.source.shards[0]}, and found none)")
            if barren == 3 * self.order.per_epoch:
                first = f"; the first: {skips[0][0]} ({skips[0][1]})" if skips else ""
                raise NoUsableSample(f"the training data holds no usable sample: loader {consumer} decoded no sample in 3 "
                                     f"passes over its shards ({skipped} skipped; first shard {self.source.shards[0]}{first}): "
                                     "check data.image_key and data.caption_key against the shards' member names")
            item, position = item + consumers, ()
