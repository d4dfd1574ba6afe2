"""One step under torch.profiler, summed up: where the GPU's time went and where it waited.

`profiled_step` runs a step (the trainer's `train.profile_step`, or bench_e2e's ceiling) under
torch.profiler and returns a small JSON-able account: the GPU's busy share of the step's wall
time, the kernels' time by kind (`kernel_account`), the idle gaps and what the host was doing in
the longest of them (the innermost operations running when each gap began: a wait for data, a
host synchronisation, a Python stretch between launches), and the time of each CUDA stream
(the step's and the decoder's side streams). Optionally the Chrome trace, gzipped, for
chrome://tracing or Perfetto.
"""
from __future__ import annotations

import gzip
import heapq
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

# What kind of work a GPU kernel does, from its name: the first pattern that matches. Order
# matters: cuDNN's convolution kernels say "sgemm" too, Inductor's fused layer norms are reductions.
# cuDNN's attention backward has helpers of its own (`compute_dot_do_o`, `convert_dq_to_16bits`):
# attention, not a convolution.
KERNEL_KINDS = (
    ("attention", r"flash|fmha|sdpa|attention|dot_do_o|convert_dq"),
    ("convolution", r"conv(?!ert)|wgrad|dgrad"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|matmul|cublas"),
    ("loss (Inf-CL kernels)", r"^(lse_fwd|merge|weights|rowdot)_kernel"),
    ("crop and resize", r"^(rows|columns)_kernel"),
    ("JPEG decoding (nvJPEG)", r"nvjpeg|jpeg|idct|huffman|color_?conv|yuv"),
    ("optimizer", r"multi_tensor|adam"),
    ("layer norm", r"layer_norm|layernorm"),
    ("pointwise (Inductor: GELU, residuals, casts)", r"^triton_poi"),
    ("reductions (Inductor)", r"^triton_(red|per)"),
    ("copies and fills", r"memcpy|memset|copy|CatArray|fill"),
    ("NCCL", r"nccl"),
    ("elementwise and reductions (eager)", r"elementwise|reduce_kernel"),
)
KINDS_MATCHING = tuple((kind, re.compile(pattern, re.I)) for kind, pattern in KERNEL_KINDS)
MATMUL_KINDS = ("matmul", "attention")
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
# Host operations too common or too coarse to say what a gap waited on (the step's own ranges).
NOT_A_CAUSE = re.compile(r"^(## |cudaLaunch|cudaGraphLaunch)")
STEP_RANGE = "## the profiled step ##"  # a range around the step: its thread is the one launching it


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS_MATCHING if pattern.search(name)), "other")


def kernel_account(kernel_us: dict[str, float]) -> list[dict]:
    """The kernels' time by kind (`KERNEL_KINDS`), largest first: each kind's share of all kernel
    time, its milliseconds and how many distinct kernels it has."""
    kinds: dict[str, list] = {}
    for name, us in kernel_us.items():
        entry = kinds.setdefault(kernel_kind(name), [0.0, 0])
        entry[0] += us
        entry[1] += 1
    total = sum(kernel_us.values()) or 1.0
    return [{"kind": kind, "share": round(us / total, 4), "ms": round(us / 1e3, 2), "kernels": count}
            for kind, (us, count) in sorted(kinds.items(), key=lambda item: -item[1][0])]


def gpu_work(events: list) -> list:
    """The GPU's kernels, copies and fills among a profile's events, by start time. Not the GPU-side
    ranges of `record_function` (user annotations): the profiled step's own range spans all of it."""
    return sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
                   and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)


