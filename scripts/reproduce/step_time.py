"""Table S1 and Figure 4 of the Inf-CL paper: training time per step and per epoch against batch size.

For each loss and global batch: full training steps (training_step.py: Gradient Cache at
`--chunk`, bf16 autocast, fused AdamW, data offloaded to the host), the median of
`--repeats` after one untimed step at that batch (allocator, kernel autotuning). Time per
epoch = ceil(epoch samples / batch) x time per step, for the dataset size given by
`--epoch-samples` (recorded in the JSON). A batch whose steps would not end before the
`--budget` deadline, at the speed measured so far, is skipped and recorded as such; an
out-of-memory step is recorded too (vanilla at large batches).

    python scripts/reproduce/step_time.py --out docs/results/step_time_vit_b16_1xh100.json
    torchrun --nproc_per_node 2 scripts/reproduce/step_time.py --out docs/results/step_time_vit_b16_2xh200.json
    python scripts/reproduce/step_time.py --smoke --out /tmp/step_time.json     # tiny, CPU

Writes the JSON and a PNG next to it (seconds per step against batch, log-log, per loss).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from clipscale.checks import check_loss_choices
from clipscale.provenance import provenance
from common import RESULTS, log_log, publish, pyplot, save_figure, write_json
from training_step import agree, load_workload, smoke_model_name, start, training_step


def measure(work, world, loss: str, batch: int, args, seconds_per_sample: float | None, deadline: float) -> dict:
    row = {"loss": loss, "batch": batch}
    estimate = (args.repeats + 1) * batch * (seconds_per_sample or 0.0) * 1.2
    if agree(time.monotonic() + estimate > deadline, world.device):  # ranks must take the same decision
        return row | {"skipped": f"estimated {estimate:.0f} s, past the --budget deadline"}
    steps = [training_step(work, world, loss, batch, args.chunk, offload=True) for _ in range(args.repeats + 1)]
    if any("error" in s for s in steps):
        return row | {"error": next(s["error"] for s in steps if "error" in s)}
    step_s = statistics.median(s["step_s"] for s in steps[1:])
    return row | {"step_s": step_s, "samples_per_s": batch / step_s, "peak_gib": max(s["peak_gib"] or 0 for s in steps) or None,
                  "epoch_h": math.ceil(args.epoch_samples / batch) * step_s / 3600}


def plot(record: dict, path: Path) -> None:
    plt = pyplot()
    fig, (per_step, per_epoch) = plt.subplots(1, 2, figsize=(11, 4.2))
    for loss in record["losses"]:
        rows = [r for r in record["rows"] if r["loss"] == loss and "step_s" in r]
        per_step.plot([r["batch"] for r in rows], [r["step_s"] for r in rows], "o-", label=loss)
        per_epoch.plot([r["batch"] for r in rows], [r["epoch_h"] for r in rows], "o-", label=loss)
    per_step.set_ylabel("seconds per training step")
    per_epoch.set_ylabel(f"hours per epoch of {record['epoch_samples']:,} samples")
    for ax in (per_step, per_epoch):
        log_log(ax, [r["batch"] for r in record["rows"]])
        low, high = ax.get_ylim()
        if high < 2 * low:  # one batch, or times within 2x: log ticks would label at most one value
            ax.set_yscale("linear")
        ax.set_xlabel("global batch size (samples)")
        ax.legend()
    skipped = sorted({r["batch"] for r in record["rows"] if "skipped" in r})
    if skipped:
        fig.text(0.5, 0.01, "not measured (time budget): " + ", ".join(f"{b:,}" for b in skipped), ha="center", fontsize=9)
    fig.suptitle(f"{record['device']}: {record['model']}, Gradient Cache chunk {record['chunk']}, data offloaded", fontsize=10)
    save_figure(fig, path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--losses", nargs="+", default=["vanilla", "local", "disco", "infcl"])
    parser.add_argument("--batches", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--chunk", type=int, default=256, help="Gradient Cache samples per GPU per encoder pass")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per batch, after one untimed")
    parser.add_argument("--epoch-samples", type=int, default=10_000_000, help="dataset size for time per epoch")
    parser.add_argument("--budget", type=float, default=540, help="seconds; batches that would end later are skipped")
    parser.add_argument("--smoke", action="store_true", help="tiny model and batches on the CPU: checks the script")
    parser.add_argument("--out", default=str(RESULTS / "step_time.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batches, args.chunk, args.repeats = smoke_model_name(), [16, 32], 8, 1

    check_loss_choices([(loss, {}) for loss in args.losses], [args.model])
    world = start()
    deadline = time.monotonic() + args.budget
    work = load_workload(args.model, world)
    record = {"what": "time per full training step and per epoch against global batch, per loss",
              "model": args.model, "losses": args.losses, "chunk": args.chunk, "epoch_samples": args.epoch_samples,
              "world_size": world.world_size, **provenance(argv), "rows": []}
    # Smallest batches first, every loss, so that a tight budget still gives each loss a curve.
    for batch in sorted(args.batches):
        for loss in args.losses:
            timed = [r for r in record["rows"] if r["loss"] == loss and "step_s" in r]
            rate = timed[-1]["step_s"] / timed[-1]["batch"] if timed else None
            if any(r["loss"] == loss and "error" in r for r in record["rows"]):
                continue  # out of memory at a smaller batch already
            record["rows"].append(measure(work, world, loss, batch, args, rate, deadline))
            if world.is_main:
                print(record["rows"][-1], flush=True)
                write_json(record, Path(args.out))
    if world.is_main:
        publish(record, Path(args.out), plot)
    return record


if __name__ == "__main__":
    main()
