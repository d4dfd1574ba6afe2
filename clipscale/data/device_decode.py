"""JPEG decoding on the training device (`data.decoder: device`): the loader reads, the GPU decodes.

`DeviceDecoder` decodes a batch's chunks on a thread and CUDA stream of its own, with the GPU's
hardware JPEG engines (`JpegEngines`, nvImageCodec) or nvJPEG on the SMs (`TorchvisionJpeg`),
then crops and resizes a whole chunk at once (`crop_resize`); what they refuse, PIL decodes.
`DeviceDecodedRows` are the images column's rows: the pieces' JPEG bytes, decoded chunk by chunk.
On a CPU device the same code runs torchvision's CPU decoder: that is how the tests hold it.
"""

from __future__ import annotations

import io
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from clipscale.console import native_noise_filtered
from clipscale.data.chunks import Arrivals, ChunkSource, DeviceTransform, KeepBudget
from clipscale.data.encoded import EncodedBatch, EncodedImages, is_whole_jpeg
from clipscale.data.transforms import SplitTransform


class TorchvisionJpeg:
    """nvJPEG on the GPU's SMs through torchvision (libjpeg-turbo on a CPU device): batched,
    and image by image when one bad image fails the batch."""

    name = "nvjpeg"

    def __init__(self, device: torch.device):
        self.device = device

    def for_another_thread(self) -> "TorchvisionJpeg":
        return self  # holds nothing a second thread could disturb

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

    def for_another_thread(self) -> "JpegEngines":
        """A decoder of its own for another decoding thread: several feed the engines at once."""
        return type(self)(self.device, self.nvimgcodec)

    @classmethod
    def create(cls, device: torch.device) -> tuple["JpegEngines | None", str]:
        """The engines' decoder, or None and the reason it cannot run here."""
        if device.type != "cuda":
            return None, "no GPU"
        with native_noise_filtered():  # its extensions for formats we never read (nvTIFF) complain at start
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
        # DLPack instead of __cuda_array_interface__: measured no cheaper in GIL time (torch's from_dlpack is Python
        # per image too; bench_contention's GIL samples), kept because the GPU decode tests ran on it
        decoded = [None if image is None else torch.from_dlpack(image) for image in images]
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


def decode_rows(split: SplitTransform, encoded: EncodedImages, start: int, stop: int,
                device: torch.device, jpeg: Callable[[list[torch.Tensor]], list] | None = None) -> torch.Tensor:
    """encoded[start:stop] decoded, cropped and resized on `device`: uint8 [n, 3, H, W].
    `jpeg`: the JPEG decoder (`JpegEngines`, default `TorchvisionJpeg`); what it cannot decode, PIL does.
    It runs in a thread of the training process, beside the threads that launch the model's
    kernels: the bytes, the JPEG check and the crops are taken for the whole chunk in a few calls."""
    jpeg = jpeg or TorchvisionJpeg(device)
    blobs = encoded.blobs(start, stop)
    whole = encoded.whole_jpegs(start, stop).nonzero().flatten().tolist()
    decoded = {k: image for k, image in zip(whole, jpeg([blobs[k] for k in whole])) if image is not None}
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
    order = list(decoded)  # ascending: the decoder returns the images in the order given
    if not order:
        return torch.stack([others[k] for k in range(len(blobs))])
    boxes = encoded.params[start:stop] if not others else encoded.params[start:stop][order]
    cropped = resized_crops(split, [decoded[k] for k in order], boxes, device)
    if not others:
        return cropped
    rows = {**dict(zip(order, cropped.unbind())), **others}
    return torch.stack([rows[k] for k in range(len(blobs))])


def resized_crops(split: SplitTransform, images: list[torch.Tensor], boxes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Decoded images cropped and resized by `split`'s PIL steps (`boxes`: int64 [n, k], each
    image's drawn crop): uint8 [n, 3, H, W]. On a GPU (or under Triton's interpreter) one batched
    pass for the whole list (`crop_resize`) when the steps are a single RandomResizedCrop it can
    run; torchvision's kernels image by image otherwise."""
    crop = split.only_random_resized_crop()
    if crop is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        from clipscale.data import crop_resize  # Triton: imported where it runs

        return crop_resize.resized_crops(images, boxes, tuple(crop.size), crop.interpolation.value)
    return torch.stack([split.apply_to_tensor(img, tuple(box)) for img, box in zip(images, boxes.tolist())])


def decode_parts(split: SplitTransform, parts: list[tuple[EncodedImages, int, int]], device: torch.device,
                 jpeg: Callable[[list[torch.Tensor]], list] | None = None) -> torch.Tensor:
    """A chunk kept as pieces (`EncodedBatch.rows`), decoded in order: uint8 [n, 3, H, W] on `device`."""
    decoded = [decode_rows(split, encoded, lo, hi, device, jpeg) for encoded, lo, hi in parts]
    return decoded[0] if len(decoded) == 1 else torch.cat(decoded)


