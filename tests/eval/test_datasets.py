"""Each data format and task variant, end to end through run_task, on solid-colour pictures; the
built-in tasks' class names and templates.

With RiggedModel an image's feature is its RGB colour, so the expected
metrics are known exactly (worked out in the comments).
"""

from __future__ import annotations

import json
import math

import pytest
import webdataset as wds
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES
from torchvision.transforms import ToTensor

from clipscale.eval.tasks import BUILTIN_TASKS, class_names, prompt_templates, resolve_task

from tests.helpers.rigged import (EXPECTED_RETRIEVAL, FEATURE, RETRIEVAL_CAPTIONS, RiggedModel, caption_model, evaluate,
                                  picture, png_bytes, write_lines)


# Folders sort as blue (label 0), green (1), red (2). Purple scores red = blue, and blue wins the tie.
FOLDER_IMAGES = {"blue": ["blue"], "green": ["green", "red"], "red": ["red", "purple"]}
# Hits: blue, green, red; misses: the red picture in green, the purple one in red.
EXPECTED_FOLDER = {"acc1": 3 / 5, "mean_per_class_recall": pytest.approx((1 + 1 / 2 + 1 / 2) / 3), "num_samples": 5,
                   "num_skipped": 0}


def check_folder_metrics(metrics):
    assert math.isnan(metrics.pop("acc5"))  # three classes: no top-5, as in CLIP_benchmark
    assert metrics == EXPECTED_FOLDER


def test_image_folder(tmp_path, colour_model, templates):
    for folder, colours in FOLDER_IMAGES.items():
        for i, colour in enumerate(colours):
            picture(tmp_path / "val" / folder / f"{i}.png", colour)
    task = resolve_task("imagefolder", data=str(tmp_path / "val"), templates=templates)
    check_folder_metrics(evaluate(task, colour_model))


def test_classification_shards_by_pattern_folder_or_glob(tmp_path, colour_model, templates):
    """Shards named as training names them: a brace pattern, their folder, a glob."""
    labels = {"blue": 0, "green": 1, "red": 2}
    samples = [(colour, labels[folder]) for folder, colours in FOLDER_IMAGES.items() for colour in colours]
    (tmp_path / "val").mkdir()
    for shard, part in enumerate((samples[:2], samples[2:])):
        with wds.TarWriter(str(tmp_path / "val" / f"val-{shard}.tar")) as sink:
            for i, (colour, label) in enumerate(part):
                sink.write({"__key__": f"{shard}-{i}", "png": png_bytes(colour, tmp_path), "cls": label})
    classnames = write_lines(tmp_path / "classes.txt", ["blue", "green", "red"])
    for data in ("val/val-{0..1}.tar", "val", "val/*.tar"):
        task = resolve_task("wds", data=str(tmp_path / data), classnames=classnames, templates=templates)
        check_folder_metrics(evaluate(task, colour_model))


def test_numeric_folders_are_labels(tmp_path, templates):
    # ImageNet-V2 layout: sorted order would make "10" label 0; the folder name is the label.
    picture(tmp_path / "v2" / "10" / "0.png", "green")
    picture(tmp_path / "v2" / "2" / "0.png", "red")
    names = [f"n{i}" for i in range(11)]
    model = RiggedModel({f"a {n}": FEATURE["red"] if n == "n2" else FEATURE["green"] if n == "n10" else [0.0] * 3 for n in names})
    classnames = write_lines(tmp_path / "names.txt", names)
    task = resolve_task("imagenet-v2", data=str(tmp_path / "v2"), classnames=classnames, templates=templates)
    metrics = evaluate(task, model)
    assert (metrics["acc1"], metrics["num_samples"]) == (1.0, 2)


def test_folder_names_keep_listed_folders_in_listed_order(tmp_path, colour_model, templates):
    # ObjectNet layout: only the mapped folders count, labelled in the mapping's order, named by it.
    for folder, colour in (("f_red", "red"), ("f_green", "green"), ("unmapped", "blue")):
        picture(tmp_path / "objectnet" / folder / "0.png", colour)
    mapping = tmp_path / "folders.json"
    mapping.write_text(json.dumps({"f_red": "red", "f_green": "green"}))
    task = resolve_task("objectnet", data=str(tmp_path / "objectnet"), folder_names=str(mapping), templates=templates)
    metrics = evaluate(task, colour_model)
    assert (metrics["acc1"], metrics["num_samples"]) == (1.0, 2)


