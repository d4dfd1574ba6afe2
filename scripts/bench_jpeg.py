"""The GPU's JPEG decoders on a shard's own images, alone: how fast each decodes a chunk, which images
it refuses, and how much of the GIL its calls take from a Python thread beside it.

A component benchmark for choosing the chunk decoder (docs/architecture.md): the JPEG bytes are
read from the shards into memory first. Decoders:

  torchvision   torchvision.io.decode_jpeg(list, device="cuda"): one call a chunk (nvJPEG; baseline
                JPEGs batched on the hardware engines where the GPU has them)
  torchvision_pinned
                the same with the JPEG bytes in pinned host memory (as the trainer's batch holds them)
  nvimgcodec    nvImageCodec's HW_GPU_ONLY backend, one `decode` a chunk of CodeStreams
  nvjpeg_direct, nvjpeg_direct_urgent
                nvJPEG's batched hardware decode called through ctypes (the libnvjpeg that
                torchvision ships) into one chunk-sized buffer, on a stream of ours of normal or
                of the highest priority: an experiment, not yet in the trainer. Only the JPEGs
                the hardware takes (nvjpegDecodeBatchedSupported) are timed; the rest are counted
  nvjpeg_direct_urgent_pinned
                the same with the JPEG bytes in pinned host memory (as the trainer's chunk has them)
  nvjpeg_direct_urgent[_pinned]_torch_allocators
                the same with nvJPEG's device and pinned buffers from PyTorch's caching allocators

For each: images/s over --repeats chunks, the calling thread's CPU milliseconds an image
(`host_cpu_ms_per_image`), the images it returned None for or failed on,
`python_share`: a pure-Python loop's iterations in the main thread while the decoder runs in a
second thread, over the same loop's iterations alone (1.0: the decoder never holds the GIL), and
`beside_matmuls_images_per_s`: its rate while the main thread keeps the GPU's SMs busy with bf16
matrix products (what a training step does to it), its calls on a stream of normal priority and
(nvimgcodec, which takes the caller's stream) of high priority.

    python scripts/bench_jpeg.py --shards '/tmp/shards-img/synthetic-{0000..0007}.tar' --out /tmp/jpeg.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import webdataset as wds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from clipscale.provenance import provenance  # noqa: E402


def shard_jpegs(pattern: str, count: int) -> list[bytes]:
    jpegs = []
    for sample in wds.WebDataset(pattern, shardshuffle=False):
        jpegs.append(sample["jpg"])
        if len(jpegs) == count:
            break
    return jpegs


def torchvision_decoder(device: torch.device):
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(blobs: list[torch.Tensor]) -> list:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)

    return decode


def nvimgcodec_decoder(device: torch.device, stream: torch.cuda.Stream | None = None):
    from nvidia import nvimgcodec

    decoder = nvimgcodec.Decoder(device_id=device.index or 0, backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
    params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB, sample_format=nvimgcodec.P_RGB)

    def decode(blobs: list[torch.Tensor]) -> list:
        images = decoder.decode([nvimgcodec.CodeStream(blob.numpy()) for blob in blobs], params=params,
                                cuda_stream=(stream or torch.cuda.current_stream(device)).cuda_stream)
        return [None if image is None else torch.from_dlpack(image) for image in images]

    return decode


def loaded_nvjpeg(device: torch.device) -> str:
    """The libnvjpeg torchvision itself loads (bundled in torchvision.libs or from the nvidia-nvjpeg
    wheel, depending on the build): decode one image through it, then read the process's maps."""
    from torchvision.io import decode_jpeg, encode_jpeg

    decode_jpeg(encode_jpeg(torch.zeros(3, 16, 16, dtype=torch.uint8)), device=device)
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libnvjpeg" in line:
            return line.split()[-1]
    raise RuntimeError("torchvision's GPU decode loaded no libnvjpeg")


class NvjpegImage(ctypes.Structure):
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]  # nvjpeg.h's nvjpegImage_t


