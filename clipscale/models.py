"""Towers from open_clip: a named architecture or a custom CLIP config dict.

Returns the model with open_clip's conventions untouched (`encode_image`,
`encode_text`, `logit_scale` stored as a log, dict output), its train and
validation image transforms and the matching tokenizer. Weights come only
from local files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import open_clip
import torch.nn as nn

from clipscale.config import ModelConfig


@dataclass
class Towers:
    model: nn.Module
    train_transform: Callable
    val_transform: Callable
    tokenizer: Callable
    open_clip_config: dict  # what open_clip's `local-dir:` loader needs to rebuild the model


def build_model(cfg: ModelConfig) -> Towers:
    if cfg.name is not None:
        model, train_transform, val_transform = open_clip.create_model_and_transforms(
            cfg.name, pretrained=cfg.pretrained, output_dict=True, weights_only=True
        )
        tokenizer = open_clip.get_tokenizer(cfg.name)
        model_cfg = open_clip.get_model_config(cfg.name)
    else:
        model_cfg = dict(cfg.custom)
        model = open_clip.CLIP(**model_cfg, output_dict=True)
        if cfg.pretrained is not None:
            open_clip.load_checkpoint(model, cfg.pretrained, weights_only=True)
        size = model.visual.image_size
        train_transform = open_clip.image_transform(size, is_train=True)
        val_transform = open_clip.image_transform(size, is_train=False)
        context_length = model_cfg.get("text_cfg", {}).get("context_length", 77)
        tokenizer = open_clip.SimpleTokenizer(context_length=context_length)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return Towers(model, train_transform, val_transform, tokenizer, {"model_cfg": model_cfg})
