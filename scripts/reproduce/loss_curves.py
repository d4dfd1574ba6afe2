"""Figure S2 of the Inf-CL paper: the same run under each loss gives the same loss curve.

Trains the digits job once per loss with the same seed and data order (torchrun,
`--nproc` processes), overlays the per-step training losses and writes
`<out>/loss_curves_digits.{json,png}`. The JSON holds every curve, the largest
difference to the first loss at any step, and the device, versions, date and command.

    python scripts/reproduce/loss_curves.py                       # 4 losses, 2 processes, 200 steps
    python scripts/reproduce/loss_curves.py --steps 20 -- train.batch_size=64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_loss(loss: str, args, run_root: Path) -> list[float]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
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


def plot(curves: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = next(iter(curves))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    styles = ["-", "--", ":", "-."]
    for (loss, values), style in zip(curves.items(), styles * 2):
        steps = range(1, len(values) + 1)
        top.plot(steps, values, style, label=loss, linewidth=1.6)
        if loss != reference:
            bottom.plot(steps, [abs(a - b) for a, b in zip(values, curves[reference])], style, label=f"|{loss} − {reference}|")
    top.set_ylabel("training loss (nats)")
    top.set_title(title)
    top.legend()
    bottom.set_xlabel("step")
    bottom.set_ylabel("abs. difference")
    bottom.set_yscale("symlog", linthresh=1e-7)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", nargs="+", default=["vanilla", "local", "disco", "infcl"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--config", default=str(REPO / "configs" / "digits.yaml"))
    parser.add_argument("--out", default=str(REPO / "docs" / "results"))
    parser.add_argument("--runs", default=str(REPO / "runs" / "loss_curves"), help="where the training runs go")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = parser.parse_args(argv)

    import torch

    curves = {}
    for loss in args.losses:
        print(f"training with loss {loss} on {args.nproc} processes ...", flush=True)
        curves[loss] = run_loss(loss, args, Path(args.runs))
    reference = args.losses[0]
    max_difference = {
        loss: max(abs(a - b) for a, b in zip(values, curves[reference])) for loss, values in curves.items() if loss != reference
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "what": f"per-step training loss of the same run under each loss ({args.nproc} processes, same seed and data)",
        "reference": reference,
        "max_abs_difference_to_reference": max_difference,
        "curves": curves,
        "device": platform.processor() or platform.machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    (out / "loss_curves_digits.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(curves, out / "loss_curves_digits.png", f"digits, {args.nproc} processes: training loss under each loss function")
    for loss, difference in max_difference.items():
        print(f"max |{loss} - {reference}| over {args.steps} steps: {difference:.3g}")
    return result


if __name__ == "__main__":
    main()
