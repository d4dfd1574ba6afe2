"""What every contrastive loss shares: where this rank sits, input checks, gathers.

Batch layout (rectangular batches included). Every rank passes `m` images and
`n >= m` texts; text k < m is the partner of image k, texts m..n-1 are extra
negatives. Globally, ranks are concatenated in rank order, so image i of rank r
is global image r*m + i and its partner is global text r*n + i. With m == n this
is the usual square CLIP batch.

Loss (open_clip's symmetric CLIP loss over the global batch, B = world * m):

    x_ij = s * <I_i, T_j>
    L = 1/2 * [ 1/B sum_i (lse_{all texts j} x_ij - x_i,p(i))
              + 1/B sum_{paired j} (lse_{all images i} x_ij - x_q(j),j) ]

Extra texts are negatives in image->text only; text->image runs over the
paired texts, so with m == n both directions are plain cross-entropies.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn

from clipscale.distributed import is_distributed, rank_and_world


@dataclass(frozen=True)
class Layout:
    """This rank's place in the global batch: `images`/`texts` are per-rank counts."""

    rank: int
    world: int
    images: int
    texts: int

    @property
    def global_images(self) -> int:
        return self.world * self.images

    def local_partners(self, device) -> torch.Tensor:
        """Global text index of the partner of each of this rank's images."""
        return self.rank * self.texts + torch.arange(self.images, device=device)

    def global_partners(self, device) -> torch.Tensor:
        """Global text index of the partner of every global image."""
        image = torch.arange(self.global_images, device=device)
        return (image // self.images) * self.texts + image % self.images


def as_scale(logit_scale, like: torch.Tensor) -> torch.Tensor:
    """The exponentiated logit scale as a tensor (a Python number is accepted, without gradient)."""
    if isinstance(logit_scale, torch.Tensor):
        return logit_scale
    # torch.full, not torch.tensor: no host-to-device copy, so no synchronisation on CUDA
    return torch.full((), float(logit_scale), dtype=torch.float32, device=like.device)


class NonFiniteError(ValueError):
    """The features or the scale hold NaN or infinity. A trainer skips such a step
    (the weights stay untouched) instead of stopping; see clipscale.trainer."""


NON_FINITE = "contains NaN or infinite values"


def _host_problem(named: dict[str, torch.Tensor], logit_scale: torch.Tensor) -> str | None:
    """The first thing wrong with this rank's inputs that the host sees without
    reading device memory (types, shapes, dtypes), in words, or None."""
    (first_name, first), *others = named.items()
    for name, features in named.items():
        if not isinstance(features, torch.Tensor) or not features.is_floating_point():
            kind = getattr(features, "dtype", type(features).__name__)
            return f"{name} must be a floating-point tensor, got {kind}"
        if features.dim() != 2:
            return f"{name} must have shape [batch, dim], got {tuple(features.shape)}"
        if features.shape[0] == 0:
            return f"{name} is empty (batch of 0 samples)"
    for name, features in others:
        if features.shape[1] != first.shape[1]:
            return f"feature dims differ: {first_name} has {first.shape[1]}, {name} has {features.shape[1]}"
        if features.dtype != first.dtype:
            return f"dtypes differ: {first_name} is {first.dtype}, {name} is {features.dtype}"
        if features.shape[0] < first.shape[0]:
            return f"{name} has fewer rows ({features.shape[0]}) than {first_name} ({first.shape[0]})"
    if logit_scale.numel() != 1:
        return f"the logit scale must be a single number, got shape {tuple(logit_scale.shape)}"
    return None


# Floating dtypes by a code that is the same in every process (same torch build).
_FLOAT_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point}, key=str)


def _device_values(named: dict[str, torch.Tensor], logit_scale: torch.Tensor, device) -> torch.Tensor:
    """float64 [2 * len(named) + 1] on `device`: (min, max) of every feature tensor, then
    the scale. NaN propagates through min/max, so a tensor is finite iff both are;
    computed on the inputs' device without any host synchronisation."""
    parts = [torch.stack(torch.aminmax(t.detach())).to(device=device, dtype=torch.float64) for t in named.values()]
    parts.append(logit_scale.detach().reshape(1).to(device=device, dtype=torch.float64))
    return torch.cat(parts)


def _value_problem(names: list[str], values: list[float]) -> str | None:
    """What the gathered (min, max, ..., scale) values of one rank say is wrong, or None."""
    for k, name in enumerate(names):
        if not (math.isfinite(values[2 * k]) and math.isfinite(values[2 * k + 1])):
            return f"{name} {NON_FINITE}"
    scale = values[2 * len(names)]
    if not math.isfinite(scale):
        return f"the logit scale {NON_FINITE}"
    if not scale > 0:
        return f"the logit scale must be positive (it is exp(log-scale)), got {scale}"
    return None


def _raise(rank: int, world: int, problem: str):
    error = NonFiniteError if problem.endswith(NON_FINITE) else ValueError
    raise error(f"rank {rank}: {problem}" if world > 1 else problem)


