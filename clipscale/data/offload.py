"""Keep a batch on the host in its compact form and stream it to the device one chunk at a time.

A contrastive batch of a million samples does not fit on a GPU, and decoded it does
not even fit in host memory (10^6 x 3x224x224 uint8 = 150 GB). So the batch stays on
the host as what the shards hold -- encoded JPEG bytes and caption strings
(`EncodedSamples`), or a pinned uint8 / token tensor where that is small enough
(`HostTensor`) -- and `stream_chunks` decodes chunk i+1 in background threads into
pinned memory and copies it on a side CUDA stream while the model computes on chunk i.
`JpegBytes` instead sends the compressed bytes and lets the GPU decode them (nvJPEG),
for batches whose decoding would outrun the host's cores. Each column says how:
`submit` starts preparing a chunk on the host, `to_device` moves it, `device_transform`
finishes it there.

GradCache walks the batch twice, so every chunk is decoded twice: decoding must be a
pure function of the sample, and it runs in threads beside the model, so it must not
touch the global RNG either (that would race, and shift the dropout masks GradCache
replays). Random augmentation belongs in the sample: the loader draws the crop box
(e.g. `RandomResizedCrop.get_params` from the JPEG header) and `decode` applies it
with `torchvision.transforms.functional.resized_crop`.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Executor
from typing import Any, Callable, Iterator, Sequence

import torch
from torchvision.io import decode_jpeg

ROWS_PER_JOB = 32

DeviceTransform = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _to_device(host: torch.Tensor, device: torch.device, copy_stream) -> torch.Tensor:
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


class HostTensor:
    """A column already decoded into one host tensor (uint8 images, token ids).

    Pinned once, so that every chunk copy can be asynchronous. `device_transform` runs on
    the device after the copy (e.g. uint8 -> normalised float, 4x fewer bytes on the bus).
    """

    def __init__(self, tensor: torch.Tensor, device_transform: DeviceTransform | None = None):
        if torch.cuda.is_available() and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        self.tensor = tensor
        self.device_transform = device_transform or _identity

    def __len__(self) -> int:
        return len(self.tensor)

    def submit(self, start: int, stop: int, pool: Executor, pin: bool) -> Callable[[], torch.Tensor]:
        chunk = self.tensor[start:stop]  # a row slice of a pinned tensor is pinned
        return lambda: chunk

    to_device = staticmethod(_to_device)


class EncodedSamples:
    """A column kept as encoded samples (JPEG/PNG bytes, captions), decoded per chunk.

    `decode(sample)` returns a CPU tensor of the same shape for every sample (e.g. a
    uint8 [3, H, W] image, an int64 [context_length] token row). It runs in the
    thread pool; PIL's decoders release the GIL, so threads decode in parallel.
    """

    def __init__(
        self,
        samples: Sequence[Any],
        decode: Callable[[Any], torch.Tensor],
        device_transform: DeviceTransform | None = None,
    ):
        self.samples = samples
        self.decode = decode
        self.device_transform = device_transform or _identity

    def __len__(self) -> int:
        return len(self.samples)

    def submit(self, start: int, stop: int, pool: Executor, pin: bool) -> Callable[[], torch.Tensor]:
        """Start decoding samples[start:stop] into one (pinned) buffer; return a waiter for it."""
        # The first sample is decoded here to learn the shape, so the workers can write
        # straight into the pinned buffer with no extra stacking copy.
        first = self.decode(self.samples[start])
        buffer = torch.empty((stop - start, *first.shape), dtype=first.dtype, pin_memory=pin)
        buffer[0] = first

        def fill(rows: range) -> None:
            for row in rows:
                buffer[row] = self.decode(self.samples[start + row])

        # A few dozen rows per job: a million per-sample futures would cost more Python
        # time than the decoding they schedule.
        futures = [
            pool.submit(fill, range(row, min(row + ROWS_PER_JOB, stop - start)))
            for row in range(1, stop - start, ROWS_PER_JOB)
        ]

        def wait() -> torch.Tensor:
            for future in futures:
                future.result()
            return buffer

        return wait

    to_device = staticmethod(_to_device)


class JpegBytes:
    """A column of JPEG bytes decoded on the device itself, a chunk at a time (nvJPEG through
    `torchvision.io.decode_jpeg(..., device=...)`; torchvision's CPU decoder on a CPU device).

    Only the compressed bytes cross the bus (about 10x fewer than uint8 pixels) and the
    host's cores are not the limit: a million-sample batch is decoded twice per step, which
    host threads cannot keep up with beside a fast GPU. Every image must decode to the same
    shape (crop and resize on the device belong in `device_transform`, which gets the
    stacked uint8 batch [n, 3, H, W]).
    """

    def __init__(self, samples: Sequence[bytes], device_transform: DeviceTransform | None = None):
        self.samples = samples
        self.device_transform = device_transform or _identity
        self._decode_streams: dict = {}

    def __len__(self) -> int:
        return len(self.samples)

    def submit(self, start: int, stop: int, pool: Executor, pin: bool) -> Callable[[], list[torch.Tensor]]:
        chunk = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in self.samples[start:stop]]
        return lambda: chunk

    def to_device(self, host: list[torch.Tensor], device: torch.device, copy_stream) -> torch.Tensor:
        if device.type != "cuda":
            decoded = decode_jpeg(host, device=device)
        else:
            # nvJPEG's hardware engine writes its outputs without waiting for the work queued
            # on its stream (pytorch/vision#9606, meta-pytorch/torchcodec#1634): on the compute
            # stream it would overwrite blocks the caching allocator just recycled while queued
            # kernels still read them (we saw NaN features). On a stream of its own nothing is
            # queued before it (decode_jpeg drains that stream before returning), and the
            # outputs are handed to the compute stream with record_stream, so their blocks are
            # not recycled before the compute stream is done with them.
            decode_stream = self._decode_streams.setdefault(device, torch.cuda.Stream(device))
            with torch.cuda.stream(decode_stream):
                decoded = decode_jpeg(host, device=device)
            compute = torch.cuda.current_stream(device)
            compute.wait_stream(decode_stream)
            for image in decoded:
                image.record_stream(compute)
        shapes = {tuple(image.shape) for image in decoded}
        if len(shapes) != 1:
            raise ValueError(f"JpegBytes: the images of a chunk decode to different shapes {sorted(shapes)[:4]}; "
                             "store them at one size, or decode on the host with EncodedSamples")
        return torch.stack(decoded)


HostColumn = HostTensor | EncodedSamples | JpegBytes


def stream_chunks(
    column: HostColumn,
    bounds: Sequence[tuple[int, int]],
    device: torch.device,
    pool: Executor,
    lookahead: int = 2,
) -> Iterator[torch.Tensor]:
    """Yield column[start:stop] on `device` for each bound, preparing the next ones meanwhile.

    Up to `lookahead` chunks are being decoded on the host while one is used; the copy of
    a chunk is issued on a side stream, so it overlaps the kernels still queued for the
    previous chunk. Host memory in flight: about `lookahead` decoded chunks.
    """
    on_cuda = device.type == "cuda"
    copy_stream = torch.cuda.Stream(device) if on_cuda else None
    pending = deque(column.submit(start, stop, pool, on_cuda) for start, stop in bounds[:lookahead])
    later = iter(bounds[lookahead:])
    for _ in bounds:
        host = pending.popleft()()
        upcoming = next(later, None)
        if upcoming is not None:
            pending.append(column.submit(*upcoming, pool, on_cuda))
        yield column.device_transform(column.to_device(host, device, copy_stream))
