r"""Zero-shot classification or retrieval of a checkpoint, written as CLIP_benchmark-style JSON.

After the README's first command (which writes runs/digits and data/digits), from the clone's root:

    python scripts/eval_zeroshot.py --checkpoint runs/digits --task digits --data data/digits
    python scripts/eval_zeroshot.py --checkpoint runs/digits --task wds --data 'data/digits/val-{0000..0001}.tar' \
        --classnames data/digits/classnames.txt --templates data/digits/templates.txt --output digits.json

A CSV table of your own (held_out.tsv and labelled.csv below), as training reads it (data.kind: csv;
open_clip's columns filepath and title, split at a tab; image paths relative to the table's folder):
retrieval, the rows of one image its captions; or classification, with a label column (class
names, or indices into --classnames):

    python scripts/eval_zeroshot.py --checkpoint runs/digits --task csv-retrieval --data held_out.tsv
    python scripts/eval_zeroshot.py --checkpoint runs/digits --task csv --data labelled.csv \
        --csv-separator , --csv-label-key label --templates data/digits/templates.txt

With your own checkpoints and sets:

    python scripts/eval_zeroshot.py --checkpoint ViT-B-32-laion2b.pt --model ViT-B-32 \
        --task imagenet --data /data/imagenet/val
    torchrun --nproc-per-node 8 scripts/eval_zeroshot.py ...   # each GPU evaluates its part

--checkpoint is a .pt file or a run folder (then its latest checkpoint). The
model comes from the checkpoint's own config (clipscale checkpoints) or from
--model: an open_clip architecture name, an open_clip model-config JSON
(embed_dim, vision_cfg, text_cfg), or a run folder or its open_clip_config.json
(the model and preprocessing config clipscale writes there). Weights load
through open_clip, which reads both open_clip's and clipscale's layout
("state_dict", "module." prefixes).
--task is a built-in set (see clipscale.eval.tasks) or a YAML/JSON task file;
the options below override its fields. Every path is checked before the model
is built (a table's or caption JSON's image files too); a bad one is one `error:` line naming its
flag. A sample that cannot be used (an image that does not decode, an empty caption) is skipped as
training skips it: the results count them (num_skipped) and a line names the first few.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import open_clip
import torch

from clipscale.checkpoint import CHECKPOINTS, CheckpointError, latest_checkpoint, refusing_pickled_objects, resolve_checkpoint
from clipscale.checks import check_model
from clipscale.config import PREPROCESS_KEYS, ModelConfig
from clipscale.distributed import init_distributed, shutdown_distributed
from clipscale.errors import UserError, run_main
from clipscale.console import library_noise_kept_off
from clipscale.eval.tasks import TaskError, check_data, resolve_task, run_task
from clipscale.models import OPEN_CLIP_CONFIG, build_model


def default_workers() -> int:
    """Loader workers for this process: its share of the cores it may run on (torchrun's processes
    split the machine), at most 4; more than the cores makes torch's DataLoader warn and wait."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="local .pt file (clipscale or open_clip), or a run folder")
    p.add_argument("--model", help="open_clip model name, model-config JSON, run folder or its open_clip_config.json; "
                                   "default: the checkpoint's config")
    p.add_argument("--task", required=True, help="built-in task name or a YAML/JSON task file")
    p.add_argument("--data", help="image folder, shards (a brace pattern, their folder or a glob), caption JSON or CSV table")
    p.add_argument("--image-root", help="coco: folder the caption JSON's image paths are relative to")
    p.add_argument("--split", help="coco: split of a Karpathy JSON (default test)")
    p.add_argument("--classnames", help="'imagenet', 'folders' or a file of class names")
    p.add_argument("--templates", help="'openai', 'simple' or a file of '{c}' templates")
    p.add_argument("--class-subset", help="file of class-name indices the data's labels refer to")
    p.add_argument("--folder-names", help="JSON {folder: class name}; only these folders are used")
    p.add_argument("--csv-image-key", help="csv: the column of image paths (default filepath, as data.csv_image_key)")
    p.add_argument("--csv-caption-key", help="csv-retrieval: the column of captions (default title)")
    p.add_argument("--csv-separator", help="csv: the column separator (default a tab)")
    p.add_argument("--csv-label-key", help="csv: the column of labels, class names or indices (default label)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=default_workers(),
                   help="image loading processes (default: this process's cores, at most 4)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on GPU")
    p.add_argument("--output", help="write the results JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# The task's fields that are options of this script (--class-subset for class_subset, ...)
TASK_FLAGS = ("data", "image_root", "split", "classnames", "templates", "class_subset", "folder_names",
              "csv_image_key", "csv_caption_key", "csv_separator", "csv_label_key")


@contextlib.contextmanager
def flags_named(args: argparse.Namespace):
    """A TaskError as the user's error line: the flag that sets the field and the value given
    (a field no flag sets is one of the --task file's)."""
    try:
        yield
    except TaskError as err:
        if err.field in TASK_FLAGS or err.field == "task":
            value = err.value if err.value is not None else getattr(args, err.field)
            where = f"--{err.field.replace('_', '-')}" + ("" if value is None else f" {value}")
        else:
            where = f"--task {args.task}: {err.field}" + ("" if err.value is None else f" {err.value}")
        raise UserError(f"{where}: {err.reason}" + ("" if err.field == "task" else f" (task {err.task})")) from None


def checkpoint_file(given: str) -> str:
    """--checkpoint as the file to load (a run folder: its latest checkpoint). Where there is none,
    one error line names the flag and the checkpoints that do exist nearby."""
    try:
        return str(resolve_checkpoint(given))
    except CheckpointError:
        path = Path(given)
        why = "a folder without a checkpoint" if path.is_dir() else "no such file or folder"
        raise UserError(f"--checkpoint {given}: {why}; {checkpoints_near(path)}") from None


def checkpoints_near(path: Path) -> str:
    """The checkpoints in the nearest existing folder of `path` (or, when it holds none, its parent):
    its .pt files and its run folders' latest checkpoints, as --checkpoint takes them."""
    folder = next(p for p in [path, *path.parents] if p.is_dir())
    searched = list(dict.fromkeys([folder, folder.parent]))  # a run folder's parent is runs/
    for where in searched:
        found = [str(file) for file in sorted(where.glob("*.pt"))]
        for run in sorted(p for p in [where, *where.iterdir()] if (p / CHECKPOINTS).is_dir()):
            latest = latest_checkpoint(run / CHECKPOINTS)
            if latest is not None:
                found.append(f"{run} (latest: {latest.name})")
        if found:
            return f"checkpoints in {where}: " + ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    return (f"no checkpoint in {' nor '.join(map(str, searched))} (give a .pt file, or a run folder that train.py "
            "has written a checkpoint in)")


def model_config(checkpoint: str, model: str | None) -> ModelConfig:
    if model is None:
        # mmap: read the config without loading every tensor into memory.
        with refusing_pickled_objects(checkpoint):
            saved = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(saved, dict) or "config" not in saved:
            raise UserError(f"{checkpoint} has no clipscale config; say which architecture with --model")
        return ModelConfig(**{**saved["config"]["model"], "pretrained": checkpoint, "grad_checkpointing": False})
    path = Path(model) / OPEN_CLIP_CONFIG if Path(model).is_dir() else Path(model)
    if not path.is_file():
        if model not in open_clip.list_models():
            raise UserError(f"--model {model}: no such file or folder, nor an open_clip architecture")
        return ModelConfig(name=model, pretrained=checkpoint)
    written = json.loads(path.read_text())
    if "model_cfg" in written:  # a run folder's open_clip_config.json: the model and its preprocessing
        preprocess = {k: v for k, v in written.get("preprocess_cfg", {}).items() if k in PREPROCESS_KEYS}
        return ModelConfig(custom=written["model_cfg"], preprocess=preprocess or None, pretrained=checkpoint)
    return ModelConfig(custom=written, pretrained=checkpoint)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.checkpoint = checkpoint_file(args.checkpoint)
    model_cfg = model_config(args.checkpoint, args.model)
    check_model(model_cfg)  # the same model checks as a training run, before any work
    with flags_named(args):
        task = resolve_task(args.task, **{field: getattr(args, field) for field in TASK_FLAGS})
        check_data(task)
    world = init_distributed(args.device)
    with library_noise_kept_off():  # open_clip's "initialized randomly": the checkpoint's weights load next
        towers = build_model(model_cfg)
    model = towers.model.to(world.device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and world.device.type == "cuda")
    autocast = torch.bfloat16 if bf16 else None  # entered as clipscale.precision.autocast_factory does
    with flags_named(args):
        metrics = run_task(
            task,
            model,
            towers.tokenizer,
            towers.val_transform,
            world.device,
            batch_size=args.batch_size,
            workers=args.workers,
            autocast=autocast,
            progress=not args.no_progress,
        )
    result = {
        "dataset": task.name,
        "model": args.model or "checkpoint config",
        "pretrained": args.checkpoint,
        "task": "zeroshot_retrieval" if task.kind == "retrieval" else "zeroshot_classification",
        "metrics": metrics,
    }
    if world.is_main:
        print(json.dumps(result, indent=2))
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    shutdown_distributed()
    return result


if __name__ == "__main__":
    run_main(main)
