"""JPEG decoding on the training device (`data.decoder: device`): the loader reads, the device decodes.

`DeviceDecoder` decodes a batch's chunks in a thread and on a CUDA stream of its own, in the
training process's own CUDA context: a whole chunk's JPEGs in one call of nvJPEG (torchvision's
batched decoder: the GPU's hardware JPEG engines for baseline JPEGs, nvJPEG's hybrid decoder
for progressive ones), then all of its crops resized in one pass (`crop_resize`). The images the
device does not take came decoded by the loader's workers (`EncodedImages.pixels`: their crop
regions, resized here with the JPEGs' crops); what nvJPEG still refuses, PIL decodes here, and
what nothing decodes trains as a black image, counted.

The thread shares the training process's interpreter with the threads that launch the model's
kernels, and every tensor call hands the GIL over and waits to get it back: a chunk costs a few
dozen calls, never one per image (bench_contention.py measures it beside the step). On a CPU
device the same code runs torchvision's CPU decoder image by image: that is how the tests hold it.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from clipscale.caption_length import to_device_async  # a copy that never waits for the step's queued work
from clipscale.data.chunks import Arrivals, ChunkSource, DeviceTransform, KeepBudget
from clipscale.data.encoded import EncodedBatch, EncodedImages
from clipscale.data.transforms import SplitTransform


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
    uint8 [3, h, w] in `pixels` (flat), cropped to the whole of itself."""

    def __init__(self, encoded: EncodedImages, which: slice, device: torch.device):
        span, self.starts, self.sizes = encoded.worker_span(which)
        self.pixels = to_device_async(span, device)
        self.boxes = torch.cat([torch.zeros_like(self.sizes), self.sizes], 1)

    def table(self) -> torch.Tensor:
        """int64 [m, 3]: each region's address, height and width (`crop_resize.image_table`'s columns)."""
        return torch.cat([(self.pixels.data_ptr() + self.starts)[:, None], self.sizes], 1)

    def images(self) -> list[torch.Tensor]:
        """Each region as a tensor of its own (a view): for the image-by-image resize only."""
        lengths = (3 * self.sizes.prod(1)).tolist()
        return [image.view(3, h, w) for image, (h, w) in zip(self.pixels.split(lengths), self.sizes.tolist())]


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

        images, where = crop_resize.image_table(images)
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
                   device_transform: DeviceTransform | None, budget: KeepBudget | None) -> ChunkSource:
    """A batch's images column over `rows` the decoder's threads decode; its chunks of
    `chunk_size` decoded ahead when the budget and the transform allow (a single random resized
    crop: every image's pixels are the same size)."""
    images = ChunkSource(rows, device_transform, budget)
    crop = split.only_random_resized_crop()
    if budget is not None and chunk_size is not None and crop is not None:
        images.prepare_ahead(chunk_size, 3 * crop.size[0] * crop.size[1], arrivals)
    return images


# Decoding threads, each with a CUDA stream: nvJPEG's batched decoder is one per process (torchvision
# holds a lock around it), so a second thread only overlaps one chunk's host calls with another's decode.
DECODE_THREADS = 2


class DeviceDecoder:
    """Decodes a batch's chunks on the device in `threads` threads of its own.

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
                 threads: int = DECODE_THREADS):
        self.split, self.device, self.chunk_size = split, device, chunk_size
        self.own = threading.local()  # each thread's CUDA stream
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

    def submit(self, encoded: EncodedBatch, arrivals: Arrivals, start: int, stop: int,
               counted: "DeviceDecodedRows | None" = None) -> "DecodedChunk":
        """Rows [start, stop) decoded once they have arrived; the images trained black are added to
        `counted`'s count (their first decode's, not a second's)."""
        return DecodedChunk(self.thread.submit(self._decode, encoded, arrivals, start, stop, counted))

    def _decode(self, encoded: EncodedBatch, arrivals: Arrivals, start: int, stop: int, counted: "DeviceDecodedRows | None"
                ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        arrivals.wait_for(stop)
        if not hasattr(self.own, "stream"):  # this thread's first chunk
            # The highest priority: the crop's kernels take SMs as the step's kernels free them.
            self.own.stream = torch.cuda.Stream(self.device, priority=-100) if self.device.type == "cuda" else None
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
        self.trained_black = 0  # images of the batch nothing decoded, trained black (at their first decode)

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        self.encoded.add(rows.start, piece["encoded"])

    def prepare(self, start: int, stop: int, pass_number: int) -> DecodedChunk:
        return self.decoder.submit(self.encoded, self.arrivals, start, stop, counted=self if pass_number == 1 else None)

    def release(self) -> None:
        """Nothing is held elsewhere: the bytes are this process's, dropped with the batch."""
