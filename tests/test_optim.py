"""The optimizer and the learning rate, as open_clip_train has them: AdamW with its weight-decay
exclusions (checked by parameter name), the lr schedules (warmup, then cosine, const or
const-cooldown) in a formula and in real runs, the logit scale clamped at 100 after each update,
and LiT's locked tower kept out of the optimizer. Expected values are open_clip's formulas written
out here, not ours called back."""

from __future__ import annotations

import math

import pytest
import torch

from clipscale.config import ConfigError, OptimConfig, load_config
from clipscale.metrics import read_metrics
from clipscale.models import build_model
from clipscale.optim import learning_rate

from tests.helpers.tiny_runs import DIGITS_YAML, TINY_MODEL
from tests.helpers.trainer_harness import (checkpointed_run, load, max_difference, step_checkpoints, train_in_process,
                                           training_records)

pytestmark = pytest.mark.timeout(240)


# --- lr schedules (open_clip_train/scheduler.py) -------------------------------------------

BASE, WARMUP, TOTAL = 1e-3, 10, 100


def open_clip_warmup(step):
    return BASE * (step + 1) / WARMUP


@pytest.mark.parametrize("step", [0, 4, 9, 10, 37, 55, 99])
def test_cosine_schedule(step):
    expected = open_clip_warmup(step) if step < WARMUP else \
        0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP))) * BASE
    cfg = OptimConfig(lr=BASE, warmup_steps=WARMUP)
    assert learning_rate(step, cfg, TOTAL) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step", [0, 9, 10, 50, 99])
def test_const_schedule(step):
    expected = open_clip_warmup(step) if step < WARMUP else BASE
    cfg = OptimConfig(lr=BASE, warmup_steps=WARMUP, lr_scheduler="const")
    assert learning_rate(step, cfg, TOTAL) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("power, end", [(1.0, 0.0), (2.0, 1e-5), (0.5, 2e-4)])
@pytest.mark.parametrize("step", [0, 9, 10, 69, 70, 71, 85, 99])
def test_const_cooldown_schedule(step, power, end):
    cooldown = 30
    start = TOTAL - cooldown  # 70: the first step of the cooldown
    if step < WARMUP:
        expected = open_clip_warmup(step)
    elif step < start:
        expected = BASE
    else:
        expected = (1 - (step - start) / cooldown) ** power * (BASE - end) + end
    cfg = OptimConfig(lr=BASE, warmup_steps=WARMUP, lr_scheduler="const-cooldown", lr_cooldown_steps=cooldown,
                      lr_cooldown_power=power, lr_cooldown_end=end)
    assert learning_rate(step, cfg, TOTAL) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr_scheduler=const-cooldown"], "optim.lr_cooldown_steps: required with optim.lr_scheduler=const-cooldown"),
    (["optim.lr_scheduler=const-cooldown", "optim.lr_cooldown_steps=201"], "optim.lr_cooldown_steps: must be in 1..200"),
    (["optim.lr_cooldown_steps=10"], "optim.lr_cooldown_steps: only for optim.lr_scheduler=const-cooldown, not cosine"),
    (["optim.lr_scheduler=linear"], "optim.lr_scheduler: got 'linear', expected one of 'cosine', 'const', 'const-cooldown'"),
    (["optim.lr_scheduler=const-cooldown", "optim.lr_cooldown_steps=10", "optim.lr_cooldown_end=1"],
     "optim.lr_cooldown_end: must be in [0, optim.lr=0.002]"),
])
def test_schedule_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(".", r"\.")):
        load_config(DIGITS_YAML, overrides)


# --- a real run: const-cooldown over a run length in samples --------------------------------


@pytest.mark.slow
def test_run_follows_the_schedule_for_its_samples(knob_run):
    records = [r for r in read_metrics(knob_run / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # 384 samples at 64 a step
    # warmup 5 steps to 2e-3, then the cooldown over the last 3 steps (3, 4, 5, 0-based) down to 1e-4
    expected = [2e-3 * 1 / 5, 2e-3 * 2 / 5, 2e-3 * 3 / 5, 2e-3 * 4 / 5, 2e-3 * 5 / 5,
                (1 - 2 / 3) * (2e-3 - 1e-4) + 1e-4]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-9)


# --- AdamW, warmup + cosine and the logit scale in a run, a checkpoint per step ----------------

LR, RUN_WARMUP, RUN_STEPS = 1e-4, 3, 8
WEIGHT_DECAY = 0.5 / LR  # at the peak learning rate, AdamW's decoupled decay halves a decayed weight per step


def _no_decay_by_name(name: str, tensor: torch.Tensor) -> bool:
    """open_clip_train's exclusions, written out: gains and biases (1-d), norms, the logit scale."""
    return tensor.ndim < 2 or name.endswith("bias") or ".ln_" in f".{name}" or "logit_scale" in name


def _expected_lr(step: int) -> float:
    """The lr of (1-based) step: linear warmup to LR over RUN_WARMUP steps, then half a cosine to 0."""
    if step <= RUN_WARMUP:
        return LR * step / RUN_WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - 1 - RUN_WARMUP) / (RUN_STEPS - RUN_WARMUP))) * LR


