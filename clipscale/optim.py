"""AdamW with open_clip's weight-decay exclusions, and open_clip_train's learning-rate schedules
(open_clip_train/scheduler.py: cosine_lr, const_lr, const_lr_cooldown) as functions of the step."""

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


def learning_rate(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The lr at `step` (0-based) of a run of `total_steps`, by optim.lr_scheduler: a linear warmup
    to optim.lr over optim.warmup_steps, then the schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "cosine":
        return cosine_lr(step, cfg.lr, cfg.warmup_steps, total_steps)
    if cfg.lr_scheduler == "const":
        return cfg.lr
    return const_cooldown_lr(step, cfg.lr, total_steps, cfg.lr_cooldown_steps, cfg.lr_cooldown_power, cfg.lr_cooldown_end)


def cosine_lr(step: int, base_lr: float, warmup_steps: int, total_steps: int) -> float:
    """open_clip's `cosine_lr` after the warmup: half a cosine from base_lr down to 0."""
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) * base_lr


def const_cooldown_lr(step: int, base_lr: float, total_steps: int, cooldown_steps: int, power: float, end_lr: float) -> float:
    """open_clip's `const_lr_cooldown` after the warmup: base_lr until the last `cooldown_steps`,
    then (1 - progress) ** power of the way from base_lr down to end_lr."""
    cooldown_start = total_steps - cooldown_steps
    if step < cooldown_start:
        return base_lr
    decay = (1 - (step - cooldown_start) / cooldown_steps) ** power
    return decay * (base_lr - end_lr) + end_lr
