"""End to end on real shards: `train.py` against `python -m open_clip_train.main`, loader included.

Each case launches the real entry point as its own process on the same webdataset shards
and measures what a user sees: samples/s over steps 2..N, the first step's time, the
process tree's peak host memory (PSS, loader workers included, sampled every 0.5 s) and
the GPU's peak memory (train.py's allocator peak; for both, the device's used memory as
nvidia-smi reports it).

    python scripts/make_synthetic_shards.py --out /tmp/shards --shards 160 --size 224 --processes 16
    python scripts/bench_e2e.py --shards '/tmp/shards/synthetic-{0000..0159}.tar' --workers 14 \\
        --case runner=openclip,model=ViT-B-16,batch=256,steps=30 \\
        --case runner=clipscale,model=ViT-B-16,batch=32768,chunk=512,steps=3 --out results/bench_e2e.json

Case keys: runner (clipscale | openclip), model, batch (global), chunk (clipscale: an int,
auto or none; default the config's), steps, offload (0/1), loss (clipscale, default infcl),
decoder and device_decoder (clipscale; default the config's: auto), compile (clipscale: 0/1,
default the config's: auto; openclip: 1 adds --torchcompile), cache (clipscale: a
model.compile_cache folder, so a second case reuses what the first compiled), resampled
(clipscale: 1 draws shards with replacement, so a batch may be larger than the shards), parallel
(clipscale: ddp or fsdp), fsdp_offload and grad_checkpointing (clipscale: 0/1), nproc (torchrun
processes, default 1; openclip too), accum (openclip: --accum-freq; batch stays the global batch),
local_loss (openclip: 1 adds --local-loss --gather-with-grad), pythonpath (prepended for this case only: open_clip_train needs
webdataset 0.2.x). Cases past --budget seconds are recorded as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from clipscale.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def process_tree(root: int) -> list[int]:
    """A process and all its descendants, through /proc's children lists (torchrun starts its
    workers in sessions of their own, so a process group would not hold them)."""
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def tree_pss_bytes(root: int) -> int:
    """Proportional set size of a process and all its descendants (shared pages split fairly)."""
    total = 0
    for pid in process_tree(root):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def kill_tree(root: int) -> None:
    """SIGKILL a process and every process below it: killing torchrun alone leaves its workers
    running with the output pipe open, and reading the log would then wait forever."""
    for pid in process_tree(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def gpu_used_bytes() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return sum(int(v) for v in out.split()) * 2**20
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


class Sampler(threading.Thread):
    """Peak host memory of a process tree and peak GPU memory used, while the process runs."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.host, self.gpu, self.done = pid, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.host = max(self.host, tree_pss_bytes(self.pid))
            self.gpu = max(self.gpu, gpu_used_bytes() or 0)


def clipscale_command(case: dict, shards: str, workers: int, out_dir: Path) -> list[str]:
    optional = {"chunk": "train.chunk_size", "decoder": "data.decoder", "device_decoder": "data.device_decoder",
                "compile": "model.compile", "cache": "model.compile_cache", "resampled": "data.resampled",
                "parallel": "train.parallel", "fsdp_offload": "train.fsdp_offload", "grad_checkpointing": "model.grad_checkpointing"}
    chosen = [f"{key}={ {'none': 'null', '0': 'false', '1': 'true'}.get(case[name], case[name]) }"
              for name, key in optional.items() if name in case]
    return [*launcher(case), str(REPO / "train.py"), "--config", str(REPO / "configs" / "vit_b16_infcl.yaml"),
            f"model.name={case['model']}", "data.kind=webdataset", f"data.train_shards={shards}", f"data.workers={workers}",
            f"train.batch_size={case['batch']}", *chosen,
            f"train.steps={case['steps']}", f"train.offload={'true' if int(case.get('offload', 0)) else 'false'}",
            f"loss.name={case.get('loss', 'infcl')}", "train.log_every=1", "train.checkpoint_every=1000000",
            "optim.warmup_steps=1", "eval.zeroshot=false", "run.name=bench", f"run.output_dir={out_dir}"]


def launcher(case: dict) -> list[str]:
    """python, or torchrun with case nproc processes (both take `-m module`)."""
    nproc = int(case.get("nproc", 1))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 \
        else [sys.executable]


