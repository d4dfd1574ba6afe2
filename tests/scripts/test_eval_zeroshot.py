"""scripts/eval_zeroshot.py loads real (tiny) open_clip models from both checkpoint layouts
and reports what the in-process evaluation reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipscale.config import ModelConfig
from clipscale.errors import run_main
from clipscale.eval.tasks import resolve_task, run_task
from clipscale.models import build_model
from tests.helpers.rigged import picture, write_lines
from tests.helpers.tiny_runs import REPO
from tests.helpers.towers import TINY_CLIP

pytestmark = pytest.mark.slow

sys.path.insert(0, str(REPO / "scripts"))
import eval_zeroshot  # noqa: E402


def run_script(*args) -> dict:
    subprocess.run([sys.executable, str(REPO / "scripts" / "eval_zeroshot.py"), *args], check=True, cwd=REPO, timeout=120)
    return json.loads(Path(args[args.index("--output") + 1]).read_text())


def test_script_matches_in_process_evaluation_for_both_checkpoint_layouts(tmp_path):
    for i, colour in enumerate(["red", "green", "blue", "purple", "yellow"] * 2):
        picture(tmp_path / "val" / f"{i % 5}_{colour}" / f"{i}.png", colour)  # five classes: acc5 is a number
    templates = write_lines(tmp_path / "templates.txt", ["a photo of {c}.", "a {c} thing."])

    torch.manual_seed(0)
    towers = build_model(ModelConfig(custom=TINY_CLIP))
    state = towers.model.state_dict()
    ours = tmp_path / "step_3.pt"  # clipscale layout: DDP-prefixed state_dict and the resolved config
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "step": 3, "epoch": 0,
                "config": {"model": {"name": None, "custom": TINY_CLIP, "pretrained": None, "grad_checkpointing": True}}},
               ours)  # fmt: skip
    plain = tmp_path / "open_clip.pt"  # a bare state dict, architecture given by --model
    torch.save(state, plain)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_CLIP))

    task = resolve_task("imagefolder", data=str(tmp_path / "val"), templates=templates)
    expected = run_task(task, towers.model, towers.tokenizer, towers.val_transform, "cpu", batch_size=3, workers=0, progress=False)

    common = ["--task", "imagefolder", "--data", str(tmp_path / "val"), "--templates", templates,
              "--device", "cpu", "--batch-size", "3", "--workers", "0", "--no-progress"]  # fmt: skip
    from_ours = run_script("--checkpoint", str(ours), "--output", str(tmp_path / "ours.json"), *common)
    from_plain = run_script("--checkpoint", str(plain), "--model", str(tmp_path / "tiny.json"), "--output", str(tmp_path / "plain.json"), *common)
    assert from_ours["metrics"] == expected == from_plain["metrics"]
    assert from_ours["task"] == "zeroshot_classification" and expected["num_samples"] == 10


def _help_text() -> str:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "eval_zeroshot.py"), "--help"], capture_output=True,
                          text=True, check=True, cwd=REPO).stdout


def _help_examples(section_end: str) -> list[str]:
    """The example command lines of the script's --help before `section_end`, continued lines joined."""
    runnable = _help_text().split(section_end, 1)[0].replace("\\\n", " ")
    return [line.strip() for line in runnable.splitlines() if line.strip().startswith("python scripts/eval_zeroshot.py")]


def test_the_help_shows_the_examples_as_the_script_writes_them():
    """Continued lines keep their backslash and line break, so a copied example runs in a shell."""
    source = (REPO / "scripts" / "eval_zeroshot.py").read_text().split('"""', 2)[1]
    examples = [line for line in source.splitlines() if line.startswith("    python ") or line.startswith("        --")]
    assert any(line.endswith("\\") for line in examples)
    shown = _help_text().splitlines()
    assert [line for line in examples if line not in shown] == []


def test_the_default_workers_fit_the_cores(monkeypatch):
    """torch's DataLoader warns when its workers outnumber the cores: on 2 cores the default is 2,
    and under torchrun each process takes its share."""
    required = ["--checkpoint", "x.pt", "--task", "digits"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert eval_zeroshot.parse_args(required).workers == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert eval_zeroshot.parse_args(required).workers == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert eval_zeroshot.parse_args(required).workers == 4


def test_the_help_examples_run_from_a_clone_after_the_readmes_first_command(tmp_path, digits_root):
    """runs/digits (here a tiny checkpoint with clipscale's config) and data/digits as the first command
    leaves them; the CSV examples' tables beside them, made of held-out digits."""

    from clipscale.data.digits import CLASSNAMES
    from clipscale.eval.datasets import shard_classification

    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "eval_zeroshot.py", tmp_path / "scripts")
    shutil.copytree(digits_root, tmp_path / "data" / "digits")
    checkpoints = tmp_path / "runs" / "digits" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.manual_seed(0)
    towers = build_model(ModelConfig(custom=TINY_CLIP))
    torch.save({"state_dict": towers.model.state_dict(), "step": 3, "epoch": 0,
                "config": {"model": {"name": None, "custom": TINY_CLIP, "pretrained": None}}}, checkpoints / "step_00000003.pt")
    rows = []
    val = str(tmp_path / "data" / "digits" / "val-{0000..0001}.tar")
    for i, (image, label) in zip(range(12), shard_classification(val, lambda image: image)):
        image.save(tmp_path / f"{i}.png")
        rows.append((f"{i}.png", CLASSNAMES[label]))
    (tmp_path / "held_out.tsv").write_text("filepath\ttitle\n" + "".join(f"{p}\ta handwritten {c}\n" for p, c in rows))
    (tmp_path / "labelled.csv").write_text("filepath,label\n" + "".join(f"{p},{c}\n" for p, c in rows))

    examples = _help_examples("With your own checkpoints")
    assert len(examples) == 4
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for example in examples:
        command = example.replace("python ", f"{sys.executable} ", 1) + " --no-progress"  # the default --workers
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (example, result.stderr[-2000:])
        assert "worker processes in total" not in result.stderr, result.stderr  # torch's warning: more workers than cores
        metrics = json.loads(result.stdout)["metrics"]
        assert metrics.get("num_samples", 12) >= 12, example
        assert "initialized randomly" not in result.stderr, result.stderr
    assert json.loads((tmp_path / "digits.json").read_text())["dataset"] == "wds"


