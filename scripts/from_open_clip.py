"""Turn an open_clip_train command line into a clipscale YAML configuration.

    python scripts/from_open_clip.py torchrun --nproc_per_node 8 -m open_clip_train.main \\
        --model ViT-B-32 --train-data 'shards/{00000..01023}.tar' --train-num-samples 10000000 \\
        --batch-size 256 --epochs 10 --lr 5e-4 --warmup 2000 --report-to tensorboard > my_run.yaml
    python train.py --config my_run.yaml          # (under torchrun with the same number of GPUs)

    python scripts/from_open_clip.py --markdown   # the table of docs/from_open_clip.md

The YAML states open_clip_train's defaults for what shapes the run (lr, betas, eps, weight decay,
warmup, precision, no gradient clipping, every checkpoint kept), where clipscale's defaults differ.
open_clip counts the batch per GPU; clipscale's train.batch_size is the global batch (per-GPU batch
x GPUs x --accum-freq, the negatives each sample sees), so the number of GPUs is read from the
launcher (torchrun's --nproc_per_node x --nnodes, srun's --ntasks or --ntasks-per-node x --nodes)
or given as --gpus; a command without them counts one, and a note says so. The command may start
open_clip_train in any of its usual forms: `-m open_clip_train.main`, `-m training.main` (older
clones), or the script `src/open_clip_train/main.py` under python, torchrun or srun. Epoch-based
flags (--epochs, --epochs-cooldown, --save-frequency, --zeroshot-frequency, --val-frequency, and the
last two's defaults, 2 and 1 epochs, where their evaluation is asked for) become steps through the
samples in an epoch: --train-num-samples, else for webdataset the `sizes.json` (or `__len__`) file
beside the shards, as open_clip_train reads it, and the table's rows for a CSV (as open_clip_train,
which ignores --train-num-samples there; the table is read here). A flag clipscale does not support
stops the conversion with a list of them and why; a flag that does not change the run (logging
paths, debugging) is noted on stderr and dropped, and so is a warmup longer than the whole run.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Flag:
    kind: str  # "mapped", "ignored" or "unsupported"
    text: str  # mapped: the clipscale keys; ignored and unsupported: why


def mapped(keys: str) -> Flag:
    return Flag("mapped", keys)


def ignored(why: str) -> Flag:
    return Flag("ignored", why)


def unsupported(why: str) -> Flag:
    return Flag("unsupported", why)


AUDIO = unsupported("audio towers (CLAP) are not supported")
NAFLEX = unsupported("NaFlex (variable-resolution) towers are not supported")
LAYER_DECAY = unsupported("layer-wise lr decay is not supported: one lr for every parameter group")
COCA = unsupported("CoCa is not supported (its captioning loss is not implemented; CoCa models are refused)")
DISTILL = unsupported("distillation is not supported (no teacher model or distillation loss)")
EPOCHS = "(epochs x steps per epoch: --train-num-samples, or a CSV's rows)"

# Every flag of open_clip_train/params.py (the main branch, and the 3.3 release's --horovod,
# --torchscript and --trace), in its order.
FLAGS: dict[str, Flag] = {
    "--train-data": mapped("`data.train_shards` (with `data.kind`; sources joined with `::` as in open_clip)"),
    "--train-data-upsampling-factors": mapped("`data.upsampling_factors`"),
    "--val-data": mapped("`eval.val_data`"),
    "--train-num-samples": mapped("`train.num_samples_per_epoch` (webdataset; a CSV's epoch is its rows, counted "
                                  "by the script, as open_clip_train ignores the flag there)"),
    "--val-num-samples": ignored("the validation set is read whole"),
    "--dataset-type": mapped("`data.kind` (`webdataset` or `csv`; `auto` by the extension, as open_clip; `synthetic` is not supported)"),
    "--audio-ext": AUDIO, "--pretrained-audio": AUDIO, "--audio-fill": AUDIO, "--audio-trunc": AUDIO,
    "--audio-fusion": AUDIO, "--audio-int16-normalize": AUDIO, "--audio-zeroshot-dataset": AUDIO,
    "--audio-zeroshot-split": AUDIO, "--audio-zeroshot-audio-key": AUDIO, "--audio-zeroshot-target-key": AUDIO,
    "--audio-zeroshot-class-key": AUDIO, "--audio-zeroshot-template": AUDIO, "--audio-zeroshot-workers": AUDIO,
    "--audio-zeroshot-multiprocessing-context": AUDIO, "--audio-multiprocessing-context": AUDIO,
    "--dataset-resampled": mapped("`data.resampled: true`"),
    "--csv-separator": mapped("`data.csv_separator`"),
    "--csv-img-key": mapped("`data.csv_image_key`"),
    "--csv-caption-key": mapped("`data.csv_caption_key`"),
    "--image-key": mapped("`data.image_key`"),
    "--max-image-pixels": mapped("`data.max_image_pixels`"),
    "--text-key": mapped("`data.caption_key`"),
    "--json-text-key": unsupported("captions come from a text member (data.caption_key), not from keys inside the json"),
    "--json-text-key-probs": unsupported("captions come from a text member (data.caption_key), not from keys inside the json"),
    "--imagenet-val": mapped("`eval.sets: [{task: imagenet, data: PATH}]`"),
    "--imagenet-v2": mapped("`eval.sets: [{task: imagenet-v2, data: PATH}]`"),
    "--cache-dir": ignored("nothing is downloaded: weights are local files"),
    "--logs": mapped("`run.output_dir`"),
    "--log-local": ignored("only rank 0 logs, to runs/<name>/metrics.jsonl"),
    "--name": mapped("`run.name`"),
    "--workers": mapped("`data.workers`"),
    "--batch-size": mapped("`train.batch_size` (global: per-GPU batch x GPUs x --accum-freq)"),
    "--epochs": mapped("`train.epochs` (with `train.steps: null`)"),
    "--epochs-cooldown": mapped(f"`optim.lr_cooldown_steps` {EPOCHS}"),
    "--lr": mapped("`optim.lr`"),
    "--beta1": mapped("`optim.beta1`"),
    "--beta2": mapped("`optim.beta2`"),
    "--eps": mapped("`optim.eps`"),
    "--wd": mapped("`optim.weight_decay`"),
    "--momentum": unsupported("the optimizer is AdamW (open_clip_train's default), which has no momentum"),
    "--warmup": mapped("`optim.warmup_steps`"),
    "--opt": mapped("`adamw` only (the optimizer clipscale uses); timm optimizers are not supported"),
    "--opt-kwargs": unsupported("timm optimizers are not supported"),
    "--opt-fallback-list": unsupported("timm optimizers are not supported"),
    "--text-layer-decay": LAYER_DECAY, "--image-layer-decay": LAYER_DECAY, "--visual-layer-decay": LAYER_DECAY,
    "--audio-layer-decay": LAYER_DECAY,
    "--wd-exclude": unsupported("weight decay excludes open_clip_train's defaults (gains, biases, norms, logit scale); no patterns"),
    "--text-pooler-own-group": LAYER_DECAY,
    "--use-bn-sync": unsupported("SyncBatchNorm is not supported"),
    "--skip-scheduler": mapped("`optim.lr_scheduler: const` with `optim.warmup_steps: 0`"),
    "--lr-scheduler": mapped("`optim.lr_scheduler` (`cosine`, `const`, `const-cooldown`)"),
    "--lr-cooldown-end": mapped("`optim.lr_cooldown_end`"),
    "--lr-cooldown-power": mapped("`optim.lr_cooldown_power`"),
    "--save-frequency": mapped(f"`train.checkpoint_every` {EPOCHS}"),
    "--save-most-recent": ignored("runs/<name>/checkpoints/latest always names the newest checkpoint"),
    "--zeroshot-frequency": mapped(f"`eval.every_n_steps` {EPOCHS}; open_clip_train's default, 2 epochs, where "
                                   "--imagenet-val or --imagenet-v2 is given"),
    "--val-frequency": mapped(f"`eval.every_n_steps` {EPOCHS}; open_clip_train's default, 1 epoch, where --val-data is given"),
    "--val-retrieval-chunk-size": ignored("retrieval is computed in blocks of clipscale's own size"),
    "--val-retrieval-precision": ignored("retrieval similarities are computed in fp32"),
    "--resume": mapped("`run.resume: true` for `latest` (the run in run.output_dir/run.name); another checkpoint path is not supported"),
    "--precision": mapped("`train.precision` (`amp`, open_clip_train's default, fp16; `amp_bf16`/`amp_bfloat16` bf16; `fp32`; pure low-precision weights are not supported)"),
    "--model": mapped("`model.name`"),
    "--pretrained": mapped("`model.pretrained` (a local file; pretrained tags are downloads, not supported)"),
    "--pretrained-image": unsupported("downloads timm's ImageNet weights; give a local file as model.pretrained_image"),
    "--lock-image": mapped("`model.lock_image`"),
    "--lock-image-unlocked-groups": mapped("`model.lock_image_unlocked_groups`"),
    "--lock-image-freeze-bn-stats": mapped("`model.lock_image_freeze_bn_stats`"),
    "--image-mean": mapped("`model.preprocess.mean`"),
    "--image-std": mapped("`model.preprocess.std`"),
    "--image-interpolation": mapped("`model.preprocess.interpolation`"),
    "--image-resize-mode": mapped("`model.preprocess.resize_mode`"),
    "--aug-cfg": unsupported("training augmentation is open_clip's default transform for the model"),
    "--grad-checkpointing": mapped("`model.grad_checkpointing`"),
    "--local-loss": ignored("every loss is the exact loss over the global batch (what --local-loss --gather-with-grad compute)"),
    "--gather-with-grad": ignored("every loss is the exact loss over the global batch (what --local-loss --gather-with-grad compute)"),
    "--force-context-length": mapped("`model.force_context_length`"),
    "--force-image-size": mapped("`model.force_image_size` (one size; height and width apart are not supported)"),
    "--force-quick-gelu": mapped("`model.force_quick_gelu`"),
    "--force-patch-dropout": mapped("`model.force_patch_dropout`"),
    "--force-custom-text": unsupported("changes the model class and its state-dict keys; use model.custom with text_cfg of your own"),
    "--force-naflex-vision": NAFLEX,
    "--torchcompile": mapped("`model.compile`"),
    "--torchcompile-strategy": ignored("model.compile compiles the model's forward"),
    "--torchcompile-backend": ignored("model.compile uses torch.compile's default backend"),
    "--torchcompile-mode": ignored("model.compile uses torch.compile's default mode"),
    "--accum-freq": mapped("`train.chunk_size` (the per-GPU batch; `train.batch_size` is multiplied by it: Gradient Cache, as open_clip's feature cache)"),
    "--device": mapped("`run.device`"),
    "--dist-url": ignored("the process group comes from torchrun's or srun's environment"),
    "--dist-backend": ignored("gloo on CPUs, NCCL on GPUs"),
    "--report-to": mapped("`wandb.enabled`, `tensorboard.enabled` (trackio is not supported)"),
    "--wandb-notes": ignored("not passed to wandb"),
    "--wandb-project-name": mapped("`wandb.project`"),
    "--debug": ignored("no debug logging mode"),
    "--copy-codebase": ignored("the run folder keeps the configuration, not the code"),
    "--ddp-static-graph": ignored("a DDP speed option; clipscale's steps run their own backward passes"),
    "--fsdp": mapped("`train.parallel: fsdp` (FSDP2; with `amp` refused: use `amp_bf16`; docs/fsdp.md)"),
    "--fsdp-no-reshard-after-forward": ignored("clipscale's FSDP reshards every block after its forward (memory "
                                               "before speed); there is no key for it"),
    "--fsdp-offload-cpu": mapped("`train.fsdp_offload: true` (with --fsdp)"),
    "--fsdp-checkpoint": ignored("under FSDP the step checkpoints are sharded `torch.distributed.checkpoint` folders "
                                 "and the final weights one open_clip file (docs/fsdp.md)"),
    "--no-set-device-rank": ignored("each process takes the GPU of its local rank"),
    "--seed": mapped("`run.seed`"),
    "--grad-clip-norm": mapped("`optim.grad_clip` (open_clip's default, no clipping, is written as null)"),
    "--lock-text": mapped("`model.lock_text`"),
    "--lock-text-unlocked-layers": mapped("`model.lock_text_unlocked_layers`"),
    "--lock-text-freeze-layer-norm": mapped("`model.lock_text_freeze_layer_norm`"),
    "--log-every-n-steps": mapped("`train.log_every`"),
    "--log-metric-every-n-steps": ignored("every metric is logged every train.log_every steps"),
    "--train-loss-ema-samples": ignored("the logged loss is the step's loss"),
    "--coca-caption-loss-weight": COCA, "--coca-contrastive-loss-weight": COCA,
    "--remote-sync": unsupported("copy runs/<name> to remote storage yourself (each checkpoint is written whole, atomically)"),
    "--remote-sync-frequency": unsupported("copy runs/<name> to remote storage yourself"),
    "--remote-sync-protocol": unsupported("copy runs/<name> to remote storage yourself"),
    "--delete-previous-checkpoint": mapped("`train.keep_checkpoints: 1`"),
    "--distill-model": DISTILL, "--distill-pretrained": DISTILL,
    "--use-bnb-linear": unsupported("bitsandbytes int8 layers are not supported"),
    "--siglip": mapped("`loss.name: siglip`, on a model with a logit bias (a SigLIP architecture, or `model.custom` "
                       "with `init_logit_bias`); open_clip_train's adding a bias to a CLIP architecture is not supported"),
    "--loss-dist-impl": ignored("clipscale's losses choose their own communication (loss.name, loss.options)"),
    "--use-naflex": NAFLEX, "--naflex-num-train-image-tokens": NAFLEX, "--naflex-patch-sizes": NAFLEX,
    "--naflex-patch-size-probs": NAFLEX, "--naflex-seq-lens": NAFLEX, "--naflex-seq-len-probs": NAFLEX,
    "--naflex-max-tokens-per-batch": NAFLEX, "--naflex-max-text-tokens": NAFLEX, "--naflex-batch-divisor": NAFLEX,
    "--naflex-loss-scale": NAFLEX,
    "--length-bucketing": NAFLEX, "--bucket-pool": NAFLEX, "--bucket-chunk": NAFLEX, "--bucket-prefetch-pools": NAFLEX,
    "--naflex-pad-multiple": NAFLEX,
    "--text-pad-multiple": unsupported("captions are padded to the model's context length"),
    "--horovod": unsupported("Horovod is not supported: torchrun or srun"),
    "--torchscript": unsupported("TorchScript models are not supported"),
    "--trace": unsupported("TorchScript tracing is not supported"),
}


class ConversionError(Exception):
    """The command line cannot become a clipscale run; the message says why."""


ENTRY_MODULES = ("open_clip_train.main", "training.main")  # `python -m ...`, `torchrun -m ...`
ENTRY_SCRIPTS = ("open_clip_train/main.py", "training/main.py")  # `python -u src/open_clip_train/main.py`


def _entry(token: str) -> bool:
    return token in ENTRY_MODULES or token.replace("\\", "/").endswith(ENTRY_SCRIPTS)


def split_command(tokens: list[str]) -> tuple[int | None, list[str], list[str]]:
    """(GPUs the launcher starts, or None where it does not say; open_clip_train's arguments; notes).

    torchrun: --nproc_per_node x --nnodes; srun: --ntasks (-n), or --ntasks-per-node x --nodes (-N)."""
    at = next((i for i, token in enumerate(tokens) if _entry(token)), None)
    if at is None:
        return None, tokens, []
    launcher, tokens = tokens[:at], tokens[at + 1:]
    options = dict(_flag_values(launcher))

    def count(*names: str) -> int | None:
        for name in names:
            if options.get(name):
                value = options[name][0]
                if not value.isdigit():
                    raise ConversionError(f"{name} {value}: give the number of GPUs with --gpus")
                return int(value)
        return None

    if "torchrun" in " ".join(launcher) or "torch.distributed.run" in launcher:
        per_node, nodes = count("--nproc_per_node", "--nproc-per-node"), count("--nnodes")
        return (per_node or 1) * (nodes or 1), tokens, []
    if launcher and Path(launcher[0]).name == "srun":
        tasks = count("--ntasks", "-n")
        per_node, nodes = count("--ntasks-per-node"), count("--nodes", "-N")
        if tasks is None and per_node is not None:
            tasks = per_node * (nodes or 1)
        if tasks is None:
            return None, tokens, ["srun's command line does not say how many processes it starts (the job's #SBATCH "
                                  "lines do): give --gpus N before the command"]
        return tasks, tokens, []
    return None, tokens, []


def _flag_values(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """[(flag, its values)]: a flag's values are the tokens after it up to the next flag
    (`--name=value` is one value; a negative number is a value, `-m` a flag)."""
    flags: list[tuple[str, list[str]]] = []
    for token in tokens:
        if token.startswith("-") and not _is_number(token):
            name, has_value, value = token.partition("=")
            flags.append((name, [value] if has_value else []))
        elif flags:
            flags[-1][1].append(token)
    return flags


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def number(flag: str, text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise ConversionError(f"{flag} {text}: expected {'an integer' if kind is int else 'a number'}") from None


def to_config(tokens: list[str], gpus: int | None = None) -> tuple[dict, list[str]]:
    """The clipscale configuration for an open_clip_train command line, and notes on the flags dropped."""
    found_gpus, arguments, launcher_notes = split_command(tokens)
    counted_one = gpus is None and found_gpus is None  # nothing said how many: one, with a note
    gpus = gpus or found_gpus or 1
    given: dict[str, list[str]] = {}
    for flag, values in _flag_values(arguments):
        given[flag] = values
    unknown = [flag for flag in given if flag not in FLAGS]
    if unknown:
        raise ConversionError(f"not open_clip_train flags: {', '.join(unknown)}")
    refused = [f"{flag}: {FLAGS[flag].text}" for flag in given if FLAGS[flag].kind == "unsupported"]
    notes = [f"dropped {flag}: {FLAGS[flag].text}" for flag in given if FLAGS[flag].kind == "ignored"]
    if counted_one:
        notes += launcher_notes or ["no torchrun or srun in the command: one GPU (train.batch_size is --batch-size x "
                                    "--accum-freq); give --gpus N before the command for a run on N GPUs"]

    def one(flag, default=None, kind=str):
        if flag not in given:
            return default
        values = given[flag]
        if len(values) != 1:
            raise ConversionError(f"{flag}: expected one value, got {len(values)}")
        return values[0] if kind is str else number(flag, values[0], kind)

    def switch(flag) -> bool:
        return flag in given

    precision = one("--precision", "amp")  # open_clip_train's default: fp16 autocast
    model_name = one("--model", "RN50")
    vit = "vit" in model_name.lower()  # open_clip_train's get_default_params
    if model_name.lower().startswith("coca"):
        refused.append(f"--model {model_name}: {COCA.text}")
    precisions = {"amp": "fp16", "amp_bf16": "bf16", "amp_bfloat16": "bf16", "fp32": "fp32"}
    if precision not in precisions:
        refused.append(f"--precision {precision}: pure low-precision weights are not supported (amp, amp_bf16 or fp32)")
    if one("--opt", "adamw") != "adamw":
        refused.append(f"--opt {one('--opt')}: the optimizer is AdamW")
    if one("--dataset-type", "auto") == "synthetic":
        refused.append("--dataset-type synthetic: not supported (data.kind digits is a small real dataset)")
    resume = one("--resume")
    if resume is not None and resume != "latest":
        refused.append(f"--resume {resume}: clipscale resumes the run in run.output_dir/run.name (`latest` only)")
    pretrained = one("--pretrained", "")
    if pretrained and not (Path(pretrained).is_file() or "/" in pretrained or Path(pretrained).suffix):
        refused.append(f"--pretrained {pretrained}: a pretrained tag is a download; give a local weights file")
    image_size = given.get("--force-image-size")
    if image_size is not None and len(image_size) != 1:
        refused.append(f"--force-image-size {' '.join(image_size)}: one size for height and width")
    reports = [r for r in ",".join(given.get("--report-to", [])).split(",") if r]
    if "trackio" in reports:
        refused.append("--report-to trackio: wandb and tensorboard only")
    if switch("--fsdp") and precision == "amp":
        refused.append("--fsdp with --precision amp: fp16 under FSDP is refused (each process would judge an overflow "
                       "from its own gradient shards); use amp_bf16")
    if refused:
        raise ConversionError("open_clip_train flags that clipscale does not support: " + "; ".join(refused))

    accum = one("--accum-freq", 1, int)
    per_gpu = one("--batch-size", 64, int)
    batch_size = per_gpu * gpus * accum
    num_samples = one("--train-num-samples", None, int)
    train_data = one("--train-data")
    dataset_type = one("--dataset-type", "auto")
    if dataset_type == "auto" and train_data is not None:
        dataset_type = "csv" if train_data.split("::")[0].lower().endswith((".csv", ".tsv")) else "webdataset"
    if dataset_type == "csv" and train_data is not None:
        rows = csv_rows(train_data, one("--csv-img-key", "filepath"), one("--csv-caption-key", "title"),
                        one("--csv-separator", "\t"), num_samples)
        if rows is not None:
            if num_samples is not None and num_samples != rows:
                notes.append(f"dropped --train-num-samples {num_samples}: an epoch of a CSV is its {rows} rows "
                             "(open_clip_train ignores the flag for a CSV)")
            num_samples = rows
    if dataset_type == "webdataset" and train_data is not None and num_samples is None:
        num_samples = listed_size(train_data)
        if num_samples is not None:
            notes.append(f"train.num_samples_per_epoch {num_samples}: the sizes the shards' folder lists (sizes.json or "
                         "__len__), as open_clip_train reads them without --train-num-samples")

    def epochs_in_steps(flag, epochs):
        if num_samples is None:
            raise ConversionError(f"{flag} counts epochs: give --train-num-samples, the samples in an epoch")
        return epochs * math.ceil(num_samples / batch_size)

    run = {"name": one("--name", "open_clip_run")}
    if switch("--logs"):
        run["output_dir"] = one("--logs")
    run["seed"] = one("--seed", 0, int)
    if switch("--device"):
        run["device"] = "cpu" if one("--device") == "cpu" else "cuda"
    if resume == "latest":
        run["resume"] = True

    model: dict = {"name": model_name}
    if pretrained:
        model["pretrained"] = pretrained
    preprocess = {key: [number(flag, v) for v in given[flag]] for key, flag in (("mean", "--image-mean"), ("std", "--image-std"))
                  if flag in given}
    preprocess.update({key: one(flag) for key, flag in (("interpolation", "--image-interpolation"),
                                                         ("resize_mode", "--image-resize-mode")) if flag in given})
    if preprocess:
        model["preprocess"] = preprocess
    for flag, key in (("--lock-image", "lock_image"), ("--lock-image-freeze-bn-stats", "lock_image_freeze_bn_stats"),
                      ("--lock-text", "lock_text"), ("--grad-checkpointing", "grad_checkpointing"),
                      ("--force-quick-gelu", "force_quick_gelu"), ("--torchcompile", "compile")):
        if switch(flag):
            model[key] = True
    if switch("--lock-image-unlocked-groups"):
        model["lock_image_unlocked_groups"] = one("--lock-image-unlocked-groups", kind=int)
    if switch("--lock-text"):
        model["lock_text_unlocked_layers"] = one("--lock-text-unlocked-layers", 0, int)
        model["lock_text_freeze_layer_norm"] = switch("--lock-text-freeze-layer-norm")  # open_clip's default: false
    if switch("--force-patch-dropout"):
        model["force_patch_dropout"] = one("--force-patch-dropout", kind=float)
    if image_size is not None:
        model["force_image_size"] = number("--force-image-size", image_size[0], int)
    if switch("--force-context-length"):
        model["force_context_length"] = one("--force-context-length", kind=int)

    data: dict = {}
    if train_data is not None:
        data.update(kind=dataset_type, train_shards=train_data)
    for flag, key in (("--csv-img-key", "csv_image_key"), ("--csv-caption-key", "csv_caption_key"),
                      ("--csv-separator", "csv_separator"), ("--image-key", "image_key"), ("--text-key", "caption_key"),
                      ("--train-data-upsampling-factors", "upsampling_factors")):
        if switch(flag):
            data[key] = one(flag)
    if switch("--max-image-pixels"):
        data["max_image_pixels"] = one("--max-image-pixels", kind=int)
    if switch("--dataset-resampled"):
        data["resampled"] = True
    data["workers"] = one("--workers", 4, int)

    loss = {"name": "siglip"} if switch("--siglip") else {"name": "vanilla"}

    optim = {
        "lr": one("--lr", 5.0e-4, float),
        "beta1": one("--beta1", 0.9, float),
        "beta2": one("--beta2", 0.98 if vit else 0.999, float),
        "eps": one("--eps", 1.0e-6 if vit else 1.0e-8, float),
        "weight_decay": one("--wd", 0.2, float),
        "warmup_steps": one("--warmup", 10000, int),
        "grad_clip": one("--grad-clip-norm", None, float),
        "lr_scheduler": one("--lr-scheduler", "cosine"),
    }
    if switch("--skip-scheduler"):
        optim.update(lr_scheduler="const", warmup_steps=0)
    if optim["lr_scheduler"] == "const-cooldown":
        cooldown = one("--epochs-cooldown", None, int)
        if cooldown is None:
            raise ConversionError("--lr-scheduler const-cooldown needs --epochs-cooldown (as open_clip_train)")
        optim["lr_cooldown_steps"] = epochs_in_steps("--epochs-cooldown", cooldown)
        optim["lr_cooldown_power"] = one("--lr-cooldown-power", 1.0, float)
        optim["lr_cooldown_end"] = one("--lr-cooldown-end", 0.0, float)

    train: dict = {"batch_size": batch_size}
    if accum > 1:
        train["chunk_size"] = per_gpu
    if num_samples is None:
        raise ConversionError("--train-num-samples is needed (the shards' folder has no sizes.json nor __len__ here): "
                              "clipscale counts the run in samples (train.epochs of train.num_samples_per_epoch), as "
                              "open_clip_train does for webdataset")
    train.update(steps=None, epochs=one("--epochs", 32, int), num_samples_per_epoch=num_samples)
    total_steps = epochs_in_steps("--epochs", train["epochs"])
    if optim["warmup_steps"] > total_steps:
        notes.append(f"optim.warmup_steps {optim['warmup_steps']} (--warmup, open_clip_train's default 10000 where not "
                     f"given) is more than the run's {total_steps} steps: the lr never reaches --lr {optim['lr']:g}; "
                     "give a shorter --warmup")
    train["precision"] = precisions[precision]
    if switch("--fsdp"):
        train["parallel"] = "fsdp"
        if switch("--fsdp-offload-cpu"):
            train["fsdp_offload"] = True
    elif switch("--fsdp-offload-cpu"):
        notes.append("dropped --fsdp-offload-cpu: without --fsdp there is nothing to offload (as in open_clip_train)")
    if switch("--log-every-n-steps"):
        train["log_every"] = one("--log-every-n-steps", kind=int)
    train["checkpoint_every"] = epochs_in_steps("--save-frequency", one("--save-frequency", 1, int))
    train["keep_checkpoints"] = 1 if switch("--delete-previous-checkpoint") else None

    evaluation: dict = {}
    # open_clip_train evaluates the ImageNet sets every --zeroshot-frequency epochs (default 2) and
    # --val-data every --val-frequency epochs (default 1), each where its data is given
    asked = [(flag, default) for flag, default, data in (("--zeroshot-frequency", 2, ("--imagenet-val", "--imagenet-v2")),
                                                          ("--val-frequency", 1, ("--val-data",)))
             if any(switch(d) for d in data)]
    frequencies = [one(flag, default, int) for flag, default in asked]
    frequencies = [f for f in frequencies if f > 0]  # 0 turns an evaluation off in open_clip_train
    if frequencies:
        evaluation["every_n_steps"] = epochs_in_steps("--zeroshot-frequency/--val-frequency", min(frequencies))
        if len(set(frequencies)) > 1:
            notes.append(f"eval.every_n_steps: one frequency for every evaluation, the more frequent ({min(frequencies)} epochs)")
    if switch("--val-data"):
        evaluation["val_data"] = one("--val-data")
    sets = [{"task": task, "data": one(flag)} for flag, task in (("--imagenet-val", "imagenet"), ("--imagenet-v2", "imagenet-v2"))
            if switch(flag)]
    if sets:
        evaluation["sets"] = sets
    evaluation["zeroshot"] = False  # the digits zero-shot; open_clip_train's evaluations are the sets above

    config = {"run": run, "model": model, "data": data, "loss": loss, "optim": optim, "train": train, "eval": evaluation}
    if "wandb" in reports or "all" in reports:
        config["wandb"] = {"enabled": True, "project": one("--wandb-project-name", "open-clip")}
    if "tensorboard" in reports or "all" in reports:
        config["tensorboard"] = {"enabled": True}
    return config, notes


def listed_size(train_data: str) -> int | None:
    """The samples of the shards `train_data` names, from the `sizes.json` ({shard file name: samples})
    or `__len__` file in the first shard's folder, as open_clip_train's get_dataset_size reads them;
    None where there is neither (or a shard is not listed)."""
    import webdataset as wds

    shards = wds.shardlists.expand_urls(train_data)
    folder = os.path.dirname(shards[0])
    sizes, length = os.path.join(folder, "sizes.json"), os.path.join(folder, "__len__")
    if os.path.isfile(sizes):
        with open(sizes) as f:
            listed = json.load(f)
        try:
            return sum(int(listed[os.path.basename(shard)]) for shard in shards)
        except KeyError:
            return None
    if os.path.isfile(length):
        with open(length) as f:
            return int(ast.literal_eval(f.read().strip()))
    return None


def csv_rows(train_data: str, image_key: str, caption_key: str, separator: str, num_samples: int | None) -> int | None:
    """The rows of the CSV table(s) `train_data` names, read as clipscale's data.kind=csv reads them;
    None when they cannot be read here and --train-num-samples says how many there are."""
    from clipscale.config import ConfigError
    from clipscale.data.sources import read_rows

    try:
        return sum(len(read_rows(path, image_key, caption_key, separator, "--train-data")) for path in train_data.split("::"))
    except ConfigError as err:
        if num_samples is not None:
            return None
        raise ConversionError(f"{err} (an epoch of a CSV is its rows: run this where the table is, or give "
                              "--train-num-samples with its row count)") from None


def markdown_table() -> str:
    rows = ["| open_clip_train flag | clipscale |", "| --- | --- |"]
    for flag, entry in FLAGS.items():
        text = entry.text if entry.kind == "mapped" else f"{entry.kind.replace('unsupported', 'not supported')}: {entry.text}"
        rows.append(f"| `{flag}` | {text} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    # Our own options come first; everything after them is the open_clip_train command line,
    # which argparse must not read (its --model, --lr, ... are not ours).
    ours = []
    while argv and argv[0] in ("--gpus", "--markdown", "-h", "--help"):
        ours.append(argv.pop(0))
        if ours[-1] == "--gpus" and argv:
            ours.append(argv.pop(0))
    if argv[:1] == ["--"]:
        argv.pop(0)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--gpus N] [--] OPEN_CLIP_TRAIN_COMMAND... | %(prog)s --markdown")
    parser.add_argument("--gpus", type=int, help="GPUs of the run (default: torchrun's --nproc_per_node x --nnodes, else 1)")
    parser.add_argument("--markdown", action="store_true", help="print the flag table of docs/from_open_clip.md")
    args = parser.parse_args(ours)
    if args.markdown:
        print(markdown_table(), end="")
        return 0
    tokens = shlex.split(argv[0]) if len(argv) == 1 else argv
    if not tokens:
        parser.error("give the open_clip_train command line")
    try:
        config, notes = to_config(tokens, args.gpus)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
