"""A step's batch on the host, gathered from the loader's pieces while the step runs.

`BatchStream` puts each piece, in a thread of the training process, into the batch's columns
(`ChunkSource`s: pinned uint8 images and token ids, or the images' bytes for a decoder), one
batch ahead; a chunk is handed to the step as soon as its pieces are in. A batch is a context:
leaving it after the step marks it used, which moves the stream's cursors past its pieces, and
frees its buffers for the batch after next.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from clipscale.data.chunks import Arrivals, ChunkSource, DeviceTransform, KeepBudget, PinnedRows, on_the_callers_device
from clipscale.data.shards import SKIPS_NAMED, StreamState
from clipscale.errors import UserError

# A worker decodes a piece before handing it over: large pieces delay the first step and
# hold more memory in flight; small ones cost per-piece overhead (tokenizer call, IPC).
MAX_PIECE = 1024


class ImageDecoder(Protocol):
    """Who decodes the images beside the loader (decoders.DeviceDecoder, decoders.DecodePool)."""

    def column(self, batch_size: int, arrivals: Arrivals, device_transform: DeviceTransform | None,
               budget: KeepBudget | None) -> ChunkSource: ...

    def close(self) -> None: ...


def pinned_empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked where CUDA is, at its exact size.

    `torch.empty(..., pin_memory=True)` goes through the caching host allocator, which
    rounds every block up to a power of two: a 4.9 GB batch would hold 8 GB. Registering
    plain memory with CUDA pins exactly what the batch needs."""
    tensor = torch.empty(shape, dtype=dtype)
    if torch.cuda.is_available() and tensor.numel():
        nbytes = tensor.numel() * tensor.element_size()
        status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if status != 0:  # cudaSuccess; otherwise fall back to the caching allocator
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        weakref.finalize(tensor.untyped_storage(), torch.cuda.cudart().cudaHostUnregister, tensor.data_ptr())
    return tensor


@dataclass
class StreamedBatch:
    """One step's batch: its columns, filled while the step runs, and its pieces' stream records.
    Used as a context: leaving it without an error marks it used (`BatchStream.done_with`)."""

    images: ChunkSource
    texts: ChunkSource
    arrivals: Arrivals
    slot: int
    stream: "BatchStream"
    records: list = field(default_factory=list)  # (cursor, skipped, skips named, shard errors, problem shards) of each piece, in order
    handed_out_after_s: float = 0.0  # how long `BatchStream.next` waited for this batch to start

    @property
    def data_wait_s(self) -> float:
        """Time the step waited for this batch's data: its start, then each chunk not yet there."""
        return self.handed_out_after_s + self.images.wait_s + self.texts.wait_s

    def __len__(self) -> int:
        return len(self.texts)

    def __enter__(self) -> "StreamedBatch":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.stream.done_with(self, used=error is None)


