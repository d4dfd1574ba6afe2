"""What one training step promises: non-finite steps skipped, AdamW with open_clip's weight-decay
exclusions (checked by parameter name), warmup + cosine, the logit scale clamped at 100, and
bf16/fp16 autocast with the GradScaler. In-process runs of `clipscale.trainer.train` with the
test losses of trainer_plugins.py; what is checked is read from the run's files."""

from __future__ import annotations

import math

import pytest
import torch

from clipscale.config import load_config
from clipscale.models import build_model
from clipscale.trainer import train

import trainer_plugins  # noqa: F401 - registers scripted_faults
from tiny_runs import DIGITS_YAML, TINY_MODEL, tiny_run
from trainer_harness import load, max_difference, step_checkpoints, training_records


def _train(digits_root, output_dir, name, *extra):
    # Every checkpoint is kept: these tests read the weights of each step.
    overrides = tiny_run(digits_root, output_dir, f"run.name={name}", "eval.zeroshot=false", "data.workers=1",
                         "train.keep_checkpoints=null", *extra)
    return train(load_config(DIGITS_YAML, overrides)), output_dir / name


def _faults(**options) -> str:
    return "loss.name=scripted_faults", "loss.options={" + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}"


# --- non-finite steps ----------------------------------------------------------


@pytest.fixture(scope="module")
def nonfinite_run(digits_root, module_tmp):
    """Step 3: NaN loss, finite gradients. Step 5: finite loss, infinite gradients. A checkpoint per step."""
    _, run_dir = _train(digits_root, module_tmp("nonfinite"), "nonfinite", "train.steps=7",
                        "train.checkpoint_every=1", *_faults(nan_loss_calls=[3], inf_grad_calls=[5]))
    return {step: load(path) for step, path in step_checkpoints(run_dir).items()}, training_records(run_dir)


def _adam_steps(checkpoint) -> set:
    return {float(state["step"]) for state in checkpoint["optimizer"]["state"].values()}


def _check_untouched(checkpoints, step):
    before, after = checkpoints[step - 1], checkpoints[step]
    assert max_difference(before["state_dict"], after["state_dict"]) == 0.0, "the weights moved on a skipped step"
    assert _adam_steps(before) == _adam_steps(after), "the optimizer stepped (its state advanced) on a skipped step"


def test_a_nan_loss_with_finite_gradients_does_not_step_the_optimizer(nonfinite_run):
    checkpoints, records = nonfinite_run
    assert math.isnan(records[2]["loss"]) and math.isfinite(records[2]["grad_norm"])  # the case this test is about
    _check_untouched(checkpoints, 3)


def test_infinite_gradients_with_a_finite_loss_do_not_step_the_optimizer(nonfinite_run):
    checkpoints, records = nonfinite_run
    assert math.isfinite(records[4]["loss"]) and not math.isfinite(records[4]["grad_norm"])
    _check_untouched(checkpoints, 5)


def test_finite_steps_do_step_and_nonfinite_ones_are_counted(nonfinite_run):
    checkpoints, records = nonfinite_run
    for step in (2, 4, 6, 7):
        assert max_difference(checkpoints[step - 1]["state_dict"], checkpoints[step]["state_dict"]) > 0, step
    assert [m["nonfinite_steps"] for m in records] == [0, 0, 1, 1, 2, 2, 2]


def test_the_in_a_row_count_restarts_after_a_finite_step(digits_root, tmp_path):
    """Pairs of bad steps separated by good ones never make max_nonfinite_steps=2 in a row."""
    _train(digits_root, tmp_path, "pairs", "train.steps=9", "train.max_nonfinite_steps=2",
           *_faults(nan_loss_calls=[2, 3, 5, 6, 8, 9]))
    assert training_records(tmp_path / "pairs")[-1]["nonfinite_steps"] == 6
    with pytest.raises(RuntimeError, match="3 steps in a row"):
        _train(digits_root, tmp_path, "three", "train.steps=9", "train.max_nonfinite_steps=2", *_faults(nan_loss_calls=[2, 3, 4]))


# --- optimizer, schedule, logit scale ------------------------------------------

LR, WARMUP, STEPS = 1e-4, 3, 8
WEIGHT_DECAY = 0.5 / LR  # at the peak learning rate, AdamW's decoupled decay halves a decayed weight per step