def test_class_subset_maps_labels_onto_a_longer_name_list(tmp_path, templates):
    # ImageNet-R layout: folder i (sorted) is class name subset[i] of the full list.
    picture(tmp_path / "r" / "a" / "0.png", "red")
    picture(tmp_path / "r" / "b" / "0.png", "green")
    names = write_lines(tmp_path / "names.txt", [f"x{i}" for i in range(5)])
    subset = write_lines(tmp_path / "subset.txt", [4, 1])
    model = RiggedModel({"a x4": FEATURE["red"], "a x1": FEATURE["green"]})
    task = resolve_task("imagefolder", data=str(tmp_path / "r"), classnames=names, class_subset=subset, templates=templates)
    assert evaluate(task, model)["acc1"] == 1.0


def test_csv_classification_labels_are_class_names_or_indices(tmp_path, colour_model, templates):
    """A CSV table with a label column: class names (the distinct labels, sorted, as folders are) or,
    given --classnames, indices into them; paths relative to the table's folder."""
    rows = [(f"images/{folder}-{i}.png", colour, folder) for folder, colours in FOLDER_IMAGES.items()
            for i, colour in enumerate(colours)]
    for path, colour, _ in rows:
        picture(tmp_path / path, colour)
    named = tmp_path / "named.csv"
    named.write_text("image,label\n" + "".join(f"{path},{label}\n" for path, _, label in rows))
    task = resolve_task("csv", data=str(named), csv_image_key="image", csv_separator=",", templates=templates)
    check_folder_metrics(evaluate(task, colour_model))

    numbered = tmp_path / "numbered.tsv"
    order = ["blue", "green", "red"]
    numbered.write_text("filepath\tlabel\n" + "".join(f"{path}\t{order.index(label)}\n" for path, _, label in rows))
    classnames = write_lines(tmp_path / "classes.txt", order)
    task = resolve_task("csv", data=str(numbered), classnames=classnames, templates=templates)
    check_folder_metrics(evaluate(task, colour_model))


def test_csv_retrieval_makes_an_images_rows_its_captions(tmp_path):
    """Training's CSV keys (filepath, title, a tab: open_clip's); the rows of one image, wherever they
    are in the table, are its captions, in their order; images in the order of their first row."""
    rows = []
    for i, (colour, captions) in enumerate(zip(RETRIEVAL_COLOURS, RETRIEVAL_CAPTIONS)):
        picture(tmp_path / "images" / f"{i}.png", colour)
        rows.append([(f"images/{i}.png", caption) for caption in captions])
    interleaved = [rows[0][0], rows[1][0], rows[0][1], *rows[1][1:], *rows[2], *rows[3]]
    table = tmp_path / "held_out.tsv"
    table.write_text("filepath\ttitle\n" + "".join(f"{path}\t{caption}\n" for path, caption in interleaved))
    assert evaluate(resolve_task("csv-retrieval", data=str(table)), caption_model()) == EXPECTED_RETRIEVAL


@pytest.mark.parametrize("task, fields, flag, message", [
    ("imagefolder", {"data": "{tmp}/nowhere"}, "data", "no such folder"),
    ("imagefolder", {"data": "{tmp}/table.csv"}, "data", "a CSV table is the task csv"),
    ("wds", {"data": "{tmp}/val-{{0..1}}.tar"}, "data", "no such file"),
    ("wds", {"data": "{tmp}/classes"}, "data", "is an empty folder"),
    ("wds-retrieval", {"data": "{tmp}/*"}, "data", "matches no .tar file"),
    ("wds-retrieval", {"data": "{tmp}/table.csv"}, "data", "a CSV table, not webdataset shards: use the task csv-retrieval"),
    ("coco", {"data": "{tmp}/table.csv"}, "data", "not a caption JSON"),
    ("csv-retrieval", {"data": "{tmp}/table.csv"}, "csv_image_key", "has no such column"),
    ("csv-retrieval", {"data": "{tmp}/table.csv", "csv_separator": ",", "csv_image_key": "image"}, "csv_caption_key",
     "has no such column"),
    ("csv", {"data": "{tmp}/table.csv", "csv_separator": ",", "csv_image_key": "image"}, "csv_label_key", "has no such column"),
    ("imagefolder", {"data": "{tmp}", "templates": "{tmp}/none.txt"}, "templates", "no such file, nor one of openai"),
])
def test_a_task_that_cannot_be_read_names_the_field_before_any_model(tmp_path, task, fields, flag, message):
    from clipscale.eval.tasks import TaskError, check_data

    (tmp_path / "table.csv").write_text("image,text\nimages/0.png,a red thing\n")
    (tmp_path / "classes").mkdir()
    resolved = resolve_task(task, **{key: value.format(tmp=tmp_path) for key, value in fields.items()})
    with pytest.raises(TaskError, match=message) as raised:
        check_data(resolved)
    assert raised.value.field == flag


