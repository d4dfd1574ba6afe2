"""Bad inputs get a ValueError that names the problem, on every rank, never a wrong answer.

Problems local to one rank (one rank's NaN, one rank's smaller batch) must
raise on *all* ranks: a rank that raised alone would leave the others waiting
in the next collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clipscale.losses import available_losses, build_loss
from tests.helpers.gloo_world import run_in_gloo_world

CLIP_LOSSES = ["vanilla", "local", "disco", "infcl", "siglip"]


def unit(*shape, dtype=torch.float32):
    return F.normalize(torch.randn(*shape), dim=-1).to(dtype)


def with_value(features, value):
    return features.index_fill(0, torch.tensor([1]), value)


SCALE = torch.tensor(10.0)
BAD_CLIP_INPUTS = {
    "empty": ((unit(0, 8), unit(0, 8), SCALE), "image_features is empty"),
    "not a matrix": ((unit(2, 3, 8), unit(2, 8), SCALE), r"image_features must have shape \[batch, dim\]"),
    "dims": ((unit(4, 8), unit(4, 16), SCALE), "feature dims differ: image_features has 8, text_features has 16"),
    "dtypes": ((unit(4, 8), unit(4, 8, dtype=torch.bfloat16), SCALE), "dtypes differ"),
    "integers": ((torch.ones(4, 8, dtype=torch.long), unit(4, 8), SCALE), "must be a floating-point tensor"),
    "fewer texts": ((unit(4, 8), unit(3, 8), SCALE), r"text_features has fewer rows \(3\) than"),
    "nan": ((with_value(unit(4, 8), float("nan")), unit(4, 8), SCALE), "image_features contains NaN"),
    "inf scale": ((unit(4, 8), unit(4, 8), torch.tensor(float("inf"))), "the logit scale contains NaN or inf"),
    "negative scale": ((unit(4, 8), unit(4, 8), torch.tensor(-1.0)), "the logit scale must be positive"),
    "vector scale": ((unit(4, 8), unit(4, 8), torch.ones(2)), "the logit scale must be a single number"),
}


@pytest.mark.parametrize("problem", BAD_CLIP_INPUTS)
@pytest.mark.parametrize("loss", CLIP_LOSSES)
def test_clip_losses_reject_bad_inputs(loss, problem):
    inputs, message = BAD_CLIP_INPUTS[problem]
    with pytest.raises(ValueError, match=message):
        build_loss(loss)(*inputs)


@pytest.mark.parametrize(
    "features, temperature, message",
    [
        (unit(5, 8), 0.1, r"features must stack two views \[2b, d\]; got an odd number of rows \(5\)"),
        (unit(4, 8), 0.0, "temperature must be positive"),
        (with_value(unit(4, 8), float("inf")), 0.1, "features contains NaN or infinite"),
    ],
)
def test_ntxent_rejects_bad_inputs(features, temperature, message):
    with pytest.raises(ValueError, match=message):
        build_loss("ntxent", temperature=temperature)(features)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"backend": "cuda"}, "unknown Inf-CL backend 'cuda'; choose one of auto, reference, triton"),
        ({"tile_size": 0}, "tile_size must be a positive integer"),
        ({"backend": "triton", "tile_size": 64}, "tile_size sets the reference backend's tiles"),
    ],
)
def test_infcl_rejects_bad_options_when_built(options, message):
    with pytest.raises(ValueError, match=message):
        build_loss("infcl", **options)


def test_siglip_rejects_a_bad_bias():
    with pytest.raises(ValueError, match="logit_bias must be one finite number"):
        build_loss("siglip")(unit(4, 8), unit(4, 8), SCALE, torch.tensor(float("nan")))


def test_unknown_loss_names_the_available_ones():
    with pytest.raises(ValueError, match=", ".join(available_losses())):
        build_loss("clip")


def _rank_specific_problems(rank: int) -> dict:
    """Inputs that are fine on rank 0 and wrong on rank 1."""
    torch.manual_seed(rank)
    smaller = 3 if rank == 1 else 4
    nan = float("nan") if rank == 1 else 0.0
    return {
        "unequal batch": (unit(smaller, 8), unit(smaller, 8)),
        "nan on one rank": (unit(4, 8) + nan, unit(4, 8)),
    }


def error_worker(rank: int, world: int) -> dict[str, str]:
    messages = {}
    for name in [*CLIP_LOSSES, "ntxent"]:
        for problem, (image, text) in _rank_specific_problems(rank).items():
            try:
                if name == "ntxent":
                    build_loss(name)(torch.cat([image, text]))
                else:
                    build_loss(name)(image, text, SCALE)
                messages[f"{name}: {problem}"] = "no error"
            except ValueError as error:
                messages[f"{name}: {problem}"] = str(error)
    return messages


@pytest.mark.timeout(120)
def test_rank_specific_problems_raise_on_every_rank():
    per_rank = run_in_gloo_world(error_worker, 2, timeout=90)
    assert per_rank[0] == per_rank[1], "ranks must raise the same error"
    for key, message in per_rank[0].items():
        if key.endswith("unequal batch"):
            assert "every rank must pass the same local batch shape" in message, key
            ntxent = key.startswith("ntxent")
            shapes = "(8, 8, 'torch.float32'), (6, 8," if ntxent else "(4, 4, 8, 'torch.float32'), (3, 3, 8,"
            assert shapes in message, key
        else:
            assert message.startswith("rank 1: ") and "contains NaN or infinite values" in message, key


def collective_worker(rank: int, world: int) -> dict[str, list[str]]:
    """The collectives check_clip_inputs issues, per situation, on this rank."""
    import torch.distributed as dist

    from clipscale.losses.common import check_clip_inputs

    calls: list[str] = []
    for name in ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "broadcast",
                 "broadcast_object_list", "gather", "scatter", "reduce_scatter", "barrier"):
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    torch.manual_seed(rank)
    situations = {
        "fine": (unit(4, 8), unit(4, 8)),
        "nan on rank 1": (unit(4, 8) + (float("nan") if rank == 1 else 0.0), unit(4, 8)),
        "empty on rank 1": (unit(0 if rank == 1 else 4, 8), unit(4, 8)),
    }
    seen = {}
    for situation, (image, text) in situations.items():
        calls.clear()
        try:
            check_clip_inputs(image, text, SCALE)
        except ValueError:
            pass
        seen[situation] = list(calls)
    return seen


@pytest.mark.timeout(120)
def test_input_check_is_one_tensor_collective():
    """Fine inputs (and non-finite ones) cost one all_gather of a small tensor, no
    pickled objects; only a failed host-side check fetches its message (a second gather)."""
    per_rank = run_in_gloo_world(collective_worker, 2, timeout=90)
    for seen in per_rank:
        assert seen["fine"] == ["all_gather"]
        assert seen["nan on rank 1"] == ["all_gather"]
        assert seen["empty on rank 1"] == ["all_gather", "all_gather_object"]
