"""JPEG decoding on the training device (`data.decoder: device`): the loader reads, the GPU decodes.

With loader decoding, a worker spends most of a sample's time in libjpeg and PIL's resize;
at ViT-B/32's pace 14 workers cannot keep one H100 busy. With device decoding the workers
only read the shards, parse each JPEG's header to draw its crop (the same draw, from the
same per-sample seed, as loader decoding), and tokenize. The host keeps the batch as the
shards' bytes (`EncodedImages`, about a tenth of its uint8 pixels), so every batch is
offloaded. Gradient Cache's first pass decodes each chunk on the device: one batched call
to the GPU's hardware JPEG engines (`JpegEngines`, nvImageCodec) or to nvJPEG on the SMs
(`TorchvisionJpeg`), then every image's crop and resize in one batched pass (`crop_resize`,
within a grey level of torchvision's `resized_crop`). The second pass takes the pixels the
first kept on the device (`batches.stream_chunks`); a chunk the device had no room for is
decoded again, with the same bytes, code and device, so both passes see the same pixels,
which the cached feature gradients need.

A sample that is not a whole JPEG (PNG, WebP, a JPEG with bytes after its end marker) is
decoded by the worker with PIL to judge it, exactly as loader decoding would (an
undecodable one is skipped and counted), and again here with PIL. A whole JPEG is decoded
by the worker at 1/8 scale (`decodes_at_reduced_scale`), which finds damaged data as a full
decode would, so it is skipped and counted too. A JPEG that the device rejects (CMYK,
say) is decoded with PIL. On a CPU device the same code runs
torchvision's CPU decoder: that is how the tests hold it.
"""

from __future__ import annotations

import io
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from clipscale.data.batches import Arrivals, DeviceBudget, DeviceTransform, HostColumn
from clipscale.data.offload import EncodedImages, encoded_rows
from clipscale.data.transforms import SplitTransform

JPEG_START, JPEG_END = b"\xff\xd8\xff", b"\xff\xd9"


def is_whole_jpeg(data) -> bool:
    """A JPEG from its start marker to its end marker (bytes or a uint8 array): what the device
    decodes. A cut-short file lacks the end marker; the worker then decodes it itself, to skip
    and count it."""
    return bytes(data[:3]) == JPEG_START and bytes(data[-2:]) == JPEG_END


class TorchvisionJpeg:
    """nvJPEG on the GPU's SMs through torchvision (libjpeg-turbo on a CPU device): batched,
    and image by image when one bad image fails the batch."""

    name = "nvjpeg"

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, blobs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        try:
            return list(self._decode(blobs))
        except RuntimeError:
            return [self._decode_one(blob) for blob in blobs]

    def _decode_one(self, blob: torch.Tensor) -> torch.Tensor | None:
        try:
            return self._decode([blob])[0]
        except RuntimeError:
            return None

    def _decode(self, blobs: list[torch.Tensor]) -> list[torch.Tensor]:
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its image decoders for TorchCodec's
            warnings.simplefilter("ignore", category=DeprecationWarning)
            return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=self.device)


