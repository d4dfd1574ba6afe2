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

"digits" is the held-out split that clipscale.data.digits writes: its `data` is the data root,
whose manifest lists the shards; the class names and templates are the files written beside it.
`eval.zeroshot: true` with `data.kind: digits` evaluates it under the name "zeroshot".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import yaml
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

from clipscale.eval import datasets
from clipscale.eval.inference import Autocast
from clipscale.eval.retrieval import evaluate_retrieval
from clipscale.eval.zeroshot import evaluate_zeroshot, zeroshot_classifier

NAMED_CLASSNAMES = {"imagenet": IMAGENET_CLASSNAMES}
NAMED_TEMPLATES = {"openai": OPENAI_IMAGENET_TEMPLATES, "simple": SIMPLE_IMAGENET_TEMPLATES}


@dataclass
class EvalTask:
    name: str
    kind: Literal["classification", "retrieval"] = "classification"
    format: Literal["imagefolder", "wds", "coco"] = "imagefolder"
    data: Optional[str] = None  # folder, shard pattern ("val-{000..009}.tar") or caption JSON
    image_root: Optional[str] = None  # coco: folder the JSON's image paths are relative to (default: the JSON's folder)
    split: str = "test"  # coco: which split of a Karpathy file
    classnames: str = "folders"  # "imagenet", "folders" or a file
    templates: str = "openai"  # "openai", "simple" or a file of "{c}" strings
    class_subset: Optional[str] = None  # file of indices into the class names, in label order
    folder_names: Optional[str] = None  # JSON {folder: class name}: only these folders, labelled in this order
    numeric_folders: bool = False  # folder names are the labels (ImageNet-V2's "0".."999")

    def __post_init__(self):
        for field, allowed in (("kind", ("classification", "retrieval")), ("format", ("imagefolder", "wds", "coco"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"eval task {self.name!r}: {field} must be one of {allowed}, got {getattr(self, field)!r}")
        if self.format == "coco" and self.kind != "retrieval":
            raise ValueError(f"eval task {self.name!r}: format 'coco' is a retrieval format")
        if self.kind == "retrieval" and self.format == "imagefolder":
            raise ValueError(f"eval task {self.name!r}: retrieval needs format 'coco' or 'wds'")


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
        raise ValueError(f"unknown eval task {task!r}: not a file and not one of {', '.join([*BUILTIN_TASKS, DIGITS])}")
    allowed = {f.name for f in dataclasses.fields(EvalTask)}
    unknown = sorted(set(base) - allowed)
    if unknown:
        raise ValueError(f"eval task {base.get('name', task)!r}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    resolved = EvalTask(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
    required = REQUIRED_FIELDS.get(resolved.name)
    if required and getattr(resolved, required) is None:
        raise ValueError(f"eval task {resolved.name!r} needs {required} (see clipscale.eval.tasks)")
    if resolved.data is None:
        raise ValueError(f"eval task {resolved.name!r} needs data (a folder, shard pattern or caption JSON)")
    return resolved


def eval_task(entry) -> EvalTask:
    """An eval.sets entry ({task: name, field: value, ...}, a task name or a task file) as an EvalTask."""
    if isinstance(entry, dict):
        fields = dict(entry)
        return resolve_task(fields.pop("task", fields), **fields) if "task" in entry else resolve_task(fields)
    return resolve_task(entry)


def digits_task(root: Optional[str], name: str = DIGITS) -> EvalTask:
    """The digits held-out split under `root`, read from the manifest clipscale.data.digits writes last."""
    if root is None:
        raise ValueError(f"eval task {DIGITS!r} needs data (the digits data root, which holds manifest.json)")
    folder = Path(root)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"eval task {DIGITS!r}: no {manifest_path} (the digits data root, written by a digits run)")
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
    """CLIP_benchmark-named metrics of `model` on `task`; under torch.distributed every rank
    evaluates its own part and returns the same result."""
    if task.kind == "retrieval":
        if task.format == "coco":
            image_root = task.image_root or str(Path(task.data).parent)
            dataset = datasets.rank_shard(datasets.CaptionedImages(task.data, image_root, transform, task.split))
        else:
            dataset = datasets.shard_retrieval(task.data, transform)
        loader = datasets.make_loader(dataset, batch_size, workers, collate_fn=datasets.collate_captions)
        return evaluate_retrieval(model, tokenizer, loader, device, autocast=autocast, progress=progress)

    folder_names = _read_json(task.folder_names) if task.folder_names else None  # {folder: class name}
    if task.format == "wds":
        dataset, folders = datasets.shard_classification(task.data, transform), None
    else:
        folder_labels = {folder: label for label, folder in enumerate(folder_names)} if folder_names else None
        folder_set = datasets.LabelledFolder(task.data, transform, folder_labels, task.numeric_folders)
        dataset, folders = datasets.rank_shard(folder_set), folder_set.classes
    classnames = class_names(task, folders, folder_names)
    if folders is not None and not task.numeric_folders and len(folders) != len(classnames):
        raise ValueError(f"eval task {task.name!r}: {len(folders)} class folders but {len(classnames)} class names")
    classifier = zeroshot_classifier(
        model, tokenizer, classnames, prompt_templates(task), device, batch_size=batch_size, autocast=autocast
    )
    loader = datasets.make_loader(dataset, batch_size, workers)
    return evaluate_zeroshot(model, classifier, loader, device, autocast=autocast, progress=progress)


def class_names(task: EvalTask, folders: Optional[list], folder_names: Optional[dict]) -> list[str]:
    if task.classnames in NAMED_CLASSNAMES:
        names = list(NAMED_CLASSNAMES[task.classnames])
    elif task.classnames == "folders":
        if folders is None:
            raise ValueError(f"eval task {task.name!r}: shards have no folder names; give classnames (a file)")
        names = list(folder_names.values()) if folder_names else [f.replace("_", " ") for f in folders]
    else:
        names = _read_list(task.classnames)
    if task.class_subset is not None:
        names = [names[int(i)] for i in _read_list(task.class_subset)]
    return names


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
