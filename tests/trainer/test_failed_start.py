"""A run name is claimed only by a run that started: everything checkable before training (the
data found, the weights loadable into the model, the model config valid) is checked before
runs/<name> is written, so a mistake leaves no run folder, or the old one as it was, and the
same command succeeds once the mistake is fixed."""

from __future__ import annotations

import torch

from clipscale.config import load_config
from clipscale.models import build_model

from tests.helpers.tiny_runs import DIGITS_YAML, TINY_MODEL, run_train
from tests.helpers.trainer_harness import shard_run, training_records, write_shards

import pytest

pytestmark = pytest.mark.slow

BAD_MODEL = TINY_MODEL.replace("patch_dropout: 0.0}", "patch_dropout: 0.0, not_a_vision_key: 1}")
assert BAD_MODEL != TINY_MODEL


def _run(shards, tmp_path, *extra):
    return run_train(shard_run(shards, tmp_path, "tiny", "train.steps=2", "train.batch_size=16", "train.log_every=1",
                               "data.workers=0", *extra))


def _failed(result, names):
    assert result.returncode != 0 and names in result.stderr, result.stderr[-3000:]


def test_shards_that_are_not_there_yet_claim_no_run_name(tmp_path):
    folder = tmp_path / "shards"
    pattern = str(folder / "part-{0000..0001}.tar")
    _failed(_run(pattern, tmp_path), "data.train_shards")
    assert not (tmp_path / "tiny").exists()
    assert write_shards(folder, shards=2, per_shard=16) == pattern
    assert _run(pattern, tmp_path).returncode == 0
    assert [m["step"] for m in training_records(tmp_path / "tiny")] == [1, 2]


def test_pretrained_weights_that_are_not_there_yet_claim_no_run_name(tmp_path):
    shards = write_shards(tmp_path / "shards", shards=1, per_shard=32)
    weights = tmp_path / "start.pt"
    _failed(_run(shards, tmp_path, f"model.pretrained={weights}"), "model.pretrained")
    assert not (tmp_path / "tiny").exists()
    model = build_model(load_config(DIGITS_YAML, [TINY_MODEL]).model).model
    torch.save({"state_dict": model.state_dict()}, weights)
    result = _run(shards, tmp_path, f"model.pretrained={weights}")
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_bad_model_key_claims_no_run_name_and_moves_no_run_aside(tmp_path):
    shards = write_shards(tmp_path / "shards", shards=1, per_shard=32)
    bad = shard_run(shards, tmp_path, "tiny", "train.steps=2", "train.batch_size=16", "data.workers=0")
    bad[bad.index(TINY_MODEL)] = BAD_MODEL
    _failed(run_train(bad), "not_a_vision_key")
    assert not (tmp_path / "tiny").exists()
    assert _run(shards, tmp_path).returncode == 0  # the fixed command: the name is free

    run_dir = tmp_path / "tiny"
    before = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    _failed(run_train([*bad, "run.resume=false", "run.overwrite=true"]), "not_a_vision_key")
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == before
    assert not list(tmp_path.glob("tiny.old-*"))
