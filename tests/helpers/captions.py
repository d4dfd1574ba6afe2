"""A tiny open_clip model at 77 text positions, and captions of chosen lengths laid out as
open_clip's tokenizer lays them out."""

from __future__ import annotations

import torch

from clipscale.config import ModelConfig
from clipscale.models import build_model

CONTEXT, VOCAB = 77, 1000
SOT, EOT = VOCAB - 2, VOCAB - 1  # open_clip's tokenizer: the end-of-text token has the highest id


# Caption lengths (positions, SOT and EOT included) that fall into several buckets, two at the limit.
LENGTHS = [3, 77, 12, 5, 40, 9, 24, 17, 66, 77, 7, 33]
def tiny_config(**text) -> dict:
    return {"embed_dim": 32,
            "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 32},
            "text_cfg": {"context_length": CONTEXT, "vocab_size": VOCAB, "width": 64, "heads": 2, "layers": 2, **text}}


def tiny_model(bias: bool = False, **config) -> torch.nn.Module:
    """A 2-layer ViT and 2-layer text transformer at 77 positions, dropout off (as built)."""
    torch.manual_seed(0)
    custom = tiny_config(**config.pop("text", {}))
    custom.update(config)
    if bias:
        custom["init_logit_bias"] = -10.0
    return build_model(ModelConfig(custom=custom)).model.train()


def make_tokens(lengths: list[int], seed: int, eot: int = EOT) -> torch.Tensor:
    """Tokens as open_clip's tokenizer lays them out: SOT, words, EOT, zeros (a caption at the
    limit has its EOT at the last position)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(lengths), CONTEXT, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens[row, 0] = SOT
        tokens[row, 1 : length - 1] = torch.randint(1, SOT, (length - 2,), generator=generator)
        tokens[row, length - 1] = eot
    return tokens
