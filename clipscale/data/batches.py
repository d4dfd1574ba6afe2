"""A step's batch on the host, gathered from the loader's pieces while the step runs.

Loader workers decode chunk-sized pieces (`ShardStream`); `BatchStream` copies them, in
a thread of the training process, into one pinned host buffer per column, as uint8:
the batch is held once, in its smallest decoded form. The step does not wait for the
whole batch: each column is a `HostColumn` whose chunk [start, stop) becomes available
as soon as the pieces covering it have arrived, so Gradient Cache's first pass runs on
the first piece while the others are still being decoded. The next batch is gathered
into a second buffer while the current step computes, and no further: at most one
batch ahead, so host memory is about two batches of uint8.

A column moves to the device one chunk at a time (`stream_chunks`): the copy of chunk
i+1 is issued on a side CUDA stream while the model computes on chunk i, and the float
conversion and normalisation run on the device (`device_transform`). Gradient Cache asks
for every chunk twice, naming the pass; a chunk that pass 1 brought to the device is kept
there, as uint8, for pass 2 while a `DeviceBudget` allows, so an image is decoded (or
copied) once per step. The time the step spends waiting for its data is counted per batch.

    stream = BatchStream(loader, batch_size=..., piece_size=..., batches=steps, to_float=split.to_float)
    batch = stream.next()        # at once: its pieces keep arriving
    loss = step(batch.images, batch.texts)
    batch.consumed(stream_state); stream.release(batch)
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

# A worker decodes a piece before handing it over: large pieces delay the first step and
# hold more memory in flight; small ones cost per-piece overhead (tokenizer call, IPC).
MAX_PIECE = 1024

DeviceTransform = Callable[[torch.Tensor], torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def copy_to_device(host: torch.Tensor, device: torch.device, copy_stream) -> torch.Tensor:
    """host -> device; on CUDA issued on `copy_stream`, ordered before the compute stream's next work."""
    if copy_stream is None:
        return host.to(device)
    with torch.cuda.stream(copy_stream):
        moved = host.to(device, non_blocking=True)
    compute = torch.cuda.current_stream(device)
    compute.wait_stream(copy_stream)
    # The tensor was allocated on the copy stream but is used (and freed) on the compute
    # stream: tell the caching allocator, or it could hand the memory out too early.
    moved.record_stream(compute)
    return moved


