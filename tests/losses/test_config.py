"""Every loss checked against its contract before any work, and every loss the trainer
accepts trains.

- Every loss name and every option of every loss, given wrongly, stops train.py with a
  config error before the data root is written. The cases come from the losses' own
  contracts (`loss_contract`): an option added to a loss is covered without editing this
  file. train.py runs in one subprocess for all cases (runpy, as `python train.py`
  would; importing open_clip once instead of once per case).
- Each loss the trainer accepts trains two digits steps to a finite loss.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from clipscale.checks import load_checked_config
from clipscale.losses import CLIP_INPUTS, available_losses, loss_contract
from clipscale.metrics import read_metrics
from tests.helpers.tiny_runs import DIGITS_YAML, REPO, TINY_MODEL, tiny_run

BUILT_IN = ("vanilla", "local", "disco", "infcl", "siglip", "ntxent")
BIAS = "model.custom.init_logit_bias=-10"  # open_clip's SigLIP initial bias


def model_overrides(name: str) -> list[str]:
    """A tiny model that fits loss `name`: with a logit bias when the loss takes one."""
    return [TINY_MODEL, *([BIAS] if "logit_bias" in loss_contract(name).inputs else [])]


def wrong_cases() -> list[tuple[list[str], str]]:
    """(overrides, what the error must say) for every way of naming a loss wrongly."""
    cases = [(["loss.name=vanila"], "loss.name: got 'vanila', expected one of")]
    for name in BUILT_IN:
        contract = loss_contract(name)
        if not set(CLIP_INPUTS) <= set(contract.inputs):
            cases.append(([f"loss.name={name}"], "single-view self-contrast, a library function"))
            continue
        takes_bias = "logit_bias" in contract.inputs
        wrong_model = [TINY_MODEL] if takes_bias else [TINY_MODEL, BIAS]
        cases.append(([f"loss.name={name}", *wrong_model],
                      "needs the model's logit bias" if takes_bias else "takes no logit bias"))
        fitting = [f"loss.name={name}", *model_overrides(name)]
        cases.append(([*fitting, "loss.options={bogus: 1}"], f"unknown key loss.options.bogus; allowed keys in loss.options of {name}"))
        for option in contract.options:  # a mapping is the wrong type for every option a loss declares
            cases.append(([*fitting, f"loss.options={{{option}: {{wrong: 1}}}}"], f"loss.options.{option}: got {{'wrong': 1}}, expected"))
    return cases


def test_every_built_in_loss_is_covered():
    assert set(BUILT_IN) <= set(available_losses())
    assert any(loss_contract(name).options for name in BUILT_IN)  # the option cases are not empty


TRAIN_EACH = """
import contextlib, io, json, runpy, sys
outcomes = []
for overrides in json.loads(sys.argv[1]):
    sys.argv = ["train.py", "--config", sys.argv[2], *overrides]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            runpy.run_path(sys.argv[0], run_name="__main__")
        outcomes.append("finished")
    except SystemExit as stop:
        outcomes.append(f"{stop.code}|{printed.getvalue().strip()}")
print(json.dumps(outcomes))
"""


@pytest.mark.slow
def test_a_wrong_loss_stops_train_py_before_the_data_is_written(tmp_path):
    cases = wrong_cases()
    root, runs = tmp_path / "digits", tmp_path / "runs"
    where = [f"data.root={root}", f"run.output_dir={runs}", "train.steps=1"]
    result = subprocess.run(
        [sys.executable, "-c", TRAIN_EACH, json.dumps([[*where, *overrides] for overrides, _ in cases]), DIGITS_YAML],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    for (overrides, expected), outcome in zip(cases, outcomes, strict=True):
        assert outcome.startswith("2|error: ") and expected in outcome, (overrides, outcome)
    assert not root.exists() and not runs.exists()


@pytest.mark.parametrize("name", [name for name in BUILT_IN if set(CLIP_INPUTS) <= set(loss_contract(name).inputs)])
def test_each_accepted_loss_trains_two_steps(name, digits_root, tmp_path):
    from clipscale.trainer import train

    overrides = tiny_run(digits_root, tmp_path, f"loss.name={name}", *model_overrides(name)[1:], "train.steps=2",
                         "data.workers=0", "eval.zeroshot=false")
    train(load_checked_config(DIGITS_YAML, overrides))
    losses = [record["loss"] for record in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "loss" in record]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
