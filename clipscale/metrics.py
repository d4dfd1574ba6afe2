"""Where numbers go: runs/<name>/metrics.jsonl, wandb and TensorBoard (when enabled) and the console.

Only rank 0 writes. On resume, lines past the checkpoint's step are dropped so
the file always reads as one clean curve, and so is a last line cut short by a
crash or a full disk (with a warning naming the file). Every line is strict
JSON: a non-finite number is written as null and its key listed under
"nonfinite" (`{"step": 7, "loss": null, "nonfinite": ["loss"]}`), so any JSON
reader takes the file. TensorBoard's event files (runs/<name>/tensorboard) get
every number of each record as a scalar of that name; on resume its events past
the checkpoint's step are purged the same way.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from clipscale.config import Config
from clipscale.errors import UserError, storage_errors

NONFINITE = "nonfinite"  # the key listing a record's values that were NaN or infinite
TENSORBOARD = "tensorboard"  # the event files' folder in the run folder


def _wandb_mode(mode: str) -> str:
    """'auto' is online only when a key is configured (env or ~/.netrc from `wandb login`)."""
    if mode != "auto":
        return mode
    netrc = Path.home() / ".netrc"
    logged_in = netrc.exists() and "api.wandb.ai" in netrc.read_text()
    return "online" if os.environ.get("WANDB_API_KEY") or logged_in else "offline"


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: Config, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self.tensorboard = None
        if not enabled:
            return
        if self.path.exists():
            kept = [line for line, record in _complete_lines(self.path) if record["step"] <= resume_step]
            with storage_errors(self.path, "write"):
                self.path.write_text("".join(line + "\n" for line in kept))
        if cfg.wandb.enabled:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb.project,
                name=cfg.run.name,
                id=cfg.run.name,
                resume="allow",
                dir=str(run_dir),
                config=cfg.to_dict(),
                mode=_wandb_mode(cfg.wandb.mode),
            )
        if cfg.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            with storage_errors(run_dir / TENSORBOARD, "write"):
                self.tensorboard = SummaryWriter(str(run_dir / TENSORBOARD), purge_step=resume_step + 1)

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values}
        with storage_errors(self.path, "write"), self.path.open("a") as f:
            f.write(strict_json(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, global_step=step)

    def write_json(self, path: Path, values: dict) -> None:
        if self.enabled:
            with storage_errors(path, "write"):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(strict_json(values, indent=1) + "\n")

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def strict_json(record: dict, **options) -> str:
    """`record` as JSON without NaN or Infinity (which strict readers reject): each non-finite
    top-level number becomes null and its key is listed under "nonfinite"."""
    nonfinite = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
    if nonfinite:
        record = {**{key: None if key in nonfinite else value for key, value in record.items()}, NONFINITE: nonfinite}
    return json.dumps(record, allow_nan=False, **options)


def _complete_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of every line of a metrics file. A last line that is cut short is
    dropped with a warning; an unreadable line before it is a UserError naming it."""
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            records.append((line, json.loads(line)))
        except json.JSONDecodeError as err:
            if number == len(lines):
                warnings.warn(f"{path}: dropped its last line, cut short by an interrupted write: {line[:80]!r}", stacklevel=3)
                break
            raise UserError(f"{path} line {number} is not JSON ({err.msg}); remove or repair that line") from None
    return records


def read_metrics(path: Path) -> list[dict]:
    return [record for _, record in _complete_lines(Path(path))]
