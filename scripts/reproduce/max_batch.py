"""Tables 1 and 2 of the Inf-CL paper: loss memory, peak memory and the largest batch that trains.

For each model x loss x offload setting, full training steps (training_step.py: Gradient
Cache at `--chunk` samples per encoder pass, bf16 autocast, fused AdamW, synthetic data)
at growing global batches: doubling from `--start` until a step runs out of memory, then
bisection between the last batch that fit and the first that did not, down to
`--resolution`. Every probe records its step time and peak memory, and the loss memory
(the loss alone, forward and backward, on this rank's features at that batch). Searches
share `--budget` seconds: a probe whose estimated time would not fit is not run, and the
largest batch that fit is then reported as a lower bound. open_clip_train's own step
(its `train_one_epoch`, plain step, no Gradient Cache, data on the GPU) is searched the
same way as the baseline, in a single process. Each search also reports where a quadratic
fit of its peak memory against batch reaches the GPU's memory (an estimate, as the paper's
Figure 1 estimates beyond 80 GB), since at the largest batches a single step takes longer
than a command may run.

`--probe memory` (the default) makes the largest batches reachable within minutes: each
probe is a step whose encoders run for real on a few chunks only and return stand-in
features on the others (`training_step.SampledEncoders`), so everything of batch size --
the data, the features and their gradients, the loss over the global batch -- is allocated
as in a full step, beside one chunk's activations, but the time is that of the loss.
Each model's first batch is also run as a full step and both peaks are recorded
(`probe_check`), so the JSON shows whether the probe sees the full step's peak.
`--probe full` runs whole steps only.

    python scripts/reproduce/max_batch.py --models ViT-B-16 --out docs/results/max_batch_vit_b16_1xh100.json
    torchrun --nproc_per_node 2 scripts/reproduce/max_batch.py --models ViT-L-14 --out docs/results/max_batch_vit_l14_2xh200.json
    python scripts/reproduce/max_batch.py --smoke --out /tmp/max_batch.json     # tiny model, CPU, < 1 minute

Writes the JSON (rewritten after every search) and a PNG next to it: memory against batch,
log-log, one panel per loss.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # scripts/bench_*.py
from bench_step import SyntheticBatches, open_clip_train_steps
from clipscale.checks import check_loss_choices
from clipscale.provenance import provenance
from common import RESULTS, log_log, publish, pyplot, save_figure, write_json
from training_step import (
    GIB,
    agree,
    load_workload,
    loss_memory_gib,
    release,
    smoke_model_name,
    start,
    training_step,
)

# Samples per GPU per encoder pass. Small enough for ViT-L/14's activations on an 80 GB GPU;
# pass the paper's accumulation size with --chunk to match its setting exactly.
DEFAULT_CHUNK = 128


class Search:
    """Doubling, then bisection, for the largest global batch for which `probe(batch)` fits."""

    def __init__(self, probe, start_batch: int, resolution: int, multiple: int, deadline: float, limit: int, world):
        self.probe, self.batch, self.resolution, self.multiple, self.deadline = probe, start_batch, resolution, multiple, deadline
        self.limit, self.world = limit, world
        self.probes: list[dict] = []

    def run(self) -> dict:
        fits, fails = 0, None
        while fails is None or fails - fits > self.resolution:
            batch = self.batch if fails is None else self.round((fits + fails) // 2)
            if batch in (fits, fails) or batch > self.limit or not self.affordable(batch):
                break
            row = {"batch": batch, **self.probe(batch)}
            self.probes.append(row)
            if self.world.is_main:
                print(f"    batch {batch:>9,}: {row}", flush=True)
            if "error" in row:
                fails = batch
            else:
                fits = batch
                self.batch = batch * 2
        if fails is not None and fails - fits <= self.resolution:
            bound = "exact"
        else:
            bound = "lower bound (--max-batch)" if self.batch > self.limit else "lower bound (time budget)"
        return {"max_batch": fits or None, "first_failing_batch": fails, "max_batch_is": bound, "probes": self.probes}

    def round(self, batch: int) -> int:
        return max(self.multiple, batch // self.multiple * self.multiple)

    def affordable(self, batch: int) -> bool:
        """Would a step at `batch` end before the deadline, at the speed of the last step that ran?"""
        timed = [p for p in self.probes if "step_s" in p]
        estimate = 1.2 * batch * timed[-1]["step_s"] / timed[-1]["batch"] if timed else 0.0
        # Ranks must agree, or one would wait forever in a collective the other never joins.
        return not agree(time.monotonic() + estimate >= self.deadline, self.world.device)


def extrapolate(probes: list[dict], capacity_gib: float | None) -> int | None:
    """The batch at which a quadratic fit of peak memory against batch reaches the GPU's
    capacity (the paper's Figure 1 extrapolates the same way); None without 3 measured points."""
    points = [(p["batch"], p["peak_gib"]) for p in probes if p.get("peak_gib") is not None]
    if capacity_gib is None or len(points) < 3:
        return None
    batches, peaks = zip(*points)
    c2, c1, c0 = numpy.polyfit(batches, peaks, 2)
    roots = [r.real for r in numpy.roots([c2, c1, c0 - capacity_gib]) if abs(r.imag) < 1e-9 and r.real > max(batches)]
    return int(min(roots)) if roots else None


def clipscale_probe(work, world, loss, chunk, offload, memory_probe):
    def probe(batch: int) -> dict:
        row = training_step(work, world, loss, batch, chunk, offload, memory_probe=memory_probe)
        row["loss_gib"] = loss_memory_gib(loss, world, batch, work.feature_dim)
        return row

    return probe


def open_clip_train_probe(model_name: str, device: torch.device, smoke: bool):
    """open_clip_train's train_one_epoch for two steps (the first allocates AdamW's state)."""
    loop_args = Namespace(lock_image=False, grad_checkpointing=False, precision="bf16" if device.type == "cuda" else "fp32")

    def probe(batch: int) -> dict:
        release(device)
        images = texts = batches = None
        try:
            size, context = (32, 16) if smoke else (224, 77)
            images = torch.randn(batch, 3, size, size, device=device)
            texts = torch.randint(1, 49408, (batch, context), device=device)
            batches = SyntheticBatches(images, texts, 2, device)
            open_clip_train_steps(loop_args, model_name, batches, device)
            row = {"step_s": batches.stamps[-1] - batches.stamps[-2]}
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
            return row
        except torch.OutOfMemoryError:
            return {"error": "out of memory"}
        finally:
            images = texts = batches = None
            release(device)

    return probe


def plot(record: dict, path: Path) -> None:
    plt = pyplot()
    losses = record["losses"]
    columns = min(2, len(losses))
    rows = -(-len(losses) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.2 * rows), sharey=True, squeeze=False)
    for ax, loss in zip(axes.flat, losses):
        loss_only = {}  # per model (its feature width); the same with and without offload
        for search in (s for s in record["searches"] if s["loss"] == loss):
            fitted = sorted((p for p in search["probes"] if p.get("peak_gib") is not None), key=lambda p: p["batch"])
            if not fitted:  # a CPU run measures no GPU memory
                continue
            ax.plot([p["batch"] for p in fitted], [p["peak_gib"] for p in fitted], "o-",
                    label=f"{search['model']}, offload {'on' if search['offload'] else 'off'}: peak")
            loss_only.setdefault(search["model"], {}).update(
                {p["batch"]: p["loss_gib"] for p in fitted if isinstance(p.get("loss_gib"), float)})
        for (model, by_batch), style in zip(loss_only.items(), ["k--", "k:", "k-."]):
            batches = sorted(by_batch)
            ax.plot(batches, [by_batch[b] for b in batches], style, label=f"{model}: the loss alone")
        if ax.lines:
            log_log(ax, [p["batch"] for s in record["searches"] if s["loss"] == loss for p in s["probes"] if "peak_gib" in p])
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no GPU memory measured\n(CPU run)", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"loss: {loss}")
        ax.set_xlabel("global batch size (samples)")
    for ax in axes[:, 0]:
        ax.set_ylabel("GPU memory per GPU (GiB)")
    for ax in axes.flat[len(losses):]:
        ax.set_visible(False)
    fig.suptitle(f"{record['device']}: memory of a full training step (Gradient Cache, chunk {record['chunk']} per GPU)",
                 fontsize=11)
    save_figure(fig, path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["ViT-B-16", "ViT-L-14"])
    parser.add_argument("--losses", nargs="+", default=["vanilla", "local", "disco", "infcl"])
    parser.add_argument("--offload", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="Gradient Cache samples per GPU per encoder pass")
    parser.add_argument("--start", type=int, default=4096, help="first global batch of every search")
    parser.add_argument("--resolution", type=int, default=None, help="stop bisecting below this gap (default start/4)")
    parser.add_argument("--max-batch", type=int, default=2**23, help="never probe above this global batch")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all searches together")
    parser.add_argument("--probe", choices=["memory", "full"], default="memory",
                        help="memory: steps whose encoders run on a few chunks only (training_step.SampledEncoders), "
                             "checked against a full step at --start; full: every probe is a whole training step")
    parser.add_argument("--no-baseline", action="store_true", help="skip open_clip_train's search")
    parser.add_argument("--smoke", action="store_true", help="tiny model and batches on the CPU: checks the script")
    parser.add_argument("--out", default=str(RESULTS / "max_batch.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.chunk, args.start, args.max_batch = [smoke_model_name()], 8, 16, 32

    check_loss_choices([(loss, {}) for loss in args.losses], args.models)
    world = start()
    deadline = time.monotonic() + args.budget
    resolution = args.resolution or max(world.world_size, args.start // 4)
    baseline = not args.no_baseline and world.world_size == 1
    capacity_gib = torch.cuda.get_device_properties(world.device).total_memory / GIB if world.device.type == "cuda" else None
    record = {"what": "largest global batch of a full training step, and its memory, per model x loss x offload",
              "losses": args.losses, "chunk": args.chunk, "world_size": world.world_size, "gpu_memory_gib": capacity_gib,
              "precision": "bf16 autocast, fp32 master weights, fused AdamW" if world.device.type == "cuda" else "fp32 (CPU)",
              **provenance(argv), "searches": []}
    searches_left = len(args.models) * (len(args.offload) * len(args.losses) + baseline)
    memory_probe = args.probe == "memory"
    record["probe"] = args.probe
    for model_name in args.models:
        work = load_workload(model_name, world)
        if memory_probe:  # does the probe see the peak of a full step? Both at the first batch, with Inf-CL.
            offload = args.offload[0] == "on"
            full, probed = (training_step(work, world, "infcl", args.start, args.chunk, offload, memory_probe=m) for m in (False, True))
            record.setdefault("probe_check", []).append(
                {"model": model_name, "batch": args.start, "offload": offload, "loss": "infcl",
                 "full_step_peak_gib": full.get("peak_gib"), "memory_probe_peak_gib": probed.get("peak_gib"),
                 "full_step_s": full.get("step_s"), "memory_probe_s": probed.get("step_s")})
            if world.is_main:
                print(f"  probe check: {record['probe_check'][-1]}", flush=True)
        for offload, loss in ((o == "on", loss) for o in args.offload for loss in args.losses):
            if world.is_main:
                print(f"{model_name} {loss} offload {'on' if offload else 'off'}", flush=True)
            share = (deadline - time.monotonic()) / searches_left  # what earlier searches left over goes to later ones
            searches_left -= 1
            search = Search(clipscale_probe(work, world, loss, args.chunk, offload, memory_probe), args.start, resolution,
                            world.world_size * args.chunk, time.monotonic() + share, args.max_batch, world)
            found = search.run()
            found["extrapolated_max_batch"] = extrapolate(found["probes"], capacity_gib)
            record["searches"].append({"model": model_name, "loss": loss, "offload": offload, **found})
            if world.is_main:
                write_json(record, Path(args.out))
        work = search = None  # free this model before the next one, and before the baseline builds its own
        release(world.device)
    if baseline:
        for model_name in args.models:
            print(f"{model_name} open_clip_train", flush=True)
            share = (deadline - time.monotonic()) / searches_left
            searches_left -= 1
            search = Search(open_clip_train_probe(model_name, world.device, args.smoke), max(8, args.start // 16),
                            max(8, resolution // 16), 8, time.monotonic() + share, args.max_batch, world)
            record.setdefault("baseline_open_clip_train", []).append(
                {"model": model_name, "what": "open_clip_train.train.train_one_epoch, plain step, data on the GPU", **search.run()})
    if world.is_main:
        publish(record, Path(args.out), plot)
    return record


if __name__ == "__main__":
    main()
