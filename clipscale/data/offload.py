"""Batches beyond host memory (`train.offload` with loader decoding): keep the bytes, decode again in processes.

`OffloadedRows` are an offloaded batch's images: pass 1 takes the loader's pixels as they arrive,
holding those of a few pieces only, and a later pass decodes the kept bytes again in a pool of
processes (`DecodePool`) with the same PIL code and crop, so it sees the same pixels bit for bit.
"""

from __future__ import annotations

import multiprocessing
import queue
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable

import torch

from clipscale.data.chunks import Arrivals, ChunkSource, DeviceTransform, HostChunk, KeepBudget
from clipscale.data.encoded import EncodedBatch, EncodedImages

POLL_S = 1.0  # how often a waiting first pass checks whether the loader failed


def _one_thread() -> None:
    torch.set_num_threads(1)  # one decode process a core: torch's own threads would fight for it


def decode_each(decode: Callable, encoded: EncodedImages, start: int, stop: int) -> torch.Tensor:
    """encoded[start:stop] through `decode` (the SplitTransform's, sent with each task: a few steps)."""
    return torch.stack([decode(encoded[i]) for i in range(start, stop)])


class DecodePool:
    """Processes that decode offloaded images again for the second pass.

    Started from a fork server: the training process has threads and a CUDA context by
    then, which a plain fork would copy half-way. The inputs and results travel through
    shared memory (torch's multiprocessing reductions). `window`: how many pieces of the
    loader's pixels a batch holds for pass 1 (0: no bound)."""

    def __init__(self, decode: Callable[[tuple[bytes, tuple]], torch.Tensor], processes: int, window: int = 0):
        self.processes, self.window = processes, window
        self.executor = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("forkserver"),
                                            initializer=_one_thread)
        self.decode_one = decode

    def column(self, batch_size: int, arrivals: Arrivals, device_transform: DeviceTransform | None,
               budget: KeepBudget | None) -> ChunkSource:
        """A batch's images column, decoded again here for pass 2."""
        return ChunkSource(OffloadedRows(batch_size, arrivals, self), device_transform, budget)

    def decode(self, encoded: EncodedImages, start: int, stop: int) -> list[Future]:
        """Futures of uint8 row blocks that stack to encoded[start:stop], spread over the processes."""
        rows = max(1, -(-(stop - start) // self.processes))
        return [self.executor.submit(decode_each, self.decode_one, encoded, lo, min(lo + rows, stop))
                for lo in range(start, stop, rows)]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def pinned(parts: list[torch.Tensor]) -> torch.Tensor:
    """One pinned block, so the copy to the device is asynchronous."""
    out = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                      pin_memory=torch.cuda.is_available())
    return torch.cat(parts, out=out)


class LoaderPixels(HostChunk):
    """Pass 1's rows [start, stop): the loader's pixels, taken off the batch's queue in order."""

    def __init__(self, pixels: queue.Queue, arrivals: Arrivals, start: int, stop: int):
        self.pixels, self.arrivals, self.start, self.stop = pixels, arrivals, start, stop

    def host(self) -> torch.Tensor:
        parts, row = [], self.start
        while row < self.stop:
            try:
                first, pixels = self.pixels.get(timeout=POLL_S)
            except queue.Empty:
                self.arrivals.raise_if_failed()
                continue
            if first != row:
                raise RuntimeError(f"offloaded batch: expected the piece at row {row}, got {first}")
            parts.append(pixels)
            row += len(pixels)
        if row != self.stop:
            raise RuntimeError(f"offloaded batch: pieces do not tile the chunk [{self.start}, {self.stop})")
        return pinned(parts)


class DecodedInPool(HostChunk):
    """A later pass's rows, decoded again from the kept bytes in the pool's processes."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def host(self) -> torch.Tensor:
        return pinned([future.result() for future in self.futures])

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()


class OffloadedRows:
    """The images of an offloaded batch. Pass 1 takes the loader's pixels off a queue of at most
    the pool's `window` pieces, so the pixels of only a few pieces are ever held on the host; a
    later pass (for the chunks pass 1 could not keep on the device) decodes the kept bytes again."""

    def __init__(self, batch_size: int, arrivals: Arrivals, pool: DecodePool):
        self.batch_size, self.arrivals, self.pool = batch_size, arrivals, pool
        self.pixels: queue.Queue = queue.Queue(maxsize=pool.window)  # (first row, uint8 piece), in order
        self.encoded = EncodedBatch()

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        """A piece from the loader; blocks while pass 1 has `window` pieces to take."""
        self.encoded.add(rows.start, piece["encoded"])
        self.pixels.put((rows.start, piece["images"]))

    def prepare(self, start: int, stop: int, pass_number: int) -> HostChunk:
        if pass_number == 1:
            return LoaderPixels(self.pixels, self.arrivals, start, stop)
        return DecodedInPool([future for encoded, lo, hi in self.encoded.rows(start, stop)
                              for future in self.pool.decode(encoded, lo, hi)])

    def release(self) -> None:
        """Nothing is held elsewhere: the bytes are this process's, dropped with the batch."""
