"""User errors are one line, `error: ...`, printed once (by rank 0), without a traceback, and every
process exits non-zero; tested on the real entry points (train.py, torchrun, eval_zeroshot.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from clipscale.checkpoint import save_checkpoint
from clipscale.config import ModelConfig
from clipscale.eval.tasks import resolve_task, run_task
from clipscale.models import build_model, write_open_clip_folder
from tests.helpers.rigged import picture, write_lines
from tests.helpers.towers import TINY_CLIP

from tests.helpers.tiny_runs import DIGITS_YAML, REPO, TINY_MODEL, run_train, tiny_run

EVAL_SCRIPT = str(REPO / "scripts" / "eval_zeroshot.py")


def _run(*command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    """The message of the single `error:` line, after checking that it came alone, without a traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0].removeprefix("error: ")


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("run:\n  name: broken\ntrain:\n  steps: [10\n  batch_size: 64\n")
    message = _one_line_error(_run("train.py", "--config", str(config)))
    assert message.startswith(f"{config}: YAML syntax error at line 5, column 13: "), message
    assert result_is_quiet(message)


def result_is_quiet(message: str) -> bool:
    return "\n" not in message and "yaml." not in message  # no exception class or module named


def test_a_config_mistake_is_reported_before_torch_is_imported(tmp_path):
    """torch and open_clip take seconds to load; a typo in a key should not wait for them."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['train.py', '--config', 'configs/digits.yaml', 'train.stepz=3']\n"
             "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
             "finally:\n    print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)\n")
    result = _run("-c", probe)
    assert _one_line_error(result).startswith("unknown key train.stepz; allowed keys in train: batch_size, ")
    assert "torch not imported" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("kind", ["folder", "missing"])
def test_a_config_path_that_is_a_folder_or_missing(tmp_path, kind):
    path = tmp_path if kind == "folder" else tmp_path / "nope.yaml"
    message = _one_line_error(_run("train.py", "--config", str(path)))
    expected = f"--config {path} is a folder; give a YAML file" if kind == "folder" else f"--config {path}: no such file"
    assert message.startswith(expected), message


def _last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_the_processes_is_reported_once(digits_root, tmp_path):
    """Two processes under torchrun: only rank 0 prints, when it happens and once more after
    torchrun's own report of the failed workers (the launcher's traceback), as the last line."""
    result = run_train(tiny_run(digits_root, tmp_path, "train.batch_size=255", "run.device=cpu"), nproc=2)
    output = result.stdout + result.stderr
    error = "error: train.batch_size=255 is the global batch and must split evenly over 2 processes (it leaves a remainder of 1)"
    assert result.returncode != 0
    assert output.count(error) == 2 and _last_line(result.stderr) == error, output[-3000:]
    # The first rank to exit has status 2; torchrun may stop the other before it has exited by itself.
    assert "exitcode  : 2" in output and "ConfigError" not in output and "train.py\", line" not in output, output[-3000:]


@pytest.mark.slow
def test_under_torchrun_the_error_is_the_last_line(digits_root, tmp_path):
    """A mistake found only once the workers run (weights that do not fit the model, found when
    it is built): the error line comes after torchrun's ChildFailedError report."""
    weights = _wider_text_tower_weights(tmp_path)
    result = run_train(tiny_run(digits_root, tmp_path, f"model.pretrained={weights}", "run.device=cpu"), nproc=2)
    assert "ChildFailedError" in result.stderr, result.stderr[-3000:]
    assert _last_line(result.stderr).startswith(f"error: model.pretrained {weights} does not fit the model: "), result.stderr[-3000:]
    assert "AssertionError" not in result.stderr and "train.py\", line" not in result.stderr, result.stderr[-3000:]


def _wider_text_tower_weights(tmp_path) -> str:
    """The tiny runs' model with a text tower of width 96 instead of 64, saved as a state dict."""
    from clipscale.config import load_config

    cfg = load_config(DIGITS_YAML, [TINY_MODEL, "model.custom.text_cfg.width=96"])
    path = tmp_path / "wider_text.pt"
    torch.save(build_model(cfg.model).model.state_dict(), path)
    return str(path)


@pytest.mark.slow
def test_a_pretrained_file_whose_text_width_differs(digits_root, tmp_path):
    """open_clip's position-embedding resize asserts "text pos_embed width changed!"; we name the file and keys."""
    weights = _wider_text_tower_weights(tmp_path)
    message = _one_line_error(run_train(tiny_run(digits_root, tmp_path, f"model.pretrained={weights}")))
    assert message.startswith(f"model.pretrained {weights} does not fit the model: "), message
    assert "positional_embedding (file (16, 96), model (16, 64))" in message, message


