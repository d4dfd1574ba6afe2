"""The trainer's side of a batch's images: their bytes as the workers hand them over, and the decoders
that turn a chunk of them into pixels.

**Bytes.** `EncodedImages` is one piece's images, bytes and drawn crops, as the workers hand them
over (`data.decoder: device`, or `train.offload`); `EncodedBatch` is a step's batch of them on the
host. `jpeg_frame` and `device_decodes` are how a worker judges, from the JPEG's header alone, what
the device will decode; what it will not, the worker decodes itself and hands over as pixels beside
the bytes. The workers (shards.py) import this part.

**On the device** (`data.decoder: device`). `DeviceDecoder` decodes a batch's chunks in a thread and
on a CUDA stream of its own, in the training process's own CUDA context: a whole chunk's JPEGs in
one call of nvJPEG (torchvision's batched decoder: the GPU's hardware JPEG engines for baseline
JPEGs, nvJPEG's hybrid decoder for progressive ones), then all of its crops resized in one pass
(`crop_resize`). The images the device does not take came decoded by the loader's workers
(`EncodedImages.pixels`: their crop regions, resized here with the JPEGs' crops); what nvJPEG still
refuses, PIL decodes here, and what nothing decodes trains as a black image, counted.

The thread shares the training process's interpreter with the threads that launch the model's
kernels, and every tensor call hands the GIL over and waits to get it back: a chunk costs a few
dozen calls, never one per image (bench_contention.py measures it beside the step). On a CPU device
the same code runs torchvision's CPU decoder image by image: that is how the tests hold it.

**Again, in processes** (`train.offload` with `data.decoder: loader`). `OffloadedRows` are an
offloaded batch's images: pass 1 takes the loader's pixels as they arrive, holding those of a few
pieces only, and a later pass decodes the kept bytes again in a pool of processes (`DecodePool`)
with the same PIL code and crop, so it sees the same pixels bit for bit.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from clipscale.caption_length import to_device_async  # a copy that never waits for the step's queued work
from clipscale.data.chunks import (Arrivals, ChunkSource, DeviceTransform, HostChunk, HostWaitingRoom, InArena, KeepBudget, Rows,
                                   SpillFile, WorkerArenas, spill_directory)
from clipscale.data.transforms import SplitTransform, uint8_image_bytes

JPEG_START, JPEG_END = b"\xff\xd8", b"\xff\xd9"
# Frame headers (SOFn) whose JPEGs the device decodes: baseline, extended and progressive Huffman
# coding. Lossless, hierarchical and arithmetic-coded ones are decoded by the worker (PIL).
DEVICE_FRAMES = (0xC0, 0xC1, 0xC2)


@dataclass(frozen=True)
class JpegFrame:
    """What a JPEG's frame header (its SOFn segment) says: how it is coded and its size."""

    marker: int  # 0xC0 baseline, 0xC2 progressive, ...
    precision: int  # bits a sample
    height: int
    width: int
    components: int  # 1 grayscale, 3 YCbCr, 4 CMYK or YCCK


def jpeg_frame(data) -> JpegFrame | None:
    """The frame header of a JPEG (bytes), read by walking its segments up to the first frame
    header: microseconds, where decoding it would take a millisecond. None for anything that is
    not a JPEG whose segments lead to a frame header (another format, or damaged headers)."""
    if data[:2] != JPEG_START:
        return None
    at, end = 2, len(data)
    while at + 4 <= end:
        if data[at] != 0xFF:
            return None  # not at a marker: the headers are damaged
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte before the marker
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a segment
            at += 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn (not DHT, JPG, DAC)
            if at + 10 > end:
                return None
            return JpegFrame(marker, data[at + 4], int.from_bytes(data[at + 5 : at + 7], "big"),
                             int.from_bytes(data[at + 7 : at + 9], "big"), data[at + 9])
        if marker == 0xDA:  # a scan before any frame header
            return None
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