class BatchStream:
    """Gathers the loader's pieces into per-step batches in a background thread, one batch ahead.

    loader:     an iterable of pieces (dicts of "images", "texts", "cursor", "skipped_samples", "skips", "problem_shards",
                "shard_errors", and "encoded" for a decoder), typically a DataLoader over `ShardStream`.
    batch_size: this rank's samples per step, a multiple of piece_size.
    state:      where the stream stands (`StreamState`, the one the loader's `ShardStream` reads
                when it starts): each used batch moves it on. It bounds the gathering, with
                `steps`, to the run's batches.
    device_transform: the device transform of the images (uint8 -> normalised float), or None
                when the pieces already hold the final images.
    decoder:    None (the pieces hold the pixels), or who decodes the images (`ImageDecoder`).
    budget:     what chunks may keep on the device for pass 2 (`KeepBudget`), or None.
    in_thread:  gather in a background thread, one batch ahead. Off when the loader decodes in
                this process (no workers): its per-sample seeding sets the process-wide RNG,
                which a thread would race with the step's dropout and Gradient Cache's replays.
                The whole batch is then gathered inside `next()`.
    """

    SLOTS = 2  # the batch in use and the next one

    def __init__(self, loader: Iterable[dict], *, batch_size: int, piece_size: int, state: StreamState, steps: int,
                 device_transform: DeviceTransform | None = None, decoder: ImageDecoder | None = None,
                 budget: KeepBudget | None = None, in_thread: bool = True):
        if batch_size % piece_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of piece_size {piece_size}")
        self.loader_iterable, self.loader = loader, None  # iterated (its workers started) by the first `next()`
        self.state, self.steps = state, steps
        self.in_thread = in_thread
        self.batch_size, self.piece_size = batch_size, piece_size
        self.device_transform = device_transform
        self.decoder = decoder
        self.budget = budget
        self.buffers: list[dict] = [{} for _ in range(self.SLOTS)]  # per slot: column name -> pinned tensor
        self.free: queue.Queue = queue.Queue()
        for slot in range(self.SLOTS):
            self.free.put(slot)
        self.ready: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.problem_shards: list[str] = []  # shards where the used batches met skipped samples or a cut (for the console)
        self.skips: list[tuple[str, str]] = []  # (where, why) of the first samples the used batches skipped (`take_skips`)
        self.thread = None

    def start(self) -> None:
        """Start reading: the loader's workers take the stream as it is now (a resumed run's cursors
        are in it by then, whenever they were restored), and the gathering thread starts."""
        self.loader = iter(self.loader_iterable)
        if self.in_thread:
            self.thread = threading.Thread(target=on_the_callers_device(self._gather), args=(self.steps - self.state.batches,),
                                           name="clipscale-batches", daemon=True)
            self.thread.start()

    def next(self) -> StreamedBatch:
        """The next step's batch, as soon as its first piece is on its way (the first call starts reading)."""
        started = time.perf_counter()
        if self.loader is None:
            self.start()
        if self.thread is None:
            gathered: list = []
            self._gather_batch(self.free.get_nowait(), gathered.append)
            batch = gathered[0]
        else:
            batch = self.ready.get()
            if isinstance(batch, UserError):
                raise type(batch)(last_line(str(batch))) from None  # a worker's, wrapped with its traceback's text
            if isinstance(batch, BaseException):
                raise RuntimeError("the data loader failed") from batch
        batch.handed_out_after_s = time.perf_counter() - started
        return batch

    def done_with(self, batch: StreamedBatch, used: bool) -> None:
        """The step is done with `batch`: when it was `used`, the stream moves past its pieces; its
        buffers take the batch after next."""
        if used:
            batch.arrivals.wait_for(len(batch))
            for record in batch.records:
                self.state.update(record)
                self.problem_shards += [shard for shard in record["problem_shards"] if shard not in self.problem_shards]
                self.skips += record.get("skips", [])[: SKIPS_NAMED - len(self.skips)]
            self.state.batches += 1
            self.state.images_trained_black += getattr(batch.images.rows, "trained_black", 0)  # a GPU decoder's rows count them
        batch.images.release()
        batch.texts.release()
        self.free.put(batch.slot)

    def take_skips(self) -> list[tuple[str, str]]:
        """(where, why) of the first `SKIPS_NAMED` samples (this rank's) that the batches used since the last call skipped."""
        skips, self.skips = self.skips, []
        return skips

    def close(self) -> None:
        """Stop gathering, release the batches gathered ahead and shut the loader's workers down
        (before the interpreter exits: a thread still inside the loader then aborts the process)."""
        self.stopping.set()
        self.free.put(None)  # wakes the thread if it waits for a slot
        if self.thread is not None:
            self.thread.join(timeout=10)
        while not self.ready.empty():
            batch = self.ready.get_nowait()
            if isinstance(batch, StreamedBatch):
                self.done_with(batch, used=False)
        shutdown = getattr(self.loader, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _buffer(self, slot: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """The slot's pinned buffer for a column, allocated once (pinning gigabytes takes seconds)."""
        shape = (self.batch_size, *like.shape[1:])
        buffer = self.buffers[slot].get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != like.dtype:
            buffer = pinned_empty(shape, like.dtype)
            self.buffers[slot][name] = buffer
        return buffer

    def _gather(self, batches: int) -> None:
        try:
            for _ in range(batches):
                slot = self.free.get()
                if slot is None or self.stopping.is_set():
                    return
                self._gather_batch(slot, self.ready.put)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, which raises it
            self.ready.put(error)

    def _gather_batch(self, slot: int, publish: Callable[[StreamedBatch], None]) -> None:
        """Gather one batch into `slot`, publishing it as soon as its first piece is there."""
        piece = next(self.loader)
        arrivals = Arrivals()
        if self.decoder is not None:
            images = self.decoder.column(self.batch_size, arrivals, self.device_transform, self.budget)
        else:
            images = ChunkSource(PinnedRows(self._buffer(slot, "images", piece["images"]), "images", arrivals),
                                 self.device_transform, self.budget)
        texts = ChunkSource(PinnedRows(self._buffer(slot, "texts", piece["texts"]), "texts", arrivals), budget=self.budget)
        batch = StreamedBatch(images, texts, arrivals, slot, self)
        publish(batch)
        try:
            for k in range(self.batch_size // self.piece_size):
                if self.stopping.is_set():
                    raise RuntimeError("the batch stream was closed")
                if k:
                    piece = next(self.loader)
                rows = slice(k * self.piece_size, (k + 1) * self.piece_size)
                if len(piece["texts"]) != self.piece_size:
                    raise RuntimeError(f"a loader piece has {len(piece['texts'])} samples, expected {self.piece_size}")
                images.put(rows, piece)
                texts.put(rows, piece)
                batch.records.append({key: piece[key] for key in ("cursor", "drawn", "sample_keys", "skipped_samples", "skips",
                                                                   "shard_errors", "captions_cut", "problem_shards")
                                      if key in piece})
                arrivals.add(self.piece_size)
        except BaseException as error:
            arrivals.fail(error)
            raise


def last_line(message: str) -> str:
    """A loader worker's error as the DataLoader re-raises it ("Caught X in DataLoader worker
    process 0. Original Traceback ... X: message"): the message alone."""
    last = message.rstrip().splitlines()[-1] if message.strip() else message
    return last.split(": ", 1)[1] if "Original Traceback" in message and ": " in last else message


def piece_size_for(batch_size: int, chunk_size: int) -> int:
    """The loader's piece: the largest size up to MAX_PIECE that tiles both this rank's batch
    and its chunks, so a chunk is ready as soon as its own pieces are (a batch of 65,536 in
    chunks of 512 comes in pieces of 512; 1,000 in chunks of 512 in pieces of 8)."""
    return math.gcd(batch_size, min(chunk_size, MAX_PIECE, batch_size))
