"""Images as the shards hold them: the bytes a loader worker keeps and a decoder on the trainer's side reads.

`EncodedImages` is one piece's images, bytes and drawn crops, as the workers hand them over
(`data.decoder: device`, or `train.offload`); `EncodedBatch` is a step's batch of them on the
host. `jpeg_frame` and `device_decodes` are how a worker judges, from the JPEG's header alone,
what the device will decode; what it will not, the worker decodes itself and hands over as
pixels beside the bytes. The workers (shards.py) and the decoders (device_decode.py, offload.py)
both import this module, and nothing here runs on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


class EncodedImages:
    """Images as the shards hold them: all encoded bytes in one uint8 tensor, `offsets` [n + 1]
    delimiting the samples, and each sample's drawn crop in `params` [n, k]. The images the
    device will not decode (`device_decodes`) come decoded by the worker instead, with no bytes:
    each one's crop region, pixels the device resizes with the JPEGs' crops (the resize cost a
    worker more than the decode), laid end to end in `pixels` (uint8, flat),
    each of `pixel_sizes` [m, 2] (height, width) and starting at `pixel_offsets` [m + 1]; their
    rows in `pixel_rows` [m] (ascending). Tensors, so loader workers pass it through shared memory.

    `self[i]` is (bytes, params tuple), what `SplitTransform.decode` takes."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, params: torch.Tensor,
                 pixels: torch.Tensor | None = None, pixel_sizes: torch.Tensor | None = None,
                 pixel_rows: torch.Tensor | None = None):
        self.data, self.offsets, self.params = data, offsets, params
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
        rows = [k for k, pixels in enumerate(decoded or ()) if pixels is not None]
        if rows:
            blobs = tuple(b"" if pixels is not None else blob for blob, pixels in zip(blobs, decoded))
        offsets = torch.zeros(len(blobs) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(b) for b in blobs], dtype=torch.int64), 0, out=offsets[1:])
        joined = b"".join(blobs)  # empty where the worker decoded every image (torch.frombuffer refuses nothing)
        data = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
        width = len(params[0]) if params else 0
        pixels = sizes = None
        if rows:  # each image copied once, into its place (PIL's come as [3, h, w] views of [h, w, 3] memory)
            sizes = torch.tensor([decoded[k].shape[1:] for k in rows], dtype=torch.int64)
            lengths = (3 * sizes.prod(1)).tolist()
            pixels = torch.empty(sum(lengths), dtype=torch.uint8)
            for k, place in zip(rows, pixels.split(lengths)):
                place.view(decoded[k].shape).copy_(decoded[k])
        return cls(data, offsets, torch.tensor(params, dtype=torch.int64).reshape(len(blobs), width),
                   pixels, sizes, torch.tensor(rows, dtype=torch.int64) if rows else None)

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
        """The worker's image k, uint8 [3, h, w] (a view)."""
        height, width = self.pixel_sizes[k].tolist()
        return self.pixels[int(self.pixel_offsets[k]) : int(self.pixel_offsets[k + 1])].view(3, height, width)

    def params_of(self, i: int) -> tuple:
        return tuple(self.params[i].tolist())

    def clone(self, pinned: bool = False) -> "EncodedImages":
        """A private copy; `pinned`: the worker's pixels page-locked, so that a chunk's rows of them
        go to the device in one asynchronous copy, from a view (`worker_span`)."""
        pixels = self.pixels.pin_memory() if pinned and self.pixels.numel() else self.pixels.clone()
        return EncodedImages(self.data.clone(), self.offsets.clone(), self.params.clone(), pixels, self.pixel_sizes.clone(),
                             self.pixel_rows.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.offsets, self.params, self.pixels, self.pixel_sizes,
                                                              self.pixel_offsets, self.pixel_rows))


class EncodedBatch:
    """A step's images kept as the pieces' `EncodedImages`, in row order, as they arrive."""

    def __init__(self):
        self.pieces: list[tuple[int, EncodedImages]] = []  # (first row, the piece's images)

    def add(self, first_row: int, encoded: EncodedImages) -> None:
        """Keep a private copy: a loader worker's tensors sit in shared memory, one file descriptor
        each, and a batch of a million samples would hold thousands of them. Where CUDA is, the
        worker's pixels are copied into page-locked memory here, in the gathering thread, not by
        the decoding thread (the data path's limit) when it sends them to the device."""
        self.pieces.append((first_row, encoded.clone(pinned=torch.cuda.is_available())))

    def rows(self, start: int, stop: int) -> list[tuple[EncodedImages, int, int]]:
        """Rows [start, stop) as (piece, first, stop) within each piece that holds some of them."""
        return [(encoded, max(start, first) - first, min(stop, first + len(encoded)) - first)
                for first, encoded in self.pieces if first < stop and first + len(encoded) > start]

    @property
    def nbytes(self) -> int:
        return sum(encoded.nbytes for _, encoded in self.pieces)