@pytest.fixture(scope="module")
def optim_run(digits_root, module_tmp):
    """From a checkpoint whose logit scale is 400 (above the clamp), with a weight decay so strong
    that decayed weights halve at the peak learning rate; a checkpoint per step."""
    root = module_tmp("optim")
    torch.manual_seed(0)
    model = build_model(load_config(DIGITS_YAML, [TINY_MODEL]).model).model
    with torch.no_grad():
        model.logit_scale.fill_(math.log(400))
    torch.save({"state_dict": model.state_dict()}, root / "start.pt")
    _, run_dir = train_in_process(digits_root, root, "optim", f"model.pretrained={root / 'start.pt'}", f"optim.lr={LR}",
                                  f"optim.warmup_steps={RUN_WARMUP}", f"optim.weight_decay={WEIGHT_DECAY}",
                                  f"train.steps={RUN_STEPS}", "train.checkpoint_every=1", "train.log_every=2")
    return {step: load(path) for step, path in step_checkpoints(run_dir).items()}, training_records(run_dir)


def test_lr_warms_up_linearly_then_follows_a_half_cosine(optim_run):
    checkpoints, records = optim_run
    assert sorted(checkpoints) == list(range(1, RUN_STEPS + 1))
    for step, checkpoint in checkpoints.items():  # the lr the optimizer used in that step
        for group in checkpoint["optimizer"]["param_groups"]:
            assert group["lr"] == pytest.approx(_expected_lr(step), rel=1e-9), step
    assert [m["step"] for m in records] == [2, 4, 6, 8]  # 2-step logging windows
    for m in records:
        assert m["lr"] == pytest.approx(_expected_lr(m["step"]), rel=1e-9)


def test_weight_decay_applies_to_weights_not_to_gains_biases_norms_or_logit_scale(optim_run):
    checkpoints, _ = optim_run
    peak = RUN_WARMUP + 1  # lr == LR: a decayed weight halves, besides an Adam move of about LR per element
    before, after = checkpoints[peak - 1]["state_dict"], checkpoints[peak]["state_dict"]
    decayed = {n for n, t in before.items() if t.is_floating_point() and not _no_decay_by_name(n, t)}
    exempt = {n for n, t in before.items() if t.is_floating_point() and _no_decay_by_name(n, t)}
    assert {"logit_scale", "visual.ln_pre.weight", "visual.class_embedding", "text_projection"} <= decayed | exempt
    for name in decayed:
        assert (after[name] - 0.5 * before[name]).abs().max() <= 5 * LR, name
        assert before[name].abs().max() > 50 * LR, name  # large enough for the halving to show
    for name in exempt:
        assert (after[name] - before[name]).abs().max() <= 5 * LR, name
    # The optimizer's groups: weight decay 0 for exactly the exempt parameters' elements.
    optimizer = checkpoints[peak]["optimizer"]
    numel = {wd: sum(optimizer["state"][i]["exp_avg"].numel() for g in optimizer["param_groups"] if g["weight_decay"] == wd
                     for i in g["params"]) for wd in {g["weight_decay"] for g in optimizer["param_groups"]}}
    assert numel == {0.0: sum(before[n].numel() for n in exempt), WEIGHT_DECAY: sum(before[n].numel() for n in decayed)}


def test_the_logit_scale_is_clamped_at_100(optim_run):
    checkpoints, records = optim_run
    for step, checkpoint in checkpoints.items():
        assert float(checkpoint["state_dict"]["logit_scale"]) <= math.log(100) + 1e-6, step
    assert all(m["logit_scale"] <= 100 + 1e-3 for m in records)
    assert records[0]["logit_scale"] == pytest.approx(100, rel=1e-3)  # it started at 400


# --- LiT ---------------------------------------------------------------------------------------


def test_lit_keeps_no_optimizer_state_for_the_locked_tower(digits_root, tmp_path):
    checkpoints = checkpointed_run(digits_root, tmp_path, "lit", "train.steps=3", "model.lock_image=true")
    weights, optimizer = checkpoints[3]["state_dict"], checkpoints[3]["optimizer"]
    in_optimizer = sum(state["exp_avg"].numel() for state in optimizer["state"].values())
    unlocked = sum(t.numel() for name, t in weights.items() if not name.startswith("visual.") and t.is_floating_point()
                   and name != "attn_mask")
    assert in_optimizer == unlocked
    assert sum(len(g["params"]) for g in optimizer["param_groups"]) == len(optimizer["state"])
    visual = {k: v for k, v in weights.items() if k.startswith("visual.")}
    assert max_difference(visual, {k: checkpoints[1]["state_dict"][k] for k in visual}) == 0.0
    assert max_difference(weights, checkpoints[1]["state_dict"]) > 0  # the text tower trained
