"""Tiny towers built from local files: a two-layer BERT saved with its tokenizer, a timm and Hugging
Face config around it, and a one-layer open_clip model. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from clipscale.data.digits import CLASSNAMES

TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def write_tiny_bert(folder: Path) -> Path:
    """A two-layer BERT and its word-piece tokenizer, written into `folder` with save_pretrained."""
    import transformers

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "picture", "of", "the", "digit", "number", *CLASSNAMES]
    transformers.BertTokenizer(vocab={w: i for i, w in enumerate(words)}).save_pretrained(folder)
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    return folder


def timm_hf_config(hf_folder) -> dict:
    """A timm image tower (BatchNorm convnet) and a Hugging Face text tower, as a YAML config would give them."""
    return {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "timm_model_name": "test_resnet", "timm_pool": "avg", "timm_proj": "linear"},
        "text_cfg": {"context_length": 16, "hf_model_name": str(hf_folder), "hf_tokenizer_name": str(hf_folder),
                     "hf_pooler_type": "mean_pooler", "hf_proj_type": "linear"},
    }
