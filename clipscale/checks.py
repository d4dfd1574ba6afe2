"""Checks of a run configuration against the components it names, before any work.

clipscale.config checks every key and section on its own and imports none of
the components; this module sits above config, models, losses and eval and
asks each what it accepts: open_clip whether the architecture exists, whether
it has a logit bias, whether it is a CoCa model (refused: no captioning loss)
and which keys a custom config may have, each loss its contract (the inputs it takes and
its options with their types, `clipscale.losses.loss_contract`), the
evaluation tasks whether every set resolves. Nothing here builds a model or
starts a process group, so `train.py` and the scripts fail in a second, naming
the key, what was given and what is allowed; the data is looked at only where
it must be: a CSV table's rows are counted when train.epochs counts them, and
`plan_run` lists the shards (or reads the tables' headers) the run will read.

    cfg = load_checked_config("configs/digits.yaml", ["loss.name=infcl"])
    plan = plan_run(cfg, world)   # once the world is known: its checks, then the resolved values

`plan_run` is the last check before work (the batch splits over the processes, the data is
there, the hardware JPEG decoder asked for can run) and resolves the configuration once into a `RunPlan`, which
the components read instead of interpreting the keys again.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Literal, Optional

import open_clip
import torch
from open_clip.model import CLIPTextCfg, CLIPVisionCfg

from clipscale.config import (Config, ConfigError, LossConfig, ModelConfig, check_model_section, check_value, epochs_in_rows,
                              epochs_of_rows, load_config, unknown_architecture, unknown_loss)
from clipscale.data import check_source, table_rows
from clipscale.data.chunks import kept_bytes
from clipscale.data.sources import CSV_SUFFIXES
from clipscale.distributed import World
from clipscale.eval.tasks import eval_task
from clipscale.losses import CLIP_INPUTS, available_losses, build_loss, loss_contract
from clipscale.models import open_clip_model_config
from clipscale.precision import AUTOCAST_DTYPES


def check_model(cfg: ModelConfig) -> tuple[str, ...]:
    """The model section checked (its keys, and that open_clip knows the architecture);
    returns what the model hands its loss, in order."""
    check_model_section(cfg)
    if cfg.custom is not None:
        check_custom_keys(cfg.custom)
    model_cfg = open_clip_model_config(cfg)
    if model_cfg is None:
        raise unknown_architecture(cfg.name, open_clip.list_models())
    if "multimodal_cfg" in model_cfg:
        key = "model.custom.multimodal_cfg" if cfg.custom is not None else f"model.name={cfg.name}"
        raise ConfigError(f"{key}: a CoCa model (open_clip config with a multimodal_cfg); its captioning loss is "
                          "not supported, only contrastive CLIP training: choose a CLIP architecture")
    timm_tower = "timm_model_name" in model_cfg["vision_cfg"]
    hf_text_tower = "hf_model_name" in model_cfg["text_cfg"]
    if cfg.force_patch_dropout and timm_tower:
        check_timm_patch_dropout(model_cfg["vision_cfg"]["timm_model_name"])
    if cfg.lock_text and not cfg.lock_text_freeze_layer_norm and not hf_text_tower:
        raise ConfigError("model.lock_text_freeze_layer_norm: false needs a Hugging Face text tower; "
                          "open_clip's own text tower locks its layer norms with the rest (set it true)")
    has_bias = model_cfg.get("init_logit_bias") is not None
    return CLIP_INPUTS + ("logit_bias",) if has_bias else CLIP_INPUTS


def _init_parameters(cls) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


# What open_clip's create_model reads from a model config: CLIP's (and CustomTextCLIP's) keyword
# arguments but those create_model itself sets, and `custom_text`, which picks the class.
MODEL_CONFIG_KEYS = sorted((_init_parameters(open_clip.CLIP) | {"custom_text"}) - {"output_dict", "cast_dtype"})


def check_custom_keys(custom: dict) -> None:
    """Every key of model.custom, vision_cfg and text_cfg is one open_clip knows (its CLIPVisionCfg
    and CLIPTextCfg fields), named before open_clip's TypeError would name a dataclass instead."""
    sections = {
        "model.custom": (custom, MODEL_CONFIG_KEYS + ["multimodal_cfg"]),
        "model.custom.vision_cfg": (custom["vision_cfg"], [f.name for f in dataclasses.fields(CLIPVisionCfg)]),
        "model.custom.text_cfg": (custom["text_cfg"], [f.name for f in dataclasses.fields(CLIPTextCfg)]),
    }
    for where, (values, allowed) in sections.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: expected a mapping of its keys, got {values!r}")
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown key {where}.{unknown[0]}; allowed keys in {where}: {', '.join(allowed)}")


def check_timm_patch_dropout(timm_model_name: str) -> None:
    """open_clip hands patch dropout to a timm tower as timm's patch_drop_rate, which timm's ViTs
    take and its convnets refuse with a TypeError; asked of timm on the meta device (no memory)."""
    import timm
    import torch

    try:
        with torch.device("meta"):
            timm.create_model(timm_model_name, pretrained=False, patch_drop_rate=0.5)
    except TypeError:
        raise ConfigError(f"model.force_patch_dropout: the timm image tower {timm_model_name} has no patch dropout "
                          "(timm's ViTs and open_clip's own have)") from None


def _bias_key(cfg: ModelConfig) -> str:
    return "model.custom.init_logit_bias" if cfg.custom is not None else f"init_logit_bias in open_clip's {cfg.name} config"


