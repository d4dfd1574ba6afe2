"""README promises about what a run produces and how its parts are used: evaluation sets inside a
run, open_clip's class names and templates for the built-in tasks, the eval script under torchrun and
its --precision, intermediate checkpoints in open_clip, LiT's locked tower without optimizer state,
SigLIP's logit_bias through Gradient Cache and the trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import open_clip
import pytest
import torch
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

from clipscale.config import load_config
from clipscale.eval.tasks import BUILTIN_TASKS, class_names, prompt_templates, resolve_task
from clipscale.trainer import train

from tiny_runs import DIGITS_YAML, REPO, TINY_MODEL, run_train, tiny_run
from trainer_harness import load, max_difference, step_checkpoints, training_records


@pytest.fixture(scope="module")
def digits_run(digits_root, module_tmp):
    """4 steps, evaluated at step 2 and at the end, with the held-out digits also listed under
    eval.sets (the same data, class names and prompts as the built-in zero-shot hook)."""
    output = module_tmp("promises")
    manifest = json.loads((digits_root / "manifest.json").read_text())
    val = str(digits_root / f"val-{{0000..{len(manifest['val_shards']) - 1:04d}}}.tar")
    digits_set = (f"eval.sets=[{{task: wds, data: '{val}', classnames: {digits_root / 'classnames.txt'}, "
                  f"templates: {digits_root / 'templates.txt'}}}]")
    result = run_train(tiny_run(digits_root, output, "train.steps=4", "train.checkpoint_every=2", "eval.every_n_steps=2",
                                "train.log_every=2", digits_set))
    assert result.returncode == 0, result.stderr[-3000:]
    return output / "tiny", val


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


def _eval_script_args(run_dir, val, digits_root, precision, output) -> list[str]:
    return ["--checkpoint", str(step_checkpoints(run_dir)[4]), "--task", "wds", "--data", val,
            "--classnames", str(digits_root / "classnames.txt"), "--templates", str(digits_root / "templates.txt"),
            "--device", "cpu", "--workers", "0", "--precision", precision, "--no-progress", "--output", str(output)]


@pytest.mark.slow
def test_the_eval_script_under_torchrun_agrees_with_the_training_hook(digits_run, digits_root, tmp_path):
    """Two processes, each evaluating its part, gathered once: in fp32 the same accuracy as the
    in-training evaluation; with --precision bf16 close to it."""
    run_dir, val = digits_run
    hook = json.loads((run_dir / "eval" / "step_00000004.json").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for precision, tolerance in (("fp32", 1e-9), ("bf16", 0.03)):
        output = tmp_path / f"{precision}.json"
        script = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(REPO / "scripts" / "eval_zeroshot.py"), *_eval_script_args(run_dir, val, digits_root, precision, output)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
        )
        assert script.returncode == 0, script.stderr[-3000:]
        metrics = json.loads(output.read_text())["metrics"]
        assert metrics["acc1"] == pytest.approx(hook["zeroshot_acc1"], abs=tolerance), precision


def test_the_eval_scripts_precision_is_the_towers_compute_dtype(digits_run, digits_root, tmp_path, monkeypatch):
    """On these digits bf16 and fp32 give the same accuracy, so the test above passes whether or not
    --precision is applied; the image tower's output dtype shows which precision it ran in."""
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
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        dtypes.clear()
        eval_zeroshot.main(_eval_script_args(run_dir, val, digits_root, precision, tmp_path / f"{precision}.json"))
        assert dtypes and set(dtypes) == {dtype}, precision


def test_an_intermediate_checkpoint_loads_in_open_clip(digits_run):
    """step_2's weights, not the final ones: the loaded model must equal the checkpoint and differ from the run's end."""
    run_dir, _ = digits_run
    model = open_clip.create_model(f"local-dir:{run_dir}")  # the run folder: the final weights
    final = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint = load(step_checkpoints(run_dir)[2])
    open_clip.load_checkpoint(model, str(step_checkpoints(run_dir)[2]))
    loaded = model.state_dict()
    assert max_difference({k: loaded[k] for k in checkpoint["state_dict"]}, checkpoint["state_dict"]) == 0.0
    assert max_difference({k: final[k] for k in checkpoint["state_dict"]}, checkpoint["state_dict"]) > 1e-4


def _in_process(digits_root, output, name, *extra):
    overrides = tiny_run(digits_root, output, f"run.name={name}", "eval.zeroshot=false", "data.workers=1", "train.checkpoint_every=1",
                         "train.keep_checkpoints=null", *extra)
    train(load_config(DIGITS_YAML, overrides))
    return {step: load(path) for step, path in step_checkpoints(output / name).items()}


def test_lit_keeps_no_optimizer_state_for_the_locked_tower(digits_root, tmp_path):
    checkpoints = _in_process(digits_root, tmp_path, "lit", "train.steps=3", "model.lock_image=true")
    weights, optimizer = checkpoints[3]["state_dict"], checkpoints[3]["optimizer"]
    in_optimizer = sum(state["exp_avg"].numel() for state in optimizer["state"].values())
    unlocked = sum(t.numel() for name, t in weights.items() if not name.startswith("visual.") and t.is_floating_point()
                   and name != "attn_mask")
    assert in_optimizer == unlocked
    assert sum(len(g["params"]) for g in optimizer["param_groups"]) == len(optimizer["state"])
    visual = {k: v for k, v in weights.items() if k.startswith("visual.")}
    assert max_difference(visual, {k: checkpoints[1]["state_dict"][k] for k in visual}) == 0.0
    assert max_difference(weights, checkpoints[1]["state_dict"]) > 0  # the text tower trained


SIGLIP_MODEL = TINY_MODEL[:-1] + ", init_logit_bias: -10}"


def test_siglip_trains_its_logit_bias_through_gradient_cache_as_in_one_pass(digits_root, tmp_path):
    """Gradient Cache in chunks of 16 (4 per step) against a plain step: the same curve and the
    same logit_bias, which moves from its initial -10."""
    runs = {name: _in_process(digits_root, tmp_path, name, SIGLIP_MODEL, "loss.name=siglip", "train.steps=4", *extra)
            for name, extra in {"plain": [], "chunked": ["train.chunk_size=16"]}.items()}
    curves = {name: [m["loss"] for m in training_records(tmp_path / name)] for name in runs}
    assert curves["chunked"] == pytest.approx(curves["plain"], rel=1e-5)
    bias = {name: float(checkpoints[4]["state_dict"]["logit_bias"]) for name, checkpoints in runs.items()}
    assert bias["chunked"] == pytest.approx(bias["plain"], abs=1e-5)
    assert abs(bias["plain"] + 10) > 1e-4  # Adam moved it by about the learning rate per step
    assert max_difference(runs["chunked"][4]["state_dict"], runs["plain"][4]["state_dict"]) < 1e-5
