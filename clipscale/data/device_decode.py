"""JPEG decoding on the training device (`data.decoder: device`): the loader reads, the GPU decodes.

With loader decoding, a worker spends most of a sample's time in libjpeg and PIL's resize;
at ViT-B/32's pace 14 workers cannot keep one H100 busy. With device decoding the workers
only read the shards, parse each JPEG's header to draw its crop (the same draw, from the
same per-sample seed, as loader decoding), and tokenize. The host keeps the batch as the
shards' bytes (`EncodedImages`, about a tenth of its uint8 pixels), so every batch is
offloaded. Each Gradient Cache pass decodes its chunk on the device: one batched nvJPEG
call (torchvision's `decode_jpeg`), then every image's crop and resize in one batched pass
(`crop_resize`, within a grey level of torchvision's `resized_crop`). Both passes decode the
same bytes with the same code on the same device, so they see the same pixels, which the
cached feature gradients need.

A sample that is not a whole JPEG (PNG, WebP, a JPEG with bytes after its end marker) is
decoded by the worker with PIL to judge it, exactly as loader decoding would (an
undecodable one is skipped and counted), and again here with PIL. A JPEG that nvJPEG
rejects (CMYK, say) is decoded with PIL too. On a CPU device the same code runs
torchvision's CPU decoder: that is how the tests hold it.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from clipscale.data.batches import Arrivals, DeviceTransform, identity
from clipscale.data.offload import EncodedImages, encoded_rows
from clipscale.data.transforms import SplitTransform

JPEG_START, JPEG_END = b"\xff\xd8\xff", b"\xff\xd9"


def is_whole_jpeg(data) -> bool:
    """A JPEG from its start marker to its end marker (bytes or a uint8 array): what the device
    decodes. A cut-short file lacks the end marker; the worker then decodes it itself, to skip
    and count it."""
    return bytes(data[:3]) == JPEG_START and bytes(data[-2:]) == JPEG_END


def _decode_jpegs(blobs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its image decoders for TorchCodec's
        warnings.simplefilter("ignore", category=DeprecationWarning)
        return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)


def decode_rows(split: SplitTransform, encoded: EncodedImages, start: int, stop: int,
                device: torch.device) -> torch.Tensor:
    """encoded[start:stop] decoded, cropped and resized on `device`: uint8 [n, 3, H, W]."""
    blobs = [encoded.blob(i) for i in range(start, stop)]
    on_device = [k for k, blob in enumerate(blobs) if is_whole_jpeg(blob.numpy())]
    decoded: dict[int, torch.Tensor] = {}
    try:
        decoded.update(zip(on_device, _decode_jpegs([blobs[k] for k in on_device], device)))
    except RuntimeError:  # one bad image fails the batched call: find it one by one
        for k in on_device:
            try:
                decoded[k] = _decode_jpegs([blobs[k]], device)[0]
            except RuntimeError:
                pass
    others: dict[int, torch.Tensor] = {}  # not decoded by nvJPEG: decoded, cropped and resized by PIL
    for k in range(len(blobs)):
        if k in decoded:
            continue
        try:
            others[k] = split.decode(encoded[start + k]).to(device)
        except Exception as error:  # noqa: BLE001 - a damaged image must not end the run
            # Its header parsed in the worker, so it is in the batch; its data does not decode.
            # Loader decoding would have skipped it: data.decoder=loader for shards with many.
            warnings.warn(f"an image of this batch does not decode ({error!r}); it is trained as a black image")
            black = torch.zeros(3, 1, 1, dtype=torch.uint8, device=device)  # its crop box pads it to size
            others[k] = split.apply_to_tensor(black, encoded.params_of(start + k))
    order = sorted(decoded)
    if not order:
        return torch.stack([others[k] for k in range(len(blobs))])
    cropped = resized_crops(split, [decoded[k] for k in order], [encoded.params_of(start + k) for k in order], device)
    if not others:
        return cropped
    rows = {**dict(zip(order, cropped.unbind())), **others}
    return torch.stack([rows[k] for k in range(len(blobs))])


def resized_crops(split: SplitTransform, images: list[torch.Tensor], boxes: list[tuple], device: torch.device) -> torch.Tensor:
    """Decoded images cropped and resized by `split`'s PIL steps: uint8 [n, 3, H, W]. On a GPU
    (or under Triton's interpreter) one batched pass for the whole list (`crop_resize`) when the
    steps are a single RandomResizedCrop it can run; torchvision's kernels image by image otherwise."""
    crop = split.only_random_resized_crop()
    if crop is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        from clipscale.data import crop_resize  # Triton: imported where it runs

        return crop_resize.resized_crops(images, boxes, tuple(crop.size), crop.interpolation.value)
    return torch.stack([split.apply_to_tensor(img, box) for img, box in zip(images, boxes)])


def decode_parts(split: SplitTransform, parts: list[tuple[EncodedImages, int, int]], device: torch.device) -> torch.Tensor:
    """A chunk kept as pieces (`encoded_rows`), decoded in order: uint8 [n, 3, H, W] on `device`."""
    return torch.cat([decode_rows(split, encoded, lo, hi, device) for encoded, lo, hi in parts])


class DeviceDecoder:
    """Decodes a batch's chunks on the device ahead of the step, in a thread of its own.

    nvJPEG waits for its own work: issued from the training thread, every chunk's decode would
    stall the model's queue. On a thread with its own CUDA stream it is launched and runs
    while the model computes the previous chunk."""

    def __init__(self, split: SplitTransform, device: torch.device):
        self.split, self.device = split, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="clipscale-decode")

    def submit(self, parts: Callable[[], list]) -> Future:
        return self.thread.submit(self._decode, parts)

    def _decode(self, parts: Callable[[], list]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            pixels = decode_parts(self.split, parts(), self.device)
        return pixels, (self.stream.record_event() if self.stream is not None else None)

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


class DeviceDecodedImages:
    """The images column of a batch decoded on the device (a `HostColumn`, filled by `BatchStream`):
    the host holds each piece's `EncodedImages`; a chunk is decoded once its pieces have
    arrived, as soon as it is submitted."""

    def __init__(self, batch_size: int, arrivals: Arrivals, to_float: DeviceTransform | None, decoder: DeviceDecoder):
        self.batch_size = batch_size
        self.arrivals = arrivals
        self.device_transform = to_float or identity
        self.decoder = decoder
        self.encoded: list[tuple[int, EncodedImages]] = []  # (first row, the piece's images), in order

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        # A private copy: the piece's tensors sit in shared memory, one file descriptor each,
        # and a batch of a million samples would hold thousands of them.
        self.encoded.append((rows.start, piece["encoded"].clone()))

    def submit(self, start: int, stop: int) -> Callable[[], tuple]:
        def parts() -> list:
            self.arrivals.wait_for(stop)
            return encoded_rows(self.encoded, start, stop)

        return self.decoder.submit(parts).result

    @staticmethod
    def to_device(decoded: tuple, device: torch.device, copy_stream) -> torch.Tensor:
        """Already there: the compute stream only waits for the decode stream's work."""
        pixels, done = decoded
        if done is not None:
            compute = torch.cuda.current_stream(device)
            compute.wait_event(done)
            pixels.record_stream(compute)  # made on the decode stream, freed after the compute stream's use
        return pixels
