"""Samples/s and peak memory of one training step: clipscale's vs open_clip_train's.

Both run the same open_clip model, batch, precision and synthetic data (random pixels
and tokens already on the device) in this process, one after the other:

  open_clip_train  its own `train_one_epoch` (plain step, foreach AdamW, ClipLoss),
                   fed the synthetic batches, as `python -m open_clip_train.main` runs it;
  clipscale        the trainer's step: build_model (with the speed options given here),
                   the trainer's TrainStep (GradCache, one chunk = plain step), fused AdamW on
                   CUDA, grad clipping, the logit-scale clamp.

Step time is measured between consecutive batch fetches with the device synchronised,
so it covers everything either loop does per step; the first --warmup steps are dropped.

    python scripts/bench_step.py --model ViT-B-16 --batch 256 512 --out results/bench_step.json
    python scripts/bench_step.py --model ViT-B-16 --batch 512 --lock-image --out results/bench_step_lit.json
    python scripts/bench_step.py --smoke --out /tmp/bench_step.json      # tiny model, any device

Needs only installed wheels (torch, open_clip_torch, which ships open_clip_train); no network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from argparse import Namespace

import open_clip
import torch
from open_clip_train.train import train_one_epoch

from clipscale.config import ModelConfig, OptimConfig
from clipscale.losses import build_loss
from clipscale.models import build_model, register_custom
from clipscale.optim import build_optimizer
from clipscale.provenance import provenance
from clipscale.step import TrainStep

SMOKE_MODEL = {  # a few seconds per case on a CPU
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
GRAD_CLIP = 1.0  # both loops clip, as a real run does


class SyntheticBatches:
    """The same device batch `steps` times, with a device-synchronised timestamp before each
    fetch and after the last step; open_clip_train reads num_batches / num_samples from it."""

    def __init__(self, images, texts, steps, device):
        self.images, self.texts, self.steps, self.device = images, texts, steps, device
        self.num_batches, self.num_samples = steps, steps * len(images)
        self.stamps: list[float] = []

    def __iter__(self):
        for _ in range(self.steps):
            self.stamp()
            yield self.images, self.texts
        self.stamp()

    def __len__(self):
        return self.steps

    def stamp(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def step_seconds(self, warmup: int) -> float:
        return statistics.median([b - a for a, b in zip(self.stamps, self.stamps[1:])][warmup:])


def open_clip_train_steps(args, architecture, batches, device) -> None:
    model = open_clip.create_model(architecture, output_dict=True, device=device)
    if args.lock_image:
        model.lock_image_tower()
    if args.grad_checkpointing:
        model.set_grad_checkpointing(True)
    optimizer = build_optimizer(model, OptimConfig())  # open_clip_train's groups; its AdamW is not fused
    loop_args = Namespace(
        device=str(device), precision="amp_bf16" if args.precision == "bf16" else "fp32", distill=False,
        accum_freq=1, skip_scheduler=True, grad_clip_norm=GRAD_CLIP, horovod=False, batch_size=len(batches.images),
        world_size=1, rank=0, local_rank=0, log_every_n_steps=10**9, wandb=False,
    )
    # open_clip_train.data.DataInfo's interface, without that module's pandas import
    data = {"train": Namespace(dataloader=batches, set_epoch=lambda epoch: None)}
    train_one_epoch(model, data, open_clip.ClipLoss(), 0, optimizer, None, None, None, loop_args)


def clipscale_steps(args, architecture, batches, device) -> None:
    cfg = ModelConfig(name=architecture, lock_image=args.lock_image, grad_checkpointing=args.grad_checkpointing,
                      compile=args.compile, channels_last=args.channels_last)
    model = build_model(cfg).model.to(device).train()
    optimizer = build_optimizer(model, OptimConfig(), fused=device.type == "cuda")
    step = TrainStep(model, build_loss(args.loss), optimizer, chunk_size=len(batches.images),
                     precision="bf16" if args.precision == "bf16" else "fp32", grad_clip=GRAD_CLIP)
    for images, texts in batches:
        step(images, texts)


def measure(run, args, architecture, batch, device) -> dict:
    context, vocab = (16, 49408) if args.smoke else (77, 49408)
    size = 32 if args.smoke else 224
    images = torch.randn(batch, 3, size, size, device=device)
    texts = torch.randint(1, vocab, (batch, context), device=device)
    batches = SyntheticBatches(images, texts, args.warmup + args.steps, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        run(args, architecture, batches, device)
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    seconds = batches.step_seconds(args.warmup)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step_s": seconds, "samples_per_s": batch / seconds, "peak_allocated_gib": peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file, rewritten after every case")
    parser.add_argument("--model", default="ViT-B-16", help="an open_clip architecture")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--loss", default="vanilla", help="clipscale loss (open_clip_train uses its ClipLoss)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, autotuning, allocator)")
    parser.add_argument("--lock-image", action="store_true", help="LiT, in both loops")
    parser.add_argument("--grad-checkpointing", action="store_true", help="in both loops")
    parser.add_argument("--compile", action="store_true", help="clipscale only: model.compile")
    parser.add_argument("--channels-last", action="store_true", help="clipscale only")
    parser.add_argument("--smoke", action="store_true", help="a tiny model at 32 px: checks the script anywhere")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    architecture = register_custom(SMOKE_MODEL) if args.smoke else args.model
    record = {
        **provenance(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "cases": [],
    }
    for batch in args.batch:
        row = {"model": "smoke" if args.smoke else args.model, "batch": batch}
        for name, run in (("open_clip_train", open_clip_train_steps), ("clipscale", clipscale_steps)):
            with contextlib.redirect_stdout(sys.stderr):  # open_clip_train logs; keep stdout for results
                row[name] = measure(run, args, architecture, batch, device)
        if "samples_per_s" in row["open_clip_train"] and "samples_per_s" in row["clipscale"]:
            row["speedup"] = row["clipscale"]["samples_per_s"] / row["open_clip_train"]["samples_per_s"]
        record["cases"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
