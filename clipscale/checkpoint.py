"""Checkpoints: open_clip's layout, written atomically, loaded safely.

A checkpoint is a dict with open_clip's keys (`state_dict` of the unwrapped
model, `optimizer`, `scaler`, `epoch`, `name`) so `open_clip.load_checkpoint`
and `open_clip.create_model(name, pretrained=path)` read it, plus what exact
resumption needs: `step`, the scheduler-free training state, every rank's
data-stream cursors and RNG states. It is written to a temporary file in the
same folder and renamed over the target, so a crash never leaves a truncated
checkpoint, and it is read with `weights_only=True`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

LATEST = "latest.pt"


def save_atomic(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(checkpoint_dir: Path, step: int, state: dict) -> Path:
    """Write step_<n>.pt atomically, then make latest.pt a hard link to it (also atomic)."""
    path = checkpoint_dir / f"step_{step:08d}.pt"
    save_atomic(state, path)
    link = checkpoint_dir / f".{LATEST}.link"
    link.unlink(missing_ok=True)
    os.link(path, link)
    os.replace(link, checkpoint_dir / LATEST)
    return path


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def latest_checkpoint(checkpoint_dir: Path) -> Optional[Path]:
    path = checkpoint_dir / LATEST
    return path if path.exists() else None