class DeviceBudget:
    """How many bytes of pass-1 chunks may stay on the device for pass 2 (shared by all columns)."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.used = 0
        self.lock = threading.Lock()
        self.waiting: list[Callable[[], None]] = []  # called once when bytes are given back

    def when_freed(self, callback: Callable[[], None]) -> None:
        """Call `callback` (once) the next time bytes are given back: a column decoding ahead
        goes on when the step frees what it kept."""
        with self.lock:
            self.waiting.append(callback)

    def take(self, tensor: torch.Tensor) -> bool:
        return self.take_bytes(tensor.numel() * tensor.element_size())

    def take_bytes(self, size: int) -> bool:
        with self.lock:
            if self.used + size > self.limit:
                return False
            self.used += size
            return True

    def give_back(self, tensor: torch.Tensor) -> None:
        self.give_back_bytes(tensor.numel() * tensor.element_size())

    def give_back_bytes(self, size: int) -> None:
        with self.lock:
            self.used -= size
            waiting, self.waiting = self.waiting, []
        for callback in waiting:
            callback()


class HostColumn:
    """One column of a batch kept on the host (images or tokens), handed to the device a chunk at a time.

    Subclasses say how rows [start, stop) are prepared (`submit`, which returns a waiter for
    the host tensor) and moved (`to_device`); `device_transform` finishes them on the device.
    `chunks` is what Gradient Cache calls, once per pass."""

    def __init__(self, device_transform: DeviceTransform | None = None, budget: DeviceBudget | None = None):
        self.device_transform = device_transform or identity
        self.budget = budget
        self.kept: dict[tuple[int, int], torch.Tensor] = {}  # pass-1 chunks on the device, for pass 2
        self.charged: set[tuple[int, int]] = set()  # chunks prepared ahead whose bytes the budget already holds
        self.wait_s = 0.0  # time the step spent waiting for this column's chunks

    def __len__(self) -> int:
        raise NotImplementedError

    def submit(self, start: int, stop: int, pass_number: int) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    to_device = staticmethod(copy_to_device)

    def chunks(self, bounds: Sequence[tuple[int, int]], device: torch.device, pass_number: int = 1,
               keep: Sequence[tuple[int, int]] = ()) -> Iterator[torch.Tensor]:
        """Rows [start, stop) of each bound on `device`, in order. In pass 1 the chunks in `keep`
        (those pass 2 will ask for) stay on the device while the budget allows."""
        return stream_chunks(self, bounds, device, pass_number, keep)

    def drop_kept(self) -> None:
        """Free what pass 1 kept and pass 2 did not take (a step that ended early)."""
        for tensor in self.kept.values():
            self.budget.give_back(tensor)
        self.kept.clear()


class HostTensor(HostColumn):
    """A column held whole in one host tensor (uint8 images, token ids), pinned once so that
    every chunk copy can be asynchronous."""

    def __init__(self, tensor: torch.Tensor, device_transform: DeviceTransform | None = None,
                 budget: DeviceBudget | None = None):
        super().__init__(device_transform, budget)
        if torch.cuda.is_available() and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        self.tensor = tensor

    def __len__(self) -> int:
        return len(self.tensor)

    def submit(self, start: int, stop: int, pass_number: int) -> Callable[[], torch.Tensor]:
        chunk = self.tensor[start:stop]  # a row slice of a pinned tensor is pinned
        return lambda: chunk


class Arrivals:
    """How many leading rows of a batch have arrived; waiting on it re-raises a loader failure."""

    def __init__(self):
        self.rows = 0
        self.error: Optional[BaseException] = None
        self.condition = threading.Condition()

    def add(self, rows: int) -> None:
        with self.condition:
            self.rows += rows
            self.condition.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.condition:
            self.error = error
            self.condition.notify_all()

    def wait_for(self, rows: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.rows >= rows or self.error is not None)
            if self.rows < rows:
                self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError("the data loader failed while gathering this batch") from self.error


class ArrivingTensor(HostTensor):
    """A HostTensor whose rows are still being filled: a chunk is handed out once it has arrived."""

    def __init__(self, tensor: torch.Tensor, arrivals: Arrivals, device_transform: DeviceTransform | None = None,
                 budget: DeviceBudget | None = None):
        super().__init__(tensor, device_transform, budget)
        self.arrivals = arrivals

    def submit(self, start: int, stop: int, pass_number: int) -> Callable[[], torch.Tensor]:
        def wait() -> torch.Tensor:
            self.arrivals.wait_for(stop)
            return self.tensor[start:stop]

        return wait


def stream_chunks(column: HostColumn, bounds: Sequence[tuple[int, int]], device: torch.device, pass_number: int = 1,
                  keep: Sequence[tuple[int, int]] = (), lookahead: int = 2) -> Iterator[torch.Tensor]:
    """Yield column[start:stop] on `device` for each bound, preparing the next ones meanwhile.

    Up to `lookahead` chunks are being prepared on the host while one is used; the copy of
    a chunk is issued on a side stream, so it overlaps the kernels still queued for the
    previous chunk. Pass 2 takes the chunks pass 1 kept instead of preparing them again."""
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    keep = set(keep) if column.budget is not None and pass_number == 1 else set()

    def prepare(bound: tuple[int, int]) -> tuple[Callable[[], torch.Tensor], bool]:
        kept = column.kept.pop(bound, None) if pass_number > 1 else None
        if kept is not None:
            column.budget.give_back(kept)  # freed once this chunk has been used
            return (lambda: kept), True
        return column.submit(*bound, pass_number), False

    pending = deque(prepare(bound) for bound in bounds[:lookahead])
    later = iter(bounds[lookahead:])
    for bound in bounds:
        waiter, on_device = pending.popleft()
        started = time.perf_counter()
        host = waiter()
        column.wait_s += time.perf_counter() - started
        upcoming = next(later, None)
        if upcoming is not None:
            pending.append(prepare(upcoming))
        moved = host if on_device else column.to_device(host, device, copy_stream)
        charged = bound in column.charged
        column.charged.discard(bound)
        if bound in keep and (charged or column.budget.take(moved)):
            column.kept[bound] = moved
        elif charged:
            column.budget.give_back(moved)  # prepared ahead, not needed again: freed after this use
        yield column.device_transform(moved)


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
    """One step's batch: its columns, filled while the step runs, and its pieces' stream records."""

    images: HostColumn
    texts: ArrivingTensor
    arrivals: Arrivals
    slot: int
    records: list = field(default_factory=list)  # (cursor, skipped, shard errors) of each piece, in order
    handed_out_after_s: float = 0.0  # how long `BatchStream.next` waited for this batch to start

    @property
    def data_wait_s(self) -> float:
        """Time the step waited for this batch's data: its start, then each chunk not yet there."""
        return self.handed_out_after_s + self.images.wait_s + self.texts.wait_s

    def __len__(self) -> int:
        return len(self.texts)

    def consumed(self, stream_state) -> None:
        """Advance the stream state past this batch (call once the step has used all of it)."""
        self.arrivals.wait_for(len(self))
        for record in self.records:
            stream_state.update(record)


