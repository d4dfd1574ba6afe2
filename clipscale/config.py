"""The run configuration: typed sections, YAML file, dotted command-line overrides.

Precedence is command line > YAML file > defaults. Every key is checked
before any work starts: an unknown key names the allowed ones, a bad value
names the key, the expected type and (for choices) the allowed values.

    cfg = load_config("configs/digits.yaml", ["train.steps=100", "loss.name=infcl"])

This module knows the schema and imports none of the components. Checks that need them (an
open_clip architecture exists, the loss's options and inputs fit it, the evaluation sets resolve,
clipscale.eval.tasks.eval_task) live in clipscale.checks, which also resolves the configuration
for the world it runs on (`RunPlan`); train.py runs load_config and `check_names` (loss.name and
model.name, known without importing a component) before it imports them, so a mistake here is
reported at once.

The schema says which keys a resumed run may change (field metadata `ON_RESUME`, `on_resume`):
the others change what is trained, and a run folder that holds another value refuses them.
`schema_help` lists every section and key with its default (`python train.py --help`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from PIL import Image

from clipscale.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem, reported before any work starts."""


def relative_note(path: str) -> str:
    """For a relative local path in a message: '; relative paths are read from <cwd>, the directory
    train.py was started in' (the script's name, or "the working directory"); '' for an absolute one."""
    if Path(path).is_absolute() or "://" in path or path.startswith("pipe:"):
        return ""
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    where = (f"the directory {script} was started in" if script.endswith(".py") and script != "__main__.py"
             else "the working directory")
    return f"; relative paths are read from {os.getcwd()}, {where}"


ON_RESUME = "on_resume"  # field metadata: what a new value of the key does to a resumed run
RUN_KEY = "run key"  # names the run folder or says what to do with it
FREE = "free"  # how fast, where or how the run computes, records or evaluates; the data order goes on
REDEAL = "redeal"  # as FREE, but what is left of the epoch is dealt to the loader workers anew (clipscale.data.epoch)


def may_change(default=dataclasses.MISSING, *, on_resume: str = FREE, default_factory=dataclasses.MISSING):
    """A key (or a whole section) that a resumed run may change; `on_resume` says what that does."""
    return field(default=default, default_factory=default_factory, metadata={ON_RESUME: on_resume})


@dataclass
class RunConfig:
    name: str = may_change("digits", on_resume=RUN_KEY)
    output_dir: str = may_change("runs", on_resume=RUN_KEY)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = may_change("auto")
    # continue the run in runs/<name> when its config is this one (clipscale/run_dir.py)
    resume: bool = may_change(True, on_resume=RUN_KEY)
    # with resume: false, move an existing runs/<name> aside to runs/<name>.old-<time>
    overwrite: bool = may_change(False, on_resume=RUN_KEY)
    # resume a run with a different train.steps; the lr schedule is redrawn
    extend_steps: bool = may_change(False, on_resume=RUN_KEY)