def _input_problem(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], model: ModelConfig) -> Optional[str]:
    """Why a loss taking `inputs` cannot train a model that gives `outputs`, in words, or None."""
    if inputs == outputs:
        return None
    if not set(CLIP_INPUTS[:2]) <= set(inputs):
        return (f"{name} takes ({', '.join(inputs)}): single-view self-contrast, a library function "
                "(clipscale.losses.infcl.ntxent_loss), not a CLIP training loss of image and text features")
    if "logit_bias" in inputs and "logit_bias" not in outputs:
        return f"{name} needs the model's logit bias, and the model has none: set {_bias_key(model)} (e.g. -10, as open_clip's SigLIP models)"
    if "logit_bias" in outputs and "logit_bias" not in inputs:
        return f"{name} takes no logit bias, and the model has one ({_bias_key(model)}); a bias needs a sigmoid loss"
    return f"{name} takes ({', '.join(inputs)}), the model gives ({', '.join(outputs)})"


def check_loss(loss: LossConfig, model: ModelConfig) -> dict:
    """loss.name and loss.options against the loss's contract and the model; returns the
    options with their checked values (5e-4 given as text read as the number it means)."""
    if loss.name not in available_losses():
        raise unknown_loss(loss.name, available_losses())
    outputs = check_model(model)
    contract = loss_contract(loss.name)
    problem = _input_problem(loss.name, contract.inputs, outputs, model)
    if problem:
        fitting = [name for name in available_losses() if loss_contract(name).inputs == outputs]
        raise ConfigError(f"loss.name: got {loss.name!r}: {problem}; expected one of {', '.join(fitting)}")
    options = {}
    for key, value in loss.options.items():
        if key not in contract.options and not contract.any_options:
            allowed = ", ".join(contract.options) or "none"
            raise ConfigError(f"unknown key loss.options.{key}; allowed keys in loss.options of {loss.name}: {allowed}")
        expected = contract.options.get(key, Any)
        options[key] = value if expected is Any else check_value(f"loss.options.{key}", value, expected)
    try:
        build_loss(loss.name, **options)  # value checks of the loss itself (a tile_size of 0, ...)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"loss.options: {err}") from None
    return options


def check_loss_choices(losses: list[tuple[str, dict]], model_names: list[str]) -> None:
    """For scripts that take loss and model names: every (loss name, options) against every
    open_clip architecture, before any work."""
    for model_name in model_names:
        for name, options in losses:
            check_loss(LossConfig(name, dict(options)), ModelConfig(name=model_name))


def check_eval_sets(sets: list) -> None:
    for i, entry in enumerate(sets):
        try:
            eval_task(entry)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"eval.sets[{i}]: {err}") from None


def count_epoch_rows(cfg: Config) -> None:
    """train.epochs of a CSV table without train.num_samples_per_epoch: its rows are counted (the
    sum over the "::" tables) and train.steps follows (clipscale.config.epochs_of_rows)."""
    if epochs_in_rows(cfg):
        epochs_of_rows(cfg, table_rows(cfg.data, cfg.data.train_shards, "data.train_shards"))


def check_data(cfg: Config) -> None:
    """The training data and eval.val_data are where the configuration says, as the machine that
    trains sees them: shards listed (folders and globs expanded), CSV tables' headers read."""
    if cfg.data.kind in ("webdataset", "csv"):
        check_source(cfg.data, cfg.data.train_shards, "data.train_shards", csv=cfg.data.kind == "csv")
    if cfg.eval.val_data:
        check_source(cfg.data, cfg.eval.val_data, "eval.val_data", csv=cfg.eval.val_data.lower().endswith(CSV_SUFFIXES))


def check_config(cfg: Config) -> None:
    """Everything load_config does not know: the architecture, the loss, the evaluation sets, the
    run length of epochs of a CSV table (its rows counted). The loss options are replaced by their
    checked values."""
    cfg.loss.options = check_loss(cfg.loss, cfg.model)
    check_eval_sets(cfg.eval.sets)
    count_epoch_rows(cfg)


def load_checked_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """load_config, then check_config: what a run needs before any work starts."""
    cfg = load_config(path, overrides)
    check_config(cfg)
    return cfg


@dataclass(frozen=True)
class RunPlan:
    """The configuration resolved once for the world it runs on."""

    world_size: int
    per_rank_batch: int  # train.batch_size over the processes
    chunk: int | Literal["auto"]  # the per-rank encoder sub-batch (train.chunk_size; null: the per-rank batch)
    image_size: int  # the model's input side (model.force_image_size, or the architecture's)
    autocast_dtype: torch.dtype | None  # train.precision's (None: full precision)
    keep_on_device_bytes: int  # data.keep_on_device_gib: what pass-1 chunks may hold on the device for pass 2


def check_world(cfg: Config, world_size: int) -> None:
    if cfg.train.batch_size % world_size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is the global batch and must split evenly over "
            f"{world_size} processes (it leaves a remainder of {cfg.train.batch_size % world_size})"
        )


def plan_run(cfg: Config, world: World) -> RunPlan:
    """The checks that need the world and the machine (the data is there), then the values every
    component reads. A run length waiting for a CSV table's rows (check_config not run) is counted."""
    count_epoch_rows(cfg)
    check_world(cfg, world.world_size)
    check_data(cfg)
    per_rank = cfg.train.batch_size // world.world_size
    chunk = cfg.train.chunk_size
    size = CLIPVisionCfg(**open_clip_model_config(cfg.model)["vision_cfg"]).image_size
    return RunPlan(
        world_size=world.world_size,
        per_rank_batch=per_rank,
        chunk=chunk if chunk == "auto" else min(chunk or per_rank, per_rank),
        image_size=size[0] if isinstance(size, (tuple, list)) else size,
        autocast_dtype=AUTOCAST_DTYPES[cfg.train.precision],
        keep_on_device_bytes=kept_bytes(cfg.data.keep_on_device_gib, world.device),
    )
