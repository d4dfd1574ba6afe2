"""Evaluations inside a run: the sets of eval.sets evaluated by the training hook and logged under
their <set>_ keys, and the eval script on the run's checkpoint, under torchrun and with
--precision, agreeing with the hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.tiny_runs import REPO
from tests.helpers.trainer_harness import step_checkpoints


@pytest.mark.slow
def test_eval_sets_run_inside_training_and_log_set_metric_keys(digits_run):
    run_dir, _ = digits_run
    for step in (2, 4):
        results = json.loads((run_dir / "eval" / f"step_{step:08d}.json").read_text())
        assert {"wds_acc1", "wds_acc5", "wds_mean_per_class_recall", "zeroshot_acc1"} <= set(results), step
        assert results["wds_acc1"] == results["zeroshot_acc1"]  # the same digits, classes and prompts
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        logged = [m for m in records if m["step"] == step and "wds_acc1" in m]
        assert len(logged) == 1 and logged[0]["wds_acc1"] == results["wds_acc1"], step


def _eval_script_args(run_dir, val, digits_root, precision, output) -> list[str]:
    return ["--checkpoint", str(step_checkpoints(run_dir)[4]), "--task", "wds", "--data", val,
            "--classnames", str(digits_root / "classnames.txt"), "--templates", str(digits_root / "templates.txt"),
            "--device", "cpu", "--workers", "0", "--precision", precision, "--no-progress", "--output", str(output)]


PRECISIONS = {"fp32": (torch.float32, 1e-9), "bf16": (torch.bfloat16, 0.03)}  # dtype, tolerance to the hook's accuracy


@pytest.mark.slow
def test_the_eval_script_under_torchrun_agrees_with_the_training_hook(digits_run, digits_root, tmp_path):
    """Two processes, each evaluating its part, gathered once: in fp32 the same accuracy as the
    in-training evaluation. (The ranks gather counts of correct answers, whatever the towers'
    precision: bf16 is held to the hook in one process, below.)"""
    run_dir, val = digits_run
    hook = json.loads((run_dir / "eval" / "step_00000004.json").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    output = tmp_path / "fp32.json"
    script = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "scripts" / "eval_zeroshot.py"), *_eval_script_args(run_dir, val, digits_root, "fp32", output)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert script.returncode == 0, script.stderr[-3000:]
    metrics = json.loads(output.read_text())["metrics"]
    assert metrics["acc1"] == pytest.approx(hook["zeroshot_acc1"], abs=PRECISIONS["fp32"][1])


def test_the_eval_scripts_precision_is_the_towers_compute_dtype(digits_run, digits_root, tmp_path, monkeypatch):
    """In fp32 the hook's accuracy, with --precision bf16 close to it. On these digits bf16 and fp32
    give the same accuracy, so that passes whether or not --precision is applied; the image tower's
    output dtype shows which precision it ran in."""
    sys.path.insert(0, str(REPO / "scripts"))
    import eval_zeroshot

    dtypes = []
    real_build_model = eval_zeroshot.build_model

    def build_model(cfg):
        towers = real_build_model(cfg)
        towers.model.visual.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
        return towers

    monkeypatch.setattr(eval_zeroshot, "build_model", build_model)
    run_dir, val = digits_run
    hook = json.loads((run_dir / "eval" / "step_00000004.json").read_text())
    for precision, (dtype, tolerance) in PRECISIONS.items():
        dtypes.clear()
        eval_zeroshot.main(_eval_script_args(run_dir, val, digits_root, precision, tmp_path / f"{precision}.json"))
        assert dtypes and set(dtypes) == {dtype}, precision
        metrics = json.loads((tmp_path / f"{precision}.json").read_text())["metrics"]
        assert metrics["acc1"] == pytest.approx(hook["zeroshot_acc1"], abs=tolerance), precision