DEV_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
DEV_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
PINNED_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)


class DevAllocator(ctypes.Structure):
    _fields_ = [("dev_malloc", DEV_MALLOC), ("dev_free", DEV_FREE)]  # nvjpegDevAllocator_t


class PinnedAllocator(ctypes.Structure):
    _fields_ = [("pinned_malloc", PINNED_MALLOC), ("pinned_free", DEV_FREE)]  # nvjpegPinnedAllocator_t


def torch_allocators(device: torch.device) -> tuple:
    """nvJPEG's device and pinned buffers from PyTorch's caching allocators, so that nvJPEG never
    calls cudaMalloc/cudaFree or cudaHostAlloc/cudaFreeHost (each waits for the whole device)."""
    pinned: dict[int, torch.Tensor] = {}

    def dev_malloc(where, size):
        where[0] = torch.cuda.caching_allocator_alloc(max(size, 1), device.index or 0)
        return 0

    def dev_free(address):
        torch.cuda.caching_allocator_delete(address) if address else None
        return 0

    def pinned_malloc(where, size, flags):
        buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)
        pinned[buffer.data_ptr()] = buffer
        where[0] = buffer.data_ptr()
        return 0

    def pinned_free(address):
        pinned.pop(address, None)
        return 0

    return (DevAllocator(DEV_MALLOC(dev_malloc), DEV_FREE(dev_free)),
            PinnedAllocator(PINNED_MALLOC(pinned_malloc), DEV_FREE(pinned_free)))


def nvjpeg_direct_decoder(device: torch.device, priority: int, allocators: str = "nvjpeg"):
    """nvJPEG's batched hardware decode (NVJPEG_BACKEND_HARDWARE) through ctypes, on a stream of
    `priority` (negative: higher), its buffers from nvJPEG's own allocators or (`allocators="torch"`)
    PyTorch's. Returns decode(blobs) -> list of uint8 [3, H, W] views of one buffer, None for the
    JPEGs the hardware does not take (judged once a blob, by nvJPEG itself)."""
    lib = ctypes.CDLL(loaded_nvjpeg(device))

    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with nvjpegStatus {status}")

    handle, state, parsed = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    kept = torch_allocators(device) if allocators == "torch" else (None, None)  # alive as long as the handle
    check(lib.nvjpegCreateEx(3, *(ctypes.byref(a) if a else None for a in kept), 0, ctypes.byref(handle)),
          "nvjpegCreateEx(HARDWARE)")
    check(lib.nvjpegJpegStateCreate(handle, ctypes.byref(state)), "nvjpegJpegStateCreate")
    check(lib.nvjpegJpegStreamCreate(handle, ctypes.byref(parsed)), "nvjpegJpegStreamCreate")
    stream = torch.cuda.Stream(device, priority=priority)
    judged: dict[int, tuple | None] = {}  # blob address -> (height, width) where the hardware takes it
    batch = [0]

    def judge(blob: torch.Tensor) -> tuple | None:
        from clipscale.data.decoders import jpeg_frame

        data = blob.numpy().tobytes()
        check(lib.nvjpegJpegStreamParseHeader(handle, data, ctypes.c_size_t(len(data)), parsed), "ParseHeader")
        supported = ctypes.c_int(-1)
        check(lib.nvjpegDecodeBatchedSupported(handle, parsed, ctypes.byref(supported)), "DecodeBatchedSupported")
        frame = jpeg_frame(data)
        return (frame.height, frame.width) if supported.value == 0 and frame is not None else None

    def decode(blobs: list[torch.Tensor]) -> list:
        sizes = [judged.setdefault(blob.data_ptr(), judge(blob)) for blob in blobs]
        taken = [k for k, size in enumerate(sizes) if size is not None]
        if not taken:
            return [None] * len(blobs)
        starts = [0]
        for k in taken:
            starts.append(starts[-1] + 3 * sizes[k][0] * sizes[k][1])
        with torch.cuda.stream(stream):
            out = torch.empty(starts[-1], dtype=torch.uint8, device=device)
        images = (NvjpegImage * len(taken))()
        for image, k, start in zip(images, taken, starts):
            height, width = sizes[k]
            for c in range(3):
                image.channel[c] = out.data_ptr() + start + c * height * width
                image.pitch[c] = width
        data = (ctypes.c_void_p * len(taken))(*[blobs[k].data_ptr() for k in taken])
        lengths = (ctypes.c_size_t * len(taken))(*[blobs[k].numel() for k in taken])
        if batch[0] != len(taken):
            check(lib.nvjpegDecodeBatchedInitialize(handle, state, len(taken), 1, 3), "DecodeBatchedInitialize(RGB)")
            batch[0] = len(taken)
        decode.allocators = kept
        check(lib.nvjpegDecodeBatched(handle, state, data, lengths, images, ctypes.c_void_p(stream.cuda_stream)),
              "nvjpegDecodeBatched")
        torch.cuda.current_stream(device).wait_stream(stream)
        decoded: list = [None] * len(blobs)
        for k, start in zip(taken, starts):
            height, width = sizes[k]
            decoded[k] = out[start : start + 3 * height * width].view(3, height, width)
        return decoded

    return decode


