"""Where the data is: a folder or a glob as shards, every way of naming data that gives none said in
one line for what it is, relative paths that say where they were looked for, and train.epochs of a
CSV table counted in its rows (open_clip_train's CSV epoch). All checked before any work
(clipscale.checks: check_config, plan_run), on files the tests write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clipscale.checks import check_config, plan_run
from clipscale.config import ConfigError, load_config
from clipscale.data import prepare_data
from clipscale.distributed import World
from tests.helpers.user_data import write_csv, write_img2dataset_shards

from tests.helpers.tiny_runs import DIGITS_YAML, TINY_MODEL, TRAIN


def config(*overrides):
    return load_config(DIGITS_YAML, list(overrides))


def shards_of(*overrides) -> list[str]:
    return prepare_data(config("data.kind=webdataset", *overrides).data, World()).train_shards.shards


def refusal(*overrides) -> str:
    """The ConfigError's message of plan_run, the last check before work."""
    with pytest.raises(ConfigError) as caught:
        plan_run(config(*overrides), World())
    return str(caught.value)


def img2dataset_folder(folder: Path, shards: int) -> str:
    """img2dataset's output: NNNNN.tar with a .parquet and a _stats.json beside each, written out of order."""
    pattern = write_img2dataset_shards(folder, shards=shards, per_shard=2)
    for s in reversed(range(shards)):
        (folder / f"{s:05d}.parquet").write_bytes(b"PAR1")
        (folder / f"{s:05d}_stats.json").write_text("{}")
    return pattern


def test_a_folder_or_a_glob_gives_the_tar_files_in_it_sorted(tmp_path):
    pattern = img2dataset_folder(tmp_path / "mine", shards=3)
    listed = shards_of(f"data.train_shards={pattern}")
    assert listed == [str(tmp_path / "mine" / f"{s:05d}.tar") for s in range(3)]
    for name in (tmp_path / "mine", f"{tmp_path / 'mine'}/", f"{tmp_path}/mine/*.tar", f"{tmp_path}/mine/0000*",
                 f"{tmp_path}/mine/{{00000,00001,00002}}.t*"):  # braces first, then each name globbed
        assert shards_of(f"data.train_shards={name}") == listed, name
    # a source of each kind, joined with "::", each with its upsampling factor for each of its shards
    other = write_img2dataset_shards(tmp_path / "other", shards=2, per_shard=2)
    source = prepare_data(config("data.kind=webdataset", f"data.train_shards={tmp_path / 'mine'}::{other}",
                                 "data.resampled=true", "data.upsampling_factors=1::4").data, World()).train_shards
    assert source.shards == listed + [str(tmp_path / "other" / f"{s:05d}.tar") for s in range(2)]
    assert source.weights == [1.0] * 3 + [4.0] * 2


def test_a_folder_as_the_validation_set(tmp_path):
    """eval.val_data names shards with the training data's code: a folder works there too."""
    img2dataset_folder(tmp_path / "val", shards=2)
    plan_run(config(f"eval.val_data={tmp_path / 'val'}"), World())
    message = refusal(f"eval.val_data={tmp_path / 'nothing'}/*.tar")
    assert message == f"eval.val_data: '{tmp_path}/nothing/*.tar' matches no file"


