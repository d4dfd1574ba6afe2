"""A scaled-down analogue of the Inf-CL paper's Table 3: zero-shot accuracy against batch size.

Trains the digits job once per global batch size, every run seeing the same number of
samples (so larger batches take fewer steps), and reports zero-shot top-1 on the 359
held-out digits. Same seed, learning rate and model for every batch; warmup is a fixed
fraction of each run's steps. One process per run, on whatever device the config picks.

    python scripts/reproduce/batch_sweep_digits.py --tiny          # 64 ... 512, 12,288 and 49,152 samples each
    python scripts/reproduce/batch_sweep_digits.py --batches 32 64 --samples 2048 -- data.root=/tmp/digits

Writes `<out>/batch_sweep_digits.{json,png}`. This shows the *shape* of accuracy against
batch on a toy set; it says nothing about the paper's ImageNet numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from clipscale.provenance import provenance
from common import REPO, RESULTS, pyplot, save_figure, write_json

sys.path.insert(0, str(REPO / "scripts"))
from bench_step import SMOKE_MODEL

WARMUP_FRACTION = 0.1  # the default digits run warms up for 20 of its 200 steps


def train_once(batch: int, samples: int, args, run_root: Path) -> dict:
    steps = max(1, samples // batch)
    name = f"batch_{batch}_samples_{samples}"
    overrides = [
        f"run.name={name}",
        f"run.output_dir={run_root}",
        "run.resume=false",
        f"train.batch_size={batch}",
        f"train.steps={steps}",
        f"optim.warmup_steps={max(1, round(WARMUP_FRACTION * steps))}",
        f"train.log_every={max(1, steps // 50)}",
        f"train.checkpoint_every={steps}",
        "eval.every_n_steps=0",
        *([f"model.custom={json.dumps(SMOKE_MODEL)}"] if args.tiny else []),
        *args.overrides,
    ]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", args.config, *overrides],
                            cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"training at batch {batch} failed:\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_root / name / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    return {
        "batch_size": batch,
        "steps": steps,
        "samples_seen": steps * batch,
        "zeroshot_acc1": next(r["zeroshot_acc1"] for r in reversed(records) if "zeroshot_acc1" in r),
        "final_train_loss": losses[-1],
        "wall_s": round(time.monotonic() - started, 1),
    }


def plot(runs: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets = sorted({r["samples_per_run"] for r in runs})
    for samples in budgets:
        line = [r for r in runs if r["samples_per_run"] == samples]
        batches = [r["batch_size"] for r in line]
        accuracy = [100 * r["zeroshot_acc1"] for r in line]
        ax.plot(batches, accuracy, "o-", linewidth=1.6, label=f"{samples:,} samples per run")
        # the largest budget's labels above its points, the others' below, so that curves close together stay legible
        offset = 7 if samples == budgets[-1] else -14
        for batch, acc, run in zip(batches, accuracy, line):
            ax.annotate(f"{acc:.1f}%, {run['steps']} steps", (batch, acc), textcoords="offset points", xytext=(0, offset),
                        ha="center", fontsize=7)
    batches = sorted({r["batch_size"] for r in runs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch size (samples, log scale)")
    ax.set_ylabel("zero-shot top-1 on 359 held-out digits (%)")
    ax.axhline(10, color="grey", linestyle=":", label="chance (10 classes)")
    ax.set_ylim(0, 108)
    ax.set_yticks(range(0, 101, 20))
    ax.margins(x=0.1)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--samples", type=int, nargs="+", default=[12288, 49152],
                        help="samples seen by every run (steps = samples // batch); one curve per value")
    parser.add_argument("--tiny", action="store_true", help="bench_step's tiny CLIP instead of the config's model")
    parser.add_argument("--config", default=str(REPO / "configs" / "digits.yaml"))
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--runs", default=str(REPO / "runs" / "batch_sweep"), help="where the training runs go")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = parser.parse_args(argv)

    runs = []
    for samples in args.samples:
        for batch in args.batches:
            print(f"batch {batch}: {samples // batch} steps ...", flush=True)
            runs.append({"samples_per_run": samples, **train_once(batch, samples, args, Path(args.runs))})
            print(f"  zero-shot top-1 {100 * runs[-1]['zeroshot_acc1']:.2f}% ({runs[-1]['wall_s']} s)", flush=True)
    record = {
        "what": "zero-shot top-1 on the held-out digits after the same number of samples at each global batch size",
        "config": args.config,
        "model": f"tiny: {json.dumps(SMOKE_MODEL)}" if args.tiny else "the config's model",
        "overrides": args.overrides,
        "warmup_fraction": WARMUP_FRACTION,
        "runs": runs,
        **provenance(argv),
    }
    out = Path(args.out)
    write_json(record, out / "batch_sweep_digits.json")
    plot(runs, out / "batch_sweep_digits.png",
         f"digits ({'tiny CLIP' if args.tiny else Path(args.config).name}): same samples, lr and seed at every batch")
    return record


if __name__ == "__main__":
    main()