@dataclass
class ModelConfig:
    # An open_clip architecture name (ViT-B-16, ...) or, when `custom` is given, an open_clip
    # model config: embed_dim, vision_cfg, text_cfg. vision_cfg.timm_model_name (with timm_pool,
    # timm_proj) makes a timm image tower; text_cfg.hf_model_name, a local Hugging Face folder
    # (with hf_tokenizer_name, hf_pooler_type, hf_proj_type), a Hugging Face text tower.
    name: Optional[str] = None
    custom: Optional[dict] = None
    pretrained: Optional[str] = None  # a whole-CLIP checkpoint (open_clip's or ours), local file only
    pretrained_image: Optional[str] = None  # timm weights for a timm image tower's trunk, local file only
    preprocess: Optional[dict] = None  # open_clip image preprocessing overrides: mean, std, interpolation, resize_mode
    # LiT, with open_clip_train's names: lock the image tower, but its last N layer groups.
    lock_image: bool = False
    lock_image_unlocked_groups: int = 0
    lock_image_freeze_bn_stats: bool = False  # BatchNorm running statistics of the locked groups stay put
    # And the text tower (open_clip's lock_text_tower): but its last N layer groups. open_clip's own
    # text tower always locks its layer norms with the rest; a Hugging Face tower may leave them trainable.
    lock_text: bool = False
    lock_text_unlocked_layers: int = 0
    lock_text_freeze_layer_norm: bool = True
    # open_clip_train's --force-* overrides of the architecture's config, for named and custom models alike
    force_patch_dropout: Optional[float] = None  # the fraction of image patches dropped while training (FLIP)
    force_quick_gelu: bool = False  # QuickGELU activations, as OpenAI's original weights need
    force_image_size: Optional[int] = None
    force_context_length: Optional[int] = None  # text tokens; the tokenizer follows
    # Speed
    grad_checkpointing: bool = may_change(False)  # recompute tower activations in the backward: larger chunks fit
    # torch.compile the towers: "auto" on a GPU (off on a CPU, where compiling costs more than it
    # gains). Compiled code is cached in `compile_cache` (null: <run folder>/compile_cache), so a
    # resumed or requeued run does not compile again.
    compile: bool | Literal["auto"] = may_change("auto")
    compile_cache: Optional[str] = may_change(None)
    # Each compiled block's forward and backward replayed as CUDA graphs (torch.compile's
    # "reduce-overhead"): "auto" where the towers are compiled on a GPU under DDP or one process
    # (not FSDP, whose hooks run between the blocks' kernels) and a batch is encoded in several
    # chunks (a plain step gained nothing, measured). The threads launching the model's
    # kernels then take the interpreter lock once a block, not once a kernel, so the data path's
    # threads beside them no longer slow the step (docs/architecture.md, "Compiled towers").
    cuda_graphs: bool | Literal["auto"] = may_change("auto")
    channels_last: bool = may_change(False)  # NHWC image tower: faster convolutions (timm convnets); no gain for ViTs
    # How an open_clip ViT embeds its patches (visual.conv1, a stride-p p x p convolution): "conv", or
    # "matmul": the same weights (same state_dict key) applied as one matrix product over the unfolded
    # patches, compiled with the towers; "auto": matmul where the towers are compiled and the image
    # tower is an open_clip ViT (1.15x a ViT-B/32 step on an H200, docs/models.md), else conv.
    patch_embed: Literal["auto", "conv", "matmul"] = may_change("auto")
    # The towers' self-attention (open_clip's nn.MultiheadAttention): "sdpa", as open_clip computes it
    # (F.scaled_dot_product_attention, torch's kernel choice), or "short": sequences of at most 256
    # tokens (ViT-B/32's 50, ViT-B/16's 197, captions cut to their length) in clipscale's Triton
    # programs (clipscale/attention.py), the same parameters; longer ones as sdpa. "auto": short where
    # the towers are compiled on a GPU (1.21x a ViT-B/32 step through train.py, ViT-B/16's ceiling
    # 1.08x, on an H100), else sdpa.
    attention: Literal["auto", "sdpa", "short"] = may_change("auto")
    # The text tower at its captions' own length (clipscale.caption_length): each step encodes its
    # texts in length order, each chunk only up to its longest caption, where that gives the same
    # features (open_clip's causal towers pooled at the end-of-text token; the run says why not).
    cut_text_padding: bool = may_change(True)
    causal_text_attention: bool = may_change(True)  # the causal flag instead of the mask: flash kernels


@dataclass
class DataConfig:
    # "digits": scikit-learn's handwritten digits, written as shards on first use.
    # "webdataset": train_shards is a brace pattern of tar shards ("data/{00000..00099}.tar"; img2dataset's
    #   layout: KEY.jpg, KEY.txt, KEY.json), a folder or a glob of .tar files, `pipe:` commands or http(s):// URLs; several
    #   sources joined with "::". "csv": train_shards is a CSV file (several joined with "::") of image
    #   paths (relative to its folder) and captions. docs/own_data.md.
    kind: Literal["digits", "webdataset", "csv"] = "digits"
    root: str = "data/digits"
    train_shards: Optional[str] = None
    image_size: Optional[int] = None  # digits only: the size the digits are drawn at (null: 32); else the model's decides
    image_key: str = "jpg;jpeg;png;webp"  # a sample's image: the first of these members it has
    caption_key: str = "txt;text;caption"  # a sample's caption: the first of these members it has
    # open_clip's --train-data-upsampling-factors: one draw weight per "::" source (a list or "1::2"); needs resampled
    upsampling_factors: Optional[list | str] = None
    resampled: bool = False  # open_clip's --dataset-resampled: each epoch's shards drawn with replacement
    csv_image_key: str = "filepath"  # open_clip's --csv-img-key
    csv_caption_key: str = "title"  # open_clip's --csv-caption-key
    csv_separator: str = "\t"  # open_clip's --csv-separator
    # Loader processes per rank; every (rank, worker) pair takes its share of the epochs' slots (clipscale.data.epoch)
    workers: int = may_change(2, on_resume=REDEAL)
    shuffle_buffer: int = 1000
    # Who decodes training images (clipscale/data/pipeline.py). "loader": the loader workers, with
    # PIL (open_clip_train's way). "device": the workers read the JPEGs' headers and draw their crops,
    # the GPU decodes each chunk (nvJPEG: its hardware JPEG engines where it has them) in a thread of
    # the training process, and the host holds the batch as encoded bytes; images that are not such
    # JPEGs the workers decode. "auto": device on a GPU, loader on a CPU.
    # The decoders give the same samples and crops, their pixels within rounding.
    decoder: Literal["auto", "loader", "device"] = may_change("auto")
    # data.decoder=device: the share of the JPEGs the GPU takes that the loader workers decode
    # instead (libjpeg-turbo; PIL for the images the GPU does not take). Beside a training step the GPU's
    # decoder is the slowest part of the data path while the workers wait for room (docs/
    # benchmarks.md, "What the step waits for"); which samples is fixed by each sample's seed,
    # so a resumed run, on any shape, decodes each one the same way. The host holds those images as
    # pixels for the whole step (each its crop's region, resized by the GPU: about 250 KB for an
    # img2dataset image of short side 256, against ~25 KiB of JPEG). "auto": 1 where the workers
    # decode faster than the towers train (about 780 images/s a worker against the towers' FLOPs
    # at 0.27 of the GPU's peak: ViT-B/32 and larger with 14 workers), else 0.4 with 14 workers a GPU (measured
    # best, B/32 at 32,768 on an H200), less with fewer workers; lower, down to 0, where the
    # pixels would take more than a quarter of the host's memory (a million samples).
    # 1: the workers decode every image into arenas of page-locked shared memory and nothing of
    # the data path runs beside the step in the training process (no thread: each chunk is one
    # copy and one resize, issued by the step's own thread; the next batch's during this step's
    # pass 2 when pass 1 kept every chunk); it needs workers fast enough for the towers (about
    # 10,900 images/s from 14 on a 16-core H200 host: ViT-B/16 at 0.977 of its ceiling at 32,768, B/32
    # 0.967 at 65,536).
    worker_decode_share: float | Literal["auto"] = may_change("auto")
    # GiB of a step's pass-1 chunks (uint8 pixels, tokens) kept on the device for Gradient Cache's
    # pass 2, which then neither decodes nor copies them again; null: a quarter of the GPU's memory.
    # Beyond it they wait on the host and, where the host has no room (a million samples on one
    # GPU), on disk in $TMPDIR (docs/architecture.md).
    keep_on_device_gib: Optional[float] = may_change(None)
    # data.decoder=device: threads of the training process decoding the GPU's JPEGs (null: 2); 0:
    # none, the training thread decodes each chunk itself (the next batch's between this step's
    # pass-2 chunks, when pass 1 kept every chunk), and the loader workers write the images they
    # decode into arenas of page-locked shared memory (what worker_decode_share: 1 always does).
    # Measured slower than the threads at share 0.4 (ViT-B/32: 0.65 against 0.83 of the ceiling).
    # train.offload with data.decoder=loader: processes per rank decoding the kept image bytes
    # again for Gradient Cache's second pass; null = data.workers.
    decode_workers: Optional[int] = may_change(None)
    # An image whose header claims more pixels is skipped and counted before anything is
    # allocated for it (image bombs); the default is PIL's bound, Image.MAX_IMAGE_PIXELS.
    max_image_pixels: int = Image.MAX_IMAGE_PIXELS