def test_builtin_variants_say_what_they_need():
    with pytest.raises(ValueError, match="class_subset: needed"):
        resolve_task("imagenet-r", data="somewhere")
    with pytest.raises(ValueError, match="unknown keys"):
        resolve_task({"name": "x", "data": "d", "clasnames": "folders"})


# ---- retrieval: the rigged case of test_metrics.py, as pictures --------------------------

RETRIEVAL_COLOURS = ["red", "green", "blue", "red"]  # features e0, e1, e2, e0


def test_coco_karpathy_json(tmp_path):
    entries = []
    for i, (colour, captions) in enumerate(zip(RETRIEVAL_COLOURS, RETRIEVAL_CAPTIONS)):
        picture(tmp_path / "images" / "val2014" / f"{i}.png", colour)
        entries.append({"filepath": "val2014", "filename": f"{i}.png", "split": "test", "sentences": [{"raw": c} for c in captions]})
    entries.append({"filepath": "val2014", "filename": "0.png", "split": "train", "sentences": [{"raw": "a"}]})
    (tmp_path / "karpathy.json").write_text(json.dumps({"images": entries}))
    model = caption_model()
    task = resolve_task("coco", data=str(tmp_path / "karpathy.json"), image_root=str(tmp_path / "images"))
    assert evaluate(task, model) == EXPECTED_RETRIEVAL


def test_coco_flat_json_beside_its_images(tmp_path):
    entries = []
    for i, (colour, captions) in enumerate(zip(RETRIEVAL_COLOURS, RETRIEVAL_CAPTIONS)):
        picture(tmp_path / "val2014" / f"{i}.png", colour)
        entries.append({"image": f"val2014/{i}.png", "caption": captions})
    (tmp_path / "coco_karpathy_test.json").write_text(json.dumps(entries))
    task = resolve_task("coco", data=str(tmp_path / "coco_karpathy_test.json"))
    assert evaluate(task, caption_model()) == EXPECTED_RETRIEVAL


def test_retrieval_shards_with_caption_lists(tmp_path):
    with wds.TarWriter(str(tmp_path / "coco-0.tar")) as sink:
        for i, (colour, captions) in enumerate(zip(RETRIEVAL_COLOURS, RETRIEVAL_CAPTIONS)):
            sink.write({"__key__": f"{i:04d}", "png": png_bytes(colour, tmp_path), "json": json.dumps(captions).encode()})
    task = resolve_task("wds-retrieval", data=str(tmp_path / "coco-0.tar"))
    assert evaluate(task, caption_model()) == EXPECTED_RETRIEVAL


def _retrieval_shard(path, members) -> str:
    """The retrieval pictures and captions as one img2dataset-style shard (PNG bytes under KEY.jpg: the
    decoders go by content); members(i, captions) gives each sample's caption members."""
    with wds.TarWriter(str(path)) as sink:
        for i, (colour, captions) in enumerate(zip(RETRIEVAL_COLOURS, RETRIEVAL_CAPTIONS)):
            sink.write({"__key__": f"{i:09d}", "jpg": png_bytes(colour, path.parent), **members(i, captions)})
    return str(path)


def _img2dataset_metadata(i: int, caption: str) -> bytes:
    return json.dumps({"key": f"{i:09d}", "url": f"http://example.com/{i}.jpg", "caption": caption, "width": 4,
                       "height": 4, "status": "success"}).encode()


