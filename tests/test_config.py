"""The configuration schema as a user meets it: `python train.py --help` lists it, and it says
which keys a resumed run may change; the run plan resolves it once for a world."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from clipscale.checks import plan_run
from clipscale.config import FREE, REDEAL, RUN_KEY, Config, ConfigError, load_config, on_resume
from clipscale.distributed import World

from tiny_runs import DIGITS_YAML, REPO, TRAIN


def test_train_py_help_lists_every_section_and_key_with_its_default():
    shown = subprocess.run([sys.executable, TRAIN, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    for section in dataclasses.fields(Config):
        assert f"\n  {section.name}:" in shown, section.name
        for key in dataclasses.fields(section.default_factory):
            assert f"\n    {key.name}: " in shown, f"{section.name}.{key.name}"
    assert "\n    batch_size: 256  (int)\n" in shown
    assert "\n    workers: 2  (int)  [may change on resume: the data order restarts]\n" in shown


def test_keys_that_only_change_speed_may_change_on_resume_and_the_others_may_not():
    assert [on_resume(key) for key in ("data.workers", "data.decoder", "model.compile", "train.log_every",
                                       "train.checkpoint_every", "eval.workers", "run.name")] == [
        REDEAL, FREE, FREE, FREE, FREE, FREE, RUN_KEY]
    assert [on_resume(key) for key in ("run.seed", "train.steps", "data.shuffle_buffer", "model.custom.embed_dim",
                                       "loss.options.tile_size", "no.such")] == [None] * 6


def test_the_run_plan_resolves_the_configuration_once_for_its_world():
    cfg = load_config(DIGITS_YAML, ["train.batch_size=96", "train.chunk_size=64", "train.precision=bf16",
                                    "model.force_image_size=48", "data.keep_on_device_gib=0.5"])
    plan = plan_run(cfg, World(world_size=3))
    assert (plan.per_rank_batch, plan.chunk, plan.image_size, plan.autocast_dtype, plan.keep_on_device_bytes) == (
        32, 32, 48, torch.bfloat16, 2**29)  # the chunk: at most the per-rank batch
    assert plan_run(load_config(DIGITS_YAML, ["train.chunk_size=auto"]), World()).chunk == "auto"
    with pytest.raises(ConfigError, match="must split evenly over 5 processes"):
        plan_run(cfg, World(world_size=5))


def test_a_hardware_decoder_that_cannot_run_is_refused_before_any_work():
    """data.device_decoder=nvimgcodec is checked up front wherever the device decodes; with the
    loader decoding (data.decoder=auto on a CPU) it asks for nothing."""
    with pytest.raises(ConfigError, match="data.device_decoder=nvimgcodec: no GPU"):
        plan_run(load_config(DIGITS_YAML, ["data.decoder=device", "data.device_decoder=nvimgcodec"]), World())
    plan_run(load_config(DIGITS_YAML, ["data.device_decoder=nvimgcodec"]), World())
