"""Evaluation sets described as data, so a new variant needs a config entry, not code.

    task = resolve_task("imagenet-v2", data="/data/imagenetv2-matched-frequency")
    metrics = run_task(task, model, tokenizer, transform, device)

An `EvalTask` says where the data is and how to read it, where class names
and prompt templates come from, and how the data's labels map onto the class
names. Built-in entries cover the ImageNet family and COCO; a YAML/JSON file
or a dict with the same fields defines any other set (a list of them is what
the trainer's eval config holds).

Class names: "imagenet" (open_clip's 1,000 names, the order of sorted
WordNet-ID folders), "folders" (the folder names, or the values of
`folder_names`), or a file (.json list or one name per line). Templates:
"openai" (the 80 CLIP prompts), "simple" (open_clip's short list), or a file of
"{c}" strings. `class_subset` (file of indices into the class names) narrows
them to the classes the data has, in its label order: ImageNet-R and -A use
200 of the 1,000.

"csv" and "csv-retrieval" read a table of image paths (relative to its folder), as training's
`data.kind: csv` does, with the same keys: `csv_image_key`, `csv_caption_key`, `csv_separator`
(open_clip's `filepath`, `title`, a tab). Retrieval groups the rows of one image into its captions;
classification reads a label column (`csv_label_key`): class names (then "folders" means the
distinct labels, sorted) or indices into the class names.

"digits" is the held-out split that clipscale.data.digits writes: its `data` is the data root,
whose manifest lists the shards; the class names and templates are the files written beside it.
`eval.zeroshot: true` with `data.kind: digits` evaluates it under the name "zeroshot".

A task that cannot be read is a `TaskError` naming the field (and so the command-line flag) and
the path: `check_data` looks at every path before a model is built, a CSV table's and a caption
JSON's image files included. A sample that is there but cannot be used (an image that does not
decode, an empty caption) is skipped and counted (`num_skipped`, and a line naming the first few);
a task whose every sample is skipped is a `TaskError` on `data`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import webdataset as wds
import yaml
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

from clipscale.config import ConfigError
from clipscale.data.sources import CSV_SUFFIXES, source_shards
from clipscale.eval import datasets
from clipscale.eval.inference import Autocast
from clipscale.eval.retrieval import evaluate_retrieval
from clipscale.eval.zeroshot import evaluate_zeroshot, zeroshot_classifier

NAMED_CLASSNAMES = {"imagenet": IMAGENET_CLASSNAMES}
NAMED_TEMPLATES = {"openai": OPENAI_IMAGENET_TEMPLATES, "simple": SIMPLE_IMAGENET_TEMPLATES}


class TaskError(ConfigError):
    """A field of an eval task that does not say what the task needs: `field` names it (the
    script's flag is --field-with-dashes), `value` is what it holds."""

    def __init__(self, task: str, field: str, value, reason: str):
        self.task, self.field, self.value, self.reason = task, field, value, reason
        super().__init__(f"eval task {task!r}: {field}" + ("" if value is None else f" {value}") + f": {reason}")


FORMATS = ("imagefolder", "wds", "coco", "csv")
NAMED_FILES = {"classnames": ("folders", *NAMED_CLASSNAMES), "templates": tuple(NAMED_TEMPLATES)}


@dataclass
class EvalTask:
    name: str
    kind: Literal["classification", "retrieval"] = "classification"
    format: Literal["imagefolder", "wds", "coco", "csv"] = "imagefolder"
    data: Optional[str] = None  # folder, shard pattern ("val-{000..009}.tar"), caption JSON or CSV table
    image_root: Optional[str] = None  # coco: folder the JSON's image paths are relative to (default: the JSON's folder)
    split: str = "test"  # coco: which split of a Karpathy file
    classnames: str = "folders"  # "imagenet", "folders" or a file
    templates: str = "openai"  # "openai", "simple" or a file of "{c}" strings
    class_subset: Optional[str] = None  # file of indices into the class names, in label order
    folder_names: Optional[str] = None  # JSON {folder: class name}: only these folders, labelled in this order
    numeric_folders: bool = False  # folder names are the labels (ImageNet-V2's "0".."999")
    # csv: training's data.csv_* keys, and the column of a classification table's labels
    csv_image_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = "\t"
    csv_label_key: str = "label"

    def __post_init__(self):
        for field, allowed in (("kind", ("classification", "retrieval")), ("format", FORMATS)):
            if getattr(self, field) not in allowed:
                raise TaskError(self.name, field, repr(getattr(self, field)), f"must be one of {', '.join(allowed)}")
        if self.format == "coco" and self.kind != "retrieval":
            raise TaskError(self.name, "format", "'coco'", "is a retrieval format")
        if self.kind == "retrieval" and self.format == "imagefolder":
            raise TaskError(self.name, "format", "'imagefolder'", "retrieval needs format coco, wds or csv")
        if len(self.csv_separator) != 1:
            raise TaskError(self.name, "csv_separator", repr(self.csv_separator), "must be one character")


BUILTIN_TASKS = {
    task.name: task
    for task in (
        EvalTask("imagenet", classnames="imagenet"),
        EvalTask("imagenet-v2", classnames="imagenet", numeric_folders=True),
        EvalTask("imagenet-r", classnames="imagenet"),  # needs class_subset: the 200 ImageNet indices
        EvalTask("imagenet-a", classnames="imagenet"),  # needs class_subset: the 200 ImageNet indices
        EvalTask("objectnet", classnames="folders"),  # needs folder_names: {folder: name} of the 113 classes
        EvalTask("imagefolder"),
        EvalTask("wds", format="wds"),  # needs classnames: wds shards carry only label numbers
        EvalTask("coco", kind="retrieval", format="coco"),
        EvalTask("wds-retrieval", kind="retrieval", format="wds"),
        EvalTask("csv", format="csv"),  # classification: a label column (csv_label_key)
        EvalTask("csv-retrieval", kind="retrieval", format="csv"),
    )
}
DIGITS = "digits"  # a built-in whose fields come from the data root's manifest (digits_task)
REQUIRED_FIELDS = {"imagenet-r": "class_subset", "imagenet-a": "class_subset", "objectnet": "folder_names"}


def resolve_task(task, **overrides) -> EvalTask:
    """An EvalTask from a built-in name, a YAML/JSON file, a dict or an EvalTask, with fields overridden.

    Overrides that are None are ignored, so command-line options left unset
    keep the task's values.
    """
    if isinstance(task, EvalTask):
        base = dataclasses.asdict(task)
    elif isinstance(task, dict):
        base = dict(task)
    elif task == DIGITS:
        base = dataclasses.asdict(digits_task(overrides.pop("data", None)))
    elif task in BUILTIN_TASKS:
        base = dataclasses.asdict(BUILTIN_TASKS[task])
    elif Path(task).is_file():
        base = {"name": Path(task).stem, **yaml.safe_load(Path(task).read_text())}  # YAML also reads JSON
    else:
        raise TaskError(str(task), "task", None, f"no such file, nor one of {', '.join([*BUILTIN_TASKS, DIGITS])}")
    allowed = {f.name for f in dataclasses.fields(EvalTask)}
    unknown = sorted(set(base) - allowed)
    if unknown:
        raise TaskError(base.get("name", task), "task", None, f"unknown keys {unknown}; allowed: {sorted(allowed)}")
    resolved = EvalTask(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
    required = REQUIRED_FIELDS.get(resolved.name)
    if required and getattr(resolved, required) is None:
        raise TaskError(resolved.name, required, None, "needed by this task (see clipscale.eval.tasks)")
    if resolved.data is None:
        raise TaskError(resolved.name, "data", None, "needed: a folder, shard pattern, caption JSON or CSV table")
    return resolved


def check_data(task: EvalTask) -> None:
    """Every path `task` names is there and holds what its format reads: a TaskError naming the
    field and the path otherwise. Looks at files, reads no image."""
    data = task.data
    local = Path(data)
    if task.format == "wds":
        shards = shard_names(task)
        files = [s for s in shards if "://" not in s and not s.startswith("pipe:")]
        missing = [s for s in files if not Path(s).is_file()]
        if missing:
            which = "no such file" if len(missing) == len(shards) else f"{len(missing)} of its {len(shards)} files are missing"
            raise TaskError(task.name, "data", data, f"{which} (first: {missing[0]})")
        if files and files[0].lower().endswith(CSV_SUFFIXES):
            csv_task = "csv-retrieval" if task.kind == "retrieval" else "csv"
            raise TaskError(task.name, "data", data, f"a CSV table, not webdataset shards: use the task {csv_task}")
        if files and files[0].lower().endswith(".json"):
            raise TaskError(task.name, "data", data, "a JSON file, not webdataset shards: caption JSON is the task coco")
        if files and not tarfile.is_tarfile(files[0]):
            raise TaskError(task.name, "data", data, f"{files[0]} is not a tar file (webdataset shards are)")
        if task.kind == "classification" and task.classnames == "folders":
            raise TaskError(task.name, "classnames", None, "needed: webdataset shards carry label numbers, not class "
                            "names; give a file of class names (one a line, in label order)")
    elif task.format == "imagefolder":
        if not local.is_dir():
            what = "a file, not a folder of class folders" if local.exists() else "no such folder"
            raise TaskError(task.name, "data", data, what + _csv_hint(data))
        if not any(entry.is_dir() for entry in local.iterdir()):
            raise TaskError(task.name, "data", data, "has no class folders (one folder of images per class)")
    else:  # coco, csv: one file
        if not local.is_file():
            reads = "a caption JSON" if task.format == "coco" else "a CSV table"
            raise TaskError(task.name, "data", data, f"{'a folder' if local.is_dir() else 'no such file'}; {task.name} reads {reads}")
        if task.format == "csv":
            images = [path for path, _ in read_table(task)]
        else:
            try:
                images = [path for path, _ in datasets.CaptionedImages(data, task.image_root or str(local.parent), None,
                                                                       task.split).items]
            except (ValueError, KeyError, TypeError) as err:  # json's JSONDecodeError is a ValueError
                reason = f"no entry {err}" if isinstance(err, KeyError) else str(err).removeprefix(f"{data}: ")
                raise TaskError(task.name, "data", data, f"not a caption JSON that coco reads ({reason}){_csv_hint(data)}") from None
        _check_images(task, images)
    if task.image_root is not None and not Path(task.image_root).is_dir():
        raise TaskError(task.name, "image_root", task.image_root, "no such folder")
    for field in ("classnames", "templates", "class_subset", "folder_names"):
        value = getattr(task, field)
        if value is not None and value not in NAMED_FILES.get(field, ()) and not Path(value).is_file():
            named = NAMED_FILES.get(field)
            raise TaskError(task.name, field, value, "no such file" + (f", nor one of {', '.join(named)}" if named else ""))


def _check_images(task: EvalTask, images: list[str]) -> None:
    """Every image file a table or caption JSON names is there: a missing one is a TaskError naming it
    (a file that is there but does not decode is skipped and counted when it is read)."""
    missing = [path for path in dict.fromkeys(images) if not Path(path).is_file()]
    if missing:
        relative = "the table's folder" if task.format == "csv" else "image_root" if task.image_root else "the JSON's folder"
        where = f"image paths are relative to {relative}"
        more = f" and {len(missing) - 1} more of its {len(set(images))} images" if len(missing) > 1 else ""
        raise TaskError(task.name, "data", task.data, f"names an image that is not there: {missing[0]}{more} ({where})")


def shard_names(task: EvalTask) -> list[str]:
    """The shards of a wds task's data, named as training names them: a brace pattern, and a
    folder (its .tar files) or a glob (its .tar matches) wherever one stands, sorted."""
    names = []
    for name in wds.shardlists.expand_urls(task.data):
        if Path(name).is_dir() or (any(c in name for c in "*?[") and not Path(name).exists()):
            try:
                names += source_shards(name, "data")
            except ConfigError as err:
                raise TaskError(task.name, "data", task.data, str(err).removeprefix(f"data: {name!r} ")) from None
        else:
            names.append(name)
    return names


def _csv_hint(data: str) -> str:
    return ": a CSV table is the task csv (with a label column) or csv-retrieval" if data.lower().endswith(CSV_SUFFIXES) else ""


def read_table(task: EvalTask) -> list[tuple[str, str]]:
    """(image path made relative to the table's folder, caption or label) of every row of a csv task."""
    column = task.csv_caption_key if task.kind == "retrieval" else task.csv_label_key
    key = "csv_caption_key" if task.kind == "retrieval" else "csv_label_key"
    table = Path(task.data)
    with table.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=task.csv_separator)
        columns = reader.fieldnames or []
        for field, name in (("csv_image_key", task.csv_image_key), (key, column)):
            if name not in columns:
                raise TaskError(task.name, field, repr(name), f"{task.data} has no such column (its columns, split at "
                                f"{task.csv_separator!r}: {', '.join(map(repr, columns))}; csv_separator sets the split)")
        rows = [(str(table.parent / row[task.csv_image_key]), (row[column] or "").strip()) for row in reader]
    if not rows:
        raise TaskError(task.name, "data", task.data, "the table has no rows")
    return rows


def eval_task(entry) -> EvalTask:
    """An eval.sets entry ({task: name, field: value, ...}, a task name or a task file) as an EvalTask."""
    if isinstance(entry, dict):
        fields = dict(entry)
        return resolve_task(fields.pop("task", fields), **fields) if "task" in entry else resolve_task(fields)
    return resolve_task(entry)


def digits_task(root: Optional[str], name: str = DIGITS) -> EvalTask:
    """The digits held-out split under `root`, read from the manifest clipscale.data.digits writes last."""
    if root is None:
        raise TaskError(DIGITS, "data", None, "needed: the digits data root, which holds manifest.json "
                        "(data/digits after the README's first command)")
    folder = Path(root)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise TaskError(DIGITS, "data", root, f"no {manifest_path} (the digits data root, written by a digits run)")
    manifest = _read_json(str(manifest_path))
    return EvalTask(name, format="wds", data="::".join(str(folder / shard) for shard in manifest["val_shards"]),
                    classnames=str(folder / "classnames.txt"), templates=str(folder / "templates.txt"))


def run_task(
    task: EvalTask,
    model,
    tokenizer,
    transform,
    device,
    batch_size: int = 256,
    workers: int = 4,
    autocast: Autocast = None,
    progress: bool = True,
) -> dict:
    """CLIP_benchmark-named metrics of `model` on `task`, with num_samples and num_skipped; under
    torch.distributed every rank evaluates its own part and returns the same result. A task whose
    every sample is skipped is a TaskError naming its data and the first samples' reasons."""
    try:
        return _run_task(task, model, tokenizer, transform, device, batch_size, workers, autocast, progress)
    except datasets.NoUsableSample as err:
        raise TaskError(task.name, "data", task.data, str(err)) from None


def _run_task(task: EvalTask, model, tokenizer, transform, device, batch_size: int, workers: int, autocast: Autocast,
              progress: bool) -> dict:
    if task.kind == "retrieval":
        if task.format == "coco":
            image_root = task.image_root or str(Path(task.data).parent)
            dataset = datasets.rank_shard(datasets.CaptionedImages(task.data, image_root, transform, task.split))
        elif task.format == "csv":
            dataset = datasets.rank_shard(datasets.ListedImages(captioned_rows(read_table(task)), transform))
        else:
            dataset = datasets.shard_retrieval(shard_names(task), transform)
        loader = datasets.make_loader(dataset, batch_size, workers)
        return evaluate_retrieval(model, tokenizer, loader, device, autocast=autocast, progress=progress, name=task.name)

    folder_names = _read_json(task.folder_names) if task.folder_names else None  # {folder: class name}
    if task.format == "wds":
        dataset, folders = datasets.shard_classification(shard_names(task), transform), None
    elif task.format == "csv":
        rows = read_table(task)
        numbered = all(label.isdigit() for _, label in rows)
        folders = None if numbered else sorted({label for _, label in rows})  # "folders": the distinct labels
    else:
        folder_labels = {folder: label for label, folder in enumerate(folder_names)} if folder_names else None
        folder_set = datasets.LabelledFolder(task.data, transform, folder_labels, task.numeric_folders)
        dataset, folders = datasets.rank_shard(folder_set), folder_set.classes
    classnames = class_names(task, folders, folder_names)
    if task.format == "imagefolder" and not task.numeric_folders and len(folders) != len(classnames):
        raise TaskError(task.name, "classnames", task.classnames, f"{len(classnames)} class names, but {task.data} "
                        f"has {len(folders)} class folders")
    if task.format == "csv":
        named = folders if task.classnames == "folders" else classnames
        labels = [int(label) if numbered else _label_of(task, label, named) for _, label in rows]
        if max(labels) >= len(classnames):
            raise TaskError(task.name, "classnames", task.classnames, f"{len(classnames)} class names, but {task.data} "
                            f"has the label {max(labels)} (a number is an index into the class names)")
        dataset = datasets.rank_shard(datasets.ListedImages([(path, label) for (path, _), label in zip(rows, labels)],
                                                            transform))
    classifier = zeroshot_classifier(
        model, tokenizer, classnames, prompt_templates(task), device, batch_size=batch_size, autocast=autocast
    )
    loader = datasets.make_loader(dataset, batch_size, workers)
    return evaluate_zeroshot(model, classifier, loader, device, autocast=autocast, progress=progress, name=task.name)


def class_names(task: EvalTask, folders: Optional[list], folder_names: Optional[dict]) -> list[str]:
    if task.classnames in NAMED_CLASSNAMES:
        names = list(NAMED_CLASSNAMES[task.classnames])
    elif task.classnames == "folders":
        if folders is None:
            raise TaskError(task.name, "classnames", None, f"needed: {task.data} has label numbers, not class names; "
                            "give a file of class names (one a line, in label order)")
        names = list(folder_names.values()) if folder_names else [f.replace("_", " ") for f in folders]
    else:
        names = _read_list(task.classnames)
    if task.class_subset is not None:
        names = [names[int(i)] for i in _read_list(task.class_subset)]
    return names


def captioned_rows(rows: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(image, its captions) from (image, caption) rows: one image per path, in the order of its first
    row. An empty caption is left out, as training skips its row; an image with no other is kept with
    none, and skipped and counted when it is read (`datasets.ListedImages`)."""
    captions: dict[str, list[str]] = {}
    for path, caption in rows:
        kept = captions.setdefault(path, [])
        if caption:
            kept.append(caption)
    return list(captions.items())


def _label_of(task: EvalTask, label: str, names: list[str]) -> int:
    if label not in names:
        raise TaskError(task.name, "classnames", task.classnames, f"has no class {label!r}, a label of {task.data}")
    return names.index(label)


def prompt_templates(task: EvalTask) -> list:
    return list(NAMED_TEMPLATES.get(task.templates) or _read_list(task.templates))


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _read_list(path: str) -> list[str]:
    """A .json list, or one entry per non-empty line."""
    if path.endswith(".json"):
        return _read_json(path)
    text = Path(path).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]
