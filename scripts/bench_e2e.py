"""End to end on real shards: `train.py` against `python -m open_clip_train.main`, loader included.

Each case launches the real entry point as its own process on the same webdataset shards
and measures what a user sees: samples/s over a window of steps that leaves out the first (it compiles)
and the last (the only one with no next batch being prepared beside it: it runs faster than the
steps a long run is made of; a run stopped before its end keeps its last finished step); a window under 10 steps is marked `short_window`, no speed claim. Also the first step's time, the
process tree's peak host memory (PSS, loader workers included, sampled every 0.5 s) and
the GPU's peak memory (`peak_gpu_reserved_gib`: train.py's `peak_memory_gib`, what its allocator
took from the device, CUDA graphs' pools included; for both trainers `peak_gpu_used_gib`, the
devices' used memory as nvidia-smi reports it, summed over the GPUs). Files before 2026-11-29 have
`peak_gpu_allocated_gib` instead: the allocator's allocated peak, which misses what CUDA graph
replays use.

Beside each clipscale case, in the same command, its ceiling: the same model, loss, precision,
chunk and batch in clipscale's own TrainStep (Gradient Cache, compile_towers, the loss, fused
AdamW) on tensors already on the GPU (one chunk of random pixels handed out for every chunk, and
the shards' own captions, tokenized), so nothing waits for data. Each clipscale case reports
`of_ceiling`, its window's samples/s over the ceiling's (per GPU: over nproc ceilings), and
`of_ceiling_per_step` with its median over the window, each step's fraction of the ceiling. The ceiling cuts the text padding
(clipscale.caption_length: length-sorted chunks, each cut to its bucket, the causal kernel)
when the run did (its metrics.jsonl logs text_positions_per_sample below the context length),
else it computes every caption at full length, as the run did. Every row reports data_wait_s,
mfu (counting the text positions computed, where the run logs them) and
text_positions_per_sample, each per step, where there are such numbers.

    python scripts/make_synthetic_shards.py --out /tmp/shards --shards 160 --size 224 --processes 16 --captions web
    python scripts/bench_e2e.py --shards '/tmp/shards/synthetic-{0000..0159}.tar' --workers 14 \\
        --case runner=openclip,model=ViT-B-16,batch=256,steps=30 \\
        --case runner=clipscale,model=ViT-B-16,batch=32768,chunk=512,steps=3 --out results/bench_e2e.json

Case keys: runner (clipscale | openclip | ceiling: the ceiling alone, to compare chunks or profile
it; its keys are the clipscale case's and text: cut or full), model, batch (global), chunk (clipscale: an int,
auto or none; default the config's), steps, offload (0/1), loss (clipscale, default infcl),
decoder (clipscale; default the config's), compile (clipscale: 0/1,
default the config's: auto; openclip: 1 adds --torchcompile), cache (clipscale: a
model.compile_cache folder, so a second case reuses what the first compiled), resampled
(clipscale: 1 draws shards with replacement, so a batch may be larger than the shards), parallel
(clipscale: ddp or fsdp), fsdp_offload and grad_checkpointing (clipscale: 0/1), patch_embed (clipscale: auto, conv
or matmul, default the config's: auto; issue 49), attention (clipscale: auto, sdpa or short: model.attention), worker_share (clipscale: data.worker_decode_share, default the config's: auto; 0 for the GPU alone),
decode_threads (clipscale: data.decode_workers; 0: the training thread decodes, the workers' share into arenas), nproc (torchrun
processes, default 1; openclip and ceiling too: a ceiling of several processes computes its share of the batch in each, under
train.parallel, the loss across them), ceiling_nproc (clipscale: its ceiling's processes, default 1; the case's nproc gives
the ceiling of the run's own collectives, each process's batch as the run's), accum (openclip: --accum-freq; batch stays the global batch),
local_loss (openclip: 1 adds --local-loss --gather-with-grad), pythonpath (prepended for this case
only: open_clip_train needs webdataset 0.2.x), ceiling (clipscale: 0 skips its ceiling), ceiling_batch
(default the case's batch over nproc), ceiling_steps (default 5, the first two dropped: compiling, then
recording CUDA graphs), profile (a ceiling case run as runner=ceiling: 1 adds one step under
torch.profiler, `clipscale.profiling.profiled_step`), profile_step (clipscale: train.profile_step, that step's
profile in the case's `profile`; each profiled step's Chrome trace is kept beside --out), ceiling_text (cut or full: the
ceiling's text positions, instead of the run's) and
ddp_optimizer (a ceiling of several processes: 1 puts Dynamo's DDPOptimizer back, which split each compiled block at
DDP's gradient buckets until e9bce54: the change's before, in the same command), page_lock (clipscale: never leaves
the workers' arenas pageable, each chunk staged through pinned memory of its own). --set
KEY=VALUE adds a config override to every clipscale case and its ceiling (a tiny model.custom for a
CPU smoke run, say). Settings of the environment reach every case's processes and the record
(`environment`): CLIPSCALE_ATTENTION=flash (or cudnn, efficient, math; a comma-separated list) leaves
the compiled towers' attention only those kernels (clipscale.compile.ATTENTION_BACKENDS), and
Inductor's own TORCHINDUCTOR_* settings apply as they are. Cases past --budget seconds are
recorded as not run; a case still running when the budget ends is stopped, after its training
processes have printed where each of their threads was (SIGUSR2, clipscale.signals), kept in its
`stacks_at_kill`. SIGTERM (a machine's time limit) stops the running case at once, writes what ran
(the case marked `stopped`) and ends the script with status 143.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import open_clip
import torch
import webdataset as wds

from clipscale.caption_length import TextChunks, caption_lengths, cut_padding, length_order, use_causal_kernel
from clipscale.compile import CompilePolicy, compile_enabled
from clipscale.config import load_config
from clipscale.console import Console
from clipscale.data.chunks import chunk_bounds
from clipscale.distributed import init_distributed, shutdown_distributed
from clipscale.gradcache import trainable_towers
from clipscale.losses import build_loss
from clipscale.metrics import peak_memory_gib
from clipscale.models import build_model, open_clip_model_config
from clipscale.optim import build_optimizer
from clipscale.parallel import gathered, parallelize
from clipscale.profiling import profiled_step
from clipscale.provenance import provenance
from clipscale.step import TrainStep
from clipscale.utilization import forward_flops, peak_bf16_flops

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
CEILING_CAPTIONS = 65_536  # the ceiling tokenizes at most this many of the shards' captions, repeated to its batch


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


STACKS_WAIT_S = 3  # for a training process to print its threads' stacks on SIGUSR2
STACKS_CHARS = 200_000  # of them kept in the case's record


def print_training_stacks(root: int) -> None:
    """SIGUSR2 to the training processes below `root` (train.py's or this script's ceiling, not
    torchrun): each prints every thread's stack into the log (clipscale.signals) and goes on."""
    for pid in process_tree(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if b"torch.distributed.run" not in argv and any(arg.endswith((b"train.py", b"bench_e2e.py")) for arg in argv):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
    time.sleep(STACKS_WAIT_S)


def stacks_in(log: str) -> str | None:
    """The threads' stacks that the training processes printed (faulthandler's format), or None:
    from the first thread's header on, whole or not (the processes, forked loader workers among
    them, write theirs at once into the same pipe, so their lines may interleave)."""
    first = re.search(r"(?:Current thread|Thread) 0x", log)
    return log[first.start():] if first else None


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


CONFIG = REPO / "configs" / "vit_b16_infcl.yaml"
OPTIONAL = {"chunk": "train.chunk_size", "decoder": "data.decoder",
            "compile": "model.compile", "cuda_graphs": "model.cuda_graphs", "cache": "model.compile_cache", "resampled": "data.resampled",
            "parallel": "train.parallel", "fsdp_offload": "train.fsdp_offload", "grad_checkpointing": "model.grad_checkpointing",
            "patch_embed": "model.patch_embed", "attention": "model.attention", "worker_share": "data.worker_decode_share", "profile_step": "train.profile_step",
            "decode_threads": "data.decode_workers"}
FLAGS = ("compile", "cuda_graphs", "resampled", "fsdp_offload", "grad_checkpointing")  # 0/1 in a case: false/true


def config_overrides(case: dict, shards: str, workers: int, out_dir: Path, extra: list[str]) -> list[str]:
    """train.py's overrides of CONFIG for a clipscale case (and for its ceiling, which reads the same config)."""
    chosen = [f"{key}={ {'none': 'null', **({'0': 'false', '1': 'true'} if name in FLAGS else {})}.get(case[name], case[name]) }"
              for name, key in OPTIONAL.items() if name in case]
    return [*([f"model.name={case['model']}"] if "model" in case else []), "data.kind=webdataset",
            f"data.train_shards={shards}", f"data.workers={workers}", f"train.batch_size={case['batch']}", *chosen,
            f"train.steps={case['steps']}", f"train.offload={'true' if int(case.get('offload', 0)) else 'false'}",
            f"loss.name={case.get('loss', 'infcl')}", "train.log_every=1", "train.checkpoint_every=1000000",
            "optim.warmup_steps=1", "eval.zeroshot=false", "run.name=bench", f"run.output_dir={out_dir}", *extra]


def launcher(case: dict) -> list[str]:
    """python, or torchrun with case nproc processes (both take `-m module`)."""
    nproc = int(case.get("nproc", 1))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 \
        else [sys.executable]


def clipscale_command(case: dict, shards: str, workers: int, out_dir: Path, extra: list[str]) -> list[str]:
    return [*launcher(case), str(REPO / "train.py"), "--config", str(CONFIG), *config_overrides(case, shards, workers, out_dir, extra)]


def ceiling_command(case: dict, shards: str, workers: int, out_dir: Path, extra: list[str]) -> list[str]:
    """This script, measuring the ceiling of `case` in a process of its own (`measure_ceiling`), or
    in case nproc processes of torchrun."""
    return [*launcher(case), str(Path(__file__).resolve()), "--measure-ceiling", json.dumps(case), "--shards", shards,
            "--out", str(out_dir / "ceiling.jsonl"), *[f"--set={override}" for override in extra]]


def openclip_command(case: dict, shards: str, workers: int, out_dir: Path, extra: list[str]) -> list[str]:
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
    """Per step: samples and seconds, and what clipscale's metrics (or the ceiling's) say of it."""
    batch = int(case["batch"])
    if case["runner"] == "openclip":
        return [{"samples": batch, "step_s": batch / float(rate)} for _, rate in OPENCLIP_STEP.findall(log)]
    lines = metrics_lines(out_dir / ("ceiling.jsonl" if case["runner"] == "ceiling" else "bench/metrics.jsonl"), "step_s")
    return [{"samples": batch, "step_s": m["step_s"], "peak_gpu_reserved_gib": m["peak_memory_gib"], "loss": m["loss"],
             "data_wait_s": m.get("data_wait_s"), "mfu": m.get("mfu"),
             "text_positions_per_sample": m.get("text_positions_per_sample"),
             **({"data_wait_s_by_rank": m["data_wait_s_by_rank"]} if "data_wait_s_by_rank" in m else {})} for m in lines]


def metrics_lines(path: Path, key: str) -> list[dict]:
    """The JSON lines of `path` that hold `key` (none when it is missing)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return [line for line in lines if key in line]


MIN_WINDOW = 10  # steps in a window that makes a speed claim


def measured_window(case: dict, steps: list) -> list:
    """The steps a speed figure is taken over: all but the first (it compiles) and, for a training
    run that ran all its steps, but the last, which alone had no next batch being prepared beside
    it and so ran faster than the steps a long run is made of. A run stopped before its end (its
    budget, SIGTERM) was preparing the next batch beside its last finished step: that one counts
    (a million samples a step on one GPU has time for three steps in a 10-minute call, not four).
    The ceiling prepares nothing: all but its first two (the first compiles; in a plain step, one
    chunk a step, the second records the CUDA graphs)."""
    if case["runner"] == "ceiling":
        return steps[2:]
    return steps[1:] if len(steps) < int(case["steps"]) else steps[1:-1]


def of_ceiling(result: dict, nproc: int, ceiling_nproc: int = 1) -> None:
    """Each step's fraction of the ceiling (the ceiling's median step over its own: both compute one
    process's batch), their median over the window, and the window's samples/s over the ceiling's
    scaled to nproc processes (a ceiling of `ceiling_nproc` processes computes their batches)."""
    ceiling_step = result["ceiling"]["steady_step_s"]
    result["of_ceiling"] = result["samples_per_s"] / (nproc / ceiling_nproc * result["ceiling"]["samples_per_s"])
    result["of_ceiling_per_step"] = [round(ceiling_step / step, 3) for step in result["step_s"]]
    window = measured_window(result["case"], result["of_ceiling_per_step"])
    result["of_ceiling_median"] = statistics.median(window) if window else None


class Terminated(Exception):
    """SIGTERM reached this script (a machine's time limit, `timeout`): the running case stops at
    once, without its stacks, and what ran is written before the script ends."""


def on_sigterm(signum, frame):
    # The first SIGTERM stops the run; later ones are ignored, or one landing while the case is being
    # stopped would lose it: GNU timeout signals its child and then the child's whole process group.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def run_case(case: dict, args, timeout: float, number: int) -> dict:
    """`number`: the case's place on the command line, in the names of the traces it keeps."""
    out_dir = Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    build = {"clipscale": clipscale_command, "openclip": openclip_command, "ceiling": ceiling_command}[case["runner"]]
    command = build(case, args.shards, args.workers, out_dir, args.set)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if case.get("pythonpath"):
        env["PYTHONPATH"] = case["pythonpath"] + os.pathsep + env.get("PYTHONPATH", "")
    if case.get("page_lock") == "never":  # the workers' arenas left pageable (clipscale.data.chunks.WorkerArenas)
        env["CLIPSCALE_PAGE_LOCK_ARENAS"] = "0"
    started = time.perf_counter()
    stacks = None
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(process.pid)
    sampler.start()
    terminated = False
    try:
        log, _ = process.communicate(timeout=timeout)
    except (subprocess.TimeoutExpired, Terminated) as stop:
        terminated = isinstance(stop, Terminated)
        if case["runner"] != "openclip" and not terminated:  # open_clip_train would die of SIGUSR2: no stacks from it
            print_training_stacks(process.pid)
        kill_tree(process.pid)
        log, _ = process.communicate()
        stacks = stacks_in(log)
        if stacks:  # kept apart, so that the log's tail is still the run's own
            log = log[: len(log) - len(stacks)]
        log += (f"\n[bench_e2e: stopped by SIGTERM after {time.perf_counter() - started:.0f} s]" if terminated
                else f"\n[bench_e2e: killed after {timeout:.0f} s]")
    sampler.done.set()
    sampler.join()
    steps = steps_of(case, out_dir, log)
    result = {"case": case, "command": command, "exit_code": process.returncode, "wall_s": time.perf_counter() - started,
              "steps_done": len(steps), "peak_host_gib": sampler.host / GIB, "peak_gpu_used_gib": sampler.gpu / GIB}
    if terminated:
        result["stopped"] = "SIGTERM"
    if steps:
        result["first_step_s"] = steps[0]["step_s"]
        result["step_s"] = [s["step_s"] for s in steps]
        later = measured_window(case, steps)
        if later:
            result["window"] = f"steps 2..{1 + len(later)} of {len(steps)}"
            if case["runner"] != "ceiling" and len(later) < MIN_WINDOW:
                result["short_window"] = f"{len(later)} steps measured, fewer than {MIN_WINDOW}: not a speed claim"
            result["samples_per_s"] = sum(s["samples"] for s in later) / sum(s["step_s"] for s in later)
            result["steady_step_s"] = statistics.median(s["step_s"] for s in later)
            result["first_over_steady"] = result["first_step_s"] / result["steady_step_s"]
        if "peak_gpu_reserved_gib" in steps[-1]:
            result["peak_gpu_reserved_gib"] = steps[-1]["peak_gpu_reserved_gib"]
            result["losses"] = [s["loss"] for s in steps]
            for key in ("data_wait_s", "mfu", "text_positions_per_sample"):
                result[key] = [s[key] for s in steps]
            if all("data_wait_s_by_rank" in s for s in steps):  # several processes: each rank's wait
                result["data_wait_s_by_rank"] = [s["data_wait_s_by_rank"] for s in steps]
            if None in result["losses"]:  # metrics.jsonl writes a non-finite loss as null
                result["void"] = ("a loss was not finite: the trainer skipped that step after its first pass, "
                                  "so the times are not those of training steps")
    if process.returncode != 0 or not steps:
        result["log_tail"] = log[-3000:]
    if stacks:  # where each thread of each training process was when the case's time ran out
        result["stacks_at_kill"] = stacks[:STACKS_CHARS]
    chosen = re.search(r"train.chunk_size=auto: .*", log)
    if chosen:
        result["auto_chunk"] = chosen.group(0)
    if case["runner"] == "clipscale":  # what the run said of its data path and compilation
        result["console"] = re.findall(r"^(?:compiling the towers.*|data\.\w+.*|the steps waited.*)$", log, re.M)
    if case["runner"] == "ceiling" and metrics_lines(out_dir / "ceiling.jsonl", "profile"):
        result["profile"] = metrics_lines(out_dir / "ceiling.jsonl", "profile")[0]["profile"]
    profiled = out_dir / "bench" / "profile" / f"step_{case.get('profile_step')}.json"
    if profiled.is_file():  # train.profile_step's account
        result["profile"] = json.loads(profiled.read_text())
    for trace in sorted(out_dir.rglob("*.trace.json.gz")):  # kept beside --out, numbered by the case
        kept = Path(args.out).with_name(f"{Path(args.out).stem}.case{number}.{trace.name}")
        shutil.copyfile(trace, kept)
        result.setdefault("traces", []).append(str(kept))
    if case["runner"] == "ceiling":  # what it said of its towers and its text tower
        result["console"] = re.findall(r"^(?:text|towers): .*$", log, re.M)
        result["compiled"] = "towers: compiled" in log
    elif case["runner"] == "clipscale":
        result["compiled"] = "compiling the towers took" in log
    return result


def ceiling_case(case: dict, result: dict, args) -> dict:
    """The ceiling of a clipscale case that ran: its model, loss, compile settings, one process's
    batch (in each of `ceiling_nproc` processes), the chunk it used (auto's choice read from its
    console), its text positions (all of them, unless its metrics logged fewer)."""
    nproc, ceiling_nproc = int(case.get("nproc", 1)), int(case.get("ceiling_nproc", 1))
    ceiling = {key: case[key] for key in ("model", "loss", "compile", "cuda_graphs", "cache", "grad_checkpointing", "patch_embed",
                                              "attention") if key in case}
    ceiling.update(runner="ceiling", batch=case.get("ceiling_batch", int(case["batch"]) // nproc * ceiling_nproc),
                   steps=case.get("ceiling_steps", 5), text=case.get("ceiling_text", "full"))
    if ceiling_nproc > 1:
        ceiling["nproc"] = str(ceiling_nproc)
    if str(case.get("chunk", "")).isdigit():
        ceiling["chunk"] = case["chunk"]
    elif case.get("chunk") == "none":  # the whole batch of a process in one chunk
        ceiling["chunk"] = str(ceiling["batch"])
    elif result.get("auto_chunk"):
        ceiling["chunk"] = re.match(r"train.chunk_size=auto: (\d+)", result["auto_chunk"]).group(1)
    logged = [n for n in result.get("text_positions_per_sample", []) if n is not None]
    if "ceiling_text" not in case and logged and min(logged) < text_context(ceiling, args):
        ceiling["text"] = "cut"
    return ceiling


def text_context(case: dict, args) -> int:
    """The text tower's context length of the case's model, from its open_clip config (no model built)."""
    cfg = load_config(str(CONFIG), config_overrides({**case, "steps": 1}, args.shards, 1, Path("."), args.set))
    return ((open_clip_model_config(cfg.model) or {}).get("text_cfg") or {}).get("context_length", 77)


class RepeatedChunk:
    """One device chunk handed out as every chunk of a batch of `size` (Gradient Cache's chunk
    source interface): the towers' inputs cost nothing to prepare."""

    def __init__(self, chunk, size: int):
        self.chunk, self.size = chunk, size

    def __len__(self) -> int:
        return self.size

    def chunks(self, bounds, device, pass_number, keep=()):
        for start, stop in bounds:
            yield self.chunk[: stop - start]


def shard_captions(pattern: str, suffixes: set[str], count: int) -> list[str]:
    """The first `count` captions of the shards (members whose suffix is a caption key), in order."""
    found = []
    for shard in (shard for source in pattern.split("::") for shard in wds.shardlists.expand_urls(source)):
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.isfile() and member.name.rpartition(".")[2] in suffixes:
                    found.append(tar.extractfile(member).read().decode())
                    if len(found) == count:
                        return found
    return found


def measure_ceiling(case: dict, shards: str, extra: list[str], out: Path) -> None:
    """The towers' ceiling for `case` (see the module docstring), one JSON line per step in `out`
    (rank 0's, under torchrun: each process computes its share of the case's batch, in DDP or
    FSDP as train.parallel says, and the loss across them)."""
    cfg = load_config(str(CONFIG), config_overrides(case, shards, 1, out.parent, extra))
    world = init_distributed(group_of_one=cfg.train.parallel == "fsdp")  # and the host threads, as train.py sets them
    device = world.device
    torch.manual_seed(0)  # the same initial weights on every rank
    towers = build_model(cfg.model, compiled=compile_enabled(cfg.model.compile, device), gpu=device.type == "cuda")
    placed = parallelize(towers.model.train(), world, parallel=cfg.train.parallel, precision=cfg.train.precision,
                         reduce=cfg.train.fsdp_reduce, offload=cfg.train.fsdp_offload)
    model = placed.module
    batch = int(case["batch"]) // world.world_size
    chunk = int(case.get("chunk") or cfg.train.chunk_size or batch)
    texts = shard_captions(shards, set(cfg.data.caption_key.split(";")), min(batch, CEILING_CAPTIONS))
    if not texts:
        raise SystemExit(f"no captions in {shards} (data.caption_key {cfg.data.caption_key})")
    tokens = towers.tokenizer(texts).repeat(-(-batch // len(texts)), 1)[:batch]
    context = tokens.shape[1]
    refusal = cut_padding(model) if case.get("text", "cut") == "cut" else "the run computed every caption at full length"
    console = Console(world.is_main)  # rank 0 speaks
    if refusal is None:
        console.say(f"text: padding cut; causal kernel: {use_causal_kernel(model) or 'yes'}")
        lengths = caption_lengths(model, tokens)
        order = length_order(lengths)
        text_column = TextChunks(tokens[order].to(device), lengths[order], context)
    else:
        console.say(f"text: {context} positions for every caption: {refusal}")
        text_column = tokens.to(device)
    bounds = chunk_bounds(batch, chunk)
    positions = [text_column.positions(*b) if refusal is None else context for b in bounds]
    size = open_clip.get_model_preprocess_cfg(model)["size"]
    size = (size, size) if isinstance(size, int) else tuple(size)
    images = RepeatedChunk(torch.randn(chunk, 3, *size, device=device), batch)

    # Model FLOPs of the step, counting the text positions computed (before compiling: eager counts).
    train_image, train_text = trainable_towers(model)
    with gathered(model):
        text_flops = {n: forward_flops(model, size[0], n, device)[1] for n in set(positions)}
        image_flops = forward_flops(model, size[0], context, device)[0]
    step_flops = sum((stop - start) * ((3 if train_image else 1) * image_flops + (3 if train_text else 1) * text_flops[n])
                     for (start, stop), n in zip(bounds, positions))
    peak = peak_bf16_flops(device)

    policy = CompilePolicy.of(cfg.model, device, cfg.train.parallel, chunks=-(-batch // chunk))  # as train.py's
    console.say(f"towers: {'compiled' if policy.compiled else 'eager'}; CUDA graphs: {'yes' if policy.cuda_graphs else 'no'}")
    policy.apply(model, out.parent / "compile_cache")
    if case.get("ddp_optimizer") == "1":  # as before e9bce54: each compiled block split at DDP's gradient buckets
        torch._dynamo.config.optimize_ddp = True
    optimizer = build_optimizer(model, cfg.optim, fused=device.type == "cuda")
    step = TrainStep(placed, build_loss(cfg.loss.name, **cfg.loss.options), optimizer, chunk_size=chunk,
                     precision=cfg.train.precision, grad_clip=cfg.optim.grad_clip, cuda_graphs=policy.cuda_graphs)
    with out.open("w") if world.is_main else open(os.devnull, "w") as log:
        for _ in range(int(case["steps"])):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            loss = float(step(images, text_column, cfg.optim.lr).loss)  # waits for the step
            seconds = time.perf_counter() - started
            log.write(json.dumps({
                "step_s": seconds, "loss": loss, "data_wait_s": 0.0, "mfu": step_flops / seconds / peak if peak else None,
                "text_positions_per_sample": sum((stop - start) * n for (start, stop), n in zip(bounds, positions)) / batch,
                "peak_memory_gib": peak_memory_gib(device) if device.type == "cuda" else None,  # as train.py logs it
            }) + "\n")
            log.flush()
        if case.get("profile") == "1":  # one more step, under the profiler: where the ceiling's own time goes
            log.write(json.dumps({"profile": profiled_step(lambda: float(step(images, text_column, cfg.optim.lr).loss),
                                                           device, flops=step_flops,
                                                           trace=out.parent / "ceiling.trace.json.gz" if world.is_main else None)}) + "\n")
    shutdown_distributed()


SHOWN = ("steps_done", "window", "short_window", "samples_per_s", "first_step_s", "steady_step_s", "peak_host_gib", "peak_gpu_reserved_gib",
         "peak_gpu_used_gib", "exit_code", "auto_chunk", "mfu", "data_wait_s", "text_positions_per_sample",
         "of_ceiling", "console", "losses", "compiled", "void")


def report(name: str, result: dict) -> None:
    print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k in SHOWN}, flush=True)
    if "log_tail" in result:
        print(result["log_tail"][-1500:], flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="brace pattern of webdataset shards")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--case", action="append", default=[], help="key=value,... (see above)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every clipscale case and its ceiling")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all cases")
    parser.add_argument("--out", required=True)
    parser.add_argument("--measure-ceiling", metavar="CASE_JSON", help=argparse.SUPPRESS)  # the ceiling's own process
    args = parser.parse_args(argv)
    if args.measure_ceiling:
        measure_ceiling(json.loads(args.measure_ceiling), args.shards, args.set, Path(args.out))
        return
    cases = [dict(item.split("=", 1) for item in spec.split(",")) for spec in args.case]
    if not cases or any(case.get("runner") not in ("clipscale", "openclip", "ceiling") for case in cases):
        parser.error("give cases with --case runner=clipscale|openclip|ceiling,...")
    for case in cases:
        if case["runner"] == "ceiling":  # alone: the defaults it takes beside a run
            case.setdefault("steps", "5")
            case.setdefault("text", "cut")

    record = {**provenance(argv), "shards": args.shards, "workers": args.workers, "cases": []}
    deadline = time.monotonic() + args.budget
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        run_cases(args, cases, record, deadline)
    except Terminated:  # between two cases' processes: what ran is in the record
        record["stopped"] = "SIGTERM"
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if record.get("stopped") or any(result.get("stopped") for result in record["cases"]):
        sys.exit(128 + signal.SIGTERM)


def run_cases(args, cases: list[dict], record: dict, deadline: float) -> None:
    """Each case, and its ceiling beside a clipscale case, into `record`, written after each; the
    rest not run once a case was stopped by SIGTERM."""
    for number, (spec, case) in enumerate(zip(args.case, cases)):
        left = deadline - time.monotonic()
        if left < 30:
            record["cases"].append({"case": case, "not_run": "time budget"})
            continue
        result = run_case(case, args, left, number)
        record["cases"].append(result)
        report(spec, result)
        if result.get("stopped"):
            return
        if case["runner"] == "clipscale" and case.get("ceiling") != "0" and "samples_per_s" in result:
            left = deadline - time.monotonic()
            result["ceiling"] = run_case(ceiling_case(case, result, args), args, left, number) if left >= 30 else {"not_run": "time budget"}
            report(f"{spec} ceiling:", result["ceiling"])
            if result["ceiling"].get("stopped"):
                return
            if result["ceiling"].get("compiled") not in (None, result["compiled"]):
                result["void"] = (f"the ceiling's towers were {'compiled' if result['ceiling']['compiled'] else 'eager'} "
                                  f"while the run's were {'compiled' if result['compiled'] else 'eager'}: not its ceiling")
            if "samples_per_s" in result["ceiling"]:
                of_ceiling(result, int(case.get("nproc", 1)), int(case.get("ceiling_nproc", 1)))
                print(f"{spec} of_ceiling: {result['of_ceiling']:.3f}, median step {result['of_ceiling_median']}, "
                      f"per step {result['of_ceiling_per_step']}", flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")  # after each case: a kill keeps what ran


if __name__ == "__main__":
    main()
