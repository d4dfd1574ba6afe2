"""Towers from open_clip: a named architecture or a custom config dict.

A custom dict is an open_clip model config (`embed_dim`, `vision_cfg`, `text_cfg`). Its
`vision_cfg.timm_model_name` selects a timm image tower and its `text_cfg.hf_model_name`
a Hugging Face text tower (a local directory), exactly as in open_clip's own JSON
configs. The dict is registered with open_clip under a name derived from its content,
so named and custom models take one path through open_clip's factory and tokenizer.

The model keeps open_clip's conventions (`encode_image`, `encode_text`, `logit_scale`
stored as a log, dict output). Weights come only from local files: a whole-CLIP
checkpoint (open_clip's or ours), a timm checkpoint for a timm trunk, the Hugging Face
directory for an HF text tower. Nothing is downloaded, and no folder's own code runs
(`refuse_remote_code`).

LiT locks the image tower with open_clip's `lock_image_tower`, and `model.lock_text` the text
tower with its `lock_text_tower`. A locked tower builds no autograd graph by itself: its
parameters do not require grad and neither do its inputs, so autograd records nothing until
the first trainable layer, and the optimizer holds no state for it (see `trainable_towers` in
gradcache.py for the Gradient Cache side). `model.force_*` change the architecture's config as
open_clip's create_model(force_*=...) does; the changed config is the one registered, built
and written into the run folder.

`model.patch_embed: matmul` computes an open_clip ViT's patch convolution (`visual.conv1`) as one
matrix product over the unfolded patches (`PatchMatmul`), with the same weight under the same
state_dict key: checkpoints load both ways with open_clip. `auto` (the default) does so where the
towers are compiled (a GPU), where it was measured faster; eager towers keep the convolution.
`model.attention: short` computes the blocks' self-attention of short sequences with clipscale's
own kernels (`clipscale.attention`), with the same parameters and keys; `auto` (the default) does
so where the towers are compiled on a GPU, where it was measured faster.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F
from open_clip.factory import load_state_dict
from open_clip.tokenizer import HFTokenizer
from open_clip.transformer import VisionTransformer

from clipscale.checkpoint import refusing_pickled_objects
from clipscale.config import ModelConfig
from clipscale.errors import UserError

OPEN_CLIP_CONFIG = "open_clip_config.json"  # what open_clip's `local-dir:` loader reads
OPEN_CLIP_WEIGHTS = "open_clip_pytorch_model.bin"  # a weights file name that loader looks for
MAX_KEYS_SHOWN = 8


class WeightsError(UserError, ValueError):
    """A weights file that does not fit the model; the message names the keys that differ."""


@dataclass
class Towers:
    model: nn.Module
    train_transform: Callable
    val_transform: Callable
    tokenizer: Callable
    open_clip_config: dict  # what open_clip's `local-dir:` loader needs to rebuild the model


def build_model(cfg: ModelConfig, compiled: bool = False, gpu: bool = False) -> Towers:
    """The towers of `cfg`, on the CPU. `compiled`: whether they will be compiled
    (`compile.compile_enabled`), which model.patch_embed: auto follows; `gpu`: whether they will
    run on a GPU, which model.attention: auto follows too."""
    # A named architecture with model.force_* set is registered like a custom one: the config
    # written into the run folder is then the one the model was built from.
    forced = cfg.custom is not None or _forces(cfg)
    architecture = register_custom(open_clip_model_config(cfg)) if forced else cfg.name
    with _without_random_init_warning(cfg.pretrained is not None):
        model, train_transform, val_transform = open_clip.create_model_and_transforms(
            architecture,
            output_dict=True,
            # An HF text tower loads its weights from its directory, unless a whole-CLIP checkpoint replaces them.
            pretrained_text=cfg.pretrained is None,
            **{f"image_{key}": value for key, value in (cfg.preprocess or {}).items()},
        )
    if cfg.pretrained is not None:
        load_clip_checkpoint(model, cfg.pretrained)
    if cfg.pretrained_image is not None:
        load_timm_trunk(model.visual, cfg.pretrained_image)
    if cfg.patch_embed == "matmul" or (cfg.patch_embed == "auto" and compiled and has_patch_convolution(model.visual)):
        embed_patches_by_matmul(model.visual)
    if cfg.attention == "short" or (cfg.attention == "auto" and compiled and gpu):
        from clipscale.attention import use_short_attention  # imports Triton: only where its kernels run

        use_short_attention(model, where_possible=cfg.attention == "auto")
    if cfg.force_image_size is not None and hasattr(model.visual, "trunk"):
        model.visual.set_input_size(cfg.force_image_size)  # a timm trunk's own size, after its weights (as open_clip)
    if cfg.lock_image:
        model.lock_image_tower(cfg.lock_image_unlocked_groups, cfg.lock_image_freeze_bn_stats)
    if cfg.lock_text:
        model.lock_text_tower(cfg.lock_text_unlocked_layers, cfg.lock_text_freeze_layer_norm)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    if cfg.channels_last:  # convolutions then pick the NHWC kernels; the input need not be converted
        model.visual.to(memory_format=torch.channels_last)
    open_clip_config = {
        "model_cfg": open_clip.get_model_config(architecture),
        "preprocess_cfg": open_clip.get_model_preprocess_cfg(model),
    }
    return Towers(model, train_transform, val_transform, open_clip.get_tokenizer(architecture), open_clip_config)


class PatchMatmul(nn.Conv2d):
    """An open_clip ViT's patch embedding (`visual.conv1`: kernel = stride = the patch, no bias, no
    padding) as one matrix product: the image cut into its grid of patches, each patch flattened in
    the weight's (channel, row, column) order, times `weight.flatten(1).T`. The same parameter and
    state_dict key (`conv1.weight`) and the convolution's output, [b, width, grid_h, grid_w], in
    channels-last strides: a view of the product [b, grid_h * grid_w, width], which open_clip's
    reshape and permute into tokens give back without a copy. Pixels past the last whole patch are
    dropped, as the convolution's stride drops them. Under autocast the product runs in its dtype,
    as the convolution does. (The convolution's cuDNN kernels took 14.5% of a ViT-B/32 step for
    about 5% of its FLOPs on an H100: issue 49.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (ph, pw), (b, c, h, w) = self.kernel_size, x.shape
        gh, gw = h // ph, w // pw
        patches = (x[:, :, : gh * ph, : gw * pw]
                   .reshape(b, c, gh, ph, gw, pw)
                   .permute(0, 2, 4, 1, 3, 5)  # [b, gh, gw, c, ph, pw]: the weight's order within a patch
                   .reshape(b, gh * gw, c * ph * pw))
        tokens = F.linear(patches, self.weight.flatten(1))  # [b, gh * gw, width]
        return tokens.transpose(1, 2).unflatten(2, (gh, gw))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", as a matmul"


def has_patch_convolution(visual: nn.Module) -> bool:
    """An open_clip ViT whose `conv1` is a plain patch convolution (what `PatchMatmul` replaces).
    model.patch_embed: auto replaces it where the towers are compiled: with the product compiled
    beside them, a ViT-B/32 step was 1.15x faster than with cuDNN's convolution on an H200,
    through train.py (results/bench_e2e_h200_b32_32k_patch_embed.json); eager, it is not measured."""
    conv = getattr(visual, "conv1", None)
    return (isinstance(visual, VisionTransformer) and type(conv) is nn.Conv2d and conv.bias is None
            and conv.stride == conv.kernel_size and conv.padding == (0, 0) and conv.dilation == (1, 1)
            and conv.groups == 1)


def embed_patches_by_matmul(visual: nn.Module) -> None:
    """model.patch_embed: matmul. Replace an open_clip ViT's patch convolution (`visual.conv1`) by a
    `PatchMatmul` holding the same weight Parameter (its requires_grad, device, dtype and memory
    format, and the optimizer's hold on it, unchanged)."""
    conv = getattr(visual, "conv1", None)
    if not has_patch_convolution(visual):
        raise UserError(f"model.patch_embed: matmul applies to open_clip's own ViT image towers (a patch "
                        f"convolution at visual.conv1); this image tower is {type(visual).__name__}: "
                        "use model.patch_embed: conv")
    embed = PatchMatmul(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, bias=False, device="meta")
    embed.weight = conv.weight
    visual.conv1 = embed.train(conv.training)


def image_size(model: nn.Module) -> int:
    """The side of the square images the model's image tower takes."""
    size = model.visual.image_size
    return size[0] if isinstance(size, tuple) else size


def train_mode(model: nn.Module, cfg: ModelConfig) -> None:
    """Train mode, but LiT's wholly locked image tower in eval mode: a fixed feature extractor, no dropout."""
    model.train()
    if cfg.lock_image and cfg.lock_image_unlocked_groups == 0:
        model.visual.eval()


@contextmanager
def _without_random_init_warning(weights_follow: bool):
    """open_clip warns "No pretrained weights loaded ... initialized randomly" (on the root
    logger) for any model it builds without weights; false when model.pretrained loads next."""
    def drop(record: logging.LogRecord) -> bool:
        return not (weights_follow and "initialized randomly" in record.getMessage())

    root = logging.getLogger()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def register_custom(custom: dict) -> str:
    """Add a custom config to open_clip's registry (as open_clip_train users add JSON files)
    and return its name. Local Hugging Face paths become absolute, so the config written
    into the run folder still finds them from elsewhere."""
    model_cfg = json.loads(json.dumps(custom))  # a deep copy, and proof that it is plain JSON
    text_cfg = model_cfg.get("text_cfg", {})
    for key in ("hf_model_name", "hf_tokenizer_name"):
        if key in text_cfg:
            text_cfg[key] = str(Path(text_cfg[key]).resolve())
            refuse_remote_code(text_cfg[key], f"model.custom.text_cfg.{key}")
    text = json.dumps(model_cfg, sort_keys=True)
    name = "clipscale-custom-" + hashlib.sha1(text.encode()).hexdigest()[:12]
    if name not in open_clip.list_models():
        with tempfile.TemporaryDirectory() as folder:  # open_clip reads it once, when registering
            path = Path(folder) / f"{name}.json"
            path.write_text(text)
            open_clip.add_model_config(path)
    return name


def refuse_remote_code(folder: str, key: str) -> None:
    """A Hugging Face folder whose config names Python classes of its own (`auto_map`) would have
    transformers offer to import the folder's code (open_clip passes no trust_remote_code, so it
    asks, and runs the code on a yes); such a folder is refused before transformers sees it."""
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if path.is_file() and "auto_map" in json.loads(path.read_text()):
            raise UserError(f"{key}: {path} names Python code of its own (auto_map); Hugging Face towers load "
                            "only transformers' own classes, without running a folder's code")


def open_clip_model_config(cfg: ModelConfig) -> dict | None:
    """The open_clip model config (embed_dim, vision_cfg, text_cfg, init_logit_bias, ...) that
    `build_model` would build, without building it; None for an unknown architecture name.
    model.force_* change it as open_clip's create_model(force_*=...) does."""
    model_cfg = cfg.custom if cfg.custom is not None else open_clip.get_model_config(cfg.name)
    if model_cfg is None or not _forces(cfg):
        return model_cfg
    model_cfg = json.loads(json.dumps(model_cfg))
    vision_cfg, text_cfg = model_cfg.setdefault("vision_cfg", {}), model_cfg.setdefault("text_cfg", {})
    if cfg.force_quick_gelu:
        model_cfg["quick_gelu"] = True
    if cfg.force_patch_dropout is not None:
        vision_cfg["patch_dropout"] = cfg.force_patch_dropout
    if cfg.force_image_size is not None:
        vision_cfg["image_size"] = cfg.force_image_size
    if cfg.force_context_length is not None:
        text_cfg["context_length"] = cfg.force_context_length
    return model_cfg


def _forces(cfg: ModelConfig) -> bool:
    return (cfg.force_quick_gelu or cfg.force_patch_dropout is not None or cfg.force_image_size is not None
            or cfg.force_context_length is not None)


def load_clip_checkpoint(model: nn.Module, path: str) -> None:
    """A whole-CLIP checkpoint through open_clip's loader, which strips DDP's `module.`,
    takes `state_dict` out of a training checkpoint and resizes position embeddings;
    when it refuses the file, say which keys do not fit."""
    require_file(path, "model.pretrained")
    with refusing_pickled_objects(path):
        try:
            open_clip.load_checkpoint(model, path, weights_only=True)
        except (RuntimeError, AssertionError):  # AssertionError: open_clip's position-embedding resize refuses another width
            report = mismatch_report(model, load_state_dict(path, weights_only=True))
            if not report:
                raise
            raise WeightsError(f"model.pretrained {path} does not fit the model: {report}") from None


def load_timm_trunk(visual: nn.Module, path: str) -> None:
    """timm weights (a file saved by timm or torch, safetensors or not) into a timm tower's trunk.
    The checkpoint's classifier is dropped where open_clip replaced it by the CLIP projection,
    as timm does when the number of classes differs."""
    import timm.models

    require_file(path, "model.pretrained_image")
    if not hasattr(visual, "trunk"):
        raise WeightsError("model.pretrained_image: the image tower is not a timm model")
    trunk = visual.trunk
    with refusing_pickled_objects(path):
        state_dict = timm.models.load_state_dict(path, weights_only=True)  # unwraps `state_dict`/`model`, strips `module.`
    classifier = trunk.pretrained_cfg.get("classifier")
    ours = trunk.state_dict()
    for prefix in [classifier] if isinstance(classifier, str) else classifier or []:  # a name or a tuple of names
        for key in [k for k in state_dict if k.startswith(prefix + ".")]:
            if key not in ours or ours[key].shape != state_dict[key].shape:
                del state_dict[key]
    report = mismatch_report(trunk, state_dict)
    if report:
        raise WeightsError(f"model.pretrained_image {path} does not fit {visual.trunk.__class__.__name__}: {report}")
    trunk.load_state_dict(state_dict)


def require_file(path: str, key: str) -> None:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{key}: no file at {path!r} (only local checkpoints are loaded)")


def mismatch_report(module: nn.Module, state_dict: dict) -> str:
    """The keys that differ between a module and a state dict, a few of each kind; '' if none."""
    expected = module.state_dict()
    kinds = {
        "shape mismatch": [
            f"{key} (file {tuple(value.shape)}, model {tuple(expected[key].shape)})"
            for key, value in state_dict.items() if key in expected and value.shape != expected[key].shape
        ],
        "missing from the file": [key for key in expected if key not in state_dict],
        "not in the model": [key for key in state_dict if key not in expected],
    }
    parts = []
    for kind, keys in kinds.items():
        if keys:
            shown = ", ".join(keys[:MAX_KEYS_SHOWN]) + (f", ... ({len(keys) - MAX_KEYS_SHOWN} more)" if len(keys) > MAX_KEYS_SHOWN else "")
            parts.append(f"{len(keys)} {kind}: {shown}")
    return "; ".join(parts)


def write_open_clip_folder(folder: Path, towers: Towers) -> None:
    """Make a run folder loadable by `open_clip.create_model("local-dir:<folder>")` once
    OPEN_CLIP_WEIGHTS is written there: the model and preprocess config, and for an HF
    text tower its tokenizer files (open_clip reads an HF tokenizer from that folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / OPEN_CLIP_CONFIG).write_text(json.dumps(towers.open_clip_config, indent=2))
    if isinstance(towers.tokenizer, HFTokenizer):
        towers.tokenizer.save_pretrained(folder)