@dataclass
class LossConfig:
    name: str = "vanilla"
    options: dict = field(default_factory=dict)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.2
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    warmup_steps: int = 50
    grad_clip: Optional[float] = 1.0  # max global grad norm; null disables
    # open_clip_train's --lr-scheduler: after the linear warmup, half a cosine down to 0, constant,
    # or constant and then, over the last lr_cooldown_steps, down to lr_cooldown_end
    # ((1 - progress) ** lr_cooldown_power: linear at 1)
    lr_scheduler: Literal["cosine", "const", "const-cooldown"] = "cosine"
    lr_cooldown_steps: Optional[int] = None  # open_clip's --epochs-cooldown, in steps
    lr_cooldown_power: float = 1.0
    lr_cooldown_end: float = 0.0


@dataclass
class TrainConfig:
    batch_size: int = 256  # global: the number of negatives each sample sees
    # Per-GPU encoder sub-batch (Gradient Cache); null = the whole per-GPU batch; "auto" = the
    # largest that fits the GPU, from a memory probe of the real model (logged at start).
    # Gradient Cache gives the same gradients whatever the chunk, offloaded or not.
    chunk_size: Optional[int | Literal["auto"]] = may_change(None)
    offload: bool = may_change(False)
    # The run length: steps, or null and one of samples (ceil(samples / batch_size) steps) or epochs of
    # num_samples_per_epoch samples each (open_clip_train's --epochs with --train-num-samples:
    # epochs x ceil(num_samples_per_epoch / batch_size) steps); with data.kind: csv and
    # num_samples_per_epoch null, an epoch is the table's rows (open_clip_train's CSV epoch).
    steps: Optional[int] = 300
    samples: Optional[int] = None
    epochs: Optional[int] = None
    num_samples_per_epoch: Optional[int] = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    log_every: int = may_change(10)
    checkpoint_every: int = may_change(100)
    # the newest N step checkpoints stay; null keeps all (open_clip_train's way)
    keep_checkpoints: Optional[int] = may_change(3)
    keep_every: Optional[int] = may_change(None)  # also keep every checkpoint at a multiple of this many steps
    max_nonfinite_steps: int = may_change(10)  # consecutive skipped steps before the run stops
    # Step N (counted from 1) runs under torch.profiler: where its GPU time went and what the GPU
    # waited for, into runs/<name>/profile/step_N.json with the Chrome trace beside it (rank 0;
    # clipscale/profiling.py). null: no step is profiled.
    profile_step: Optional[int] = may_change(None)
    # ddp: every process holds the whole model; fsdp: parameters, gradients and optimizer state
    # sharded over the processes (FSDP2, docs/fsdp.md), for towers beyond one GPU's memory. Both
    # train the same weights.
    parallel: Literal["ddp", "fsdp"] = may_change("ddp")
    # fsdp: reduce-scatter the gradients after every Gradient Cache chunk ("chunk": 1/world of a
    # gradient held per process) or once a step ("step": the whole gradient held between chunks).
    fsdp_reduce: Literal["chunk", "step"] = may_change("chunk")
    # fsdp: parameters, gradients and optimizer state on the host (CPUOffloadPolicy)
    fsdp_offload: bool = may_change(False)


