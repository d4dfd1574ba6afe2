"""Where numbers go: runs/<name>/metrics.jsonl, wandb and TensorBoard (when enabled) and the console.

`RecordWindow` builds a training step's record; `MetricsLogger` writes records.
Only rank 0 writes. On resume, lines past the checkpoint's step are dropped so
the file always reads as one clean curve, and so is a last line cut short by a
crash or a full disk (with a warning naming the file); that rewrite, like every
evaluation's JSON file, goes to a temporary file renamed over the old one, so a
crash leaves the old file or the new one, never a mix. Every line is strict
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
import resource
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from clipscale.checkpoint import write_text_atomic
from clipscale.config import Config
from clipscale.errors import UserError, storage_errors

if TYPE_CHECKING:
    from clipscale.step import StepResult

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
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
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
            write_text_atomic(path, strict_json(values, indent=1) + "\n")

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


class RecordWindow:
    """A training step's metrics record: its loss, lr, gradient norm and logit scale, the
    throughput over the steps since the previous record, the peak memory, and the data errors
    (skipped samples, unreadable shards) over all ranks since the previous record and since the
    run began. Its state, the error counts at the previous record, is checkpointed (per rank),
    so the first record after a resume counts from the same record as an uninterrupted run."""

    def __init__(self, batch_size: int, device: torch.device):
        self.batch_size, self.device = batch_size, device
        self.logged_data_errors: list[int] | None = None  # [skipped samples, shard errors] at the previous record
        self.start, self.steps = time.perf_counter(), 0

    def open(self, data_errors: list[int]) -> None:
        """At the loop's start, with the counts so far (a run that resumes keeps its saved ones)."""
        if self.logged_data_errors is None:
            self.logged_data_errors = data_errors
        self.start, self.steps = time.perf_counter(), 0

    def step_done(self) -> None:
        self.steps += 1

    def record(self, result: StepResult, lr: float, *, logit_scale: float, nonfinite_steps: int,
               data_errors: list[int], extra: dict | None = None) -> dict:
        """The record, and a new window from now. `extra`: further figures, logged as given."""
        elapsed = time.perf_counter() - self.start
        skipped, shard_errors = data_errors
        record = {
            "loss": result.loss.item(),
            "lr": lr,
            "logit_scale": logit_scale,
            "grad_norm": result.grad_norm.item(),
            "samples_per_s": self.steps * self.batch_size / elapsed,
            "step_s": elapsed / self.steps,
            "peak_memory_gib": peak_memory_gib(self.device),
            "skipped_samples": skipped - self.logged_data_errors[0],
            "skipped_samples_total": skipped,
            "shard_errors": shard_errors - self.logged_data_errors[1],
            "shard_errors_total": shard_errors,
            "nonfinite_steps": nonfinite_steps,
            **(extra or {}),
            "time": time.time(),
        }
        self.logged_data_errors = list(data_errors)
        self.start, self.steps = time.perf_counter(), 0
        return record

    def state_dict(self) -> dict:
        return {"logged_data_errors": self.logged_data_errors}

    def load_state_dict(self, state: dict) -> None:
        self.logged_data_errors = state["logged_data_errors"]


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


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
