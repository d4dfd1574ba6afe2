"""The step profile (clipscale/profiling.py): kernels sorted by kind, idle gaps put on what the host
ran, and `train.profile_step` in a real run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import torch

from clipscale.profiling import HOST_SYNCS, gpu_work, host_operations_at, idle_gaps, kernel_account, kernel_kind
from tests.helpers.tiny_runs import REPO, run_train, tiny_run


def test_the_kernel_account_sorts_a_real_profiles_kernels_by_kind():
    """The kernels of a committed H100 profile (ViT-B/32's ceiling, patch embedding still a
    convolution): cuDNN's convolution kernels, whose names say "sgemm", are not counted as matmuls."""
    record = json.loads((REPO / "results" / "bench_ceiling_h100_b32_chunks_profiled.json").read_text())
    names = {k["name"]: k["share"] for k in record["cases"][0]["profile"]["top_kernels"]}
    kinds = {name: kernel_kind(name) for name in names}
    assert kinds["void precomputed_convolve_sgemm<__nv_bfloat16, 128, 6, 7, 3, 3, 5, 1, false>(int, int, int"] == "convolution"
    assert kinds["void cudnn::cnn::wgrad_alg1_engine<__nv_bfloat16, float, 128, 6, 7, 3, 3, 5, false, true>("] == "convolution"
    assert kinds["cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x"] == "attention"
    assert kinds["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT"] == "matmul"
    assert kinds["triton_poi_fused_gelu_gelu_backward_view_0"].startswith("pointwise")
    assert kinds["lse_fwd_kernel"] == "loss (Inf-CL kernels)"
    # cuDNN's attention backward helpers, seen in an H200 profile (not in the H100 file's top kernels)
    assert kernel_kind("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int,") == "attention"
    assert kernel_kind("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void") == "attention"
    account = kernel_account({name: share * 1e3 for name, share in names.items()})
    assert [entry["kind"] for entry in account][:2] == ["matmul", "convolution"]
    assert sum(entry["kernels"] for entry in account) == len(names)
    assert sum(entry["share"] for entry in account) == pytest.approx(1.0, abs=1e-3)


def test_overlapping_kernels_count_once_and_the_gaps_between_them_are_found():
    busy, gaps = idle_gaps([(0, 10), (5, 12), (20, 30), (21, 25), (40, 41)])
    assert busy == 12 + 10 + 1
    assert gaps == [(12, 8), (30, 10)]


def test_the_gpus_work_leaves_out_the_steps_own_range():
    """record_function's range has a GPU-side twin spanning the whole step: counted as work, the GPU
    would look busy all along (as the first profile of a train.py step said, 100% against 60%)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event("## the profiled step ##", 0, 100, annotation=True), event("gemm", 30, 40), event("copy", 10, 20),
              event("aten::mm", 5, 50, device=cpu), event("empty", 60, 60)]
    assert [e.name for e in gpu_work(events)] == ["copy", "gemm"]


def op(name: str, start: float, end: float, thread: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def test_a_gap_is_put_on_the_innermost_host_operation_of_the_launching_thread():
    """At each moment: the shortest operation running then on that thread, not one that has ended,
    nor one of another thread, nor the kernel launches themselves."""
    cpu = [op("step", 0, 100), op("wait for the chunk", 10, 30), op("Event.wait", 12, 20),
           op("decode", 0, 100, thread=2), op("cudaLaunchKernel", 40, 41), op("copy", 50, 60)]
    assert host_operations_at(cpu, [15, 25, 40.5, 55, 200], thread=1) == [
        "Event.wait", "wait for the chunk", "step", "copy", "(no host operation)"]
    assert host_operations_at(cpu, [15], thread=2) == ["decode"]


@pytest.mark.slow
def test_a_profiled_step_writes_its_account_and_trace_and_trains_as_any_other(digits_root: Path, tmp_path: Path):
    """train.profile_step: the step's account and Chrome trace in runs/<name>/profile, a console
    line, and the same losses as the run without it (the step ran once, under the profiler)."""
    losses = {}
    for name, extra in (("plain", []), ("profiled", ["train.profile_step=2"])):
        result = run_train(tiny_run(digits_root, tmp_path / name, "train.steps=3", "data.workers=1", "eval.zeroshot=false", *extra))
        assert result.returncode == 0, result.stderr[-2000:]
        run_dir = tmp_path / name / "tiny"
        losses[name] = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                        if "loss" in json.loads(line)]
    assert losses["profiled"] == losses["plain"] and len(losses["plain"]) == 3
    account = json.loads((run_dir / "profile" / "step_2.json").read_text())
    assert account["step"] == 2 and account["step_s"] > 0
    assert account["gpu_events"] == 0 and set(account["host_syncs"]) == set(HOST_SYNCS)  # a CPU run: no kernels
    with gzip.open(run_dir / "profile" / "step_2.trace.json.gz", "rt") as trace:
        assert any(event.get("name") == "## the profiled step ##" for event in json.load(trace)["traceEvents"])
    assert "step 2 profiled" in result.stdout + result.stderr
    assert not (tmp_path / "plain" / "tiny" / "profile").exists()
