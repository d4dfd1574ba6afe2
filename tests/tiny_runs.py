"""Tiny training runs for tests: a model that learns digits in a few seconds, launched for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIGITS_YAML = str(REPO / "configs" / "digits.yaml")

# A model small enough for a few seconds of CPU training.
TINY_MODEL = (
    "model.custom={embed_dim: 32, "
    "vision_cfg: {image_size: 32, patch_size: 8, width: 64, layers: 2, head_width: 32, mlp_ratio: 2.0}, "
    "text_cfg: {context_length: 16, vocab_size: 49408, width: 64, heads: 2, layers: 2, mlp_ratio: 2.0}}"
)


def tiny_run(digits_root: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        TINY_MODEL,
        f"data.root={digits_root}",
        f"run.output_dir={output_dir}",
        "run.name=tiny",
        "train.batch_size=64",
        "train.log_every=1",
        "optim.warmup_steps=5",
        "optim.lr=2e-3",
        "eval.every_n_steps=0",
        *extra,
    ]


def run_train(overrides: list[str], *, nproc: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(
        [*launcher, str(REPO / "train.py"), "--config", DIGITS_YAML, *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )

