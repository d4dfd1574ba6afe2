"""Evaluation on data as users have it: an image that does not decode, an empty caption, a sample
without its caption. Each task skips such samples as training does, counts them in its results
(num_skipped) and names the first few on stderr; a missing file is one error naming it, before any
model; a set with no usable sample is one error naming its data."""

from __future__ import annotations

import json

import pytest
import webdataset as wds

from clipscale.eval.tasks import TaskError, check_data, resolve_task
from tests.helpers.rigged import EXPECTED_RETRIEVAL, RETRIEVAL_CAPTIONS, caption_model, evaluate, picture, png_bytes
from tests.helpers.user_data import noise_image

pytestmark = pytest.mark.timeout(120)

RETRIEVAL_COLOURS = ["red", "green", "blue", "red"]  # the rigged retrieval case (tests/helpers/rigged.py)
FOLDER_IMAGES = {"blue": ["blue"], "green": ["green", "red"], "red": ["red", "purple"]}  # test_datasets.py's case
EXPECTED_FOLDER_ACC1 = 3 / 5


def cut_short() -> bytes:
    """A JPEG cut short after its header: PIL opens it, and its decoding fails."""
    data = noise_image(0)
    return data[: len(data) // 2]


def skipped_with(metrics: dict, count: int) -> dict:
    return {**metrics, "num_skipped": count}


def test_wds_retrieval_skips_and_counts_bad_samples_naming_them(tmp_path, capsys):
    with wds.TarWriter(str(tmp_path / "val.tar")) as sink:
        for i, (colour, captions) in enumerate(zip(RETRIEVAL_COLOURS, RETRIEVAL_CAPTIONS)):
            sink.write({"__key__": f"{i:03d}", "png": png_bytes(colour, tmp_path), "txt": "\n".join(captions)})
            if i == 1:  # between good ones: an image cut short, an empty caption, no caption at all
                sink.write({"__key__": "cut", "jpg": cut_short(), "txt": "a"})
                sink.write({"__key__": "empty", "png": png_bytes("red", tmp_path), "txt": " \n"})
                sink.write({"__key__": "nocaption", "png": png_bytes("red", tmp_path)})
    metrics = evaluate(resolve_task("wds-retrieval", data=str(tmp_path / "val.tar")), caption_model())
    assert metrics == skipped_with(EXPECTED_RETRIEVAL, 3)
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("eval wds-retrieval: 3 samples skipped (")
    assert "val.tar: sample cut.jpg: OSError: Truncated File Read" in line and "val.tar: sample empty: an empty caption" in line
    assert "val.tar: sample nocaption: no caption member" in line and line.endswith(" of 7; its results' num_skipped counts them")


def test_csv_retrieval_skips_an_undecodable_image_and_an_empty_caption(tmp_path, capsys):
    rows = []
    for i, (colour, captions) in enumerate(zip(RETRIEVAL_COLOURS, RETRIEVAL_CAPTIONS)):
        picture(tmp_path / "images" / f"{i}.png", colour)
        rows += [(f"images/{i}.png", caption) for caption in captions]
    (tmp_path / "images" / "cut.jpg").write_bytes(cut_short())
    picture(tmp_path / "images" / "silent.png", "red")
    rows[2:2] = [("images/cut.jpg", "a"), ("images/silent.png", ""), ("images/1.png", "")]  # the last: dropped
    table = tmp_path / "held_out.tsv"
    table.write_text("filepath\ttitle\n" + "".join(f"{path}\t{caption}\n" for path, caption in rows))
    metrics = evaluate(resolve_task("csv-retrieval", data=str(table)), caption_model())
    assert metrics == skipped_with(EXPECTED_RETRIEVAL, 2)  # training skips an empty caption's row too
    err = capsys.readouterr().err
    assert f"{tmp_path / 'images' / 'cut.jpg'}: OSError" in err and f"{tmp_path / 'images' / 'silent.png'}: an empty caption" in err


def test_imagefolder_skips_an_undecodable_image(tmp_path, colour_model, templates, capsys):
    for folder, colours in FOLDER_IMAGES.items():
        for i, colour in enumerate(colours):
            picture(tmp_path / "val" / folder / f"{i}.png", colour)
    (tmp_path / "val" / "green" / "broken.jpg").write_bytes(b"not an image")
    metrics = evaluate(resolve_task("imagefolder", data=str(tmp_path / "val"), templates=templates), colour_model)
    assert (metrics["acc1"], metrics["num_samples"], metrics["num_skipped"]) == (EXPECTED_FOLDER_ACC1, 5, 1)
    assert f"eval imagefolder: 1 sample skipped ({tmp_path / 'val' / 'green' / 'broken.jpg'}: UnidentifiedImageError: not an image" in capsys.readouterr().err


def test_csv_classification_and_wds_classification_skip_too(tmp_path, colour_model, templates):
    picture(tmp_path / "images" / "0.png", "red")
    (tmp_path / "images" / "1.png").write_bytes(b"not an image")
    (tmp_path / "labelled.csv").write_text("filepath,label\nimages/0.png,red\nimages/1.png,red\n")
    classnames = tmp_path / "classes.txt"
    classnames.write_text("blue\ngreen\nred\n")
    task = resolve_task("csv", data=str(tmp_path / "labelled.csv"), csv_separator=",", classnames=str(classnames),
                        templates=templates)
    assert {k: evaluate(task, colour_model)[k] for k in ("acc1", "num_samples", "num_skipped")} == {
        "acc1": 1.0, "num_samples": 1, "num_skipped": 1}
    with wds.TarWriter(str(tmp_path / "val.tar")) as sink:
        sink.write({"__key__": "0", "png": png_bytes("red", tmp_path), "cls": 2})
        sink.write({"__key__": "1", "png": b"not an image", "cls": 2})
        sink.write({"__key__": "2", "png": png_bytes("red", tmp_path)})  # no label
    task = resolve_task("wds", data=str(tmp_path / "val.tar"), classnames=str(classnames), templates=templates)
    assert {k: evaluate(task, colour_model)[k] for k in ("acc1", "num_samples", "num_skipped")} == {
        "acc1": 1.0, "num_samples": 1, "num_skipped": 2}


@pytest.mark.parametrize("kind", ["csv-retrieval", "csv", "coco"])
def test_a_missing_image_file_is_one_error_naming_it_before_any_model(tmp_path, kind):
    picture(tmp_path / "images" / "0.png", "red")
    if kind == "coco":
        data = tmp_path / "captions.json"
        data.write_text(json.dumps([{"image": f"images/{i}.png", "caption": ["a"]} for i in range(3)]))
    else:
        data = tmp_path / "table.tsv"
        data.write_text("filepath\ttitle\tlabel\n" + "".join(f"images/{i}.png\ta\tred\n" for i in range(3)))
    with pytest.raises(TaskError, match=rf"names an image that is not there: {tmp_path / 'images' / '1.png'} and 1 more "
                                        r"of its 3 images \(image paths are relative to the (table|JSON)'s folder\)") as raised:
        check_data(resolve_task(kind, data=str(data)))
    assert raised.value.field == "data"


def test_a_set_without_one_usable_sample_is_one_error_naming_its_data_and_why(tmp_path):
    (tmp_path / "images").mkdir()
    for i in range(2):
        (tmp_path / "images" / f"{i}.png").write_bytes(b"\x89PNG cut")
    (tmp_path / "table.tsv").write_text("filepath\ttitle\nimages/0.png\ta\nimages/1.png\tb\n")
    with pytest.raises(TaskError, match=rf"data {tmp_path / 'table.tsv'}: no usable sample: 2 samples skipped "
                                        rf"\({tmp_path / 'images' / '0.png'}: "):
        evaluate(resolve_task("csv-retrieval", data=str(tmp_path / "table.tsv")), caption_model())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_evaluates_sets_with_bad_samples_to_the_end_counting_them(tmp_path, digits_root):
    """eval.sets and eval.val_data with a sample that does not decode: the run ends (its open_clip
    weights written), and the counts are in the results, metrics.jsonl and the console."""
    from clipscale.metrics import read_metrics
    from tests.helpers.tiny_runs import run_train, tiny_run
    from tests.helpers.user_data import write_img2dataset_shards

    picture(tmp_path / "set" / "0.png", "red")
    picture(tmp_path / "set" / "1.png", "green")
    (tmp_path / "set" / "2.jpg").write_bytes(cut_short())
    (tmp_path / "set" / "held_out.tsv").write_text("filepath\ttitle\n0.png\ta red\n1.png\ta green\n2.jpg\ta cut\n")
    val = write_img2dataset_shards(tmp_path / "val", shards=1, per_shard=6)
    with wds.TarWriter(str(tmp_path / "val" / "00001.tar")) as sink:
        sink.write({"__key__": "cut", "jpg": cut_short(), "txt": b"a cut one"})
    val = val.replace("{00000..00000}", "{00000..00001}")
    result = run_train(tiny_run(digits_root, tmp_path / "runs", "train.steps=2", "eval.zeroshot=false",
                                f"eval.sets=[{{task: csv-retrieval, name: held, data: {tmp_path / 'set' / 'held_out.tsv'}}}]",
                                f"eval.val_data={val}", "eval.batch_size=4", "data.workers=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    assert (run_dir / "open_clip_pytorch_model.bin").is_file()
    results = json.loads((run_dir / "eval" / "step_00000002.json").read_text())
    assert (results["held_num_samples"], results["held_num_skipped"]) == (2, 1)
    assert (results["val_num_samples"], results["val_num_skipped"]) == (6, 1)
    assert [m["held_num_skipped"] for m in read_metrics(run_dir / "metrics.jsonl") if "held_num_skipped" in m] == [1]
    assert f"eval held: 1 sample skipped ({tmp_path / 'set' / '2.jpg'}: OSError: Truncated File Read) of 3" in result.stderr
    assert f"eval eval.val_data: 1 sample skipped ({tmp_path / 'val' / '00001.tar'}: sample cut: OSError" in result.stderr