def refused(decode, blobs: list[torch.Tensor]) -> dict:
    """Which images the decoder gives no image for, one at a time."""
    nothing, failed = [], []
    for k, blob in enumerate(blobs):
        try:
            if decode([blob])[0] is None:
                nothing.append(k)
        except Exception as error:  # noqa: BLE001 - recorded, the benchmark goes on
            failed.append((k, repr(error)[:200]))
    return {"none": len(nothing), "failed": len(failed), "first_failures": failed[:3]}


def rate_beside_matmuls(decode, blobs: list[torch.Tensor], device: torch.device, repeats: int,
                        small_kernels: bool = False, side_stream: bool = False) -> float:
    """Images/s of `decode` in a thread while this one queues bf16 matrix products without pause,
    or (`small_kernels`) a stream of short kernels that each fill every SM, queued far ahead as a
    training step's CUDA graphs queue them; on the default (legacy) stream, or (`side_stream`) on
    a stream of PyTorch's pool, which does not synchronize with the legacy stream."""
    if side_stream:
        with torch.cuda.stream(torch.cuda.Stream(device)):
            return rate_beside_matmuls(decode, blobs, device, repeats, small_kernels)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    done, rates = threading.Event(), []

    def decode_loop() -> None:
        # Waits for its own images only, as the trainer's decoding thread does: a device-wide
        # synchronize here would wait for the main thread's queue too, and time that instead.
        torch.cuda.set_device(device)
        own = torch.cuda.Stream(device)
        started = time.perf_counter()
        with torch.cuda.stream(own):
            for _ in range(repeats):
                decode(blobs)
                own.synchronize()
        rates.append(repeats * len(blobs) / (time.perf_counter() - started))
        done.set()

    thread = threading.Thread(target=decode_loop, daemon=True)
    thread.start()
    while not done.is_set():
        if small_kernels:
            for _ in range(200):
                a.mul_(1.0001)
            torch.cuda.current_stream(device).synchronize() if done.is_set() else None
            continue
        for _ in range(4):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.current_stream(device).synchronize()
    thread.join()
    return rates[0]


