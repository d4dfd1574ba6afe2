"""What every reproduction script shares: its output files (the provenance block of its JSON is
clipscale.provenance's)."""

from __future__ import annotations

import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"


def write_json(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on the machines that run this)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_log(ax, batches) -> None:
    """Log-log axes labelled in plain numbers: powers of two over the batches on x, '%g' values on y."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    powers = [2**k for k in range(math.floor(math.log2(min(batches))), math.ceil(math.log2(max(batches))) + 1)]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(powers, [f"{b:,}" if b < 10_000 else f"{b // 1024:,}k" for b in powers], rotation=45 if len(powers) > 7 else 0)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}", flush=True)


def publish(record: dict, json_path: Path, plot) -> None:
    """The JSON, and its picture beside it: plot(record, <json_path>.png)."""
    write_json(record, json_path)
    plot(record, json_path.with_suffix(".png"))