@pytest.mark.parametrize("arguments, line", [
    (["--task", "imagefolder", "--data", "{tmp}/nowhere"], "error: --data {tmp}/nowhere: no such folder (task imagefolder)"),
    (["--task", "digits"], "error: --data: needed: the digits data root, which holds manifest.json (data/digits after "
                           "the README's first command) (task digits)"),
    (["--task", "wds-retrieval", "--data", "{tmp}/table.csv"],
     "error: --data {tmp}/table.csv: a CSV table, not webdataset shards: use the task csv-retrieval (task wds-retrieval)"),
    (["--task", "csv-retrieval", "--data", "{tmp}/table.csv", "--csv-separator", ","],
     "error: --csv-image-key 'filepath': {tmp}/table.csv has no such column (its columns, split at ',': 'image', 'text'; "
     "csv_separator sets the split) (task csv-retrieval)"),
    (["--task", "csv-retrieval", "--data", "{tmp}/table.csv", "--csv-separator", ",", "--csv-image-key", "image",
      "--csv-caption-key", "text"],
     "error: --data {tmp}/table.csv: names an image that is not there: {tmp}/0.png (image paths are relative to the "
     "table's folder) (task csv-retrieval)"),
    (["--task", "csv-retrieval", "--data", "{tmp}/bad.csv", "--csv-separator", ",", "--csv-image-key", "image",
      "--csv-caption-key", "text", "--no-progress", "--workers", "0"],
     "error: --data {tmp}/bad.csv: no usable sample: 1 sample skipped ({tmp}/bad.png: UnidentifiedImageError: not an "
     "image of the formats read here, or cut short before its size) (task csv-retrieval)"),
    (["--task", "imagenet-r", "--data", "{tmp}"], "error: --class-subset: needed by this task (see clipscale.eval.tasks) "
                                                 "(task imagenet-r)"),
    (["--task", "nope"], "error: --task nope: no such file, nor one of imagenet, imagenet-v2, imagenet-r, imagenet-a, "
                         "objectnet, imagefolder, wds, coco, wds-retrieval, csv, csv-retrieval, digits"),
    (["--checkpoint", "{tmp}/runs/digitz", "--task", "digits"],
     "error: --checkpoint {tmp}/runs/digitz: no such file or folder; checkpoints in {tmp}/runs: {tmp}/runs/digits "
     "(latest: step_00000003.pt)"),
    (["--checkpoint", "{tmp}/runs/empty", "--task", "digits"],
     "error: --checkpoint {tmp}/runs/empty: a folder without a checkpoint; checkpoints in {tmp}/runs: {tmp}/runs/digits "
     "(latest: step_00000003.pt)"),
    (["--checkpoint", "{tmp}/runs/digits/checkpoints/step_00000009.pt", "--task", "digits"],
     "error: --checkpoint {tmp}/runs/digits/checkpoints/step_00000009.pt: no such file or folder; checkpoints in "
     "{tmp}/runs/digits/checkpoints: {tmp}/runs/digits/checkpoints/step_00000003.pt"),
])
def test_every_bad_input_is_one_error_line_naming_the_flag_and_the_path(tmp_path, capsys, arguments, line):
    """In this process (the script's main under run_main, as `python scripts/eval_zeroshot.py` runs it);
    the help examples' test runs it as a command."""
    (tmp_path / "table.csv").write_text("image,text\n0.png,a zero\n")
    (tmp_path / "bad.csv").write_text("image,text\nbad.png,a bad one\n")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    checkpoint = tmp_path / "step_3.pt"
    weights = build_model(ModelConfig(custom=TINY_CLIP)).model.state_dict() if "bad.csv" in " ".join(arguments) else {}
    torch.save({"state_dict": weights, "config": {"model": {"name": None, "custom": TINY_CLIP}}}, checkpoint)
    run_checkpoints = tmp_path / "runs" / "digits" / "checkpoints"  # a run folder, and an empty one beside it
    run_checkpoints.mkdir(parents=True)
    shutil.copy(checkpoint, run_checkpoints / "step_00000003.pt")
    (tmp_path / "runs" / "empty").mkdir()
    argv = ["--checkpoint", str(checkpoint), *[a.format(tmp=tmp_path) for a in arguments]]  # a later --checkpoint wins
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: eval_zeroshot.main(argv))
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    if "no usable sample" in line:  # the line of the samples skipped, then the error
        assert lines[0].startswith("eval csv-retrieval: 1 sample skipped") and len(lines) == 2
        lines = lines[1:]
    assert out == "" and lines == [line.format(tmp=tmp_path)]