def python_rate(seconds: float) -> float:
    count, stop = 0, time.perf_counter() + seconds
    while time.perf_counter() < stop:
        for _ in range(1000):
            count += 1
    return count / seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--decoders", default="torchvision,nvjpeg_direct,nvjpeg_direct_urgent,nvjpeg_direct_urgent_pinned")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    jpegs = shard_jpegs(args.shards, args.chunk)
    blobs = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
    record = {**provenance(argv), "chunk": len(blobs), "mean_jpeg_bytes": sum(map(len, jpegs)) / len(jpegs),
              "python_alone_per_s": python_rate(3.0), "decoders": []}
    for name in args.decoders.split(","):
        try:
            decode = {"torchvision": torchvision_decoder, "torchvision_pinned": torchvision_decoder, "nvimgcodec": nvimgcodec_decoder,
                      "nvjpeg_direct": lambda d: nvjpeg_direct_decoder(d, 0),
                      "nvjpeg_direct_urgent": lambda d: nvjpeg_direct_decoder(d, -100),
                      "nvjpeg_direct_urgent_pinned": lambda d: nvjpeg_direct_decoder(d, -100),
                      "nvjpeg_direct_urgent_torch_allocators": lambda d: nvjpeg_direct_decoder(d, -100, "torch"),
                      "nvjpeg_direct_urgent_pinned_torch_allocators": lambda d: nvjpeg_direct_decoder(d, -100, "torch"),
                      }[name](device)
        except Exception as error:  # noqa: BLE001
            record["decoders"].append({"decoder": name, "error": repr(error)})
            continue
        result = {"decoder": name, "refused": refused(decode, blobs)}
        usable = [blob.pin_memory() for blob in blobs] if "_pinned" in name else blobs
        try:
            decode(usable)
        except Exception as error:  # noqa: BLE001 - a batch with one bad image fails whole: say so
            result["batch_error"] = repr(error)[:300]
            record["decoders"].append(result)
            continue
        if name != "torchvision":  # the same pixels as torchvision's nvJPEG call gives?
            ours, theirs = decode(usable[:64]), torchvision_decoder(device)(usable[:64])
            result["max_abs_diff_vs_torchvision"] = max(
                (a.int() - b.int()).abs().max().item() for a, b in zip(ours, theirs) if a is not None)
        torch.cuda.synchronize()
        started, cpu_started = time.perf_counter(), time.thread_time()
        for _ in range(args.repeats):
            decode(usable)
        torch.cuda.synchronize()
        result["images_per_s"] = args.repeats * len(usable) / (time.perf_counter() - started)
        # The calling thread's CPU time: what a decode takes from the training process's cores (a
        # host-side Huffman pass, per-image calls), beside the time it waits for the device.
        result["host_cpu_ms_per_image"] = (time.thread_time() - cpu_started) * 1e3 / (args.repeats * len(usable))
        stopping = threading.Event()

        def loop() -> None:
            torch.cuda.set_device(device)
            while not stopping.is_set():
                decode(usable)
                torch.cuda.synchronize()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(0.5)
        result["python_share"] = python_rate(3.0) / record["python_alone_per_s"]
        stopping.set()
        thread.join()
        result["beside_matmuls_images_per_s"] = rate_beside_matmuls(decode, usable, device, max(2, args.repeats // 4))
        result["beside_small_kernels_images_per_s"] = rate_beside_matmuls(decode, usable, device, max(2, args.repeats // 4),
                                                                          small_kernels=True)
        result["beside_small_kernels_side_stream_images_per_s"] = rate_beside_matmuls(
            decode, usable, device, max(2, args.repeats // 4), small_kernels=True, side_stream=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            decode(usable)
            torch.cuda.synchronize()
        kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        names: dict[str, int] = {}
        for event in kernels:
            names[event.name[:60]] = names.get(event.name[:60], 0) + 1
        result["device_events_a_chunk"] = len(kernels)
        result["device_events_by_name"] = dict(sorted(names.items(), key=lambda kv: -kv[1])[:8])
        if name == "nvimgcodec":
            urgent = torch.cuda.Stream(device, priority=-100)  # mapped to the highest priority the GPU has
            result["beside_matmuls_high_priority_images_per_s"] = rate_beside_matmuls(
                nvimgcodec_decoder(device, urgent), usable, device, max(2, args.repeats // 4))
        record["decoders"].append(result)
        print(json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