def openclip_command(case: dict, shards: str, workers: int, out_dir: Path) -> list[str]:
    """open_clip_train's --batch-size is per GPU and per accumulation step: the global batch over both."""
    accum, nproc = int(case.get("accum", 1)), int(case.get("nproc", 1))
    return [*launcher(case), "-m", "open_clip_train.main", "--train-data", shards, "--dataset-type", "webdataset",
            "--train-num-samples", str(int(case["batch"]) * int(case["steps"])),
            "--batch-size", str(int(case["batch"]) // (nproc * accum)), "--accum-freq", str(accum),
            "--epochs", "1", "--model", case["model"], "--precision", "amp_bf16", "--workers", str(workers),
            "--warmup", "1", "--lr", "1e-3", "--wd", "0.2", "--log-every-n-steps", "1", "--save-frequency", "0",
            "--logs", str(out_dir), "--name", "bench", "--report-to", "", "--seed", "0",
            *(["--torchcompile"] if int(case.get("compile", 0)) else []),
            *(["--local-loss", "--gather-with-grad"] if int(case.get("local_loss", 0)) else [])]


OPENCLIP_STEP = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/.*?Batch \(t\): [\d.]+, ([\d.]+)/s")


def steps_of(case: dict, out_dir: Path, log: str) -> list[dict]:
    """Per step: samples and seconds."""
    batch = int(case["batch"])
    if case["runner"] == "openclip":
        return [{"samples": batch, "step_s": batch / float(rate)} for _, rate in OPENCLIP_STEP.findall(log)]
    metrics = out_dir / "bench" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
    return [{"samples": batch, "step_s": m["step_s"], "peak_gpu_allocated_gib": m["peak_memory_gib"], "loss": m["loss"],
             "data_wait_s": m.get("data_wait_s"), "mfu": m.get("mfu")} for m in lines if "step_s" in m]


def run_case(case: dict, args, timeout: float) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    build = clipscale_command if case["runner"] == "clipscale" else openclip_command
    command = build(case, args.shards, args.workers, out_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if case.get("pythonpath"):
        env["PYTHONPATH"] = case["pythonpath"] + os.pathsep + env.get("PYTHONPATH", "")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(process.pid)
    sampler.start()
    try:
        log, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        log, _ = process.communicate()
        log += f"\n[bench_e2e: killed after {timeout:.0f} s]"
    sampler.done.set()
    sampler.join()
    steps = steps_of(case, out_dir, log)
    result = {"case": case, "command": command, "exit_code": process.returncode, "wall_s": time.perf_counter() - started,
              "steps_done": len(steps), "peak_host_gib": sampler.host / GIB, "peak_gpu_used_gib": sampler.gpu / GIB}
    if steps:
        result["first_step_s"] = steps[0]["step_s"]
        later = steps[1:]
        if later:
            result["samples_per_s"] = sum(s["samples"] for s in later) / sum(s["step_s"] for s in later)
            result["steady_step_s"] = statistics.median(s["step_s"] for s in later)
            result["first_over_steady"] = result["first_step_s"] / result["steady_step_s"]
        if "peak_gpu_allocated_gib" in steps[-1]:
            result["peak_gpu_allocated_gib"] = steps[-1]["peak_gpu_allocated_gib"]
            result["losses"] = [s["loss"] for s in steps]
            result["data_wait_s"] = [s["data_wait_s"] for s in steps]
            result["mfu"] = [s["mfu"] for s in steps]
            if None in result["losses"]:  # metrics.jsonl writes a non-finite loss as null
                result["void"] = ("a loss was not finite: the trainer skipped that step after its first pass, "
                                  "so the times are not those of training steps")
    if process.returncode != 0 or not steps:
        result["log_tail"] = log[-3000:]
    chosen = re.search(r"train.chunk_size=auto: .*", log)
    if chosen:
        result["auto_chunk"] = chosen.group(0)
    if case["runner"] == "clipscale":  # what the run said of its data path and compilation
        result["console"] = re.findall(r"^(?:compiling the towers.*|data\.\w+.*|the steps waited.*)$", log, re.M)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="brace pattern of webdataset shards")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--case", action="append", required=True, help="key=value,... (see above)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all cases")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    record = {**provenance(argv), "shards": args.shards, "workers": args.workers, "cases": []}
    deadline = time.monotonic() + args.budget
    for spec in args.case:
        case = dict(item.split("=", 1) for item in spec.split(","))
        left = deadline - time.monotonic()
        if left < 30:
            record["cases"].append({"case": case, "not_run": "time budget"})
            continue
        result = run_case(case, args, left)
        record["cases"].append(result)
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                 if k in ("steps_done", "samples_per_s", "first_step_s", "steady_step_s", "peak_host_gib",
                          "peak_gpu_allocated_gib", "peak_gpu_used_gib", "exit_code", "auto_chunk", "mfu",
                          "data_wait_s", "console", "losses")}
        print(spec, shown, flush=True)
        if "log_tail" in result:
            print(result["log_tail"][-1500:], flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")  # after each case: a kill keeps what ran


if __name__ == "__main__":
    main()
