"""Evaluation is deterministic and dropout-free: a model with dropout and patch dropout, in
train mode as the training loop leaves it, evaluated under two RNG seeds gives the same
metrics, and is back in train mode afterwards."""

from __future__ import annotations

import torch
import torch.nn as nn

from clipscale.config import load_config
from clipscale.data import prepare_data
from clipscale.distributed import World
from clipscale.eval.during_training import Evaluator
from clipscale.models import build_model

from tests.helpers.tiny_runs import DIGITS_YAML

DROPOUT = 0.5
MODEL = (
    "model.custom={embed_dim: 32, "
    f"vision_cfg: {{image_size: 32, patch_size: 8, width: 64, layers: 2, head_width: 32, patch_dropout: {DROPOUT}}}, "
    "text_cfg: {context_length: 16, vocab_size: 49408, width: 64, heads: 2, layers: 2}}"
)


def with_dropout(model: nn.Module) -> nn.Module:
    """open_clip's own towers have patch dropout only: dropout after every block's MLP as well."""
    for block in (*model.visual.transformer.resblocks, *model.transformer.resblocks):
        block.mlp.add_module("dropout", nn.Dropout(DROPOUT))
    return model.train()


def test_evaluation_under_two_seeds_gives_the_same_metrics_and_leaves_train_mode(digits_root):
    cfg = load_config(DIGITS_YAML, [MODEL, f"data.root={digits_root}", "eval.batch_size=128"])
    world = World()
    towers = build_model(cfg.model)
    model = with_dropout(towers.model)
    prepare_data(cfg.data, world)
    evaluator = Evaluator(cfg, towers, world, autocast=None)

    images = torch.randn(8, 3, 32, 32)

    def encoded_under(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return model.encode_image(images)

    assert not torch.allclose(encoded_under(1), encoded_under(2)), "dropout must be on in train mode, or this proves nothing"

    results = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        results.append(evaluator(model))
        assert all(module.training for module in model.modules()), "evaluation must restore train mode"
    assert results[0]["zeroshot_num_samples"] > 100
    assert results[0] == results[1]


def test_the_validation_loss_is_computed_in_eval_mode(digits_root):
    """eval.val_data's loss and retrieval (open_clip's --val-data) on a model with dropout, left in train
    mode: the same under two seeds, so no dropout mask was drawn."""
    cfg = load_config(DIGITS_YAML, [MODEL, f"data.root={digits_root}", "eval.batch_size=64", "eval.zeroshot=false",
                                    f"eval.val_data={digits_root}/train-0000.tar"])
    towers = build_model(cfg.model)
    model = with_dropout(towers.model)
    evaluator = Evaluator(cfg, towers, World(), autocast=None)
    results = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        results.append(evaluator(model))
        assert all(module.training for module in model.modules()), "evaluation must restore train mode"
    assert set(results[0]) >= {"val_loss", "val_image_retrieval_recall@1"}
    assert results[0] == results[1]
