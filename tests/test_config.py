"""The configuration schema as a user meets it: `python train.py --help` lists it, and it says
which keys a resumed run may change."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from clipscale.config import FREE, REDEAL, RUN_KEY, Config, on_resume

from tiny_runs import REPO, TRAIN


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