def _no_decay_by_name(name: str, tensor: torch.Tensor) -> bool:
    """open_clip_train's exclusions, written out: gains and biases (1-d), norms, the logit scale."""
    return tensor.ndim < 2 or name.endswith("bias") or ".ln_" in f".{name}" or "logit_scale" in name


def _expected_lr(step: int) -> float:
    """The lr of (1-based) step: linear warmup to LR over WARMUP steps, then half a cosine to 0."""
    if step <= WARMUP:
        return LR * step / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - 1 - WARMUP) / (STEPS - WARMUP))) * LR


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
    _, run_dir = _train(digits_root, root, "optim", f"model.pretrained={root / 'start.pt'}", f"optim.lr={LR}",
                        f"optim.warmup_steps={WARMUP}", f"optim.weight_decay={WEIGHT_DECAY}", f"train.steps={STEPS}",
                        "train.checkpoint_every=1", "train.log_every=2")
    return {step: load(path) for step, path in step_checkpoints(run_dir).items()}, training_records(run_dir)


def test_lr_warms_up_linearly_then_follows_a_half_cosine(optim_run):
    checkpoints, records = optim_run
    assert sorted(checkpoints) == list(range(1, STEPS + 1))
    for step, checkpoint in checkpoints.items():  # the lr the optimizer used in that step
        for group in checkpoint["optimizer"]["param_groups"]:
            assert group["lr"] == pytest.approx(_expected_lr(step), rel=1e-9), step
    assert [m["step"] for m in records] == [2, 4, 6, 8]  # 2-step logging windows
    for m in records:
        assert m["lr"] == pytest.approx(_expected_lr(m["step"]), rel=1e-9)


def test_weight_decay_applies_to_weights_not_to_gains_biases_norms_or_logit_scale(optim_run):
    checkpoints, _ = optim_run
    peak = WARMUP + 1  # lr == LR: a decayed weight halves, besides an Adam move of about LR per element
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


# --- precision -----------------------------------------------------------------


@pytest.mark.slow
def test_bf16_and_fp16_runs_follow_the_fp32_curve(digits_root, tmp_path):
    curves = {}
    for precision in ("fp32", "bf16", "fp16"):
        _, run_dir = _train(digits_root, tmp_path, precision, f"train.precision={precision}", "train.steps=6")
        curves[precision] = [m["loss"] for m in training_records(run_dir)]
        assert len(curves[precision]) == 6 and curves[precision][-1] < curves[precision][0] - 0.1, precision
    for precision in ("bf16", "fp16"):
        assert curves[precision] == pytest.approx(curves["fp32"], abs=0.05), precision
        assert curves[precision] != curves["fp32"], f"{precision}: no autocast happened"


def test_an_fp16_overflow_skips_the_step_halves_the_scale_and_the_scale_survives_a_resume(digits_root, tmp_path):
    """Step 2's loss is 1e6 times larger: its fp16 gradients overflow under the loss scale. The
    GradScaler skips that step and halves its scale; the run is stopped by SIGUSR1 in step 3 and
    resumed, and the resumed run goes on with the halved scale (no growth in 2000 steps)."""
    faults = _faults(overflow_calls=[2], signal_calls=[3], signal_marker=tmp_path / "signalled")
    stopped, run_dir = _train(digits_root, tmp_path, "fp16", "train.precision=fp16", "train.steps=4", "train.checkpoint_every=1",
                              *faults)
    assert stopped == {"preempted_by": 10}
    checkpoints = {step: load(path) for step, path in step_checkpoints(run_dir).items()}
    assert sorted(checkpoints) == [1, 2, 3]
    assert max_difference(checkpoints[1]["state_dict"], checkpoints[2]["state_dict"]) == 0.0  # the overflow step skipped
    scale = checkpoints[1]["scaler"]["scale"]
    assert checkpoints[2]["scaler"]["scale"] == checkpoints[3]["scaler"]["scale"] == scale / 2
    _train(digits_root, tmp_path, "fp16", "train.precision=fp16", "train.steps=4", "train.checkpoint_every=1", *faults)
    final = load(step_checkpoints(run_dir)[4])  # step 4 ran in the resumed process
    assert final["scaler"]["scale"] == scale / 2
