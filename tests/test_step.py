"""What one training step promises (clipscale/step.py): a step whose features, loss or gradients
are not finite is skipped (weights and optimizer state untouched) and counted, and a run of them
stops the run; bf16/fp16 autocast with the GradScaler. On the step object itself, and through
in-process runs of `clipscale.trainer.train` with test losses (tests/helpers/trainer_plugins.py),
whose files are read."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from clipscale.config import load_config
from clipscale.losses import build_loss, register_loss
from clipscale.metrics import read_metrics
from clipscale.step import TrainStep

import tests.helpers.trainer_plugins  # noqa: F401 - registers scripted_faults
from tests.helpers.gradients import make_batch, tiny_clip
from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run
from tests.helpers.trainer_harness import load, max_difference, step_checkpoints, train_in_process, training_records


def _faults(**options) -> str:
    return "loss.name=scripted_faults", "loss.options={" + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}"


# --- non-finite steps ----------------------------------------------------------


@pytest.fixture(scope="module")
def nonfinite_run(digits_root, module_tmp):
    """Step 3: NaN loss, finite gradients. Step 5: finite loss, infinite gradients. A checkpoint per step."""
    _, run_dir = train_in_process(digits_root, module_tmp("nonfinite"), "nonfinite", "train.steps=7",
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
    train_in_process(digits_root, tmp_path, "pairs", "train.steps=9", "train.max_nonfinite_steps=2",
                     *_faults(nan_loss_calls=[2, 3, 5, 6, 8, 9]))
    assert training_records(tmp_path / "pairs")[-1]["nonfinite_steps"] == 6
    with pytest.raises(RuntimeError, match="3 steps in a row"):
        train_in_process(digits_root, tmp_path, "three", "train.steps=9", "train.max_nonfinite_steps=2",
                         *_faults(nan_loss_calls=[2, 3, 4]))


# --- a step whose features are not finite -------------------------------------------


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict())


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], dict):
            assert_same_state(got[key], want[key])
        elif isinstance(want[key], torch.Tensor):
            assert torch.equal(got[key], want[key]), key
        else:
            assert got[key] == want[key], key


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("loss_name", ["vanilla", "infcl"])
def test_a_step_with_nonfinite_features_leaves_weights_and_optimizer_untouched(loss_name, precision):
    model = tiny_clip()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = TrainStep(model, build_loss(loss_name), optimizer, chunk_size=4, precision=precision)
    images, texts = make_batch(10, seed=0)  # three chunks: 4, 4, 2
    # The optimizer gets moments and a step count to keep. In fp16 the GradScaler's first scales
    # overflow (skipped steps, each lowering the scale) before one applies.
    while not step(images, texts).applied:
        assert step.steps < 20
    skipped, steps = step.nonfinite_total, step.steps

    weights, state = copy.deepcopy(model.state_dict()), optimizer_state(optimizer)
    scaler = copy.deepcopy(step.scaler.state_dict()) if step.scaler is not None else None
    poisoned = images.clone()
    poisoned[5] = float("nan")  # one sample of the second chunk
    result = step(poisoned, texts)
    assert not result.applied and torch.isnan(result.loss)
    assert (step.nonfinite_total, step.nonfinite_in_a_row, step.steps) == (skipped + 1, 1, steps + 1)
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())
    assert_same_state(optimizer_state(optimizer), state)
    assert all(p.grad is None for p in model.parameters())
    if scaler is not None:  # no gradient was computed, so nothing overflowed: the loss scale stays
        assert step.scaler.state_dict() == scaler

    result = step(*make_batch(10, seed=1))
    assert result.applied and torch.isfinite(result.loss)
    assert (step.nonfinite_total, step.nonfinite_in_a_row, step.steps) == (skipped + 1, 0, steps + 2)
    assert not all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())
    assert all(s["step"] == 2 for s in optimizer.state_dict()["state"].values())


# --- a loss that turns features into NaN, through the trainer ----------------------------------

NAN_LOSSES: list = []  # every NanOnCalls the trainer built, to read what it saw


@register_loss("nan_on_calls")
class NanOnCalls(torch.nn.Module):
    """vanilla, except that the listed calls get NaN features; records the scale it saw."""

    def __init__(self, calls=()):
        super().__init__()
        self.calls, self.count, self.scales = set(calls), 0, []
        self.inner = build_loss("vanilla")
        NAN_LOSSES.append(self)

    def forward(self, image, text, logit_scale):
        self.count += 1
        self.scales.append(float(logit_scale.detach()))
        if self.count in self.calls:
            image = image * math.nan
        return self.inner(image, text, logit_scale)


def _train_in_process(digits_root, tmp_path, *extra):
    from clipscale.trainer import train

    overrides = tiny_run(digits_root, tmp_path, "data.workers=0", "eval.zeroshot=false", "loss.name=nan_on_calls", *extra)
    return train(load_config(DIGITS_YAML, overrides))


def test_nonfinite_steps_are_skipped_without_touching_weights(digits_root, tmp_path):
    _train_in_process(digits_root, tmp_path, "loss.options={calls: [3, 4]}", "train.steps=6")
    scales = NAN_LOSSES[-1].scales
    assert scales[2] == scales[3] == scales[4], scales  # steps 3 and 4 skipped: the weights did not move
    assert scales[1] != scales[2] and scales[4] != scales[5]  # the others stepped
    metrics = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    assert [m["nonfinite_steps"] for m in metrics] == [0, 0, 1, 2, 2, 2]
    assert metrics[2]["loss"] is None and "loss" in metrics[2]["nonfinite"]  # strict JSON: null and a flag
    assert math.isfinite(metrics[5]["loss"])


def test_a_run_that_keeps_failing_stops_with_a_clear_message(digits_root, tmp_path):
    with pytest.raises(RuntimeError, match="3 steps in a row had a non-finite loss"):
        _train_in_process(digits_root, tmp_path, f"loss.options={{calls: {list(range(1, 7))}}}", "train.steps=6",
                          "train.max_nonfinite_steps=2")


# --- precision -----------------------------------------------------------------


@pytest.mark.slow
def test_bf16_and_fp16_runs_follow_the_fp32_curve(digits_root, tmp_path):
    curves = {}
    for precision in ("fp32", "bf16", "fp16"):
        _, run_dir = train_in_process(digits_root, tmp_path, precision, f"train.precision={precision}", "train.steps=6")
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
    stopped, run_dir = train_in_process(digits_root, tmp_path, "fp16", "train.precision=fp16", "train.steps=4",
                                        "train.checkpoint_every=1", *faults)
    assert stopped == {"preempted_by": 10}
    checkpoints = {step: load(path) for step, path in step_checkpoints(run_dir).items()}
    assert sorted(checkpoints) == [1, 2, 3]
    assert max_difference(checkpoints[1]["state_dict"], checkpoints[2]["state_dict"]) == 0.0  # the overflow step skipped
    scale = checkpoints[1]["scaler"]["scale"]
    assert checkpoints[2]["scaler"]["scale"] == checkpoints[3]["scaler"]["scale"] == scale / 2
    train_in_process(digits_root, tmp_path, "fp16", "train.precision=fp16", "train.steps=4", "train.checkpoint_every=1",
                     *faults)
    final = load(step_checkpoints(run_dir)[4])  # step 4 ran in the resumed process
    assert final["scaler"]["scale"] == scale / 2