def test_names_that_give_no_shards_are_said_for_what_they_are(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a.jpg", "b.jpg", "c.jpg", "d.jpg", "pairs.csv"):
        (photos / name).write_bytes(b"x")
    (photos / "more").mkdir()
    (tmp_path / "empty").mkdir()
    webdataset = ("data.kind=webdataset",)
    assert refusal(*webdataset, f"data.train_shards={photos}") == (
        f"data.train_shards: '{photos}' is a folder with no .tar file (it holds 5 files and 1 folder: a.jpg, b.jpg, c.jpg, "
        "d.jpg and 2 more)")
    assert refusal(*webdataset, f"data.train_shards={tmp_path / 'empty'}") == f"data.train_shards: '{tmp_path / 'empty'}' is an empty folder"
    assert refusal(*webdataset, f"data.train_shards={photos}/*.jpg") == (
        f"data.train_shards: '{photos}/*.jpg' matches no .tar file (it matches 4 files: a.jpg, b.jpg, c.jpg, d.jpg)")
    assert refusal(*webdataset, f"data.train_shards={photos}/*.tar") == f"data.train_shards: '{photos}/*.tar' matches no file"
    assert refusal(*webdataset, f"data.train_shards={photos / 'pairs.csv'}") == (
        f"data.train_shards: {photos / 'pairs.csv'} is a CSV table, not webdataset shards (data.kind: csv reads tables)")
    # the other way round: a folder where a CSV table is expected
    assert refusal("data.kind=csv", f"data.train_shards={photos}") == (
        f"data.train_shards: '{photos}' is a folder, not a CSV file (it holds 5 files and 1 folder: a.jpg, b.jpg, c.jpg, "
        "d.jpg and 2 more)")
    with pytest.raises(ConfigError, match=f"^model.pretrained: '{photos}' is a folder; give the checkpoint file"):
        config(f"model.pretrained={photos}")


def test_brace_patterns_pipes_and_urls_are_passed_on_as_before(tmp_path):
    pattern = write_img2dataset_shards(tmp_path / "mine", shards=2, per_shard=2)
    assert shards_of(f"data.train_shards={pattern}") == [str(tmp_path / "mine" / f"{s:05d}.tar") for s in range(2)]
    assert shards_of("data.train_shards=pipe:cat /x/{0..1}.tar") == ["pipe:cat /x/0.tar", "pipe:cat /x/1.tar"]
    assert shards_of("data.train_shards=https://example.org/*/{0..1}.tar") == [
        "https://example.org/*/0.tar", "https://example.org/*/1.tar"]  # a remote name is never globbed here


def test_missing_relative_paths_say_where_they_were_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    where = f"; relative paths are read from {tmp_path}, the directory train.py was started in"
    assert refusal("data.kind=webdataset", "data.train_shards=shards/x-{0..3}.tar") == (
        f"data.train_shards: 'shards/x-{{0..3}}.tar' matches no file (first missing: shards/x-0.tar){where}")
    assert refusal("data.kind=webdataset", "data.train_shards=shards/*.tar") == f"data.train_shards: 'shards/*.tar' matches no file{where}"
    assert refusal("data.kind=csv", "data.train_shards=pairs.csv") == f"data.train_shards: no CSV file at 'pairs.csv'{where}"
    assert refusal("eval.val_data=val/{0..1}.tar") == f"eval.val_data: 'val/{{0..1}}.tar' matches no file (first missing: val/0.tar){where}"
    assert refusal("eval.val_data=val.csv") == f"eval.val_data: no CSV file at 'val.csv'{where}"
    with pytest.raises(ConfigError) as caught:
        config("model.pretrained=weights/w.pt")
    assert str(caught.value) == f"model.pretrained: no file at 'weights/w.pt' (only local checkpoints are loaded){where}"
    # found where they were looked for, they work; absolute ones say nothing more
    write_img2dataset_shards(tmp_path / "shards", shards=1, per_shard=2)
    assert shards_of("data.train_shards=shards") == ["shards/00000.tar"]
    assert refusal("data.kind=webdataset", f"data.train_shards={tmp_path}/x.tar") == (
        f"data.train_shards: '{tmp_path}/x.tar' matches no file (first missing: {tmp_path}/x.tar)")
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert refusal("data.kind=csv", "data.train_shards=pairs.csv").endswith(
        f"; relative paths are read from {tmp_path}, the working directory")


def test_epochs_of_a_csv_table_count_its_rows(tmp_path):
    """open_clip_train's epoch of a CSV is its rows (len(CsvDataset)); here summed over the "::"
    tables. The count happens in check_config (train.py) or, where that was not run, plan_run."""
    first = write_csv(tmp_path / "a", rows=30)
    second = write_csv(tmp_path / "b", rows=12)
    overrides = ["data.kind=csv", f"data.train_shards={first}::{second}", "train.epochs=3", "train.steps=null",
                 "train.batch_size=8"]
    cfg = config(*overrides)
    assert cfg.train.steps is None  # load_config reads no table
    check_config(cfg)
    assert (cfg.train.num_samples_per_epoch, cfg.train.steps) == (42, 3 * 6)  # ceil(42 / 8) steps an epoch
    planned = config(*overrides)
    plan_run(planned, World())
    assert planned.train == cfg.train
    # resampled, with upsampling factors: the epoch is as many draws as the tables have rows
    drawn = config(*overrides, "data.resampled=true", "data.upsampling_factors=1::4")
    check_config(drawn)
    assert (drawn.train.num_samples_per_epoch, drawn.train.steps) == (42, 18)
    # a number given is kept, as for shards
    given = config(*overrides, "train.num_samples_per_epoch=16")
    check_config(given)
    assert given.train.steps == 6


def test_epochs_of_a_csv_table_refused_in_one_line(tmp_path):
    table = write_csv(tmp_path, rows=10)
    csv = ["data.kind=csv", f"data.train_shards={table}", "train.epochs=2"]
    with pytest.raises(ConfigError, match=r"^train.steps=200 and train.epochs=2 \(of the CSV table's rows\) give two run "
                                          "lengths: set train.steps=null to count in epochs$"):
        config(*csv)
    with pytest.raises(ConfigError, match="^train.epochs and train.num_samples_per_epoch go together: .*with data.kind: "
                                          "csv, the table's rows when it is not given"):
        config("data.kind=webdataset", "data.train_shards=x.tar", "train.epochs=2", "train.steps=null")
    with pytest.raises(ConfigError, match=f"^data.train_shards: no CSV file at '{tmp_path}/gone.csv'$"):
        check_config(config("data.kind=csv", f"data.train_shards={table}::{tmp_path}/gone.csv", "train.epochs=2",
                            "train.steps=null"))
    (tmp_path / "empty.csv").write_text("filepath\ttitle\n")
    with pytest.raises(ConfigError, match="empty.csv has no rows"):
        check_config(config("data.kind=csv", f"data.train_shards={tmp_path}/empty.csv", "train.epochs=2", "train.steps=null"))
    # the schedule's checks wait for the steps: a cooldown longer than the run is still caught
    with pytest.raises(ConfigError, match=r"optim.lr_cooldown_steps: must be in 1..2 \(train.steps\), got 5"):
        check_config(config(*csv, "train.steps=null", "train.batch_size=10", "optim.lr_scheduler=const-cooldown",
                            "optim.lr_cooldown_steps=5"))


@pytest.mark.slow
def test_train_py_on_relative_paths_a_csv_by_epochs_and_a_validation_folder(tmp_path):
    """A real run started in the data's folder: a CSV table of 20 rows for 2 epochs of batch 8
    (3 steps each), a folder of shards as the validation set; then a relative path that is not there."""
    write_csv(tmp_path, rows=20)
    img2dataset_folder(tmp_path / "val", shards=2)

    def train(*overrides):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
               "PYTHONPATH": os.pathsep.join([str(Path(TRAIN).parent), os.environ.get("PYTHONPATH", "")])}
        return subprocess.run([sys.executable, TRAIN, "--config", DIGITS_YAML, TINY_MODEL, "run.output_dir=runs",
                               "run.name=mine", "data.kind=csv", "train.epochs=2", "train.steps=null", "train.batch_size=8",
                               "data.workers=0", "eval.zeroshot=false", "eval.val_data=val", *overrides],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)

    result = train("data.train_shards=train.csv")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 6
    assert any("val_loss" in r for r in records)
    result = train("run.name=other", "data.train_shards=tables/train.csv")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: data.train_shards: no CSV file at 'tables/train.csv'; relative paths are read from {tmp_path}, "
        "the directory train.py was started in"]
