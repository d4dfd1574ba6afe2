"""A run whose towers need neither transformers nor timm starts without importing them
(clipscale/optional_libraries.py); one whose towers do gets them, and open_clip builds every
model and tokenizer as before."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from clipscale.config import ModelConfig
from clipscale.optional_libraries import libraries_used

TINY_MODEL = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 1},
              "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1}}
TIMM_TOWER = {"embed_dim": 32, "vision_cfg": {"timm_model_name": "vit_tiny_patch16_224", "timm_pool": "token",
                                              "timm_proj": "linear", "image_size": 32},
              "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1}}


@pytest.mark.parametrize("cfg, used", [
    (ModelConfig(name="ViT-B-32"), set()),
    (ModelConfig(name="RN50"), set()),
    (ModelConfig(custom=TINY_MODEL), set()),
    (ModelConfig(custom=TIMM_TOWER), {"timm"}),
    (ModelConfig(custom={**TINY_MODEL, "text_cfg": {"hf_model_name": "/models/bert", "hf_tokenizer_name": "/models/bert"}}),
     {"transformers"}),
    (ModelConfig(name="ViT-B-16-SigLIP"), {"timm", "transformers"}),  # a timm tower, transformers' SigLIP tokenizer
    (ModelConfig(name="convnext_base"), {"timm"}),
    (ModelConfig(name="local-dir:/runs/a"), None),  # its config is read by open_clip: both stay
    (ModelConfig(name="no-such-architecture"), None),
])
def test_the_libraries_a_model_config_uses(cfg, used):
    assert libraries_used(cfg) == used


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=240)


def test_a_model_without_such_towers_builds_and_tokenizes_with_neither_imported():
    done = _run(f"""
        import sys
        from clipscale.config import ModelConfig
        from clipscale.optional_libraries import leave_out_unused_libraries
        cfg = ModelConfig(custom={TINY_MODEL!r})
        assert leave_out_unused_libraries(cfg) == ["transformers", "timm"]
        from clipscale.models import build_model
        towers = build_model(cfg)
        tokens = towers.tokenizer(["a photo of a dog"])
        features = towers.model.encode_text(tokens)
        assert sys.modules["transformers"] is None and sys.modules["timm"] is None
        print("ok", tuple(features.shape))
    """)
    assert done.returncode == 0 and "ok (1, 32)" in done.stdout, done.stderr[-3000:]


def test_a_timm_tower_gets_timm_and_a_library_already_imported_stays():
    done = _run(f"""
        import sys
        from clipscale.config import ModelConfig
        from clipscale.optional_libraries import leave_out_unused_libraries
        cfg = ModelConfig(custom={TIMM_TOWER!r})
        assert leave_out_unused_libraries(cfg) == ["transformers"]
        from clipscale.models import build_model
        towers = build_model(cfg)
        assert type(towers.model.visual).__name__ == "TimmModel" and sys.modules["timm"] is not None
        assert leave_out_unused_libraries(ModelConfig(name="ViT-B-32")) == []  # timm is in: it stays
        assert sys.modules["timm"] is not None and towers.model.visual.trunk is not None
        print("ok")
    """)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
