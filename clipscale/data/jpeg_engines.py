"""A chunk's baseline JPEGs decoded by the GPU's JPEG engines: nvJPEG's batched hardware decode, called directly.

torchvision's batched GPU decode (`decode_jpegs_cuda`) drives the same engines, but beside a
training step's queue it decoded 6,942 images/s against 13,314 alone (H200,
results/bench_jpeg_h200_direct_own_sync.json): its nvJPEG handle allocates with cudaMalloc and
cudaFree, each of which waits for the whole device, and its work runs on a stream of normal
priority. The same call made here, with nvJPEG's device and pinned buffers taken from PyTorch's
caching allocators and its work on the caller's stream of the highest priority, decoded 10,068
a second beside the same queue (13,965 where that queue is not on the legacy default stream).

The library is the libnvjpeg that torchvision itself loaded (bundled with torchvision or from the
nvidia-nvjpeg wheel): nothing more to install. The call is one for the whole chunk and its
arguments are built as tensors, never image by image: the JPEG bytes one pinned buffer with
offsets, each image's size read from its header by the loader's worker (`EncodedImages.frames`),
the outputs one device buffer, each image planar RGB at its start. Only baseline JPEGs in
YCbCr go here (`encoded.ENGINE_FRAMES`); what the engines refuse fails the call, and the caller
then decodes the chunk the other way.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

HARDWARE_BACKEND, OUTPUT_RGB = 3, 3  # nvjpeg.h: NVJPEG_BACKEND_HARDWARE, NVJPEG_OUTPUT_RGB (planar)
ARCH_MISMATCH = 6  # nvjpeg.h: NVJPEG_STATUS_ARCH_MISMATCH, a GPU without JPEG engines
IMAGE_FIELDS = 8  # nvjpegImage_t: 4 channel pointers, then 4 pitches (size_t): int64 [n, 8]

DEV_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
PINNED_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)


class DevAllocator(ctypes.Structure):
    _fields_ = [("dev_malloc", DEV_MALLOC), ("dev_free", FREE)]  # nvjpegDevAllocator_t


class PinnedAllocator(ctypes.Structure):
    _fields_ = [("pinned_malloc", PINNED_MALLOC), ("pinned_free", FREE)]  # nvjpegPinnedAllocator_t


class JpegEnginesError(RuntimeError):
    """nvJPEG refused a call (its status in the message): the chunk is decoded another way."""


def loaded_nvjpeg(device: torch.device) -> str | None:
    """The path of the libnvjpeg that torchvision loads in this process, or None: its image
    extension links it, or (some builds) loads it at its first GPU decode, so one tiny image is
    decoded on `device` when the library is not there yet."""
    from torchvision.io import decode_jpeg, encode_jpeg

    def loaded() -> str | None:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libnvjpeg" in line:
                return line.split()[-1]
        return None

    if loaded() is None:
        decode_jpeg(encode_jpeg(torch.zeros(3, 8, 8, dtype=torch.uint8)), device=device)
    return loaded()


class JpegEngines:
    """One decoding thread's nvJPEG hardware decoder on `device`, decoding on `stream` (a handle
    and its state: nvJPEG's states are one a thread). `open` gives None where there are no JPEG
    engines or no libnvjpeg.

    nvJPEG's buffers come from PyTorch's caching allocators (cudaMalloc and cudaFree would wait
    for the whole device), always for `stream`, and what nvJPEG frees goes back to them only
    once `stream` has passed the call that freed it: work queued before the free may still use it."""

    call_lock = threading.Lock()  # the engines' calls one at a time in a process, as torchvision's are

    def __init__(self, lib: ctypes.CDLL, device: torch.device, stream: torch.cuda.Stream):
        self.lib, self.device, self.stream = lib, device, stream
        self.pinned: dict[int, torch.Tensor] = {}  # nvJPEG's pinned buffers, alive until it frees them
        self.freed: list = []  # device addresses and pinned buffers nvJPEG freed during the current call
        self.retired: list[tuple[torch.cuda.Event, list]] = []  # ... and after which event they may be reused
        # The callbacks and their structs live as long as the handle that calls them.
        self.allocators = (DevAllocator(DEV_MALLOC(self._dev_malloc), FREE(self._dev_free)),
                           PinnedAllocator(PINNED_MALLOC(self._pinned_malloc), FREE(self._pinned_free)))
        self.handle, self.state = ctypes.c_void_p(), ctypes.c_void_p()
        self.batch = 0  # the batch size the state is initialized for
        status = lib.nvjpegCreateEx(HARDWARE_BACKEND, ctypes.byref(self.allocators[0]), ctypes.byref(self.allocators[1]),
                                    0, ctypes.byref(self.handle))
        if status == ARCH_MISMATCH:
            raise JpegEnginesError("this GPU has no JPEG engines")
        self._check(status, "nvjpegCreateEx")
        self._check(lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "nvjpegJpegStateCreate")

    @classmethod
    def open(cls, device: torch.device, stream: torch.cuda.Stream) -> "JpegEngines | None":
        path = loaded_nvjpeg(device) if device.type == "cuda" else None
        if path is None:
            return None
        try:
            return cls(ctypes.CDLL(path), device, stream)
        except (OSError, AttributeError, JpegEnginesError):  # an old libnvjpeg, or a GPU without engines
            return None

    def decode(self, spans: list[torch.Tensor], starts: torch.Tensor, lengths: torch.Tensor,
               sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """JPEGs at `starts` (int64 [n]) of `lengths` bytes in the host bytes `spans` laid end to
        end, of `sizes[k]` = (height, width), decoded on the engines' stream: (uint8 on the device,
        the images one after another, each [3, height, width]; int64 [n + 1], where each starts).
        The bytes are first copied into one pinned buffer (the engines' copies then overlap),
        kept until the stream has read it. Raises JpegEnginesError where nvJPEG refuses the batch."""
        self._release_passed()
        data = torch.empty(sum(len(span) for span in spans), dtype=torch.uint8, pin_memory=True)
        torch.cat(spans, out=data)
        n = len(sizes)
        heights, widths = sizes[:, 0], sizes[:, 1]
        plane = heights * widths
        image_starts = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(3 * plane, 0, out=image_starts[1:])
        with torch.cuda.stream(self.stream):
            out = torch.empty(int(image_starts[-1]), dtype=torch.uint8, device=self.device)
        images = torch.zeros(n, IMAGE_FIELDS, dtype=torch.int64)  # nvjpegImage_t [n]
        images[:, 0:3] = out.data_ptr() + image_starts[:-1, None] + plane[:, None] * torch.arange(3)
        images[:, 4:7] = widths[:, None]  # each plane's pitch
        pointers = data.data_ptr() + starts  # const unsigned char* [n]
        try:
            with self.call_lock:
                if self.batch != n:
                    self.batch = 0
                    self._check(self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, n, 1, OUTPUT_RGB),
                                "nvjpegDecodeBatchedInitialize")
                    self.batch = n
                self._check(self.lib.nvjpegDecodeBatched(self.handle, self.state, _address(pointers), _address(lengths),
                                                         _address(images), ctypes.c_void_p(self.stream.cuda_stream)),
                            "nvjpegDecodeBatched")
        finally:
            self.retired.append((self.stream.record_event(), [*self.freed, data]))
            self.freed = []
        return out, image_starts

    def _release_passed(self) -> None:
        """Give back to PyTorch what nvJPEG freed during calls the stream has passed."""
        while self.retired and self.retired[0][0].query():
            for buffer in self.retired.pop(0)[1]:
                if isinstance(buffer, int):
                    torch.cuda.caching_allocator_delete(buffer)

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise JpegEnginesError(f"{call} failed with nvjpegStatus {status}")

    def _dev_malloc(self, where, size: int) -> int:
        where[0] = torch.cuda.caching_allocator_alloc(max(size, 1), self.device.index or 0, self.stream)
        return 0

    def _dev_free(self, address) -> int:
        if address:
            self.freed.append(address)
        return 0

    def _pinned_malloc(self, where, size: int, flags: int) -> int:
        buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)
        self.pinned[buffer.data_ptr()] = buffer
        where[0] = buffer.data_ptr()
        return 0

    def _pinned_free(self, address) -> int:
        if address in self.pinned:
            self.freed.append(self.pinned.pop(address))
        return 0


def _address(table: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(table.data_ptr())