@dataclass
class EvalConfig:
    every_n_steps: int = 0  # 0: evaluate only at the end of training
    zeroshot: bool = True  # the held-out digits (data.kind: digits)
    # Further sets: built-in names (imagenet, imagenet-v2, coco, ...) with their fields,
    # e.g. {task: imagenet, data: /data/imagenet/val}, or task files; see clipscale/eval/tasks.py.
    sets: list = field(default_factory=list)
    batch_size: int = 256
    workers: int = 2
    # open_clip's --val-data: held-out shards (a brace pattern, a folder or a glob) or a .csv/.tsv file, read with data.*'s keys;
    # gives val_loss (the configured loss over eval.batch_size batches) and val_ retrieval recalls
    val_data: Optional[str] = None


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "clipscale"
    mode: Literal["auto", "online", "offline"] = "auto"  # auto: offline when no API key


@dataclass
class TensorboardConfig:
    enabled: bool = False  # event files in runs/<name>/tensorboard with the scalars of metrics.jsonl


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = may_change(default_factory=EvalConfig)
    wandb: WandbConfig = may_change(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = may_change(default_factory=TensorboardConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def on_resume(key: str) -> str | None:
    """What a new value of the dotted `key` does to a resumed run (RUN_KEY, FREE, REDEAL), from its
    section's metadata or its own; None for a key that changes what is trained (and for a value
    inside a mapping key, such as model.custom.embed_dim: it is its key's)."""
    section_name, _, rest = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections:
        return None
    section = sections[section_name]
    if ON_RESUME in section.metadata:
        return section.metadata[ON_RESUME]
    keys = {f.name: f for f in dataclasses.fields(section.default_factory)}
    found = keys.get(rest.partition(".")[0])
    return found.metadata.get(ON_RESUME) if found is not None else None


UNSET = "(unset)"  # a key one configuration has and the other lacks


def config_differences(old: dict, new: dict) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} for every key whose value differs between two
    configurations (as `Config.to_dict` gives them). A key the old one lacks (a newer clipscale's)
    counts at its default value."""
    old_flat, new_flat = _flatten(old), _flatten(new)
    defaults = _flatten(Config().to_dict())
    differences = {}
    for key in sorted(old_flat.keys() | new_flat.keys()):
        before = old_flat.get(key, defaults.get(key, UNSET))
        after = new_flat.get(key, UNSET)
        if before != after:
            differences[key] = (before, after)
    return differences


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def schema_help() -> str:
    """Every section and key with its default and type, from the schema (train.py --help)."""
    marks = {RUN_KEY: "", FREE: "  [may change on resume]", REDEAL: "  [may change on resume: the epoch goes on, dealt anew]"}
    lines = ["configuration keys, given as section.key=value after the YAML file (defaults shown):"]
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        lines.append(f"  {section.name}:" + marks.get(section.metadata.get(ON_RESUME), ""))
        for key in dataclasses.fields(cls):
            default = key.default_factory() if key.default is dataclasses.MISSING else key.default
            mark = marks.get(key.metadata.get(ON_RESUME), "")
            lines.append(f"    {key.name}: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"
                         f"  ({_describe(hints[key.name])}){mark}")
    return "\n".join(lines)


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def check_value(key: str, value: Any, tp) -> Any:
    """Check `value` against the annotation `tp`, allowing int -> float and nothing else implicit."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return check_value(key, value, arg)
            except ConfigError:
                pass
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif tp is float and isinstance(value, str):
        # PyYAML (YAML 1.1) reads 5e-4 without a dot as a string; accept it as the number it means.
        try:
            return float(value)
        except ValueError:
            pass
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp in (str, bool, dict, list) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: got {value!r}, expected {_describe(tp)}")


def _apply(section, updates: dict, prefix: str) -> None:
    hints = typing.get_type_hints(type(section))
    for key, value in updates.items():
        if key not in hints:
            allowed = ", ".join(hints)
            raise ConfigError(f"unknown key {prefix}{key}; allowed keys in {prefix.rstrip('.') or 'the config'}: {allowed}")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key}: expected a mapping of its keys, got {value!r}")
            _apply(current, value, f"{prefix}{key}.")
        else:
            setattr(section, key, check_value(prefix + key, value, hints[key]))


def _override_to_nested(override: str) -> dict:
    """'train.steps=100' -> {'train': {'steps': 100}}; the value is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    dotted, raw = override.split("=", 1)
    section_names = [section.name for section in dataclasses.fields(Config)]
    if "." not in dotted and dotted.strip() not in section_names:
        nearest = nearest_key(dotted.strip())
        suggestion = f"; the nearest key is {nearest}: {nearest}={raw}" if nearest else f" (sections: {', '.join(section_names)})"
        raise ConfigError(f"override {override!r}: keys are section.key{suggestion}")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({_yaml_problem(err)})") from None
    nested: dict = {}
    node = nested
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return nested


def nearest_key(name: str) -> str | None:
    """The schema's section.key closest to `name` (a bare key such as 'steps', or a misspelt dotted
    one), by its key alone or by the whole dotted name; None when nothing is close."""
    dotted = [f"{section.name}.{key.name}" for section in dataclasses.fields(Config)
              for key in dataclasses.fields(section.default_factory)]
    by_key = {key.split(".", 1)[1]: key for key in reversed(dotted)}  # a key in two sections: the first section's
    close = difflib.get_close_matches(name, by_key, n=1) if "." not in name else []
    if close:
        return by_key[close[0]]
    close = difflib.get_close_matches(name, dotted, n=1)
    return close[0] if close else None


# clipscale.losses' own losses (a test keeps the two lists equal): importing it to ask would import torch.
BUILTIN_LOSSES = ("disco", "infcl", "local", "ntxent", "siglip", "vanilla")


def known_losses() -> list[str]:
    """The loss names a run may give, without importing torch where nothing else did: the built-in
    ones, and any registered by user code (`register_loss`), which has imported clipscale.losses."""
    losses = sys.modules.get("clipscale.losses")
    return losses.available_losses() if losses is not None else sorted(BUILTIN_LOSSES)


def open_clip_architectures() -> list[str] | None:
    """open_clip's architecture names (its model_configs/*.json), read without importing it (and torch)
    where nothing else did; once imported, its own list (user code may have added configs). None
    where open_clip is not installed."""
    module = sys.modules.get("open_clip")
    if module is not None:
        return module.list_models()
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    return sorted(path.stem for folder in spec.submodule_search_locations for path in (Path(folder) / "model_configs").glob("*.json"))


def unknown_loss(name: str, known: list[str]) -> ConfigError:
    return ConfigError(f"loss.name: got {name!r}, expected one of {', '.join(known)}")


def unknown_architecture(name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    nearest = f" (the nearest is {close[0]})" if close else ""
    return ConfigError(f"model.name: unknown open_clip architecture {name!r}{nearest}; see open_clip.list_models()")


def check_names(cfg: Config) -> None:
    """loss.name and model.name against the losses and architectures known without importing torch
    (`known_losses`, `open_clip_architectures`): train.py's mistakes in a name in a fraction of a
    second. A model name with a schema (local-dir:, hf-hub:) is clipscale.checks' to judge, as is
    everything else about the loss and the architecture."""
    losses = known_losses()
    if cfg.loss.name not in losses:
        raise unknown_loss(cfg.loss.name, losses)
    architectures = open_clip_architectures()
    if cfg.model.name is not None and ":" not in cfg.model.name and architectures is not None \
            and cfg.model.name not in architectures:
        raise unknown_architecture(cfg.model.name, architectures)


def _merge(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


PREPROCESS_KEYS = ("mean", "std", "interpolation", "resize_mode")  # open_clip's image_<key> overrides


def check_model_section(cfg: ModelConfig) -> None:
    """Model keys that depend on each other or name local files; the architecture itself
    is open_clip's to know (clipscale.checks)."""
    if (cfg.name is None) == (cfg.custom is None):
        raise ConfigError("model: set exactly one of model.name (an open_clip architecture) or model.custom (a CLIP config dict)")
    vision_cfg, text_cfg = {}, {}
    if cfg.custom is not None:
        missing = [key for key in ("embed_dim", "vision_cfg", "text_cfg") if key not in cfg.custom]
        if missing:
            raise ConfigError(f"model.custom: missing {', '.join(missing)} (an open_clip model config needs embed_dim, vision_cfg, text_cfg)")
        vision_cfg, text_cfg = cfg.custom["vision_cfg"], cfg.custom["text_cfg"]
    if vision_cfg.get("timm_model_pretrained"):
        raise ConfigError("model.custom.vision_cfg.timm_model_pretrained: weights are never downloaded; "
                          "give a local timm checkpoint as model.pretrained_image")
    for key in ("hf_model_name", "hf_tokenizer_name"):
        if key in text_cfg and not Path(text_cfg[key]).is_dir():
            raise ConfigError(f"model.custom.text_cfg.{key}: no directory at {text_cfg[key]!r} "
                              "(Hugging Face towers load from a local save_pretrained folder only)"
                              + relative_note(text_cfg[key]))
    for key in ("pretrained", "pretrained_image"):
        path = getattr(cfg, key)
        if path is not None and not Path(path).is_file():
            if Path(path).is_dir():
                raise ConfigError(f"model.{key}: {path!r} is a folder; give the checkpoint file "
                                  "(only local checkpoints are loaded)")
            raise ConfigError(f"model.{key}: no file at {path!r} (only local checkpoints are loaded){relative_note(path)}")
    if cfg.pretrained_image is not None and "timm_model_name" not in vision_cfg:
        raise ConfigError("model.pretrained_image: only for a timm image tower (model.custom.vision_cfg.timm_model_name); "
                          "open_clip towers load from a whole-CLIP checkpoint, model.pretrained")
    unknown = set(cfg.preprocess or {}) - set(PREPROCESS_KEYS)
    if unknown:
        raise ConfigError(f"model.preprocess: unknown keys {', '.join(sorted(unknown))}; allowed: {', '.join(PREPROCESS_KEYS)}")
    if cfg.lock_image_unlocked_groups < 0:
        raise ConfigError(f"model.lock_image_unlocked_groups: must be >= 0, got {cfg.lock_image_unlocked_groups}")
    if not cfg.lock_image and (cfg.lock_image_unlocked_groups or cfg.lock_image_freeze_bn_stats):
        raise ConfigError("model.lock_image_unlocked_groups / lock_image_freeze_bn_stats need model.lock_image: true")
    if cfg.lock_text_unlocked_layers < 0:
        raise ConfigError(f"model.lock_text_unlocked_layers: must be >= 0, got {cfg.lock_text_unlocked_layers}")
    if not cfg.lock_text and (cfg.lock_text_unlocked_layers or not cfg.lock_text_freeze_layer_norm):
        raise ConfigError("model.lock_text_unlocked_layers / lock_text_freeze_layer_norm need model.lock_text: true")
    if cfg.force_patch_dropout is not None and not 0 <= cfg.force_patch_dropout < 1:
        raise ConfigError(f"model.force_patch_dropout: the fraction of patches dropped, in [0, 1), got {cfg.force_patch_dropout}")
    for key in ("force_image_size", "force_context_length"):
        if getattr(cfg, key) is not None and getattr(cfg, key) <= 0:
            raise ConfigError(f"model.{key}: must be positive or null, got {getattr(cfg, key)}")


