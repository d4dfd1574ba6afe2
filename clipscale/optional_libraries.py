"""Start without the libraries a run's towers do not use.

open_clip imports transformers and timm when it is imported (its Hugging Face and timm towers),
whatever the model: about 2.3 s of the 9.6 s a tiny run of train.py took on a CPU (five runs
each, docs/benchmarks.md, "Starting"), paid again by every process of a torchrun job and every
restart. A run whose model config is known before open_clip is imported (`model.custom`, or one of
open_clip's own architecture files) and names neither kind of tower starts as if they were not
installed: open_clip then skips them, as it does where they are missing. Anything else (a
`local-dir:` or `hf-hub:` name, an unknown one) imports both, as before.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from clipscale.config import ModelConfig

OPTIONAL = ("transformers", "timm")


def libraries_used(cfg: ModelConfig) -> set[str] | None:
    """Which of `OPTIONAL` the towers (and their tokenizer) of `cfg` need; None where the model's
    config cannot be read without open_clip."""
    model_cfg = cfg.custom if cfg.custom is not None else _open_clip_architecture(cfg.name)
    if model_cfg is None:
        return None
    vision_cfg, text_cfg = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    used = set()
    if "timm_model_name" in vision_cfg:
        used.add("timm")
    # open_clip's get_tokenizer: an hf_tokenizer_name (even empty) or a SigLIP name takes transformers' tokenizers
    if "hf_model_name" in text_cfg or "hf_tokenizer_name" in text_cfg or "siglip" in (cfg.name or "").lower():
        used.add("transformers")
    return used


def _open_clip_architecture(name: str | None) -> dict | None:
    """open_clip's model_configs/<name>.json, read from its package folder without importing it."""
    spec = importlib.util.find_spec("open_clip")
    if not name or spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "model_configs" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def leave_out_unused_libraries(cfg: ModelConfig) -> list[str]:
    """Mark the optional libraries the towers do not use as absent (None in `sys.modules`, Python's
    own way of saying "not installed": an import raises ImportError, find_spec returns None) for the
    rest of this process, before open_clip is imported; returns those left out. One already
    imported (by open_clip, say) stays."""
    used = libraries_used(cfg)
    if used is None:
        return []
    left_out = [name for name in OPTIONAL if name not in used and name not in sys.modules]
    for name in left_out:
        sys.modules[name] = None
    return left_out