def device_decodes(frame: JpegFrame | None, data) -> bool:
    """Whether the device's JPEG decoder takes this image: a whole JPEG (its end marker last: a
    file cut short lacks it) of 8-bit Huffman-coded grayscale or YCbCr, of a known size. Anything
    else is decoded by the worker, which skips and counts what PIL cannot decode either."""
    return (frame is not None and frame.marker in DEVICE_FRAMES and frame.precision == 8 and frame.components in (1, 3)
            and frame.height > 0 and frame.width > 0 and bytes(data[-2:]) == JPEG_END)


def size_only(height: int, width: int) -> torch.Tensor:
    """An image's size without its pixels, to draw a crop from a JPEG's header: a [3, H, W] view
    of one element, all that torchvision's `F.get_dimensions` reads of an image."""
    return torch.empty(()).expand(3, height, width)


class Regions:
    """Crop regions a worker decoded, each as the decoders give it (a uint8 [3, h, w] view of
    [h, w, 3] rows), to be laid end to end as `EncodedImages.pixels`: written into a worker's arena
    by `WorkerArenas.carry` (`write_into`), or into memory of their own (`tensor`). It has the
    dtype and shape of the flat tensor they make."""

    dtype = torch.uint8

    def __init__(self, regions: list[torch.Tensor]):
        self.regions = regions
        self.lengths = [region.numel() for region in regions]
        self.shape = torch.Size([sum(self.lengths)])

    def numel(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        return 1

    def write_into(self, flat: torch.Tensor) -> None:
        """Each region's rows into its place in `flat` (uint8, `shape`): whole rows, one copy each."""
        for region, place in zip(self.regions, flat.split(self.lengths)):
            place.view(region.shape[1], region.shape[2], 3).copy_(region.permute(1, 2, 0))

    def tensor(self) -> torch.Tensor:
        flat = torch.empty(self.shape, dtype=self.dtype)
        self.write_into(flat)
        return flat


class EncodedImages:
    """Images as the shards hold them: all encoded bytes in one uint8 tensor, `offsets` [n + 1]
    delimiting the samples, and each sample's drawn crop in `params` [n, k]. The images the
    device will not decode (`device_decodes`) come decoded by the worker instead, with no bytes:
    each one's crop region, pixels the device resizes with the JPEGs' crops (the resize cost a
    worker more than the decode), laid end to end in `pixels` (uint8, flat), each as the decoders
    give it, [h, w, 3] rows of RGB (so handing it over copies whole rows), of `pixel_sizes` [m, 2]
    (h, w) and starting at `pixel_offsets` [m + 1]; their
    rows in `pixel_rows` [m] (ascending). Tensors, so loader workers pass it through shared memory,
    or write them into their arena (`WorkerArenas.carry`): then each is a view of the arena in the
    trainer and `arena_span` is (worker, start, stop) of what the worker wrote.

    `self[i]` is (bytes, params tuple), what `SplitTransform.decode` takes."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, params: torch.Tensor,
                 pixels: torch.Tensor | None = None, pixel_sizes: torch.Tensor | None = None,
                 pixel_rows: torch.Tensor | None = None, arena_span: tuple[int, int, int] | None = None):
        self.data, self.offsets, self.params = data, offsets, params
        self.arena_span = arena_span
        self.pixels = pixels if pixels is not None else torch.empty(0, dtype=torch.uint8)
        self.pixel_sizes = pixel_sizes if pixel_sizes is not None else torch.empty(0, 2, dtype=torch.int64)
        self.pixel_rows = pixel_rows if pixel_rows is not None else torch.empty(0, dtype=torch.int64)
        self.pixel_offsets = torch.zeros(len(self.pixel_sizes) + 1, dtype=torch.int64)
        torch.cumsum(3 * self.pixel_sizes.prod(1), 0, out=self.pixel_offsets[1:])

    @classmethod
    def from_samples(cls, blobs: tuple[bytes, ...], params: tuple[tuple, ...],
                     decoded: tuple[torch.Tensor | None, ...] | None = None) -> "EncodedImages":
        """`decoded`: per sample, its uint8 [3, h, w] pixels where the worker decoded it (its
        bytes are then not kept)."""
        return cls.of_parts(cls.parts_of_samples(blobs, params, decoded))

    @staticmethod
    def parts_of_samples(blobs: tuple[bytes, ...], params: tuple[tuple, ...],
                         decoded: tuple[torch.Tensor | None, ...] | None = None) -> dict:
        """What `tensors` would give, with the worker's decoded images not yet laid end to end:
        `Regions` in place of `pixels`, so that a worker writes each straight into its arena
        (`WorkerArenas.carry`), one copy where laying them out first made two."""
        rows = [k for k, pixels in enumerate(decoded or ()) if pixels is not None]
        if rows:
            blobs = tuple(b"" if pixels is not None else blob for blob, pixels in zip(blobs, decoded))
        offsets = torch.zeros(len(blobs) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(b) for b in blobs], dtype=torch.int64), 0, out=offsets[1:])
        joined = b"".join(blobs)  # empty where the worker decoded every image (torch.frombuffer refuses nothing)
        data = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
        width = len(params[0]) if params else 0
        return {"data": data, "offsets": offsets, "params": torch.tensor(params, dtype=torch.int64).reshape(len(blobs), width),
                "pixels": Regions([decoded[k] for k in rows]) if rows else torch.empty(0, dtype=torch.uint8),
                "pixel_sizes": torch.tensor([decoded[k].shape[1:] for k in rows], dtype=torch.int64).reshape(len(rows), 2),
                "pixel_rows": torch.tensor(rows, dtype=torch.int64)}

    @classmethod
    def of_parts(cls, parts: dict) -> "EncodedImages":
        """`parts_of_samples`' parts as one piece's images, the regions laid end to end in memory of their own."""
        pixels = parts["pixels"]
        return cls(**{**parts, "pixels": pixels.tensor() if isinstance(pixels, Regions) else pixels})

    def tensors(self) -> dict[str, torch.Tensor]:
        """What it is made of, by name (`WorkerArenas.carry` writes them into a worker's arena)."""
        return {"data": self.data, "offsets": self.offsets, "params": self.params, "pixels": self.pixels,
                "pixel_sizes": self.pixel_sizes, "pixel_rows": self.pixel_rows}

    @classmethod
    def in_arena(cls, tensors: dict[str, torch.Tensor], carried: InArena) -> "EncodedImages":
        """Made of views of a worker's arena (`WorkerArenas.take`), held until `carried.stop` is released."""
        return cls(**tensors, arena_span=(carried.worker, carried.start, carried.stop))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[bytes, tuple]:
        return self.blob(i).numpy().tobytes(), self.params_of(i)

    def blob(self, i: int) -> torch.Tensor:
        """Sample i's bytes, a view."""
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def blobs(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Samples [start, stop)'s bytes, views, split in one call: the decoder's thread shares the
        training process's interpreter, so it spends no Python per sample where one call does."""
        first = int(self.offsets[start])
        return torch.tensor_split(self.data[first : int(self.offsets[stop])], self.offsets[start + 1 : stop] - first)

    def all_by_worker(self) -> bool:
        """Whether the worker decoded every image (its image k is then row k)."""
        return len(self.pixel_rows) == len(self)

    def decoded_rows(self, start: int, stop: int) -> tuple[list[int], slice]:
        """The rows of [start, stop) whose pixels the worker decoded, counted from `start`, and
        which of the worker's images they are: consecutive ones, as the rows ascend."""
        first, last = torch.searchsorted(self.pixel_rows, torch.tensor([start, stop])).tolist()
        return (self.pixel_rows[first:last] - start).tolist(), slice(first, last)

    def worker_span(self, which: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The worker's images `which` (consecutive): their pixels, one flat view to send in one
        copy; where each starts in it (int64 [m]) and its size (int64 [m, 2]: height, width)."""
        first = self.pixel_offsets[which.start]
        starts = self.pixel_offsets[which.start : which.stop] - first
        return self.pixels[int(first) : int(self.pixel_offsets[which.stop])], starts, self.pixel_sizes[which]

    def worker_image(self, k: int) -> torch.Tensor:
        """The worker's image k, uint8 [3, h, w] (a view of its [h, w, 3] rows)."""
        height, width = self.pixel_sizes[k].tolist()
        return self.pixels[int(self.pixel_offsets[k]) : int(self.pixel_offsets[k + 1])].view(height, width, 3).permute(2, 0, 1)

    def params_of(self, i: int) -> tuple:
        return tuple(self.params[i].tolist())

    def clone(self, pinned: bool = False) -> "EncodedImages":
        """A private copy; `pinned`: the worker's pixels page-locked, so that a chunk's rows of them
        go to the device in one asynchronous copy, from a view (`worker_span`). Images in a worker's
        arena are not copied: they are page-locked views already, until given back."""
        if self.arena_span is not None:
            return self
        pixels = self.pixels.pin_memory() if pinned and self.pixels.numel() else self.pixels.clone()
        return EncodedImages(self.data.clone(), self.offsets.clone(), self.params.clone(), pixels, self.pixel_sizes.clone(),
                             self.pixel_rows.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.offsets, self.params, self.pixels, self.pixel_sizes,
                                                              self.pixel_offsets, self.pixel_rows))


class EncodedBatch:
    """A step's images kept as the pieces' `EncodedImages`, in row order, as they arrive; pixels the
    workers wrote into their `arenas` stay there, until `release`."""

    def __init__(self, arenas: WorkerArenas | None = None):
        self.pieces: list[tuple[int, EncodedImages]] = []  # (first row, the piece's images)
        self.arenas = arenas
        self.released = False
        self.given_back = 0  # pieces [0, given_back) are not read again (`give_back_before`)
        self.copying: deque[tuple[torch.cuda.Event | None, list[EncodedImages]]] = deque()  # given back once copied

    def add(self, first_row: int, encoded: EncodedImages) -> None:
        """Keep a private copy: a loader worker's tensors sit in shared memory, one file descriptor
        each, and a batch of a million samples would hold thousands of them. Where CUDA is, the
        worker's pixels are copied into page-locked memory here, in the gathering thread, not by
        the decoding thread (the data path's limit) when it sends them to the device; pixels in a
        worker's arena are page-locked where they are, and stay there."""
        self.pieces.append((first_row, encoded.clone(pinned=torch.cuda.is_available())))

    def release(self) -> None:
        """Give the workers' arenas back the pieces (call once no copy from them is pending);
        once: the batch's rows cannot be read again."""
        self.copying.clear()
        self._give_back(encoded for _, encoded in self.pieces)
        self.released = True

    def give_back_before(self, row: int, copied: torch.cuda.Event | None) -> None:
        """Rows before `row` are not read again: the pieces wholly before it go back to the workers'
        arenas once the device has run `copied` (an event after their copies), so that the workers
        write the next batch there while this one trains. Pieces go back in row order, as each
        worker wrote them."""
        first = self.given_back
        while self.given_back < len(self.pieces):
            start, encoded = self.pieces[self.given_back]
            if start + len(encoded) > row:
                break
            self.given_back += 1
        if self.given_back > first:
            self.copying.append((copied, [encoded for _, encoded in self.pieces[first : self.given_back]]))
        while self.copying and (self.copying[0][0] is None or self.copying[0][0].query()):
            self._give_back(self.copying.popleft()[1])

    @property
    def given_back_rows(self) -> int:
        """Rows [0, given_back_rows) are not read again."""
        if not self.given_back:
            return 0
        start, encoded = self.pieces[self.given_back - 1]
        return start + len(encoded)

    def _give_back(self, pieces: Iterable[EncodedImages]) -> None:
        for encoded in pieces:
            if encoded.arena_span is not None:
                worker, _, stop = encoded.arena_span
                self.arenas.release(worker, stop)

    def rows(self, start: int, stop: int) -> list[tuple[EncodedImages, int, int]]:
        """Rows [start, stop) as (piece, first, stop) within each piece that holds some of them."""
        if self.released or start < self.given_back_rows:
            raise RuntimeError(f"rows {start}..{stop} of a batch read after its pixels were given back")
        return [(encoded, max(start, first) - first, min(stop, first + len(encoded)) - first)
                for first, encoded in self.pieces if first < stop and first + len(encoded) > start]

    @property
    def nbytes(self) -> int:
        return sum(encoded.nbytes for _, encoded in self.pieces)


# --- decoding on the device -------------------------------------------------------------------------


def decode_jpegs(blobs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """uint8 [3, H, W] RGB on `device` for each JPEG (uint8 bytes on the host), None where it does
    not decode. On a GPU one call of torchvision's batched nvJPEG op for the whole list (its
    Python wrapper checks every image in Python first, so the op is called directly); a batch
    with one undecodable image fails whole, so then image by image."""
    if not blobs:
        return []
    try:
        return list(_nvjpeg_or_cpu(blobs, device))
    except RuntimeError:
        return [_decode_one(blob, device) for blob in blobs]


def _decode_one(blob: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return _nvjpeg_or_cpu([blob], device)[0]
    except RuntimeError:
        return None


def _nvjpeg_or_cpu(blobs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type == "cuda":
        return torch.ops.image.decode_jpegs_cuda(blobs, ImageReadMode.RGB.value, device)
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its image decoders for TorchCodec's
        warnings.simplefilter("ignore", category=DeprecationWarning)
        return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)


def decode_rows(split: SplitTransform, encoded: EncodedImages, start: int, stop: int,
                device: torch.device) -> tuple[torch.Tensor, int]:
    """encoded[start:stop] decoded, cropped and resized on `device`: (uint8 [n, 3, H, W], how many
    images nothing could decode, trained black). The JPEGs are decoded in one call, the worker's
    crop regions sent in one copy, and all of them resized in one pass; what nvJPEG refuses, PIL
    decodes here."""
    if encoded.all_by_worker():  # the workers decoded every image (data.worker_decode_share 1): one copy, one resize
        regions = WorkerRegions(encoded, slice(start, stop), device)
        return resized_crops(split, [], encoded.params[:0, :4], device, regions), 0
    n = stop - start
    blobs = encoded.blobs(start, stop)
    pixel_rows, pixel_index = encoded.decoded_rows(start, stop)
    by_worker = set(pixel_rows)
    jpeg_rows = [k for k in range(n) if k not in by_worker]
    decoded = decode_jpegs([blobs[k] for k in jpeg_rows] if pixel_rows else list(blobs), device)
    boxes = encoded.params[start:stop, :4]
    refused = [k for k, image in zip(jpeg_rows, decoded) if image is None]
    if refused:
        kept = [(k, image) for k, image in zip(jpeg_rows, decoded) if image is not None]
        jpeg_rows, decoded = [k for k, _ in kept], [image for _, image in kept]
    if len(jpeg_rows) < n:
        boxes = boxes[jpeg_rows]
    regions = WorkerRegions(encoded, pixel_index, device) if pixel_rows else None
    out = resized_crops(split, decoded, boxes, device, regions)
    if len(jpeg_rows) == n:
        return out, 0
    rows = torch.empty(n, *out.shape[1:], dtype=torch.uint8, device=device)
    if len(out):
        rows[to_device_async(torch.tensor(jpeg_rows + pixel_rows), device)] = out  # the regions come after the JPEGs
    undecodable = 0
    for k in refused:  # rare: a JPEG whose header looked whole, nvJPEG refused it
        try:
            rows[k] = split.decode(encoded[start + k]).to(device)
        except (OSError, ValueError, SyntaxError) as error:  # PIL's errors for bytes it cannot decode
            warnings.warn(f"an image of this batch does not decode ({error!r}); it is trained as a black image")
            black = torch.zeros(3, 1, 1, dtype=torch.uint8, device=device)  # its crop box pads it to size
            rows[k] = split.apply_to_tensor(black, encoded.params_of(start + k))
            undecodable += 1
    return rows, undecodable


class WorkerRegions:
    """The crop regions a worker decoded for rows of a chunk, on the device in one copy: each is
    uint8 [h, w, 3] rows in `pixels` (flat), cropped to the whole of itself."""

    def __init__(self, encoded: EncodedImages, which: slice, device: torch.device):
        span, self.starts, self.sizes = encoded.worker_span(which)
        self.pixels = to_device_async(span, device)
        self.boxes = torch.cat([torch.zeros_like(self.sizes), self.sizes], 1)

    def table(self) -> torch.Tensor:
        """int64 [m, 4]: each region's address and strides (`crop_resize.image_table`'s columns): its
        channels 1 apart, its rows 3 w, its columns 3."""
        width = self.sizes[:, 1:]
        return torch.cat([(self.pixels.data_ptr() + self.starts)[:, None], torch.ones_like(width), 3 * width,
                          torch.full_like(width, 3)], 1)

    def images(self) -> list[torch.Tensor]:
        """Each region as a tensor of its own (a view): for the image-by-image resize only."""
        lengths = (3 * self.sizes.prod(1)).tolist()
        return [image.view(h, w, 3).permute(2, 0, 1) for image, (h, w) in zip(self.pixels.split(lengths), self.sizes.tolist())]


def resized_crops(split: SplitTransform, images: list[torch.Tensor], boxes: torch.Tensor, device: torch.device,
                  regions: WorkerRegions | None = None) -> torch.Tensor:
    """Decoded images cropped and resized by `split`'s PIL steps (`boxes`: int64 [n, 4], each
    image's drawn crop), then the worker's `regions`: uint8 [n + m, 3, H, W]. On a GPU (or under
    Triton's interpreter) one batched pass for all of them (`crop_resize`) when the steps are a
    single RandomResizedCrop it can run, the regions placed by a table (no call per image);
    torchvision's kernels image by image otherwise."""
    crop = split.only_random_resized_crop()
    from clipscale.triton_modes import interpreting  # Triton: imported where it runs

    if regions is not None:
        boxes = torch.cat([boxes, regions.boxes])
    if crop is not None and (device.type == "cuda" or interpreting()):
        from clipscale.data import crop_resize

        where = crop_resize.image_table(images)
        if regions is not None:
            where = torch.cat([where, regions.table()])
        return crop_resize.resized_crops_at(where, boxes, tuple(crop.size), crop.interpolation.value, device)
    images = images + (regions.images() if regions is not None else [])
    if not images:
        return torch.empty(0, 3, *crop.size, dtype=torch.uint8, device=device)
    return torch.stack([split.apply_to_tensor(img, tuple(box)) for img, box in zip(images, boxes.tolist())])


def decode_parts(split: SplitTransform, parts: list[tuple[EncodedImages, int, int]], device: torch.device) -> tuple[torch.Tensor, int]:
    """A chunk kept as pieces (`EncodedBatch.rows`), decoded in order: (uint8 [n, 3, H, W] on
    `device`, images trained black)."""
    decoded = [decode_rows(split, encoded, lo, hi, device) for encoded, lo, hi in parts]
    pixels = decoded[0][0] if len(decoded) == 1 else torch.cat([rows for rows, _ in decoded])
    return pixels, sum(black for _, black in decoded)


def decoded_column(rows, split: SplitTransform, chunk_size: int | None, arrivals: Arrivals,
                   device_transform: DeviceTransform | None, budget: KeepBudget | None, in_a_thread: bool) -> ChunkSource:
    """A batch's images column over `rows` the decoder decodes; its chunks of `chunk_size` decoded
    ahead when the budget and the transform allow (a single random resized crop: every image's
    pixels are the same size): `in_a_thread` by a thread of its own as soon as they arrive, else
    by the training thread during the previous step's pass 2 (`ChunkSource.prepare_some_ahead`)."""
    images = ChunkSource(rows, device_transform, budget)
    crop = split.only_random_resized_crop()
    if budget is not None and chunk_size is not None and crop is not None:
        row_bytes = 3 * crop.size[0] * crop.size[1]
        if in_a_thread:
            images.prepare_ahead(chunk_size, row_bytes, arrivals)
        else:
            images.ahead_shape = (chunk_size, row_bytes, rows.decoder.device)
    return images


# Decoding threads, each with a CUDA stream: nvJPEG's batched decoder is one per process (torchvision
# holds a lock around it), so a second thread only overlaps one chunk's host calls with another's decode.
DECODE_THREADS = 2


class DeviceDecoder:
    """Decodes a batch's chunks on the device in `threads` threads of its own, or (`threads=0`) in
    the thread that asks for them, when the loader's workers decoded every image into their
    `arenas`: a chunk is then one copy and one resize, a few calls, cheaper than any hand-over to
    another thread of the training process, which would share its interpreter lock (a thread doing
    Python beside the step slows every one of the step's launches: bench_contention.py).

    A decode waits for its own work: issued from the training thread, every chunk's decode
    would stall the model's queue. On threads each with its own CUDA stream, chunks
    are launched and decoded while the model computes the previous ones: pass 2 asks for its
    chunks `LOOKAHEAD` ahead, so an image decoded again costs no step time while the threads
    outpace the step. With a keep budget, each chunk of `chunk_size` is decoded as soon as its
    pieces are in and the budget has room: during the previous step, so pass 1 finds it ready
    (`ChunkSource.prepare_ahead`). `images_decoded` counts every image decoded (the tests hold
    "once per step" and "at most twice" with it); the images nothing decoded, trained black, are
    counted by their batch's rows at their chunk's first decode (`DeviceDecodedRows.trained_black`)."""

    def __init__(self, split: SplitTransform, device: torch.device, chunk_size: int | None = None,
                 threads: int = DECODE_THREADS, arenas: WorkerArenas | None = None, room_ahead: int = 0, spilled: int = 0):
        self.split, self.device, self.chunk_size, self.arenas = split, device, chunk_size, arenas
        self.own = threading.local()  # each thread's CUDA stream
        self.streams: list = []  # every thread's, for `wait_for_copies`
        self.thread = ThreadPoolExecutor(threads, thread_name_prefix="clipscale-decode",
                                         initializer=torch.cuda.set_device if device.type == "cuda" else None,
                                         initargs=(device,) if device.type == "cuda" else ()) if threads else None
        self.count_lock = threading.Lock()
        self.images_decoded = 0
        self.decode_s = 0.0  # the threads' time in decoding calls, summed (their rows' arrival not counted)
        # Pass 2's chunks on the host, every batch's, where arenas hold a window: `room_ahead` bytes of
        # it made from the start (`HostWaitingRoom`), for chunks of `chunk_size` at the crop's size;
        # where the host has no room for all of them, the room holds that much and `spilled` bytes
        # wait on disk (`SpillFile`).
        crop = split.only_random_resized_crop() if split is not None else None
        height, width = crop.size if crop is not None else (0, 0)  # a slot of the room: a whole chunk
        spill = SpillFile(spill_directory(), spilled / (spilled + room_ahead)) if spilled else None
        self.waiting_room = HostWaitingRoom(room_ahead, (chunk_size or 0) * uint8_image_bytes(height, width), spill)

    def column(self, batch_size: int, arrivals: Arrivals, device_transform: DeviceTransform | None,
               budget: KeepBudget | None) -> ChunkSource:
        """A batch's images column, decoded here; its chunks decoded ahead when the budget and the
        transform allow (a single random resized crop: every image's pixels are the same size)."""
        images = decoded_column(DeviceDecodedRows(batch_size, arrivals, self), self.split, self.chunk_size, arrivals,
                                device_transform, budget, in_a_thread=self.thread is not None)
        if self.arenas is not None and self.thread is None and not self.arenas.holds_a_batch:
            images.waiting_room = self.waiting_room
        return images

    def submit(self, encoded: EncodedBatch, arrivals: Arrivals, start: int, stop: int,
               counted: "DeviceDecodedRows | None" = None) -> "DecodedChunk":
        """Rows [start, stop) decoded once they have arrived; the images trained black are added to
        `counted`'s count (their first decode's, not a second's)."""
        if self.thread is not None:
            return DecodedChunk(self.thread.submit(self._decode, encoded, arrivals, start, stop, counted))
        decoded: Future = Future()
        decoded.set_result(self._decode(encoded, arrivals, start, stop, counted))
        return DecodedChunk(decoded)

    def _decode(self, encoded: EncodedBatch, arrivals: Arrivals, start: int, stop: int, counted: "DeviceDecodedRows | None"
                ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        arrivals.wait_for(stop)
        if not hasattr(self.own, "stream"):  # this thread's first chunk
            # The highest priority: the crop's kernels take SMs as the step's kernels free them.
            self.own.stream = torch.cuda.Stream(self.device, priority=-100) if self.device.type == "cuda" else None
            with self.count_lock:
                self.streams.append(self.own.stream)
        stream = self.own.stream
        started = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            pixels, black = decode_parts(self.split, encoded.rows(start, stop), self.device)
        with self.count_lock:
            self.images_decoded += len(pixels)
            if counted is not None:
                counted.trained_black += black
            self.decode_s += time.perf_counter() - started
        return pixels, (stream.record_event() if stream is not None else None)

    def issued(self) -> torch.cuda.Event | None:
        """An event after every copy and resize the calling thread has issued (None where it has not
        issued any on a CUDA stream)."""
        stream = getattr(self.own, "stream", None)
        return stream.record_event() if stream is not None else None

    def wait_for_copies(self) -> None:
        """Until every copy and resize issued so far has run (the arenas' pixels they read may be
        written again after)."""
        with self.count_lock:
            streams = list(self.streams)
        for stream in streams:
            if stream is not None:
                stream.synchronize()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=False, cancel_futures=True)
        if self.waiting_room.spill is not None:
            self.waiting_room.spill.close()


class DecodedChunk:
    """A chunk being decoded by the decoder's thread on its CUDA stream."""

    def __init__(self, future: Future):
        self.future = future

    def on_device(self, device: torch.device, copy_stream) -> torch.Tensor:
        """Already there: the compute stream only waits for the decode stream's work."""
        pixels, done = self.future.result()
        if done is not None:
            compute = torch.cuda.current_stream(device)
            compute.wait_event(done)
            pixels.record_stream(compute)  # made on the decode stream, freed after the compute stream's use
        return pixels

    def cancel(self) -> None:
        self.future.cancel()


class DeviceDecodedRows(Rows):
    """The images of a batch that the device decodes: the host holds the pieces' JPEG bytes and
    crops (`EncodedBatch`, about a tenth of their uint8 pixels); every pass decodes what it asks
    for that was not kept."""

    def __init__(self, batch_size: int, arrivals: Arrivals, decoder: DeviceDecoder):
        self.batch_size, self.arrivals, self.decoder = batch_size, arrivals, decoder
        self.encoded = EncodedBatch(decoder.arenas)
        self.trained_black = 0  # images of the batch nothing decoded, trained black (at their first decode)

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        self.encoded.add(rows.start, piece["encoded"])

    def prepare(self, start: int, stop: int, pass_number: int) -> DecodedChunk:
        return self.decoder.submit(self.encoded, self.arrivals, start, stop, counted=self if pass_number == 1 else None)

    def on_device_before(self, row: int) -> None:
        """Rows before `row` are on the device for as long as the step needs them (chunks prepared
        ahead, `ChunkSource.prepare_some_ahead`, in the calling thread): their pieces go back to the
        workers' arenas once the device has copied them, while the batch is still to train."""
        if self.decoder.arenas is not None and self.decoder.thread is None:
            self.encoded.give_back_before(row, self.decoder.issued())

    def release(self) -> None:
        """The bytes are this process's, dropped with the batch; pixels in the workers' arenas go
        back to them once the device has read them."""
        if self.decoder.arenas is not None and not self.encoded.released:
            self.decoder.wait_for_copies()
            self.encoded.release()


# --- decoding again in processes (train.offload) ----------------------------------------------------


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


class OffloadedRows(Rows):
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