def check_lr_schedule(cfg: OptimConfig, steps: int) -> None:
    if cfg.lr_scheduler != "const-cooldown":
        if cfg.lr_cooldown_steps is not None:
            raise ConfigError(f"optim.lr_cooldown_steps: only for optim.lr_scheduler=const-cooldown, not {cfg.lr_scheduler}")
        return
    if cfg.lr_cooldown_steps is None:
        raise ConfigError("optim.lr_cooldown_steps: required with optim.lr_scheduler=const-cooldown "
                          "(the last steps over which the lr falls to optim.lr_cooldown_end)")
    if not 0 < cfg.lr_cooldown_steps <= steps:  # a cooldown that begins in the warmup begins after it (open_clip's way)
        raise ConfigError(f"optim.lr_cooldown_steps: must be in 1..{steps} (train.steps), got {cfg.lr_cooldown_steps}")
    if cfg.lr_cooldown_power <= 0:
        raise ConfigError(f"optim.lr_cooldown_power: must be positive, got {cfg.lr_cooldown_power}")
    if not 0 <= cfg.lr_cooldown_end <= cfg.lr:
        raise ConfigError(f"optim.lr_cooldown_end: must be in [0, optim.lr={cfg.lr}], got {cfg.lr_cooldown_end}")


def resolve_run_length(cfg: TrainConfig, csv: bool = False) -> None:
    """train.steps from train.samples or train.epochs (the one place a run length in samples
    becomes steps); a train.steps that says otherwise is a conflict, not a choice. With `csv` (a CSV
    table's data), train.epochs without train.num_samples_per_epoch counts the table's rows, which
    clipscale.checks reads (`epochs_of_rows`): train.steps stays null until then."""
    for key in ("samples", "epochs", "num_samples_per_epoch"):
        if getattr(cfg, key) is not None and getattr(cfg, key) <= 0:
            raise ConfigError(f"train.{key}: must be positive or null, got {getattr(cfg, key)}")
    if cfg.samples is not None and cfg.epochs is not None:
        raise ConfigError("train.samples and train.epochs both give the run length: set one of them")
    if csv and cfg.epochs is not None and cfg.num_samples_per_epoch is None:
        if cfg.steps is not None:
            raise ConfigError(f"train.steps={cfg.steps} and train.epochs={cfg.epochs} (of the CSV table's rows) give two "
                              "run lengths: set train.steps=null to count in epochs")
        return
    if (cfg.epochs is not None) != (cfg.num_samples_per_epoch is not None):
        raise ConfigError("train.epochs and train.num_samples_per_epoch go together: an epoch is "
                          "train.num_samples_per_epoch samples (open_clip_train's --train-num-samples; "
                          "with data.kind: csv, the table's rows when it is not given)")
    if cfg.samples is None and cfg.epochs is None:
        if cfg.steps is None:
            raise ConfigError("train.steps: null needs the run length as train.samples or train.epochs")
        return
    given = (f"train.samples={cfg.samples}" if cfg.samples is not None
             else f"train.epochs={cfg.epochs} of train.num_samples_per_epoch={cfg.num_samples_per_epoch}")
    steps = math.ceil(cfg.samples / cfg.batch_size) if cfg.samples is not None else cfg.epochs * steps_per_epoch(cfg)
    if cfg.steps is not None and cfg.steps != steps:
        raise ConfigError(f"train.steps={cfg.steps} and {given} ({steps} steps of train.batch_size={cfg.batch_size}) "
                          "give two run lengths: set train.steps=null to count in samples or epochs")
    cfg.steps = steps