@pytest.mark.slow
def test_an_unknown_key_in_model_custom_names_it():
    message = _one_line_error(_run("train.py", "--config", DIGITS_YAML, "model.custom.vision_cfg.patch_sise=8"))
    assert message.startswith("unknown key model.custom.vision_cfg.patch_sise; allowed keys in model.custom.vision_cfg: "), message
    assert "patch_size" in message


@pytest.mark.slow
def test_coca_is_refused_in_one_line():
    message = _one_line_error(_run("train.py", "--config", DIGITS_YAML, "model.custom=null", "model.name=coca_ViT-B-32"))
    assert message.startswith("model.name=coca_ViT-B-32: a CoCa model"), message
    assert "captioning loss is not supported" in message


@pytest.mark.slow
def test_an_output_folder_under_proc(tmp_path):
    message = _one_line_error(_run("train.py", "--config", DIGITS_YAML, "run.output_dir=/proc/clipscale-runs"))
    assert message == "cannot create the run folder /proc/clipscale-runs/digits: /proc takes no new files (No such file or directory)"


@pytest.mark.slow
def test_a_shard_pattern_that_matches_nothing(tmp_path):
    pattern = str(tmp_path / "shards-{000..009}.tar")
    message = _one_line_error(_run("train.py", "--config", DIGITS_YAML, f"run.output_dir={tmp_path}", "data.kind=webdataset",
                                   f"data.train_shards={pattern}"))
    assert message == f"data.train_shards: {pattern!r} matches no file (first missing: {tmp_path / 'shards-000.tar'})"


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_names_the_file(digits_root, mounted):
    """1 MB holds the run's config and metrics, not its first checkpoint (about 40 MB)."""
    output_dir = mounted("1m")
    result = run_train(tiny_run(digits_root, output_dir, "train.steps=2", "train.checkpoint_every=2",
                                "eval.zeroshot=false"))
    message = _one_line_error(result)
    assert message == f"cannot write {output_dir / 'tiny' / 'checkpoints' / 'step_00000002.pt'}: no space left on the device"


@pytest.mark.slow
def test_a_read_only_output_folder_is_reported_before_any_work(digits_root, mounted):
    read_only = mounted("64k", read_only=True)
    result = run_train(tiny_run(digits_root, read_only / "runs"))
    assert _one_line_error(result) == f"cannot write to {read_only / 'runs'}: the file system is read-only"
    assert "tiny" not in result.stdout  # no progress bar: it stopped before the model and the data


@pytest.mark.slow
def test_eval_of_a_missing_checkpoint(tmp_path):
    result = _run(EVAL_SCRIPT, "--checkpoint", str(tmp_path / "runs" / "gone"), "--task", "imagefolder", "--data", str(tmp_path))
    line = _one_line_error(result)  # the flag, the path, and where it looked for checkpoints nearby
    assert line.startswith(f"--checkpoint {tmp_path / 'runs' / 'gone'}: no such file or folder; no checkpoint in ")


@pytest.mark.slow
def test_eval_takes_a_run_folder_and_its_open_clip_config(tmp_path):
    """A run folder as clipscale writes it (open_clip_config.json, checkpoints/ with `latest`) as
    --checkpoint, and it or its open_clip_config.json as --model; no false random-init warning."""
    for i, colour in enumerate(["red", "green", "blue", "purple", "yellow"]):
        picture(tmp_path / "val" / f"{i}_{colour}" / f"{i}.png", colour)  # five classes: acc5 is a number
    templates = write_lines(tmp_path / "templates.txt", ["a photo of {c}."])
    torch.manual_seed(0)
    towers = build_model(ModelConfig(custom=TINY_CLIP))
    run_dir = tmp_path / "runs" / "tiny"
    write_open_clip_folder(run_dir, towers)
    save_checkpoint(run_dir / "checkpoints", 3, {"state_dict": towers.model.state_dict(), "step": 3,
                                                 "config": {"model": ModelConfig(custom=TINY_CLIP).__dict__}})
    task = resolve_task("imagefolder", data=str(tmp_path / "val"), templates=templates)
    expected = run_task(task, towers.model, towers.tokenizer, towers.val_transform, "cpu", batch_size=4, workers=0, progress=False)

    common = ["--task", "imagefolder", "--data", str(tmp_path / "val"), "--templates", templates,
              "--device", "cpu", "--batch-size", "4", "--workers", "0", "--no-progress"]
    for model in (run_dir / "open_clip_config.json", run_dir):
        output = tmp_path / "result.json"
        result = _run(EVAL_SCRIPT, "--checkpoint", str(run_dir), "--model", str(model), "--output", str(output), *common)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(output.read_text())["metrics"] == expected
        assert json.loads(output.read_text())["pretrained"] == str(run_dir / "checkpoints" / "step_00000003.pt")
        assert "initialized randomly" not in result.stderr, result.stderr
