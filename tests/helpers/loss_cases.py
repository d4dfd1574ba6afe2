"""One loss case (a loss, its options, shapes and dtype) run on one rank, and its check against
the float64 full-matrix reference: the returned loss (identical on every rank), every rank's
feature gradients (world * dL/dfeatures_r) and the rank-mean of the scale gradient (dL/ds).

Tolerances, relative (gradients: max |error| / max |reference| per tensor):
  float32 inputs: 1e-5 for every loss (measured: about 1e-6 and below).
  bfloat16 inputs: infcl/ntxent accumulate in float32, so the loss stays at
  1e-5 and gradients carry little more than their rounding to bf16 (unit
  roundoff 2^-8; tolerance 2^-7); vanilla, local and disco compute the logits
  in bf16 like open_clip (logit errors up to 2^-8 * |logit|), as does siglip:
  6e-2 (measured up to 4.6e-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from clipscale.losses import build_loss
from tests.helpers.reference_math import clip_loss_float64, ntxent_loss_float64, siglip_loss_float64

SCALE = 10.0
BIAS = -2.0
TEMPERATURE = 0.2


@dataclass(frozen=True)
class Case:
    loss: str
    images: int  # per rank; for ntxent the rows [2b] of the single tensor
    texts: int
    dim: int
    dtype: torch.dtype = torch.float32
    options: dict = field(default_factory=dict, hash=False)

    @property
    def name(self) -> str:
        shape = f"{self.images}x{self.texts}" if self.texts != self.images else f"{self.images}"
        tiled = f"-tile{self.options['tile_size']}" if "tile_size" in self.options else ""
        return f"{self.loss}{tiled}-b{shape}-d{self.dim}-{str(self.dtype).removeprefix('torch.')}"


def scalar_inputs(case: Case) -> list[str]:
    """The scalar tensors a loss takes after the features (ntxent's temperature is a float option)."""
    return {"ntxent": [], "siglip": ["scale", "bias"]}.get(case.loss, ["scale"])


def make_inputs(case: Case, world: int) -> list[list[torch.Tensor]]:
    """Per input tensor, per rank: normalised features, the same in every process.

    Partners are noisy copies of their images, so the softmaxes are neither
    flat nor saturated: losses of 0.1-5 nats, as in training. (Near a loss of
    1e-3, float32 cannot resolve lse - x_pos to 1e-5 relative, for any loss.)
    The seed is fixed; its draws give such losses for every case and world.
    """
    generator = torch.Generator().manual_seed(1000 * world + case.dim + case.images + 1)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=generator), dim=1)

    if case.loss == "ntxent":
        views = [unit(case.images // 2, case.dim) for _ in range(world)]
        features = [F.normalize(torch.cat([v, v + 3.0 * unit(*v.shape)]), dim=1) for v in views]
        return [[f.to(case.dtype) for f in features]]
    images = [unit(case.images, case.dim) for _ in range(world)]
    texts = [
        torch.cat([F.normalize(im + 3.0 * unit(*im.shape), dim=1), unit(case.texts - case.images, case.dim)])
        for im in images
    ]
    return [[im.to(case.dtype) for im in images], [t.to(case.dtype) for t in texts]]


def run_case(case: Case, rank: int, world: int) -> dict:
    """This rank's loss value, feature gradients and scale gradient, as float32 tensors."""
    inputs = [per_rank[rank].clone().requires_grad_() for per_rank in make_inputs(case, world)]
    scalars = {"scale": torch.tensor(SCALE, requires_grad=True), "bias": torch.tensor(BIAS, requires_grad=True)}
    options = {"temperature": TEMPERATURE, **case.options} if case.loss == "ntxent" else case.options
    loss = build_loss(case.loss, **options)(*inputs, *(scalars[name] for name in scalar_inputs(case)))
    loss.backward()
    no_grad = torch.tensor(0.0)
    return {
        "loss": loss.detach().float(),
        "grads": [x.grad.float() for x in inputs],
        **{f"{k}_grad": no_grad if v.grad is None else v.grad.float() for k, v in scalars.items()},
    }


def picklable(result: dict) -> dict:
    """Tensors as numpy arrays: torch tensors would travel through shared memory that dies with the worker."""
    return {k: [g.numpy() for g in v] if isinstance(v, list) else v.numpy() for k, v in result.items()}


def worker(rank: int, world: int, cases: list[Case]) -> list[dict]:
    return [picklable(run_case(case, rank, world)) for case in cases]


def reference_for(case: Case, world: int):
    inputs = make_inputs(case, world)
    if case.loss == "ntxent":
        return ntxent_loss_float64(*inputs, TEMPERATURE)
    if case.loss == "siglip":
        return siglip_loss_float64(*inputs, SCALE, BIAS)
    return clip_loss_float64(*inputs, SCALE)


def tolerances(case: Case) -> tuple[float, float]:
    """(loss, gradient) relative tolerances, as the module docstring says."""
    if case.dtype == torch.float32:
        return 1e-5, 1e-5
    if case.loss in ("infcl", "ntxent"):
        return 1e-5, 2**-7
    return 6e-2, 6e-2  # vanilla, local, disco, siglip


def relative_error(value, reference) -> float:
    value, reference = torch.as_tensor(value).double(), torch.as_tensor(reference).double()
    return float((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def assert_matches_reference(case: Case, world: int, per_rank: list[dict], scale_grad_tol: float | None = None):
    reference = reference_for(case, world)
    loss_tol, grad_tol = tolerances(case)
    scale_grad_tol = scale_grad_tol or grad_tol
    losses = [float(r["loss"]) for r in per_rank]
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"
    assert relative_error(losses[0], reference.loss) <= loss_tol
    for rank, result in enumerate(per_rank):
        for got, expected in zip(result["grads"], reference.grads):
            assert relative_error(got, expected[rank]) <= grad_tol, f"rank {rank} feature gradient"
    for name in scalar_inputs(case):
        mean_grad = sum(float(r[f"{name}_grad"]) for r in per_rank) / world
        assert relative_error(mean_grad, getattr(reference, f"{name}_grad")) <= scale_grad_tol, f"{name} gradient"
