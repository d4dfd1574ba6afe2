"""A step whose features are not finite (here: NaN pixels in one chunk of a Gradient Cache step)
is skipped: the loss refuses them before any backward (NonFiniteError), the weights and the
optimizer's state stay as they were, the step is counted, and the next finite step applies."""

from __future__ import annotations

import copy

import pytest
import torch

from clipscale.losses import build_loss
from clipscale.step import TrainStep

from test_gradcache import make_batch, tiny_clip


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