def idle_gaps(spans: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """The busy time of sorted (start, end) spans, overlaps counted once, and the gaps between them
    as (start, length)."""
    busy, gaps, reach = 0.0, [], None
    for start, end in spans:
        if reach is None or start > reach:
            if reach is not None:
                gaps.append((reach, start - reach))
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy, gaps


def host_operations_at(cpu: list, moments: list[float], thread: int | None) -> list[str]:
    """For each of `moments`, the innermost host operation running then (on `thread` where given):
    what the GPU's next work was waiting behind. One sweep over the operations by start time."""
    events = sorted((e for e in cpu if (thread is None or e.thread == thread) and not NOT_A_CAUSE.match(e.name)),
                    key=lambda e: e.time_range.start)
    running: list[tuple[float, int, object]] = []  # (end, order, event): the earliest end on top
    names, k = {}, 0
    for moment in sorted(set(moments)):
        while k < len(events) and events[k].time_range.start <= moment:
            heapq.heappush(running, (events[k].time_range.end, k, events[k]))
            k += 1
        while running and running[0][0] <= moment:
            heapq.heappop(running)
        innermost = min(running, key=lambda item: item[2].time_range.end - item[2].time_range.start, default=None)
        names[moment] = innermost[2].name if innermost else "(no host operation)"
    return [names[moment] for moment in moments]


def profiled_step(run_step: Callable[[], object], device: torch.device, flops: float | None = None,
                  trace: Path | None = None) -> dict:
    """One step under torch.profiler: the GPU's busy share of the step's wall time (kernels and
    copies, overlaps counted once), the kernels' count, their time by kind (`kernel_account`) and
    the share of it in matmuls and attention, with `flops` (the step's model FLOPs) the rate those
    kernels ran at, each stream's kernel time, the idle gaps with what the host ran at the longest
    ones and the gaps' time by that host operation, host synchronisations, and the kernels taking
    most time. `run_step` must wait for its GPU work (a loss's `float()`). `trace`: where to write
    the Chrome trace, gzipped."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, record_function(STEP_RANGE):
        started = time.perf_counter()
        run_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - started) * 1e6
    events = prof.events()
    gpu = gpu_work(events)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    busy, gaps = idle_gaps([(e.time_range.start, e.time_range.end) for e in gpu])
    kernel_us: dict[str, float] = {}
    stream_us: dict[str, float] = {}
    for e in gpu:
        us = e.time_range.elapsed_us()
        kernel_us[e.name] = kernel_us.get(e.name, 0.0) + us
        stream = f"stream {getattr(e, 'device_resource_id', '?')}"
        stream_us[stream] = stream_us.get(stream, 0.0) + us
    total = sum(kernel_us.values()) or 1.0
    main_thread = next((e.thread for e in cpu if e.name == STEP_RANGE), None)
    long_gaps = [(start, length) for start, length in gaps if length > 100]
    causes = host_operations_at(cpu, [start + length / 2 for start, length in long_gaps], main_thread)
    gap_causes: dict[str, float] = {}
    for cause, (_, length) in zip(causes, long_gaps):
        gap_causes[cause] = gap_causes.get(cause, 0.0) + length
    longest = sorted(zip(causes, long_gaps), key=lambda item: item[1][1])[-8:]
    calls = Counter(e.name for e in cpu)
    syncs = {name: calls[name] for name in HOST_SYNCS}
    matmul_us = sum(us for name, us in kernel_us.items() if kernel_kind(name) in MATMUL_KINDS)
    if trace is not None:
        with tempfile.TemporaryDirectory() as scratch:
            plain = Path(scratch) / "trace.json"
            prof.export_chrome_trace(str(plain))
            with plain.open("rb") as source, gzip.open(trace, "wb") as target:
                shutil.copyfileobj(source, target)
    return {
        "step_s": wall_us / 1e6,
        "gpu_busy_share": busy / wall_us,
        "gpu_events": len(gpu),
        "matmul_attention_share": matmul_us / total,
        # the step's useful model FLOPs (as mfu counts them: not Gradient Cache's second forward)
        # over the matmul and attention kernels' time
        "matmul_attention_tflops": flops / matmul_us / 1e6 if flops and matmul_us else None,
        "kernel_account": kernel_account(kernel_us),
        "streams_ms": {stream: round(us / 1e3, 2) for stream, us in sorted(stream_us.items(), key=lambda item: -item[1])},
        "idle_gaps_ms": {"count_over_0.1ms": sum(length > 100 for _, length in gaps), "sum": sum(length for _, length in gaps) / 1e3,
                         "longest": [{"ms": round(length / 1e3, 2), "host": cause} for cause, (_, length) in longest],
                         "over_0.1ms_by_host_operation": {name: round(us / 1e3, 2) for name, us in
                                                          sorted(gap_causes.items(), key=lambda item: -item[1])[:12]}},
        "host_syncs": syncs,
        "top_kernels": [{"name": name[:90], "share": round(us / total, 4)}
                        for name, us in sorted(kernel_us.items(), key=lambda item: -item[1])[:15]],
    }
