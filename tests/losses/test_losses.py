"""Every loss equals the float64 full-matrix reference in real gloo worlds of 1-4 ranks.

Checked per case and world: the returned loss (identical on every rank), every
rank's feature gradients (world * dL/dfeatures_r) and the rank-mean of the
scale gradient (dL/ds), to the tolerances that tests/helpers/loss_cases.py states. One
spawned world runs every case, since spawning processes costs seconds and the cases milliseconds.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.gloo_world import run_in_gloo_world
from tests.helpers.loss_cases import Case, assert_matches_reference, picklable, run_case, worker

CLIP_LOSSES = {
    "vanilla": {},
    "local": {},
    "disco": {},
    # Tiles of 3 rows: 7 local rows span 3 tiles, the last one partial.
    "infcl": {"backend": "reference", "tile_size": 3},
    "siglip": {},  # not the CLIP loss, but the same sharding contract; with a logit bias
}


def _clip_cases() -> list[Case]:
    shapes = [
        (1, 1, 8, torch.float32),  # one sample per rank
        (7, 7, 16, torch.float32),  # odd global batch for odd worlds; not a multiple of the tile
        (4, 4, 1024, torch.float32),  # long features
        (3, 5, 16, torch.float32),  # rectangular: two extra negative texts per rank
        (6, 6, 32, torch.bfloat16),
    ]
    cases = [Case(loss, *shape, options=options) for loss, options in CLIP_LOSSES.items() for shape in shapes]
    return cases + [Case("infcl", 7, 7, 16, options={"backend": "reference"})]  # default 1024 tile


def _ntxent_cases() -> list[Case]:
    options = {"backend": "reference", "tile_size": 3}
    shapes = [(2, 8, torch.float32), (10, 16, torch.float32), (6, 1024, torch.float32), (8, 32, torch.bfloat16)]
    return [Case("ntxent", rows, rows, dim, dtype, options) for rows, dim, dtype in shapes]


CASES = _clip_cases() + _ntxent_cases()


@functools.cache
def world_results(world: int) -> dict[str, list[dict]]:
    per_rank = run_in_gloo_world(worker, world, (CASES,), timeout=150)
    return {case.name: [results[i] for results in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_float64_reference(world, case):
    assert_matches_reference(case, world, world_results(world)[case.name])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64_reference_without_process_group(case):
    assert_matches_reference(case, 1, [picklable(run_case(case, 0, 1))])
