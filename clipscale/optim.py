"""AdamW with open_clip's weight-decay exclusions, and its cosine schedule with warmup."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from clipscale.config import OptimConfig


def _decays(name: str, param: nn.Parameter) -> bool:
    # open_clip_train: no decay for gains, biases, norms and the logit scale
    return not (param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name)


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.AdamW:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if not _decays(n, p)], "weight_decay": 0.0},
        {"params": [p for n, p in named if _decays(n, p)], "weight_decay": cfg.weight_decay},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)


def cosine_lr(step: int, base_lr: float, warmup_steps: int, total_steps: int) -> float:
    """open_clip's `cosine_lr`: linear warmup to base_lr, then half a cosine down to 0."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) * base_lr
