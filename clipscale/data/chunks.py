"""A column of a step's batch (its images or its texts) handed to the device a chunk at a time.

`ChunkSource` is what Gradient Cache asks for chunks, once per pass. Its `Rows` say how rows
[start, stop) become ready: a pinned host tensor (`PinnedRows`, possibly still filling from the
loader), offloaded bytes or bytes the GPU decodes (decoders.py). The source owns
everything else: preparing the next chunks while one is used, copying host rows on a side CUDA
stream, keeping pass 1's chunks on the device for pass 2 while the `KeepBudget` has room,
preparing chunks before their pass asks (`prepare_ahead`), and the time the step waited.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import math
import mmap
import os
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch

from clipscale.errors import UserError

Bounds = Sequence[tuple[int, int]]  # [start, stop) rows of each chunk of a batch, in order


def chunk_bounds(rows: int, chunk_size: int) -> list[tuple[int, int]]:
    """How a batch of `rows` is cut: chunks of `chunk_size` rows, the last one shorter. The one place
    it is computed: Gradient Cache, and the benchmarks that cut a batch as it does."""
    return [(start, min(start + chunk_size, rows)) for start in range(0, rows, chunk_size)]


DeviceTransform = Callable[[torch.Tensor], torch.Tensor]
LOOKAHEAD = 3  # chunks being prepared while one is used: one a decoding thread (decoders.DECODE_THREADS), and one queued
GIB = 2**30
DEVICE_SHARE_KEPT = 0.25  # of a GPU's memory, for chunks kept for pass 2 (data.keep_on_device_gib: null)
HOST_KEPT_GIB = 1.0  # the same on a CPU device
WRITING_THREADS = 8  # bringing host memory's pages in before CUDA page-locks it (`pinned_empty`, `populate`)
MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap names it from 3.13 on
LIBC = ctypes.CDLL(None, use_errno=True)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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


def on_the_callers_device(target: Callable) -> Callable:
    """`target` for a new thread, run with the CUDA device current where this is called: a new
    thread starts on device 0, where rank 1 of a node would create a context of its own (the
    pinned-memory registration and the JPEG decoder do) beside rank 0's training."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return target
    device = torch.cuda.current_device()

    def on_device(*args, **kwargs):
        torch.cuda.set_device(device)
        return target(*args, **kwargs)

    return on_device


def kept_bytes(keep_on_device_gib: float | None, device: torch.device) -> int:
    """data.keep_on_device_gib in bytes on `device`: the `KeepBudget`'s limit."""
    if keep_on_device_gib is not None:
        return int(keep_on_device_gib * GIB)
    if device.type == "cuda":
        return int(DEVICE_SHARE_KEPT * torch.cuda.get_device_properties(device).total_memory)
    return int(HOST_KEPT_GIB * GIB)


class KeepBudget:
    """How many bytes of chunks may wait on the device for their use: pass 1's chunks kept for
    pass 2, and chunks prepared ahead. One budget for every column of every batch in flight."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.used = 0
        self.changed = threading.Condition()

    def take(self, size: int) -> bool:
        with self.changed:
            if self.used + size > self.limit:
                return False
            self.used += size
            return True

    def take_when_room(self, size: int, unless: Callable[[], bool]) -> bool:
        """Wait until `size` bytes fit and take them (True), or until `unless()` holds (False)."""
        with self.changed:
            self.changed.wait_for(lambda: unless() or self.used + size <= self.limit)
            if unless():
                return False
            self.used += size
            return True

    def give_back(self, size: int) -> None:
        with self.changed:
            self.used -= size
            self.changed.notify_all()

    def wake(self) -> None:
        """A waiter's `unless` may hold now."""
        with self.changed:
            self.changed.notify_all()


def page_lock(tensor: torch.Tensor) -> bool:
    """Register a host tensor's memory with CUDA (page-locked, so copies from it to the GPU are
    asynchronous DMA) until the tensor's storage is freed; False where CUDA is absent or refuses."""
    if not torch.cuda.is_available() or not tensor.numel():
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0) != 0:  # not cudaSuccess
        return False
    weakref.finalize(tensor.untyped_storage(), torch.cuda.cudart().cudaHostUnregister, tensor.data_ptr())
    return True


def pinned_empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked where CUDA is, at its exact size.

    `torch.empty(..., pin_memory=True)` goes through the caching host allocator, which rounds
    every block up to a power of two: a 4.9 GB batch would hold 8 GB. Registering memory of our
    own with CUDA pins exactly what is needed. The memory is advised huge pages and written in by
    several threads first (`write_pages_in`): CUDA then pins pages that are there, in 2 MiB pages
    where the machine's transparent huge pages allow. On an H200 host 4 GiB took 0.23-0.25 s so
    (16-17 GiB/s), against 1.5-2.3 s for registering plain untouched memory, which faults every
    4 KiB page in itself, one at a time, while the process's other CUDA calls wait
    (results/bench_page_lock_h200.json): pass 2's waiting room took 24 s of a first step so."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not torch.cuda.is_available() or not nbytes:
        return torch.empty(shape, dtype=dtype)
    tensor = unforked_pages(nbytes)
    write_pages_in(tensor)
    if not page_lock(tensor):
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # CUDA refused: the caching allocator
    return tensor.view(dtype).view(shape)