def epochs_in_rows(cfg: Config) -> bool:
    """Whether the run length waits for a CSV table's row count (train.epochs of data.kind: csv
    without train.num_samples_per_epoch; `resolve_run_length`)."""
    return cfg.data.kind == "csv" and cfg.train.epochs is not None and cfg.train.num_samples_per_epoch is None


def epochs_of_rows(cfg: Config, rows: int) -> None:
    """An epoch of a CSV table is its `rows` (the sum over its "::" sources), as open_clip_train's
    CSV reader counts it whatever --dataset-resampled and the upsampling factors say: it becomes
    train.num_samples_per_epoch, and train.steps follows."""
    cfg.train.num_samples_per_epoch = rows
    resolve_run_length(cfg.train)
    check_run_length(cfg)


def steps_per_epoch(cfg: TrainConfig) -> int | None:
    """The steps of an epoch of train.num_samples_per_epoch samples, open_clip_train's way (a last,
    partial batch in every epoch); None for a run not counted in epochs."""
    return math.ceil(cfg.num_samples_per_epoch / cfg.batch_size) if cfg.num_samples_per_epoch else None


def check_data_section(cfg: DataConfig) -> None:
    if cfg.kind != "digits" and not cfg.train_shards:
        raise ConfigError(f"data.train_shards: required when data.kind is {cfg.kind!r}")
    if cfg.kind == "digits" and cfg.train_shards:
        raise ConfigError(f"data.train_shards: data.kind is 'digits', which trains on the digits it writes under "
                          f"data.root; to train on {cfg.train_shards!r} add data.kind=webdataset (or csv for a table)")
    if cfg.image_size is not None and cfg.kind != "digits":
        raise ConfigError(f"data.image_size: only for data.kind=digits (the size the digits are drawn at); with "
                          f"{cfg.kind} data the model's image size decides the training crop: remove the key")
    if cfg.image_size is not None and cfg.image_size <= 0:
        raise ConfigError(f"data.image_size: must be positive, got {cfg.image_size}")
    for key in ("image_key", "caption_key", "csv_image_key", "csv_caption_key"):
        if not getattr(cfg, key).strip(";"):
            raise ConfigError(f"data.{key}: must name at least one key")
    if len(cfg.csv_separator) != 1:
        raise ConfigError(f"data.csv_separator: must be one character, got {cfg.csv_separator!r}")
    if cfg.upsampling_factors is not None:
        if not cfg.resampled:
            raise ConfigError("data.upsampling_factors: weights for drawing shards with replacement; "
                              "set data.resampled: true (as open_clip's --dataset-resampled)")
        factors = cfg.upsampling_factors
        factors = factors.split("::") if isinstance(factors, str) else factors
        sources = len((cfg.train_shards or "").split("::"))
        try:
            cfg.upsampling_factors = [check_value("data.upsampling_factors", float(f) if isinstance(f, str) else f, float)
                                      for f in factors]
        except ValueError:
            raise ConfigError(f"data.upsampling_factors: expected numbers (a list or '1::2'), got {factors!r}") from None
        if len(cfg.upsampling_factors) != sources:
            raise ConfigError(f"data.upsampling_factors: {len(cfg.upsampling_factors)} factors for {sources} sources "
                              "(data.train_shards joined with '::'); give one per source")
        if not all(f > 0 for f in cfg.upsampling_factors):
            raise ConfigError(f"data.upsampling_factors: must be positive, got {factors!r}")


