"""Images as the shards hold them: the bytes a loader worker keeps and a decoder on the trainer's side reads.

`EncodedImages` is one piece's images, bytes and drawn crops, as the workers hand them over
(`data.decoder: device`, or `train.offload`); `EncodedBatch` is a step's batch of them on the
host. `is_whole_jpeg` and `decodes_at_reduced_scale` are how a worker judges what the device
will decode. The workers (shards.py) and the decoders (device_decode.py, offload.py) both import
this module, and nothing here runs on a GPU.
"""

from __future__ import annotations

import torch

JPEG_START, JPEG_END = b"\xff\xd8\xff", b"\xff\xd9"


def is_whole_jpeg(data) -> bool:
    """A JPEG from its start marker to its end marker (bytes or a uint8 array): what the device
    decodes. A cut-short file lacks the end marker; the worker then decodes it itself, to skip
    and count it."""
    return bytes(data[:3]) == JPEG_START and bytes(data[-2:]) == JPEG_END


def decodes_at_reduced_scale(img) -> None:
    """Decode a JPEG's entropy-coded data at 1/8 scale (libjpeg's DCT scaling: a fraction of a
    full decode), raising what a full decode would raise: the worker's check that the device
    will be able to decode what it keeps, so an undecodable image is skipped and counted there."""
    img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
    img.load()


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

    def blobs(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Samples [start, stop)'s bytes, views, split in one call: the decoder's thread shares the
        training process's interpreter, so it spends no Python per sample where one call does."""
        first = int(self.offsets[start])
        return torch.tensor_split(self.data[first : int(self.offsets[stop])], self.offsets[start + 1 : stop] - first)

    def whole_jpegs(self, start: int, stop: int) -> torch.Tensor:
        """bool [stop - start]: `is_whole_jpeg` of each sample, for all at once."""
        begins, ends = self.offsets[start:stop], self.offsets[start + 1 : stop + 1]
        long_enough = ends - begins >= len(JPEG_START)  # the markers may overlap, as in is_whole_jpeg
        whole = long_enough.clone()
        last = max(len(self.data) - 1, 0)
        for k, byte in enumerate(JPEG_START):
            whole &= self.data[(begins + k).clamp(max=last)] == byte
        for k, byte in enumerate(JPEG_END):
            whole &= self.data[(ends - len(JPEG_END) + k).clamp(min=0, max=last)] == byte
        return whole

    def params_of(self, i: int) -> tuple:
        return tuple(self.params[i].tolist())

    def clone(self) -> "EncodedImages":
        return EncodedImages(self.data.clone(), self.offsets.clone(), self.params.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.offsets, self.params))


class EncodedBatch:
    """A step's images kept as the pieces' `EncodedImages`, in row order, as they arrive."""

    def __init__(self):
        self.pieces: list[tuple[int, EncodedImages]] = []  # (first row, the piece's images)

    def add(self, first_row: int, encoded: EncodedImages) -> None:
        """Keep a private copy: a loader worker's tensors sit in shared memory, one file descriptor
        each, and a batch of a million samples would hold thousands of them."""
        self.pieces.append((first_row, encoded.clone()))

    def rows(self, start: int, stop: int) -> list[tuple[EncodedImages, int, int]]:
        """Rows [start, stop) as (piece, first, stop) within each piece that holds some of them."""
        return [(encoded, max(start, first) - first, min(stop, first + len(encoded)) - first)
                for first, encoded in self.pieces if first < stop and first + len(encoded) > start]

    @property
    def nbytes(self) -> int:
        return sum(encoded.nbytes for _, encoded in self.pieces)
