"""Where numbers go: runs/<name>/metrics.jsonl, wandb (when enabled) and the console.

Only rank 0 writes. On resume, lines past the checkpoint's step are dropped so
the file always reads as one clean curve.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from clipscale.config import Config


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
        if not enabled:
            return
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
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

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def write_json(self, path: Path, values: dict) -> None:
        if self.enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values, indent=1) + "\n")

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