def check_sections(cfg: Config) -> None:
    """Checks that span keys of the configuration alone; per-key types are checked while applying."""
    check_model_section(cfg.model)
    if cfg.train.batch_size <= 0:
        raise ConfigError(f"train.batch_size: must be positive, got {cfg.train.batch_size}")
    resolve_run_length(cfg.train, csv=cfg.data.kind == "csv")
    check_data_section(cfg.data)
    positive = {
        "train.batch_size": cfg.train.batch_size,
        "train.log_every": cfg.train.log_every,
        "train.checkpoint_every": cfg.train.checkpoint_every,
        "data.max_image_pixels": cfg.data.max_image_pixels,
        "eval.batch_size": cfg.eval.batch_size,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
    if not epochs_in_rows(cfg):
        check_run_length(cfg)
    if isinstance(cfg.train.chunk_size, int) and cfg.train.chunk_size <= 0:
        raise ConfigError(f"train.chunk_size: must be positive, null or 'auto', got {cfg.train.chunk_size}")
    if cfg.train.keep_checkpoints is not None and cfg.train.keep_checkpoints < 1:
        raise ConfigError(f"train.keep_checkpoints: must be >= 1 or null (keep all), got {cfg.train.keep_checkpoints}")
    if cfg.train.profile_step is not None and cfg.train.profile_step < 1:
        raise ConfigError(f"train.profile_step: must be a step number (from 1) or null, got {cfg.train.profile_step}")
    if cfg.train.keep_every is not None and (cfg.train.keep_every <= 0 or cfg.train.keep_every % cfg.train.checkpoint_every):
        raise ConfigError(f"train.keep_every: must be a positive multiple of train.checkpoint_every "
                          f"({cfg.train.checkpoint_every}) or null, got {cfg.train.keep_every}")
    check_parallel(cfg.train)
    if cfg.run.overwrite and cfg.run.resume:
        raise ConfigError("run.overwrite=true starts the run afresh: set run.resume=false with it")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr: must be positive, got {cfg.optim.lr}")
    if cfg.data.workers < 0:
        raise ConfigError(f"data.workers: must be >= 0, got {cfg.data.workers}")
    if cfg.data.worker_decode_share != "auto" and not 0.0 <= cfg.data.worker_decode_share <= 1.0:
        raise ConfigError(f"data.worker_decode_share: must be between 0 and 1, got {cfg.data.worker_decode_share}")
    if cfg.data.keep_on_device_gib is not None and cfg.data.keep_on_device_gib < 0:
        raise ConfigError(f"data.keep_on_device_gib: must be >= 0 or null, got {cfg.data.keep_on_device_gib}")
    if cfg.data.decode_workers is not None and cfg.data.decode_workers < 0:
        raise ConfigError(f"data.decode_workers: must be >= 0 or null, got {cfg.data.decode_workers}")


def check_run_length(cfg: Config) -> None:
    """The checks that need train.steps (known once `resolve_run_length` or `epochs_of_rows` set it)."""
    if cfg.train.steps <= 0:
        raise ConfigError(f"train.steps: must be positive, got {cfg.train.steps}")
    check_lr_schedule(cfg.optim, cfg.train.steps)


def check_parallel(train: TrainConfig) -> None:
    if train.parallel != "fsdp":
        for key in ("fsdp_reduce", "fsdp_offload"):
            if getattr(train, key) != getattr(TrainConfig, key):
                raise ConfigError(f"train.{key}: only with train.parallel=fsdp")
        return
    if train.precision == "fp16":
        raise ConfigError("train.precision=fp16 with train.parallel=fsdp: each process would test only its own "
                          "gradient shards for overflow; use train.precision=bf16 (or fp32)")
    if train.chunk_size == "auto":
        raise ConfigError("train.chunk_size: 'auto' probes the whole model on one device; with train.parallel=fsdp give "
                          "the chunk as a number")


def _given(overrides: list[dict], data_key: str) -> bool:
    """Whether a command-line override sets data.<data_key>."""
    return any(isinstance(nested.get("data"), dict) and data_key in nested["data"] for nested in overrides)


def _factors_for_the_sources(data: dict, file_factors) -> None:
    """The YAML file's data.upsampling_factors are one per source of its data.train_shards. Where the
    command line names a different number of sources (your own shards in place of the example's
    two) and no factors of its own, the file's cannot weigh them and are dropped: every shard is
    then drawn alike, as without factors."""
    factors = file_factors.split("::") if isinstance(file_factors, str) else file_factors
    shards = data.get("train_shards")
    if isinstance(shards, str) and isinstance(factors, list) and len(factors) != len(shards.split("::")):
        data["upsampling_factors"] = None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's complaint and where (1-based line and column), in one line."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(getattr(err, "problem", None) or err).split())


def _read_yaml(path: Path):
    if path.is_dir():
        raise ConfigError(f"--config {path} is a folder; give a YAML file, e.g. configs/digits.yaml")
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML syntax error at {_yaml_problem(err)}") from None


def load_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """The configuration with every key and section checked; clipscale.checks.load_checked_config
    adds the checks against the components (architecture, loss, evaluation sets)."""
    raw: dict = {}
    if path is not None:
        raw = _read_yaml(Path(path))
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    given = [_override_to_nested(override) for override in overrides]
    file_factors = raw["data"].get("upsampling_factors") if isinstance(raw.get("data"), dict) else None
    for override in given:
        _merge(raw, override)
    if file_factors is not None and _given(given, "train_shards") and not _given(given, "upsampling_factors"):
        _factors_for_the_sources(raw["data"], file_factors)
    cfg = Config()
    _apply(cfg, raw, "")
    check_sections(cfg)
    return cfg