class JpegEngines:
    """The GPU's hardware JPEG decoders (the H100's NVJPG engines) through nvImageCodec's
    `HW_GPU_ONLY` backend: the decode costs the SMs nothing. What the engines do not take
    (progressive or CMYK JPEGs, say) goes to nvJPEG. `nvimgcodec` is the optional package
    `nvidia-nvimgcodec-cu13` (with `nvidia-nvjpeg`); `create` says why it cannot be used."""

    name = "nvimgcodec"

    def __init__(self, device: torch.device, nvimgcodec):
        self.device = device
        self.nvimgcodec = nvimgcodec
        self.decoder = nvimgcodec.Decoder(device_id=device.index or 0,
                                          backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
        self.params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB, sample_format=nvimgcodec.P_RGB)
        self.fallback = TorchvisionJpeg(device)

    @classmethod
    def create(cls, device: torch.device) -> tuple["JpegEngines | None", str]:
        """The engines' decoder, or None and the reason it cannot run here."""
        if device.type != "cuda":
            return None, "no GPU"
        try:
            from nvidia import nvimgcodec
        except ImportError:
            return None, "nvImageCodec is not installed (pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg)"
        try:
            engines = cls(device, nvimgcodec)
            probe = engines.decoder.decode([nvimgcodec.CodeStream(TINY_JPEG)], params=engines.params)
        except Exception as error:  # noqa: BLE001 - any failure to start means: not on this machine
            return None, f"nvImageCodec's hardware decoder did not start ({error})"
        if probe[0] is None:
            return None, "this GPU has no hardware JPEG decoder nvImageCodec can use"
        return engines, ""

    def __call__(self, blobs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        streams = [self.nvimgcodec.CodeStream(blob.numpy()) for blob in blobs]
        images = self.decoder.decode(streams, params=self.params, cuda_stream=stream)
        decoded = [None if image is None else torch.as_tensor(image, device=self.device) for image in images]
        refused = [k for k, image in enumerate(decoded) if image is None]
        if refused:
            for k, image in zip(refused, self.fallback([blobs[k] for k in refused])):
                decoded[k] = image
        return decoded


def _tiny_jpeg() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 60, 30)).save(buffer, format="JPEG")
    return buffer.getvalue()


TINY_JPEG = _tiny_jpeg()


def decodes_at_reduced_scale(img) -> None:
    """Decode a JPEG's entropy-coded data at 1/8 scale (libjpeg's DCT scaling: a fraction of a
    full decode), raising what a full decode would raise: the worker's check that the device
    will be able to decode what it keeps, so an undecodable image is skipped and counted there."""
    img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
    img.load()


def decode_rows(split: SplitTransform, encoded: EncodedImages, start: int, stop: int,
                device: torch.device, jpeg: Callable[[list[torch.Tensor]], list] | None = None) -> torch.Tensor:
    """encoded[start:stop] decoded, cropped and resized on `device`: uint8 [n, 3, H, W].
    `jpeg`: the JPEG decoder (`JpegEngines`, default `TorchvisionJpeg`); what it cannot decode, PIL does."""
    jpeg = jpeg or TorchvisionJpeg(device)
    blobs = [encoded.blob(i) for i in range(start, stop)]
    on_device = [k for k, blob in enumerate(blobs) if is_whole_jpeg(blob.numpy())]
    decoded = {k: image for k, image in zip(on_device, jpeg([blobs[k] for k in on_device])) if image is not None}
    others: dict[int, torch.Tensor] = {}  # not decoded on the device: decoded, cropped and resized by PIL
    for k in range(len(blobs)):
        if k in decoded:
            continue
        try:
            others[k] = split.decode(encoded[start + k]).to(device)
        except (OSError, ValueError, SyntaxError) as error:  # PIL's errors for bytes it cannot decode
            # The worker decoded it at reduced scale (`decodes_at_reduced_scale`), so this is rare: a
            # file that libjpeg decodes at 1/8 scale but not whole. It is in the batch; train it black.
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


def decode_parts(split: SplitTransform, parts: list[tuple[EncodedImages, int, int]], device: torch.device,
                 jpeg: Callable[[list[torch.Tensor]], list] | None = None) -> torch.Tensor:
    """A chunk kept as pieces (`encoded_rows`), decoded in order: uint8 [n, 3, H, W] on `device`."""
    return torch.cat([decode_rows(split, encoded, lo, hi, device, jpeg) for encoded, lo, hi in parts])