def check_inputs(named: dict[str, torch.Tensor], logit_scale: torch.Tensor, group=None) -> Layout:
    """Validate the inputs of all ranks at once, so every rank raises the same ValueError.

    The host checks types and shapes; finiteness and the scale's sign are
    judged from one small device tensor per rank ((min, max) of every feature
    tensor and the scale; NaN propagates through min/max). One host read of that
    tensor is the only synchronisation on the fast path. With several ranks the
    tensor, extended by the rank's shapes, dtype and host verdict, is
    all_gathered in one collective and judged identically everywhere (a check
    that failed on one rank only would leave the others waiting in the next
    collective); only when some rank's host check failed does a second gather
    fetch its message.
    """
    rank, world = rank_and_world(group)
    names = list(named)
    tensors = list(named.values())
    host_problem = _host_problem(named, logit_scale)
    n_values = 2 * len(names) + 1
    if world == 1:
        if host_problem:
            _raise(0, 1, host_problem)
        problem = _value_problem(names, _device_values(named, logit_scale, tensors[0].device).tolist())
        if problem:
            _raise(0, 1, problem)
        return Layout(0, 1, images=tensors[0].shape[0], texts=tensors[-1].shape[0])

    # [host verdict, *values, *rows, dim, dtype code] per rank, float64 (exact for these integers)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if host_problem:
        shape = [0.0] * (len(tensors) + 2)
        values = torch.zeros(n_values, dtype=torch.float64, device=device)
    else:
        shape = [*(float(t.shape[0]) for t in tensors), float(tensors[0].shape[1]), float(_FLOAT_DTYPES.index(tensors[0].dtype))]
        values = _device_values(named, logit_scale, device)
    host = torch.tensor([float(host_problem is not None)], dtype=torch.float64)
    shape = torch.tensor(shape, dtype=torch.float64)
    mine = torch.cat([host.to(device, non_blocking=True), values, shape.to(device, non_blocking=True)])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    reports = torch.stack(gathered).tolist()  # the one host read
    messages = None
    if any(r[0] for r in reports):  # some rank's host check failed: fetch its words
        messages = [None] * world
        dist.all_gather_object(messages, host_problem, group=group)
    shapes = []
    for r, report in enumerate(reports):
        problem = messages[r] if report[0] else _value_problem(names, report[1:1 + n_values])
        if problem:
            _raise(r, world, problem)
        rows_dim_dtype = report[1 + n_values:]
        shapes.append((*(int(v) for v in rows_dim_dtype[:-1]), str(_FLOAT_DTYPES[int(rows_dim_dtype[-1])])))
    if any(s != shapes[0] for s in shapes):
        fields = f"({', '.join(named)} rows, dim, dtype)"
        raise ValueError(
            f"every rank must pass the same local batch shape and dtype; per rank {fields}: {shapes}"
        )
    return Layout(rank, world, images=tensors[0].shape[0], texts=tensors[-1].shape[0])


def check_clip_inputs(image_features, text_features, logit_scale, group=None) -> tuple[Layout, torch.Tensor]:
    logit_scale = as_scale(logit_scale, image_features)
    named = {"image_features": image_features, "text_features": text_features}
    return check_inputs(named, logit_scale, group), logit_scale


class ClipLoss(nn.Module):
    """Base of the CLIP losses: validates all ranks' inputs, then calls `compute`."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, image_features, text_features, logit_scale):
        layout, logit_scale = check_clip_inputs(image_features, text_features, logit_scale, self.group)
        return self.compute(image_features, text_features, logit_scale, layout)

    def compute(self, image, text, logit_scale, layout: Layout) -> torch.Tensor:
        raise NotImplementedError


def gather_with_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """All ranks' `tensor` concatenated in rank order; backward sums every rank's gradient
    of the gathered tensor and hands each rank its own slice (torch.distributed.nn)."""
    if not is_distributed(group):
        return tensor
    # torch marks this public autograd gather deprecated in favour of a private
    # module (_functional_collectives); keep the public one and its quiet.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_gather", FutureWarning)
        return torch.cat(dist_nn.all_gather(tensor, group=group or dist.group.WORLD))


class _GlobalMean(torch.autograd.Function):
    """Value: the mean of `local_loss` over ranks. Gradient: that of `local_loss` alone."""

    @staticmethod
    def forward(ctx, local_loss, group):
        total = local_loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def report_global_mean(local_loss: torch.Tensor, group=None) -> torch.Tensor:
    """For losses that each rank computes over its own rows (`local`, `disco`).

    The global loss is the mean of the rank-local ones, and that is what every
    rank returns (for logging). The gradient stays that of the local loss: the
    gather's backward already sums every rank's contribution, which gives rank r
    world * dL_global/dfeatures_r, as DDP expects.
    """
    if not is_distributed(group):
        return local_loss
    return _GlobalMean.apply(local_loss, group)


def clip_cross_entropy(logits_per_image, image_labels, logits_per_text, text_labels) -> torch.Tensor:
    """open_clip's symmetric loss: the mean of the two directions' cross-entropies."""
    return (
        torch.nn.functional.cross_entropy(logits_per_image, image_labels)
        + torch.nn.functional.cross_entropy(logits_per_text, text_labels)
    ) / 2