class BatchStream:
    """Gathers the loader's pieces into per-step batches in a background thread, one batch ahead.

    loader:     an iterable of pieces (dicts of "images", "texts", "cursor", "skipped_samples",
                "shard_errors", and "encoded" with offload), typically a DataLoader over `ShardStream`.
    batch_size: this rank's samples per step, a multiple of piece_size.
    to_float:   the device transform of the images (uint8 -> normalised float), or None when
                the pieces already hold the final images.
    image_column: None, or a factory (batch_size, arrivals, to_float, budget) -> a column that
                takes the images piece by piece (`offload.OffloadedImages`,
                `device_decode.DeviceDecodedImages`) instead of one pinned buffer.
    budget:     what pass-1 chunks may keep on the device for pass 2 (`DeviceBudget`), or None.
    in_thread:  gather in a background thread, one batch ahead. Off when the loader decodes in
                this process (no workers): its per-sample seeding sets the process-wide RNG,
                which a thread would race with the step's dropout and Gradient Cache's replays.
                The whole batch is then gathered inside `next()`.
    """

    SLOTS = 2  # the batch in use and the next one

    def __init__(self, loader: Iterable[dict], *, batch_size: int, piece_size: int, batches: int,
                 to_float: DeviceTransform | None = None, image_column=None, in_thread: bool = True,
                 budget: DeviceBudget | None = None):
        if batch_size % piece_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of piece_size {piece_size}")
        self.loader_iterable, self.loader = loader, None  # iterated (its workers started) by the first `next()`
        self.in_thread = in_thread
        self.batch_size, self.piece_size, self.batches = batch_size, piece_size, batches
        self.to_float = to_float
        self.image_column = image_column
        self.budget = budget
        self.buffers: list[dict] = [{} for _ in range(self.SLOTS)]  # per slot: column name -> pinned tensor
        self.free: queue.Queue = queue.Queue()
        for slot in range(self.SLOTS):
            self.free.put(slot)
        self.ready: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.thread = None

    def start(self) -> None:
        """Start reading: the loader's workers take the stream as it is now (a resumed run's cursors
        are in it by then, whenever they were restored), and the gathering thread starts."""
        self.loader = iter(self.loader_iterable)
        if self.in_thread:
            self.thread = threading.Thread(target=self._gather, name="clipscale-batches", daemon=True)
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
            if isinstance(batch, BaseException):
                raise RuntimeError("the data loader failed") from batch
        batch.handed_out_after_s = time.perf_counter() - started
        return batch

    def release(self, batch: StreamedBatch) -> None:
        """The step is done with `batch`: its buffers take the batch after next."""
        batch.images.drop_kept()
        batch.texts.drop_kept()
        self.free.put(batch.slot)

    def close(self) -> None:
        """Stop gathering and shut the loader's workers down (before the interpreter exits:
        a thread still inside the loader then aborts the process)."""
        self.stopping.set()
        self.free.put(None)  # wakes the thread if it waits for a slot
        if self.thread is not None:
            self.thread.join(timeout=10)
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

    def _gather(self) -> None:
        try:
            for _ in range(self.batches):
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
        if self.image_column is not None:
            images = self.image_column(self.batch_size, arrivals, self.to_float, self.budget)
        else:
            images = ArrivingTensor(self._buffer(slot, "images", piece["images"]), arrivals, self.to_float, self.budget)
        texts = ArrivingTensor(self._buffer(slot, "texts", piece["texts"]), arrivals, budget=self.budget)
        batch = StreamedBatch(images, texts, arrivals, slot)
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
                if self.image_column is not None:
                    images.put(rows, piece)
                else:
                    images.tensor[rows].copy_(piece["images"])
                texts.tensor[rows].copy_(piece["texts"])
                batch.records.append({key: piece[key] for key in ("cursor", "skipped_samples", "shard_errors")})
                arrivals.add(self.piece_size)
        except BaseException as error:
            arrivals.fail(error)
            raise


def piece_size_for(batch_size: int, chunk_size: int) -> int:
    """The loader's piece: the largest size up to MAX_PIECE that tiles both this rank's batch
    and its chunks, so a chunk is ready as soon as its own pieces are (a batch of 65,536 in
    chunks of 512 comes in pieces of 512; 1,000 in chunks of 512 in pieces of 8)."""
    return math.gcd(batch_size, min(chunk_size, MAX_PIECE, batch_size))