class DeviceDecoder:
    """Decodes a batch's chunks on the device ahead of the step, in a thread of its own.

    A decode waits for its own work: issued from the training thread, every chunk's decode
    would stall the model's queue. On a thread with its own CUDA stream it is launched and
    runs while the model computes the previous chunk. `images_decoded` counts every image
    decoded (the tests hold "once per step" with it)."""

    def __init__(self, split: SplitTransform, device: torch.device, jpeg: Callable[[list[torch.Tensor]], list] | None = None):
        self.split, self.device = split, device
        self.jpeg = jpeg or TorchvisionJpeg(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="clipscale-decode")
        self.images_decoded = 0

    def submit(self, parts: Callable[[], list]) -> Future:
        return self.thread.submit(self._decode, parts)

    def _decode(self, parts: Callable[[], list]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            pixels = decode_parts(self.split, parts(), self.device, self.jpeg)
        self.images_decoded += len(pixels)
        return pixels, (self.stream.record_event() if self.stream is not None else None)

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


class DeviceDecodedImages(HostColumn):
    """The images column of a batch decoded on the device (a `HostColumn`, filled by `BatchStream`):
    the host holds each piece's `EncodedImages`. With `ahead` = (chunk size, bytes of an
    image's pixels), each chunk is decoded as soon as its pieces are in, while the budget has
    room: during the previous step, so pass 1 finds it ready. Otherwise a chunk is decoded when
    pass 1 asks for it. Pass 2 takes the pixels pass 1 kept on the device (`stream_chunks`);
    only the chunks the budget had no room for are decoded again."""

    def __init__(self, batch_size: int, arrivals: Arrivals, to_float: DeviceTransform | None, budget: DeviceBudget | None,
                 decoder: DeviceDecoder, ahead: tuple[int, int] | None = None):
        super().__init__(to_float, budget)
        self.batch_size = batch_size
        self.arrivals = arrivals
        self.decoder = decoder
        self.ahead = ahead if budget is not None else None
        self.encoded: list[tuple[int, EncodedImages]] = []  # (first row, the piece's images), in order
        self.decoding: dict[tuple[int, int], tuple[Future, int]] = {}  # chunks decoded ahead: (result, bytes)
        self.rows_ahead = 0  # rows [0, rows_ahead) have been handed to the decoder (ahead, or by pass 1)
        self.rows_in = 0  # rows [0, rows_in) have arrived
        self.released = False
        self.lock = threading.Lock()  # put (the gathering thread) and submit (the step) both move rows_ahead

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        # A private copy: the piece's tensors sit in shared memory, one file descriptor each,
        # and a batch of a million samples would hold thousands of them.
        self.encoded.append((rows.start, piece["encoded"].clone()))
        self.rows_in = rows.stop
        self.decode_ahead()

    def decode_ahead(self) -> None:
        """Hand the decoder every chunk whose pieces are in, while the budget has room; when it
        has none, go on once the step gives some back (the previous batch's pass 2 frees its chunks)."""
        if self.ahead is None or self.released:
            return
        chunk, image_bytes = self.ahead
        with self.lock:
            while self.rows_ahead < self.batch_size:
                start, stop = self.rows_ahead, min(self.rows_ahead + chunk, self.batch_size)
                if stop > self.rows_in:
                    return
                size = (stop - start) * image_bytes
                if not self.budget.take_bytes(size):
                    self.budget.when_freed(self.decode_ahead)
                    return
                parts = encoded_rows(self.encoded, start, stop)
                self.decoding[(start, stop)] = (self.decoder.submit(lambda parts=parts: parts), size)
                self.rows_ahead = stop

    def submit(self, start: int, stop: int, pass_number: int) -> Callable[[], tuple]:
        if pass_number == 1:
            with self.lock:
                ahead = self.decoding.pop((start, stop), None)
                self.rows_ahead = max(self.rows_ahead, stop)  # asked for now: not to be decoded ahead as well
            if ahead is not None:
                self.charged.add((start, stop))
                return ahead[0].result

        def parts() -> list:
            self.arrivals.wait_for(stop)
            return encoded_rows(self.encoded, start, stop)

        return self.decoder.submit(parts).result

    def drop_kept(self) -> None:
        self.released = True  # the step is done with this batch: nothing more is decoded ahead for it
        super().drop_kept()
        for future, size in self.decoding.values():  # decoded ahead for a step that ended early
            future.cancel()
            self.budget.give_back_bytes(size)
        self.decoding.clear()

    @staticmethod
    def to_device(decoded: tuple, device: torch.device, copy_stream) -> torch.Tensor:
        """Already there: the compute stream only waits for the decode stream's work."""
        pixels, done = decoded
        if done is not None:
            compute = torch.cuda.current_stream(device)
            compute.wait_event(done)
            pixels.record_stream(compute)  # made on the decode stream, freed after the compute stream's use
        return pixels