def test_retrieval_reads_img2dataset_shards_as_training_does(tmp_path):
    """img2dataset writes KEY.jpg, KEY.txt (the caption) and KEY.json (a metadata dict): the captions are
    the txt member's (one a line, CLIP_benchmark's layout), whatever the json holds."""
    layouts = {
        "without-json": lambda i, captions: {"txt": "\n".join(captions)},
        "img2dataset": lambda i, captions: {"txt": "\n".join(captions), "json": _img2dataset_metadata(i, captions[0])},
        "caption-key": lambda i, captions: {"caption": "\n".join(captions), "json": _img2dataset_metadata(i, "x")},
    }
    for name, members in layouts.items():
        task = resolve_task("wds-retrieval", data=_retrieval_shard(tmp_path / f"{name}.tar", members))
        assert evaluate(task, caption_model()) == EXPECTED_RETRIEVAL, name


def test_retrieval_refuses_a_json_that_is_not_a_caption_list(tmp_path):
    shard = _retrieval_shard(tmp_path / "metadata-only.tar", lambda i, captions: {"json": _img2dataset_metadata(i, captions[0])})
    with pytest.raises(ValueError, match=r"metadata-only.tar: sample 000000000: no caption member \(txt, text, caption\) "
                                         "and its json is not a list of caption strings"):
        evaluate(resolve_task("wds-retrieval", data=shard), caption_model())


def test_digits_held_out_set_is_a_wds_task_read_from_the_manifest(digits_root):
    """The digits held-out set goes the one evaluation path: a wds task over the shards the manifest
    lists, with the class names and templates written beside them."""
    from clipscale.data.digits import CLASSNAMES, ZEROSHOT_TEMPLATES
    from clipscale.eval.datasets import shard_classification
    from clipscale.eval.tasks import class_names, prompt_templates

    manifest = json.loads((digits_root / "manifest.json").read_text())
    task = resolve_task("digits", data=str(digits_root))
    assert task.format == "wds" and task.kind == "classification"
    assert task.data.split("::") == [str(digits_root / shard) for shard in manifest["val_shards"]]
    assert class_names(task, None, None) == list(CLASSNAMES) and prompt_templates(task) == list(ZEROSHOT_TEMPLATES)
    labels = [label for _, label in shard_classification(task.data, ToTensor())]
    assert len(labels) == manifest["num_val"] and set(labels) == set(range(len(CLASSNAMES)))


def test_digits_task_without_its_manifest_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="manifest.json"):
        resolve_task("digits", data=str(tmp_path))
    with pytest.raises(ValueError, match="data: needed"):
        resolve_task("digits")


@pytest.mark.parametrize("overrides, held_out", [([], True), (["eval.zeroshot=false"], False),
                                                 (["data.kind=webdataset", "data.train_shards=x.tar"], False)])
def test_evaluator_adds_the_digits_set_under_the_name_zeroshot(digits_root, overrides, held_out):
    from clipscale.config import load_config
    from clipscale.eval.during_training import Evaluator
    from tests.helpers.tiny_runs import DIGITS_YAML

    cfg = load_config(DIGITS_YAML, [f"data.root={digits_root}", *overrides])
    tasks = Evaluator(cfg, towers=None, world=None, autocast=None).tasks
    expected = resolve_task("digits", data=str(digits_root), name="zeroshot")
    assert tasks == ([expected] if held_out else [])


@pytest.mark.parametrize("name", ["imagenet", "imagenet-v2", "imagenet-r", "imagenet-a"])
def test_builtin_imagenet_tasks_use_open_clips_class_names_and_80_templates(name, tmp_path):
    subset = tmp_path / "subset.txt"
    subset.write_text("\n".join(str(i) for i in range(0, 1000, 5)))  # 200 indices, as imagenet-r/-a
    task = resolve_task(name, data=str(tmp_path), class_subset=str(subset) if name in ("imagenet-r", "imagenet-a") else None)
    templates = prompt_templates(task)
    assert len(templates) == 80 and templates == list(OPENAI_IMAGENET_TEMPLATES)
    assert templates[0]("goldfish") == "a bad photo of a goldfish."
    names = class_names(task, folders=[str(i) for i in range(1000)], folder_names=None)
    expected = list(IMAGENET_CLASSNAMES) if task.class_subset is None else list(IMAGENET_CLASSNAMES)[::5]
    assert names == expected


def test_every_builtin_task_defaults_to_the_80_openai_templates():
    assert {name: len(prompt_templates(task)) for name, task in BUILTIN_TASKS.items()} == {name: 80 for name in BUILTIN_TASKS}
