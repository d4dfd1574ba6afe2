"""The metrics record's window (clipscale/metrics.py, RecordWindow): each record counts the steps
since the previous one only, and `mfu` is one GPU's share of the world's rate.

Two bugs these catch: a window that stops clearing its text chunks after a record, which turns
`text_positions_per_sample` and `mfu` into running averages over the whole run; and `mfu` not
divided by the world size (each rank's GPU computes its share of the global batch's FLOPs)."""

from __future__ import annotations

import pytest
import torch

from clipscale.metrics import RecordWindow
from clipscale.step import StepResult

FLOPS = {16: 1_000, 32: 3_000}  # model FLOPs of a sample by the text positions it computes
PEAK = 1e6  # a peak rate given by hand: a CPU has none


def step(chunks: list[tuple[int, int]]) -> StepResult:
    return StepResult(torch.tensor(2.0), torch.tensor(1.0), True, torch.tensor(50.0), chunks)


def record(window: RecordWindow, chunks: list[tuple[int, int]]) -> dict:
    window.step_done(0.0, chunks)
    return window.record(step(chunks), 1e-3, logit_scale=50.0, nonfinite_steps=0, data_errors=[0, 0, 0, 0])


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_record_counts_its_own_steps_text_and_one_gpus_share_of_the_flops(world_size):
    window = RecordWindow(batch_size=8, device=torch.device("cpu"), world_size=world_size, flops_per_sample=FLOPS)
    window.peak_flops = PEAK
    window.open([0, 0, 0, 0])
    first = record(window, [(4, 16), (4, 16)])
    second = record(window, [(4, 32), (4, 32)])  # another length: a window still holding the first's chunks averages them
    assert first["text_positions_per_sample"] == 16 and second["text_positions_per_sample"] == 32
    for got, flops in ((first, FLOPS[16]), (second, FLOPS[32])):
        assert got["mfu"] == pytest.approx(flops * got["samples_per_s"] / world_size / PEAK, rel=1e-9)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_samples_per_s_is_the_global_batchs_rate_whatever_the_world_size(world_size):
    """train.batch_size is the global batch: a record's rate is its steps' global samples over their
    time, on every rank (not one rank's share of the batch)."""
    window = RecordWindow(batch_size=8, device=torch.device("cpu"), world_size=world_size, flops_per_sample=FLOPS)
    window.open([0, 0, 0, 0])
    window.step_done(0.0, [(8 // world_size, 16)])
    got = record(window, [(8 // world_size, 16)])  # two steps of 8 samples
    assert got["samples_per_s"] * got["step_s"] == pytest.approx(8, rel=1e-9)
