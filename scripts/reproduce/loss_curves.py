"""Figure S2 of the Inf-CL paper: the same run under each loss gives the same loss curve.

Trains the digits job once per loss with the same seed and data order (torchrun,
`--nproc` processes, on the GPUs when there are any), overlays the per-step training
losses and writes the JSON given by `--out` and a PNG beside it. The JSON holds every
curve, the largest difference to the first loss at any step, and the device, versions,
date and command.

    python scripts/reproduce/loss_curves.py                       # 4 losses, 2 processes, 200 steps
    python scripts/reproduce/loss_curves.py --steps 20 -- train.batch_size=64
    python scripts/reproduce/loss_curves.py --out docs/results/loss_curves_digits_2xh200_bf16.json -- train.precision=bf16
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
from common import REPO, RESULTS, publish, pyplot, save_figure


def run_loss(loss: str, args, run_root: Path) -> list[float]:
    # --standalone: a free rendezvous port, so several of these scripts can run side by side.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    overrides = [
        f"loss.name={loss}",
        f"run.name={loss}",
        f"run.output_dir={run_root}",
        "run.resume=false",
        f"train.steps={args.steps}",
        "train.log_every=1",
        f"train.checkpoint_every={args.steps}",
        "eval.every_n_steps=0",
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run([*launcher, str(REPO / "train.py"), "--config", args.config, *overrides], env=env,
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"training with loss {loss} failed:\n{result.stderr[-4000:]}")
    lines = (run_root / loss / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


def plot(record: dict, path: Path) -> None:
    plt = pyplot()
    curves, reference = record["curves"], record["reference"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    styles = ["-", "--", ":", "-."]
    for (loss, values), style in zip(curves.items(), styles * 2):
        steps = range(1, len(values) + 1)
        top.plot(steps, values, style, label=loss, linewidth=1.6)
        if loss != reference:
            bottom.plot(steps, [abs(a - b) for a, b in zip(values, curves[reference])], style, label=f"|{loss} − {reference}|")
    top.set_ylabel("training loss (nats)")
    top.set_title(f"digits on {record['nproc']} x {record['device']}: training loss under each loss function", fontsize=10)
    top.legend()
    bottom.set_xlabel("step")
    bottom.set_ylabel("abs. difference")
    bottom.set_yscale("symlog", linthresh=1e-7)
    bottom.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", nargs="+", default=["vanilla", "local", "disco", "infcl"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--config", default=str(REPO / "configs" / "digits.yaml"))
    parser.add_argument("--out", default=str(RESULTS / "loss_curves_digits.json"), help="the JSON; the PNG goes beside it")
    parser.add_argument("--runs", default=str(REPO / "runs" / "loss_curves"), help="where the training runs go")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = parser.parse_args(argv)

    curves = {}
    for loss in args.losses:
        print(f"training with loss {loss} on {args.nproc} processes ...", flush=True)
        started = time.monotonic()
        curves[loss] = run_loss(loss, args, Path(args.runs))
        print(f"  {time.monotonic() - started:.0f} s", flush=True)
    reference = args.losses[0]
    max_difference = {
        loss: max(abs(a - b) for a, b in zip(values, curves[reference])) for loss, values in curves.items() if loss != reference
    }
    result = {
        "what": f"per-step training loss of the same run under each loss ({args.nproc} processes, same seed and data)",
        "nproc": args.nproc,
        "overrides": args.overrides,
        "reference": reference,
        "max_abs_difference_to_reference": max_difference,
        "curves": curves,
        **provenance(argv),
    }
    publish(result, Path(args.out), plot)
    for loss, difference in max_difference.items():
        print(f"max |{loss} - {reference}| over {args.steps} steps: {difference:.3g}")
    return result


if __name__ == "__main__":
    main()