def decoded_column(rows, split: SplitTransform, chunk_size: int | None, arrivals: Arrivals,
                   device_transform: DeviceTransform | None, budget: KeepBudget | None) -> ChunkSource:
    """A batch's images column over decoded `rows` (in threads or the decode process); its chunks of
    `chunk_size` decoded ahead when the budget and the transform allow (a single random resized
    crop: every image's pixels are the same size)."""
    images = ChunkSource(rows, device_transform, budget)
    crop = split.only_random_resized_crop()
    if budget is not None and chunk_size is not None and crop is not None:
        images.prepare_ahead(chunk_size, 3 * crop.size[0] * crop.size[1], arrivals)
    return images


# Decoding threads: two keep the H100's JPEG engines fed while the model computes (one fed them
# at 4,600 images/s beside training, the engines alone decode 13,700/s); each holds a decoder and
# a CUDA stream. Not yet measured beside training at 2 or more.
DECODE_THREADS = 2


class DeviceDecoder:
    """Decodes a batch's chunks on the device in `threads` threads of its own.

    A decode waits for its own work: issued from the training thread, every chunk's decode
    would stall the model's queue. On threads each with its own CUDA stream and decoder, chunks
    are launched and decoded while the model computes the previous ones: pass 2 asks for its
    chunks `LOOKAHEAD` ahead, so an image decoded again costs no step time while the threads
    outpace the step. With a keep budget, each chunk of `chunk_size` is decoded as soon as its
    pieces are in and the budget has room: during the previous step, so pass 1 finds it ready
    (`ChunkSource.prepare_ahead`). `images_decoded` counts every image decoded (the tests hold
    "once per step" and "at most twice" with it)."""

    def __init__(self, split: SplitTransform, device: torch.device, jpeg=None, chunk_size: int | None = None,
                 threads: int = DECODE_THREADS):
        self.split, self.device, self.chunk_size = split, device, chunk_size
        self.jpeg = jpeg or TorchvisionJpeg(device)
        self.own = threading.local()  # each thread's CUDA stream and decoder
        self.thread = ThreadPoolExecutor(threads, thread_name_prefix="clipscale-decode",
                                         initializer=torch.cuda.set_device if device.type == "cuda" else None,
                                         initargs=(device,) if device.type == "cuda" else ())
        self.count_lock = threading.Lock()
        self.images_decoded = 0
        self.decode_s = 0.0  # the threads' time in decoding calls, summed (their rows' arrival not counted)

    def column(self, batch_size: int, arrivals: Arrivals, device_transform: DeviceTransform | None,
               budget: KeepBudget | None) -> ChunkSource:
        """A batch's images column, decoded here; its chunks decoded ahead when the budget and the
        transform allow (a single random resized crop: every image's pixels are the same size)."""
        return decoded_column(DeviceDecodedRows(batch_size, arrivals, self), self.split, self.chunk_size, arrivals,
                              device_transform, budget)

    def submit(self, encoded: EncodedBatch, arrivals: Arrivals, start: int, stop: int) -> "DecodedChunk":
        """Rows [start, stop) decoded once they have arrived."""
        return DecodedChunk(self.thread.submit(self._decode, encoded, arrivals, start, stop))

    def _decode(self, encoded: EncodedBatch, arrivals: Arrivals, start: int, stop: int
                ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        arrivals.wait_for(stop)
        if not hasattr(self.own, "jpeg"):  # this thread's first chunk
            self.own.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            with native_noise_filtered():
                self.own.jpeg = self.jpeg.for_another_thread()
        stream = self.own.stream
        started = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            pixels = decode_parts(self.split, encoded.rows(start, stop), self.device, self.own.jpeg)
        with self.count_lock:
            self.images_decoded += len(pixels)
            self.decode_s += time.perf_counter() - started
        return pixels, (stream.record_event() if stream is not None else None)

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


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


class DeviceDecodedRows:
    """The images of a batch that the device decodes: the host holds the pieces' JPEG bytes and
    crops (`EncodedBatch`, about a tenth of their uint8 pixels); every pass decodes what it asks
    for that was not kept."""

    def __init__(self, batch_size: int, arrivals: Arrivals, decoder: DeviceDecoder):
        self.batch_size, self.arrivals, self.decoder = batch_size, arrivals, decoder
        self.encoded = EncodedBatch()

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        self.encoded.add(rows.start, piece["encoded"])

    def prepare(self, start: int, stop: int, pass_number: int) -> DecodedChunk:
        return self.decoder.submit(self.encoded, self.arrivals, start, stop)

    def release(self) -> None:
        """Nothing is held elsewhere: the bytes are this process's, dropped with the batch."""