def unforked_pages(nbytes: int, huge: bool = True) -> torch.Tensor:
    """`nbytes` of anonymous host memory (uint8, page-aligned) that a forked child does not get.

    Linux copies a private page that is pinned for DMA into a child at fork, at once, rather than
    sharing it until either writes (the pin must keep pointing at the parent's page): a 1,048,576
    batch on one H100 had 14 loader workers forked while pass 2's waiting room was being
    page-locked, each worker took a copy of what was locked so far (21 GB of resident memory
    apiece), and the host ran out of its 128 GiB before the first chunk was decoded. The workers
    never read these pages, so they are left out of every child (MADV_DONTFORK). `huge`: advise
    2 MiB pages, which CUDA pins faster."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_DONTFORK)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps the mapping


def write_pages_in(memory: torch.Tensor) -> None:
    """Every page of `memory` written (zeros) by `WRITING_THREADS` threads, each a slice: torch
    releases the interpreter lock while it fills. Only for memory no one else writes yet."""
    parts = memory.chunk(WRITING_THREADS)
    with ThreadPoolExecutor(len(parts), thread_name_prefix="clipscale-pages") as pool:
        list(pool.map(torch.Tensor.zero_, parts))


def populate(memory: torch.Tensor) -> bool:
    """Every page of `memory` brought in as for a write, without writing it (madvise's
    MADV_POPULATE_WRITE, Linux 5.14), by `WRITING_THREADS` threads a slice each (ctypes lets the
    interpreter lock go): safe where others already write, as the workers do into their arenas.
    CUDA then registers pages that are there: a memfd's 4 GiB in 0.14-0.18 s against 1.66 s
    faulting them in itself (results/bench_page_lock_h200.json). False where the kernel refuses
    (before 5.14): nothing done, the registration faults the pages in as before."""
    if not memory.numel():
        return True
    first = memory.data_ptr() // PAGE * PAGE
    stop = memory.data_ptr() + nbytes(memory)
    step = paged(-(-(stop - first) // WRITING_THREADS))
    slices = [(start, min(start + step, stop)) for start in range(first, stop, step)]

    def advise(bounds: tuple[int, int]) -> bool:
        return LIBC.madvise(ctypes.c_void_p(bounds[0]), ctypes.c_size_t(bounds[1] - bounds[0]), MADV_POPULATE_WRITE) == 0

    with ThreadPoolExecutor(len(slices), thread_name_prefix="clipscale-pages") as pool:
        return all(pool.map(advise, slices))


class BackgroundPageLock:
    """Page-locks parts of a host tensor where CUDA is, one after another in a thread of its own,
    while the caller goes on, each part's pages brought in first (`populate`). CUDA takes
    registrations one at a time and queues the process's other
    CUDA calls behind each, so one thread registers, and the workers' arenas are registered only
    once the first batch's pass 1 is over (`BatchStream._page_lock_arenas`): at 65,536 on an H200
    host their 41 GiB took 11-19 s, and the first batch, whose copies waited behind the
    registrations, came 19.5 s after the loader's start, against 7.6 s with none; 12.8 s against
    9.75 s when they began as its last piece came in (results/bench_loader_h200_first_batch_65k_*.json).
    A copy from a part not yet page-locked is staged through pinned memory of its own: as correct,
    a host copy more. `seconds`: how long the registrations took."""

    def __init__(self, parts: list[torch.Tensor]):
        self.seconds: float | None = None
        self.locked: list[bool] = []
        self.thread = None
        if torch.cuda.is_available():
            torch.cuda.init()  # the thread registers with this device's context (on_the_callers_device)
            self.thread = threading.Thread(target=on_the_callers_device(self._lock), args=(parts,),
                                           name="clipscale-page-lock", daemon=True)
            self.thread.start()

    def _lock(self, parts: list[torch.Tensor]) -> None:
        started = time.perf_counter()
        for part in parts:
            populate(part)
            self.locked.append(page_lock(part))
        self.seconds = time.perf_counter() - started

    def wait(self) -> bool:
        """Once every part is page-locked (or CUDA refused): whether all of them are."""
        if self.thread is not None:
            self.thread.join()
        return bool(self.locked) and all(self.locked)


ARENA_WAIT_S = 0.0005  # how often a worker whose arena is full looks again
ALIGN = 8  # every tensor of a piece starts at a multiple of this in its arena: any dtype can view it


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


PAGE = mmap.PAGESIZE


def paged(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages."""
    return -(-nbytes // PAGE) * PAGE


class SharedPages:
    """Host memory shared with the loader's workers, `tensor` (uint8) in each process: an anonymous
    memory file (memfd) mapped in each, its pages coming into being as they are first written or
    page-locked. torch's shared memory (`share_memory_`) allocates every page in /dev/shm at once:
    the arenas' 41 GiB at 65,536 took 4 s before a worker started, and a container's 64 MiB
    /dev/shm would not hold them. A process forked from this one inherits the mapping; one started
    by a fork server gets the file's descriptor with the pickled object and maps it again."""

    def __init__(self, nbytes: int, fd: int | None = None):
        if fd is None:
            fd = os.memfd_create("clipscale-arenas", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        self.nbytes, self.fd = nbytes, fd
        weakref.finalize(self, os.close, fd)
        self.tensor = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping

    def __reduce__(self):
        return _shared_pages_from, (self.nbytes, reduction.DupFd(self.fd))


def _shared_pages_from(nbytes: int, duplicate) -> SharedPages:
    return SharedPages(nbytes, duplicate.detach())


@dataclass(frozen=True)
class InArena:
    """Where a worker wrote a piece's tensors in its arena (`WorkerArenas.carry`): what the loader's
    queue carries instead of them. `layout`: (name, dtype, shape, byte offset) of each."""

    worker: int
    start: int
    stop: int
    layout: tuple


def arenas_page_locked() -> bool:
    """Whether the trainer page-locks the workers' arenas: always, but where a benchmark's
    CLIPSCALE_PAGE_LOCK_ARENAS=0 leaves them pageable (its other side of the page-locking)."""
    return os.environ.get("CLIPSCALE_PAGE_LOCK_ARENAS", "1") != "0"


class WorkerArenas:
    """Host memory the loader's workers write their pieces into (pixels, token ids, the images'
    tables), one circular arena a worker, shared with the training process and page-locked there:
    a chunk goes to the GPU in one copy from where its worker wrote it, with nothing copied on the
    host and no thread in the training process (`data.worker_decode_share: 1`, docs/architecture.md).

    Nothing but a small `InArena` goes through the loader's queue. A tensor sent through it makes
    the trainer fetch the tensor's file descriptor from the worker's process, a round trip that
    waits until that busy worker's interpreter lock is free: 20-30 ms a piece of six tensors on a
    16-core GPU host whose workers never rest, about 1.5 s of a ViT-B/32 step of 32,768 (64
    pieces), all of it in the training thread.

    The arenas' pages come into being as the workers first write them (`SharedPages`), and the
    trainer page-locks them in segments of `segment_bytes` once the first batch's pass 1 is over
    (`BackgroundPageLock`).
    A worker writes its pieces one after another, wrapping round; a piece never straddles a
    segment's end (CUDA refuses a copy that spans two registrations) nor the arena's: the tail it
    does not fit in stays unused, holding no data. A segment of k largest pieces holds any k
    pieces, so an arena of whole segments holds as many pieces as its size in largest pieces says
    (`pipeline.arena_window`). The trainer gives each piece's bytes
    back once the step is done with it (`release`), in the order the worker wrote them, as the
    DataLoader hands a worker's pieces out in order. Positions count the bytes a worker has written
    since the run began, position p at p mod arena_bytes; a piece may go where everything before
    the oldest piece the trainer still holds lies a lap behind (a skipped tail included). A worker
    waits while that is not so. `released` is written by the trainer alone, a worker's own
    positions (`next_start`, `held`) by that worker alone, so no lock is needed. Its last entry
    says the trainer is closing: a waiting worker then gives up.

    In the trainer:  arenas = WorkerArenas(workers, arena_bytes, sample_bytes)   # pickled to the workers
    In worker w:     carried = arenas.carry(w, {"texts": texts, ...})   # an InArena, for the queue
    In the trainer:  tensors = arenas.take(carried) ... arenas.release(w, carried.stop)
    """

    def __init__(self, workers: int, arena_bytes: int, sample_bytes: int = 0, holds_a_batch: bool = True,
                 segment_bytes: int | None = None):
        self.workers, self.arena_bytes = workers, arena_bytes
        self.segment_bytes = min(segment_bytes or arena_bytes, arena_bytes)  # page-aligned where CUDA registers them
        self.sample_bytes = sample_bytes  # the room a sample of a piece has: more goes through the queue (`takes`)
        # False: an arena holds only some of its worker's pieces of a batch, and pass 1 hands each
        # chunk's pieces back as it goes (`ChunkSource.waiting_room`), or the workers would wait
        # for room that only the step's end gives back.
        self.holds_a_batch = holds_a_batch
        self.stride = paged(arena_bytes)  # each arena starts on a page: registrations never share one
        self.shared = SharedPages(workers * self.stride)
        self.memory = self.shared.tensor
        self.released = torch.zeros(workers + 1, dtype=torch.int64).share_memory_()
        self.next_start = [0] * workers  # where each worker's next piece goes (each worker's process keeps its own)
        self.held: list[deque] = [deque() for _ in range(workers)]  # each worker's pieces (start, stop) not known given back
        self.page_locking: BackgroundPageLock | None = None  # the trainer's, once the first batch's pass 1 is over

    def __getstate__(self) -> dict:
        # The page-locking is the trainer's own (a worker never touches CUDA); the memory goes as
        # its file descriptor (`SharedPages`), not as a tensor torch would copy into /dev/shm.
        return {**self.__dict__, "page_locking": None, "memory": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.memory = self.shared.tensor

    def segments_in_writing_order(self) -> list[torch.Tensor]:
        """Each arena's segments, the first of every worker, then the second of every worker, ...:
        the order the workers, decoding at about the same pace, first write them."""
        return [self.memory[w * self.stride + start : w * self.stride + min(start + self.segment_bytes, self.arena_bytes)]
                for start in range(0, self.arena_bytes, self.segment_bytes) for w in range(self.workers)]

    def page_lock_in_background(self) -> None:
        """In the trainer, once the first batch's pass 1 is over: page-lock the arenas segment by
        segment, in the order the workers write them (`BackgroundPageLock`). Earlier, the first
        batch's copies would queue behind the registrations. CLIPSCALE_PAGE_LOCK_ARENAS=0 leaves
        them pageable (each chunk staged through pinned memory of its own): the benchmarks' other
        side of it (`arenas_page_locked`)."""
        if arenas_page_locked():
            self.page_locking = BackgroundPageLock(self.segments_in_writing_order())

    def place(self, worker: int, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """Where worker `worker`'s next piece of `nbytes` goes, once the trainer has given back room
        for it: (its start position, a view of the arena there); None when the trainer is closing."""
        if nbytes > self.segment_bytes:
            raise RuntimeError(f"a loader piece of {nbytes:,} bytes does not fit its worker's arena segments of "
                               f"{self.segment_bytes:,}")
        start = self.next_start[worker]
        while True:  # past the end of the segment (or arena) it does not fit in: to the next one's beginning
            offset = start % self.arena_bytes
            end = min(self.arena_bytes, (offset // self.segment_bytes + 1) * self.segment_bytes)
            if offset + nbytes <= end:
                break
            start += end - offset
        stop = start + nbytes
        released, held = self.released.numpy(), self.held[worker]
        while True:
            while held and held[0][1] <= released[worker]:
                held.popleft()
            if stop - (held[0][0] if held else start) <= self.arena_bytes:  # free up to the oldest piece still held
                break
            if released[-1]:
                return None
            time.sleep(ARENA_WAIT_S)
        held.append((start, stop))
        self.next_start[worker] = stop
        return start, self.view(worker, start, stop)

    def takes(self, tensors: dict[str, torch.Tensor], samples: int) -> bool:
        """Whether a piece of `samples` samples made of `tensors` stays within their room (the
        arena holds a batch of pieces that do)."""
        return self._layout(tensors)[1] <= samples * self.sample_bytes

    @staticmethod
    def _layout(tensors: dict[str, torch.Tensor]) -> tuple[tuple, int]:
        """(name, dtype, shape, byte offset) of each of `tensors` laid one after another, each where
        its dtype may be viewed, and the bytes they take."""
        layout, nbytes = [], 0
        for name, tensor in tensors.items():
            layout.append((name, tensor.dtype, tuple(tensor.shape), nbytes))
            nbytes += aligned(tensor.numel() * tensor.element_size())
        return tuple(layout), nbytes

    def carry(self, worker: int, tensors: dict) -> InArena | None:
        """`tensors` (tensors, or parts with a `write_into` such as `decoders.Regions`) copied one
        after another into worker `worker`'s arena, once it has room; None
        when the trainer is closing. (Pieces carried this way start at multiples of ALIGN, as the
        arena's size must be.)"""
        if self.arena_bytes % ALIGN or self.segment_bytes % ALIGN:
            raise ValueError(f"an arena of {self.arena_bytes} bytes in segments of {self.segment_bytes}, not multiples of "
                             f"{ALIGN}, cannot carry tensors")
        layout, nbytes = self._layout(tensors)
        placed = self.place(worker, nbytes)
        if placed is None:
            return None
        start, place = placed
        carried = InArena(worker, start, start + nbytes, layout)
        for tensor, view in zip(tensors.values(), self._views(place, carried.layout)):
            if isinstance(tensor, torch.Tensor):
                view.copy_(tensor)
            else:  # parts that lay themselves out (decoders.Regions): each copied once, straight here
                tensor.write_into(view)
        return carried

    def take(self, carried: InArena) -> dict[str, torch.Tensor]:
        """In the trainer: the tensors `carry` wrote, as views of the arena (valid until released)."""
        views = self._views(self.view(carried.worker, carried.start, carried.stop), carried.layout)
        return {name: view for (name, *_), view in zip(carried.layout, views)}

    @staticmethod
    def _views(place: torch.Tensor, layout: tuple) -> list[torch.Tensor]:
        sizes = [(dtype, shape, offset, math.prod(shape) * dtype.itemsize) for _, dtype, shape, offset in layout]
        return [place[offset : offset + nbytes].view(dtype).view(shape) for dtype, shape, offset, nbytes in sizes]

    def view(self, worker: int, start: int, stop: int) -> torch.Tensor:
        """Bytes [start, stop) of worker `worker`'s pieces (positions as `place` gave them)."""
        offset = worker * self.stride + start % self.arena_bytes
        return self.memory[offset : offset + stop - start]

    def release(self, worker: int, stop: int) -> None:
        """The trainer is done with worker `worker`'s pieces up to position `stop` (the GPU's copies
        from them included): the worker may write there again."""
        self.released[worker] = max(int(self.released[worker]), stop)

    def close(self) -> None:
        """The trainer stops reading: workers waiting for room give up. Returns once the arenas'
        page-locking is over (a registration still running as the interpreter exits may crash it)."""
        self.released[-1] = 1
        if self.page_locking is not None:
            self.page_locking.wait()


class Arrivals:
    """How many leading rows of a batch have arrived; waiting on it re-raises a loader failure."""

    def __init__(self):
        self.rows = 0
        self.error: Optional[BaseException] = None
        self.wait_s = 0.0  # time the step's thread spent bringing pieces in itself (`PulledArrivals`); 0 when a thread gathers
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
        if isinstance(self.error, UserError):  # its one line says it all
            raise self.error
        if self.error is not None:
            raise RuntimeError("the data loader failed while gathering this batch") from self.error


class PulledArrivals(Arrivals):
    """Arrivals that the thread asking for rows brings in itself: waiting for rows calls `pull`
    (the batch's next piece from the loader, put into its columns) until they are there. No
    gathering thread: the training thread receives each piece's few small tensors when a chunk
    needs them, while the loader's workers run ahead in their arenas (`WorkerArenas`)."""

    def __init__(self, pull: Callable[[], None] | None = None):
        super().__init__()
        self.pull = pull

    def wait_for(self, rows: int) -> None:
        started = time.perf_counter()
        while self.rows < rows and self.error is None:
            try:
                self.pull()
            except BaseException as error:
                self.fail(error)
                raise
        self.wait_s += time.perf_counter() - started
        if self.rows < rows:
            self.raise_if_failed()


class Prepared(Protocol):
    """A chunk on its way: `on_device` waits for it and returns it on the device, ordered before
    the compute stream's next work."""

    def on_device(self, device: torch.device, copy_stream) -> torch.Tensor: ...

    def cancel(self) -> None: ...


class HostChunk:
    """Rows that become ready on the host (`host`, pinned), then are copied to the device."""

    def host(self) -> torch.Tensor:
        raise NotImplementedError

    def on_device(self, device: torch.device, copy_stream) -> torch.Tensor:
        return copy_to_device(self.host(), device, copy_stream)

    def cancel(self) -> None:
        """Nothing runs for it until `host` is called."""


class PinnedSlice(HostChunk):
    """Rows of a pinned tensor, handed out once they have arrived (`arrivals`: None, all there)."""

    def __init__(self, rows: torch.Tensor, arrivals: Arrivals | None, stop: int):
        self.rows, self.arrivals, self.stop = rows, arrivals, stop

    def host(self) -> torch.Tensor:
        if self.arrivals is not None:
            self.arrivals.wait_for(self.stop)
        return self.rows  # a row slice of a pinned tensor is pinned


class OnDevice:
    """A chunk already on the device (one pass 1 kept)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def on_device(self, device: torch.device, copy_stream) -> torch.Tensor:
        return self.tensor

    def cancel(self) -> None:
        """Nothing is running for it."""


class OnHost:
    """A chunk of pass 1 that pass 2 asks for again and the `KeepBudget` could not keep on the
    device: copied into a slot of the `HostWaitingRoom` (on `copy_stream`, after the current stream's
    work so far: pass 1's compute stream, or a chunk prepared ahead's own), and back for pass 2, once
    that copy has run. Where the workers' arenas hold less
    than a batch, pass 1 hands every chunk's rows back to them as it goes (`ChunkSource.waiting_room`):
    what it could not keep waits here, as final uint8 pixels, instead of in the arenas. A chunk of
    the next batch prepared during pass 2 waits here too, for that batch's pass 1 and then its pass 2."""

    def __init__(self, chunk: torch.Tensor, slot: torch.Tensor, room: "HostWaitingRoom", copy_stream):
        self.slot, self.room = slot, room
        self.host = slot[:nbytes(chunk)].view(chunk.dtype).view(chunk.shape)
        self.copied = None
        if copy_stream is None:
            self.host.copy_(chunk)
            return
        copy_stream.wait_stream(torch.cuda.current_stream(chunk.device))
        with torch.cuda.stream(copy_stream):
            self.host.copy_(chunk, non_blocking=True)
            self.copied = copy_stream.record_event()
        chunk.record_stream(copy_stream)  # its device memory is not reused before the copy has run

    def prepared(self) -> "OnHost":
        """As pass 2 prepares it: nothing to start, its pixels are on the host."""
        return self

    def on_device(self, device: torch.device, copy_stream) -> torch.Tensor:
        if device.type == "cpu":
            return self.host.clone()  # `to` would hand out the slot itself, which the next chunk there fills
        if copy_stream is not None:
            copy_stream.wait_event(self.copied)
        return copy_to_device(self.host, device, copy_stream)

    def leave(self, copy_stream) -> None:
        """Its last copy to the device is issued (on `copy_stream`): the slot takes another chunk
        once that copy has run."""
        self.room.free.append((self.slot, copy_stream.record_event() if copy_stream is not None else None))

    def cancel(self) -> None:
        """Never read again (its batch released before pass 2 took it): the slot is free once the
        copy into it has run."""
        self.room.free.append((self.slot, self.copied))


class HostWaitingRoom:
    """Page-locked host memory where pass 1's chunks wait for pass 2 (`OnHost`), for the whole run:
    segments of `pinned_empty`, cut into slots of a chunk each, made as a batch first needs them
    (the first batch's expected share ahead, in a thread: `make_ahead`) and reused by every batch
    after. A slot is free again as soon as pass 2 has copied its chunk back to the device
    (`OnHost.leave`): pass 2 reads the room in the order pass 1 wrote it, so the next batch's chunks
    prepared between pass 2's chunks (`ChunkSource.prepare_some_ahead`) take the slots it has read
    while it still runs (`hold_ahead`), and the loader's workers, whose arenas hold only a window
    of a batch, keep working through pass 2 instead of waiting for the next step.

    One `torch.empty(..., pin_memory=True)` a chunk went through the caching host allocator, which
    rounds a block up to a power of two: ViT-B/32's 77 MB chunk held 128 MB, and at 524,288 on one
    H200 with 45 GiB kept on the GPU the process tree peaked at 118 GiB of the host's 128
    (results/bench_e2e_h200_b32_524k_keep45.json), where the design counts 28 GiB for these pixels.

    A chunk is written into a slot only after the slot's last copy has run: each free slot carries
    the event after it (the copy back to the device, or the copy in that nothing read)."""

    SEGMENT_BYTES = GIB  # a segment holds a whole number of slots; a shorter tail stays unused
    ALIGN = 64

    def __init__(self, make_ahead: int = 0, chunk_bytes: int = 0, spill: "SpillFile | None" = None):
        """`make_ahead`: bytes of segments for chunks of `chunk_bytes` made from the start, in a thread
        of their own (while the first step compiles its towers), instead of in pass 1's thread as the
        first batch reaches them: page-locking 1 GiB takes about 0.3 s there beside busy workers.
        With a `spill`, the room holds about `make_ahead` bytes (at most a segment more), and the
        chunks beyond it wait on disk, spread over the batch (`SpillFile.share`). `chunk_bytes`: a
        slot's size (the first chunk's where it is 0)."""
        self.segments: list[torch.Tensor] = []  # uint8, never freed before the run's end: copies may still read them
        self.slot_bytes = self._aligned(chunk_bytes)
        self.free: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()  # slots no chunk holds, and when they may be written
        self.spill = spill
        self.limit = max(make_ahead, 1) if spill is not None else None
        self.held_bytes = self.spilled_bytes = 0  # the batch's pass 1's, so far
        self.ahead: deque[Future] = deque()  # segments being made, in order
        if make_ahead > 0 and chunk_bytes > 0:
            size = self._segment_bytes()
            if torch.cuda.is_available():
                torch.cuda.init()  # the thread registers with this device's context (on_the_callers_device)
            maker = ThreadPoolExecutor(1, thread_name_prefix="clipscale-room")
            make = on_the_callers_device(pinned_empty)
            self.ahead.extend(maker.submit(make, (size,), torch.uint8) for _ in range(-(-make_ahead // size)))
            maker.shutdown(wait=False)

    @property
    def bytes(self) -> int:
        return sum(len(segment) for segment in self.segments)

    def _aligned(self, size: int) -> int:
        return -(-size // self.ALIGN) * self.ALIGN

    def _segment_bytes(self) -> int:
        """As many slots as fit SEGMENT_BYTES (at least one): none of a segment unused."""
        return max(1, self.SEGMENT_BYTES // self.slot_bytes) * self.slot_bytes

    def _add_segment(self) -> None:
        """The next segment made ahead, else one made now, cut into free slots."""
        segment = self.ahead.popleft().result() if self.ahead else pinned_empty((self._segment_bytes(),), torch.uint8)
        self.segments.append(segment)
        self.free.extend((segment[start:start + self.slot_bytes], None)
                         for start in range(0, len(segment) - self.slot_bytes + 1, self.slot_bytes))

    def begin_batch(self) -> None:
        """A batch's pass 1 begins: the spill's share counts its chunks from here."""
        self.held_bytes = self.spilled_bytes = 0
        if self.spill is not None:
            self.spill.begin_batch()

    def _fits(self) -> bool:
        """A slot is free, or a new segment may be made: the room holds less than its limit (so at
        most a segment more)."""
        return bool(self.free) or self.limit is None or self.bytes < self.limit

    def hold(self, chunk: torch.Tensor, copy_stream) -> "OnHost | OnDisk":
        """`chunk` (pass 1's) copied into a free slot of the room, or, with a spill file, to disk where
        the room is full or the batch's chunks on disk so far fall behind the spill's share (so the
        disk writes spread over pass 1 rather than stall its end)."""
        size = nbytes(chunk)
        if self.spill is not None and (not self._fits() or
                                       self.spilled_bytes + size <= self.spill.share * (self.spilled_bytes + self.held_bytes + size)):
            self.spilled_bytes += size
            return self.spill.hold(chunk, copy_stream)
        self.held_bytes += size
        self.slot_bytes = self.slot_bytes or self._aligned(size)
        if not self.free:
            self._add_segment()
        return self._into_free_slot(chunk, copy_stream)

    def hold_ahead(self, chunk: torch.Tensor, copy_stream) -> "OnHost | None":
        """`chunk` (the next batch's, prepared during pass 2) copied into a slot pass 2 has read, or
        None where there is none: the room neither grows nor spills for it."""
        return self._into_free_slot(chunk, copy_stream) if self.free else None

    def _into_free_slot(self, chunk: torch.Tensor, copy_stream) -> OnHost:
        if nbytes(chunk) > self.slot_bytes:
            raise RuntimeError(f"a chunk of {nbytes(chunk)} bytes does not fit the host room's slots of {self.slot_bytes}")
        slot, writable = self.free.popleft()
        if copy_stream is not None and writable is not None:
            copy_stream.wait_event(writable)
        return OnHost(chunk, slot, self, copy_stream)


def spill_directory() -> str:
    """Where pass 2's chunks beyond the host's room wait (`SpillFile`): the temporary folder
    ($TMPDIR), which is the node's own disk on most clusters."""
    return tempfile.gettempdir()


def spill_room(directory: str) -> int:
    """Bytes a rank may spill in `directory`: 0 where its file system keeps files in memory (tmpfs:
    spilling there would take the very memory it spares), else 90% of its free space shared by the
    node's ranks."""
    try:
        real = os.path.realpath(directory)
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
        kind = max(((point, kind) for point, kind in mounts if real == point or real.startswith(point.rstrip("/") + "/")),
                   key=lambda found: len(found[0]), default=(None, None))[1]
        free = os.statvfs(real).f_bavail * os.statvfs(real).f_frsize
    except OSError:
        return 0
    if kind in ("tmpfs", "ramfs"):
        return 0
    return int(0.9 * free) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


class SpillFile:
    """Pass 1's chunks for pass 2 beyond what the device keeps and the host's `HostWaitingRoom`
    holds, on disk: a batch too large for both (a million samples on one 80 GB GPU). Each chunk is
    copied to a page-locked staging buffer on the copy stream and written by a thread of its own;
    pass 2 has it read back as it prepares the chunk, `LOOKAHEAD` ahead, and copied to the device
    from the buffer (`OnDisk`). The pixels come back bit for bit: no decode runs again.

    The file is unlinked at once, so nothing is left behind whatever ends the run, and opened with
    O_DIRECT where the file system takes it: the pixels do not also fill the page cache of a host
    whose memory they are there to spare. One I/O thread runs every write and read in the order
    they were asked for, so a batch's writes (from offset 0 again) follow the last batch's reads.
    Buffers are taken in turn; one is reused once its last write or read is over and its copy to
    the device has run."""

    ALIGN = PAGE  # O_DIRECT's alignment of offsets, lengths and buffers
    BUFFERS = LOOKAHEAD + 2  # reads in flight, the chunk being copied, one spare

    def __init__(self, directory: str, share: float):
        self.directory, self.share = directory, share
        descriptor, path = tempfile.mkstemp(prefix="clipscale-spill-", dir=directory)
        os.unlink(path)
        self.fd = descriptor
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError:  # a file system without direct I/O: through the page cache
            pass
        self.io = ThreadPoolExecutor(1, thread_name_prefix="clipscale-spill",
                                     initializer=on_the_callers_device(lambda: None))
        self.buffers: list[torch.Tensor] = []  # made at the first chunk, each a chunk's aligned size
        self.last_io: list[Future | None] = []
        self.copied_out: list = []  # each buffer's last copy to the device (a CUDA event), or None
        self.turn = 0
        self.offset = 0  # where the batch's next chunk goes in the file
        weakref.finalize(self, os.close, self.fd)

    def begin_batch(self) -> None:
        self.offset = 0

    def _buffer(self, size: int) -> int:
        """The next buffer in turn, once its last use is over."""
        if not self.buffers or len(self.buffers[0]) < size:
            wait([f for f in self.last_io if f is not None])
            for event in self.copied_out:
                if event is not None:
                    event.synchronize()
            self.buffers = [self._new_buffer(-(-size // self.ALIGN) * self.ALIGN) for _ in range(self.BUFFERS)]
            self.last_io, self.copied_out = [None] * self.BUFFERS, [None] * self.BUFFERS
        k, self.turn = self.turn, (self.turn + 1) % self.BUFFERS
        if self.last_io[k] is not None:
            wait([self.last_io[k]])
        if self.copied_out[k] is not None:
            self.copied_out[k].synchronize()
            self.copied_out[k] = None
        return k

    @staticmethod
    def _new_buffer(nbytes: int) -> torch.Tensor:
        """Page-aligned (what O_DIRECT asks), page-locked where CUDA is."""
        buffer = unforked_pages(nbytes, huge=False)
        page_lock(buffer)
        return buffer

    def hold(self, chunk: torch.Tensor, copy_stream) -> "OnDisk":
        """`chunk` copied to a buffer after the compute stream's work so far, and written."""
        size = nbytes(chunk)
        k = self._buffer(size)
        staging = self.buffers[k][:size].view(chunk.dtype).view(chunk.shape)
        copied = None
        if copy_stream is None:
            staging.copy_(chunk)
        else:
            copy_stream.wait_stream(torch.cuda.current_stream(chunk.device))
            with torch.cuda.stream(copy_stream):
                staging.copy_(chunk, non_blocking=True)
                copied = copy_stream.record_event()
            chunk.record_stream(copy_stream)
        length = -(-size // self.ALIGN) * self.ALIGN
        written = self.io.submit(self._write, self.buffers[k][:length], self.offset, copied)
        self.last_io[k] = written
        held = OnDisk(self, self.offset, chunk.shape, chunk.dtype, written)
        self.offset += length
        return held

    def read(self, held: "OnDisk") -> tuple[int, Future]:
        """`held`'s bytes read back into the next buffer, in the I/O thread: (the buffer, the read)."""
        k = self._buffer(held.nbytes)
        length = -(-held.nbytes // self.ALIGN) * self.ALIGN
        self.last_io[k] = self.io.submit(self._read, self.buffers[k][:length], held.offset, held.written)
        return k, self.last_io[k]

    def _write(self, buffer: torch.Tensor, offset: int, copied) -> None:
        if copied is not None:
            copied.synchronize()
        self._transfer(os.pwrite, memoryview(buffer.numpy()), offset)

    def _read(self, buffer: torch.Tensor, offset: int, written: Future) -> None:
        written.result()  # ran before (one thread, in order): its error is this chunk's
        self._transfer(os.preadv, [memoryview(buffer.numpy())], offset)

    def _transfer(self, call: Callable, view, offset: int) -> None:
        """All of `view` written or read at `offset` (the calls may move fewer bytes than asked)."""
        whole = view[0] if isinstance(view, list) else view
        done = 0
        while done < len(whole):
            rest = whole[done:]
            try:
                moved = call(self.fd, [rest] if isinstance(view, list) else rest, offset + done)
            except OSError as error:
                if error.errno == errno.EINVAL and fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT:
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    continue  # direct I/O refused this length or place: through the page cache
                raise UserError(f"the spill file for pass 2's images in {self.directory}: {error.strerror} "
                                "(set TMPDIR to a local disk with room, or data.keep_on_device_gib higher)") from error
            if moved == 0:
                raise UserError(f"the spill file for pass 2's images in {self.directory}: read past its end")
            done += moved

    def close(self) -> None:
        self.io.shutdown(wait=True)


class OnDisk:
    """A chunk of pass 1 that pass 2 asks for again, in the `SpillFile`: read back into a staging
    buffer as pass 2 prepares it (`prepared`), copied to the device from there."""

    def __init__(self, spill: SpillFile, offset: int, shape: torch.Size, dtype: torch.dtype, written: Future):
        self.spill, self.offset, self.shape, self.dtype, self.written = spill, offset, shape, dtype, written
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.buffer: int | None = None
        self.read: Future | None = None

    def prepared(self) -> "OnDisk":
        self.buffer, self.read = self.spill.read(self)
        return self

    def on_device(self, device: torch.device, copy_stream) -> torch.Tensor:
        self.read.result()
        host = self.spill.buffers[self.buffer][:self.nbytes].view(self.dtype).view(self.shape)
        if device.type == "cpu":
            return host.clone()  # `to` would hand out the buffer itself, which a later read fills again
        moved = copy_to_device(host, device, copy_stream)
        if copy_stream is not None:
            self.spill.copied_out[self.buffer] = copy_stream.record_event()
        return moved

    def cancel(self) -> None:
        """Nothing to stop: the buffer's next use waits for the read to end."""


class Rows(Protocol):
    """How a column's rows become ready: `put` takes each loader piece, `prepare` starts making
    rows [start, stop) ready for a pass."""

    def __len__(self) -> int: ...

    def put(self, rows: slice, piece: dict) -> None: ...

    def prepare(self, start: int, stop: int, pass_number: int) -> Prepared: ...

    def release(self) -> None:
        """The step is done with the batch: what its rows hold outside this process can go."""

    def on_device_before(self, row: int) -> None:
        """Rows before `row` stay on the device for as long as the step needs them: what they hold
        on the host will not be read again."""


class PinnedRows(Rows):
    """A column held whole in one pinned host tensor (uint8 images, token ids), filled from the
    loader pieces' `key` as they arrive (`arrivals`; None: the tensor is whole already)."""

    def __init__(self, tensor: torch.Tensor, key: str = "", arrivals: Arrivals | None = None):
        if torch.cuda.is_available() and not tensor.is_pinned():
            tensor = tensor.pin_memory()  # once, so that every chunk's copy can be asynchronous
        self.tensor, self.key, self.arrivals = tensor, key, arrivals

    def __len__(self) -> int:
        return len(self.tensor)

    def put(self, rows: slice, piece: dict) -> None:
        self.tensor[rows].copy_(piece[self.key])

    def prepare(self, start: int, stop: int, pass_number: int) -> PinnedSlice:
        return PinnedSlice(self.tensor[start:stop], self.arrivals, stop)

    def release(self) -> None:
        """Nothing is held elsewhere: the tensor is the batch slot's."""

    def whole(self) -> torch.Tensor:
        if self.arrivals is not None:
            self.arrivals.wait_for(len(self))
        return self.tensor


class ChunkSource:
    """One column of a batch, handed to the device a chunk at a time: what Gradient Cache asks for
    its chunks (`chunks`, once per pass). `release` once the step is done with it."""

    def __init__(self, rows: Rows, device_transform: DeviceTransform | None = None, budget: KeepBudget | None = None):
        self.rows = rows
        self.device_transform = device_transform or identity
        self.budget = budget
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # pass 1's chunks on the device, and their bytes
        self.ahead: dict[tuple[int, int], tuple[Prepared, int]] = {}  # pass 1's chunks prepared before it asked
        self.asked_until = 0  # pass 1 has asked for rows [0, asked_until): nothing there is prepared ahead
        self.ahead_until = 0  # rows [0, ahead_until) prepared ahead by `prepare_some_ahead`
        self.ahead_shape: tuple[int, int, torch.device] | None = None  # (chunk rows, device bytes a row, device) for `prepare_some_ahead`
        self.ahead_copies = None  # the CUDA stream copying chunks prepared ahead into the waiting room
        # Called between two of pass 2's chunks with how many are still to come, when pass 2 reads
        # only chunks pass 1 kept (on the device or the host): work for the next batch while the
        # device computes (BatchStream).
        self.between_chunks: Callable[[int], None] | None = None
        # Called as pass 2 asks for its first chunk: pass 1's copies from the host are over (BatchStream).
        self.before_pass_2: Callable[[], None] | None = None
        # Pass 1 hands each chunk's rows back (`Rows.on_device_before`) once the chunk is on the
        # device, keeping it there or, where pass 2 asks for it again, in this room on the host
        # (`OnHost`): the workers' arenas hold less than a batch (`WorkerArenas.holds_a_batch`).
        # Chunks prepared ahead beyond the budget wait there too (`prepare_some_ahead`).
        self.waiting_room: HostWaitingRoom | None = None
        self.on_host: dict[tuple[int, int], OnHost | OnDisk] = {}  # pass 1's chunks for pass 2 that the budget could not keep
        self.released = False
        self.lock = threading.Lock()  # the thread preparing ahead and the step both reach `ahead`
        self.wait_s = 0.0  # time the step spent waiting for this column's chunks

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, device_transform: DeviceTransform | None = None,
                  budget: KeepBudget | None = None) -> "ChunkSource":
        """A whole host tensor (pinned here) as a chunk source."""
        return cls(PinnedRows(tensor), device_transform, budget)

    def __len__(self) -> int:
        return len(self.rows)

    def put(self, rows: slice, piece: dict) -> None:
        self.rows.put(rows, piece)

    def whole(self) -> torch.Tensor:
        """Every row on the host, once all have arrived (a column of host rows: the tokens)."""
        return self.rows.whole()

    def chunks(self, bounds: Bounds, device: torch.device, pass_number: int = 1, keep: Bounds = ()) -> Iterator[torch.Tensor]:
        """Rows [start, stop) of each bound on `device`, in order, device-transformed; the next ones
        are prepared meanwhile, and a host chunk's copy overlaps the kernels still queued for the
        previous one. In pass 1 the chunks in `keep` (those pass 2 will ask for) stay on the device
        while the budget has room; pass 2 takes them instead of preparing them again."""
        if pass_number > 1 and self.before_pass_2 is not None:
            self.before_pass_2()
        copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        asked_again = set(keep) if pass_number == 1 else set()
        keep = asked_again if self.budget is not None else set()
        all_kept = pass_number > 1 and all(bound in self.kept or bound in self.on_host for bound in bounds)
        between = self.between_chunks if all_kept else None
        if between is not None:
            self.rows.release()  # pass 2 reads only what pass 1 kept: the rows' host pixels can go now
        hands_back = self.waiting_room is not None and pass_number == 1
        if hands_back:
            self.waiting_room.begin_batch()
        pending = deque(self._prepare(bound, pass_number) for bound in bounds[:LOOKAHEAD])
        later = iter(bounds[LOOKAHEAD:])
        for k, bound in enumerate(bounds):
            prepared, charged = pending.popleft()
            started = time.perf_counter()
            chunk = prepared.on_device(device, copy_stream)
            self.wait_s += time.perf_counter() - started
            upcoming = next(later, None)
            if upcoming is not None:
                pending.append(self._prepare(upcoming, pass_number))
            if bound in keep and (charged or self.budget.take(nbytes(chunk))):
                self.kept[bound] = (chunk, charged or nbytes(chunk))
            elif charged:
                self.budget.give_back(charged)  # prepared ahead, not needed again: freed after this use
            if hands_back:
                if bound in asked_again and bound not in self.kept:  # one prepared ahead into the room stays there
                    self.on_host[bound] = prepared if isinstance(prepared, OnHost) else self.waiting_room.hold(chunk, copy_stream)
                self.rows.on_device_before(bound[1])
            if isinstance(prepared, OnHost) and self.on_host.get(bound) is not prepared:
                prepared.leave(copy_stream)  # read for the last time
            yield self.device_transform(chunk)
            if between is not None:  # the chunk's work is queued: the device computes while this thread works
                between(len(bounds) - k - 1)

    def _prepare(self, bound: tuple[int, int], pass_number: int) -> tuple[Prepared, int]:
        """The chunk's preparation started, and the budget bytes it already holds."""
        if pass_number == 1:
            with self.lock:
                self.asked_until = max(self.asked_until, bound[1])
                ahead = self.ahead.pop(bound, None)
            if self.budget is not None:
                self.budget.wake()  # a chunk waiting to be prepared ahead may be asked for now
            if ahead is not None:
                return ahead
        kept = self.kept.pop(bound, None) if pass_number > 1 else None
        if kept is not None:
            tensor, size = kept
            self.budget.give_back(size)  # freed once this chunk has been used
            return OnDevice(tensor), 0
        on_host = self.on_host.pop(bound, None) if pass_number > 1 else None
        if on_host is not None:
            return on_host.prepared(), 0
        return self.rows.prepare(*bound, pass_number), 0

    def prepare_ahead(self, chunk_size: int, row_bytes: int, arrivals: Arrivals) -> None:
        """Prepare pass 1's chunks of `chunk_size` rows (`row_bytes` each on the device) in order, in a
        thread of their own: each as soon as its rows have arrived and the budget has room (so mostly
        during the previous step), until pass 1 asks for it itself or the batch is released."""
        threading.Thread(target=on_the_callers_device(self._prepare_ahead), args=(chunk_size, row_bytes, arrivals),
                         name="clipscale-ahead", daemon=True).start()

    def _prepare_ahead(self, chunk_size: int, row_bytes: int, arrivals: Arrivals) -> None:
        start = 0
        while start < len(self) and not self.released:
            stop = min(start + chunk_size, len(self))
            try:
                arrivals.wait_for(stop)
            except RuntimeError:  # the loader failed: the step raises it when it asks for these rows
                return
            size = (stop - start) * row_bytes
            taken = self.budget.take_when_room(size, unless=lambda: self.released or self.asked_until >= stop)
            with self.lock:
                if taken and not self.released and self.asked_until < stop:
                    self.ahead[(start, stop)] = (self.rows.prepare(start, stop, 1), size)
                    start = stop
                    continue
            if taken:
                self.budget.give_back(size)
            start = self.asked_until  # pass 1 prepares what it asked for

    def prepare_some_ahead(self, calls_left: int) -> None:
        """Prepare, in the calling thread, pass 1's chunks (`ahead_shape`) not yet prepared or asked
        for: an even share of them over `calls_left` calls, as far as the budget has room, and
        beyond it as far as the waiting room has slots that the batch in use has read (a window of
        the arenas: the workers then write the rest of this batch meanwhile). Rows not yet arrived
        are brought in by the preparation itself (`PulledArrivals`)."""
        chunk_size, row_bytes, device = self.ahead_shape
        start = max(self.ahead_until, self.asked_until)
        chunks_left = -(-(len(self) - start) // chunk_size)
        for _ in range(-(-chunks_left // max(1, calls_left))):
            stop = min(start + chunk_size, len(self))
            size = (stop - start) * row_bytes
            if start >= stop or self.released:
                return
            if self.budget.take(size):
                try:
                    self.ahead[(start, stop)] = (self.rows.prepare(start, stop, 1), size)
                except BaseException:
                    self.budget.give_back(size)
                    raise
            elif self.waiting_room is not None and self.waiting_room.free:
                if self.ahead_copies is None and device.type == "cuda":
                    self.ahead_copies = torch.cuda.Stream(device)
                prepared = self.rows.prepare(start, stop, 1)
                # The copy to the host follows the chunk's own preparation, not the step's queued work
                # (the compute stream does not wait for it either), and frees its device memory soon.
                with torch.cuda.stream(self.ahead_copies) if self.ahead_copies is not None else contextlib.nullcontext():
                    chunk = prepared.on_device(device, None)
                    self.ahead[(start, stop)] = (self.waiting_room.hold_ahead(chunk, self.ahead_copies), 0)
            else:
                return
            start = self.ahead_until = stop
            # On the device in the budget or on the host in the room, the chunk stays there until
            # pass 1 has used it, then for pass 2 or for no one: its host rows are not read again.
            self.rows.on_device_before(stop)

    def release(self) -> None:
        """The step is done with this column: free what pass 1 kept and pass 2 did not take (a
        step that ended early) and what was prepared ahead; nothing more is prepared ahead."""
        with self.lock:
            self.released = True
            ahead, self.ahead = self.ahead, {}
        for prepared, size in ahead.values():
            prepared.cancel()
            self.budget.give_back(size)
        for _, size in self.kept.values():
            self.budget.give_back(size)
        self.kept.clear()
        for held in self.on_host.values():
            held.cancel()
        self.on_host.clear()
        self.rows.release()
        if self.budget is not None:
            self.budget.wake()
