"""Batches beyond host memory (`train.offload`): keep the bytes, decode once per pass, in processes.

A million-sample batch decoded is 150 GB of uint8 at 224 px; as the shards hold it,
JPEG bytes, about 16 GB. With offload the loader workers still decode every image once
-- that decode is Gradient Cache's first pass, and it is how unusable samples are found
and counted -- and hand over both the pixels and the bytes, with the crop each image
drew (`EncodedImages`). The trainer keeps the bytes of the whole batch but the pixels of
a few pieces only: the first pass takes them as they arrive (`OffloadedImages`), and keeps
what the device has room for (`batches.DeviceBudget`). The second pass decodes the bytes
of the other chunks again, chunk by chunk, in a pool of processes (`DecodePool`), with the
same PIL code and the same crop, so it sees the same pixels bit for bit. Gradient Cache
needs that: the cached feature gradients hold only for the features they were computed at.
"""

from __future__ import annotations

import multiprocessing
import queue
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable

import torch

from clipscale.data.batches import Arrivals, DeviceBudget, DeviceTransform, HostColumn

POLL_S = 1.0  # how often a waiting first pass checks whether the loader failed


class EncodedImages:
    """Images as the shards hold them: all encoded bytes in one uint8 tensor, `offsets` [n + 1]
    delimiting the samples, and each sample's drawn crop in `params` [n, k]. Tensors, so loader
    workers and decode processes pass it through shared memory.

    `self[i]` is (bytes, params tuple), what `SplitTransform.decode` takes."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, params: torch.Tensor):
        self.data, self.offsets, self.params = data, offsets, params

    @classmethod
    def from_samples(cls, blobs: tuple[bytes, ...], params: tuple[tuple, ...]) -> "EncodedImages":
        offsets = torch.zeros(len(blobs) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(b) for b in blobs], dtype=torch.int64), 0, out=offsets[1:])
        data = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        width = len(params[0]) if params else 0
        return cls(data, offsets, torch.tensor(params, dtype=torch.int64).reshape(len(blobs), width))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[bytes, tuple]:
        return self.blob(i).numpy().tobytes(), self.params_of(i)

    def blob(self, i: int) -> torch.Tensor:
        """Sample i's bytes, a view."""
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def params_of(self, i: int) -> tuple:
        return tuple(self.params[i].tolist())

    def clone(self) -> "EncodedImages":
        return EncodedImages(self.data.clone(), self.offsets.clone(), self.params.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.offsets, self.params))


def encoded_rows(pieces: list[tuple[int, EncodedImages]], start: int, stop: int) -> list[tuple[EncodedImages, int, int]]:
    """Rows [start, stop) of a batch kept as (first row, EncodedImages) pieces: (piece, first, stop) within each."""
    return [(encoded, max(start, first) - first, min(stop, first + len(encoded)) - first)
            for first, encoded in pieces if first < stop and first + len(encoded) > start]


def _one_thread() -> None:
    torch.set_num_threads(1)  # one decode process a core: torch's own threads would fight for it


def decode_each(decode: Callable, encoded: EncodedImages, start: int, stop: int) -> torch.Tensor:
    """encoded[start:stop] through `decode` (the SplitTransform's, sent with each task: a few steps)."""
    return torch.stack([decode(encoded[i]) for i in range(start, stop)])


class DecodePool:
    """Processes that decode offloaded images again for the second pass.

    Started from a fork server: the training process has threads and a CUDA context by
    then, which a plain fork would copy half-way. The inputs and results travel through
    shared memory (torch's multiprocessing reductions)."""

    def __init__(self, decode: Callable[[tuple[bytes, tuple]], torch.Tensor], processes: int):
        self.processes = processes
        self.executor = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("forkserver"),
                                            initializer=_one_thread)
        self.decode_one = decode

    def decode(self, encoded: EncodedImages, start: int, stop: int) -> list[Future]:
        """Futures of uint8 row blocks that stack to encoded[start:stop], spread over the processes."""
        rows = max(1, -(-(stop - start) // self.processes))
        return [self.executor.submit(decode_each, self.decode_one, encoded, lo, min(lo + rows, stop))
                for lo in range(start, stop, rows)]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class OffloadedImages(HostColumn):
    """The images column of an offloaded batch (a `HostColumn`, filled by `BatchStream`).

    Gradient Cache asks for chunks in order, once per pass. In pass 1 a row range comes from
    the loader's pixels, taken off a queue of at most `window` pieces, so the pixels of only
    a few pieces are ever held on the host; in pass 2 (for the chunks pass 1 could not keep
    on the device) it is decoded again from the kept bytes in the pool."""

    def __init__(self, batch_size: int, arrivals: Arrivals, to_float: DeviceTransform | None, budget: DeviceBudget | None,
                 pool: DecodePool, window: int):
        super().__init__(to_float, budget)
        self.batch_size = batch_size
        self.arrivals = arrivals
        self.pool = pool
        self.pixels: queue.Queue = queue.Queue(maxsize=window)  # (first row, uint8 piece), in order
        self.encoded: list[tuple[int, EncodedImages]] = []

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        """A piece from the loader; blocks while the first pass has `window` pieces to take. The
        bytes are kept as a private copy: the piece's tensors sit in shared memory, one file
        descriptor each, and a batch of a million samples would hold thousands of them."""
        self.encoded.append((rows.start, piece["encoded"].clone()))
        self.pixels.put((rows.start, piece["images"]))

    def submit(self, start: int, stop: int, pass_number: int) -> Callable[[], torch.Tensor]:
        if pass_number == 1:
            return lambda: self._take_pixels(start, stop)
        futures = [future for encoded, lo, hi in encoded_rows(self.encoded, start, stop)
                   for future in self.pool.decode(encoded, lo, hi)]
        return lambda: self._pinned([future.result() for future in futures])

    def _take_pixels(self, start: int, stop: int) -> torch.Tensor:
        parts, row = [], start
        while row < stop:
            try:
                first, pixels = self.pixels.get(timeout=POLL_S)
            except queue.Empty:
                self.arrivals.raise_if_failed()
                continue
            if first != row:
                raise RuntimeError(f"offloaded batch: expected the piece at row {row}, got {first}")
            parts.append(pixels)
            row += len(pixels)
        if row != stop:
            raise RuntimeError(f"offloaded batch: pieces do not tile the chunk [{start}, {stop})")
        return self._pinned(parts)

    @staticmethod
    def _pinned(parts: list[torch.Tensor]) -> torch.Tensor:
        """One pinned block, so the copy to the device is asynchronous."""
        out = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                          pin_memory=torch.cuda.is_available())
        return torch.cat(parts, out=out)
