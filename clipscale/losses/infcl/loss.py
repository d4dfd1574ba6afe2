"""Inf-CL as autograd Functions: `infcl_loss`, `ntxent_loss` and their registered modules.

Both are one weighted log-sum-exp loss over a global block matrix x = s * I @ T.T
(NT-Xent: I = T = the features, the diagonal masked), written with per-row and
per-column weights so one Function serves both:

    L = sum_i a_i (row_lse_i - x_i,p(i)) + sum_j c_j (col_lse_j - x_q(j),j)

    CLIP  (B global images):  a_i = 1/(2B), c_j = 1/(2B) for paired texts, 0 for
                              extra texts (rectangular batches), p(i) = q^-1 = own text
    NT-Xent (N global rows):  a_i = 1/N, no column term, p(i) = the other view of row i

Forward: the ring (ring.py) brings every rank's text block to every rank; the
tile primitives (reference.py or kernels.py) merge row LSEs locally and column
LSEs into the visiting block. Only the inputs and the float32 LSE vectors are
saved. Backward recomputes each tile:

    dL/dx_ij = a_i softmax_row(x)_ij + c_j softmax_col(x)_ij - (a_i + c_j) [j = p(i)]
    dI_i = s sum_j dL/dx_ij T_j ;  dT_j = s sum_i dL/dx_ij I_i

with the visiting block carrying its text gradient home. The positive term
-(a_i + c_j) [j = p(i)] is folded into the weights of the own block's visit
(before they are rounded for the products), and the scale gradient needs no
pass of its own: dL/ds = sum_ij dL/dx_ij <I_i, T_j>, summed by the same
recompute in float32.

Host synchronisation: one, in the input check (`check_inputs` reads one small
tensor); the scale and the weights stay on the device.

Gradients follow DDP's convention (see clipscale.losses): rank r's share of
the objective is its own rows and paired columns, weighed by world * its
upstream gradient, so rank r receives world * dL/dfeatures_r and the ranks'
scale gradients average to dL/ds.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn as nn

from clipscale.losses import register_loss
from clipscale.losses.common import Layout, as_scale, check_clip_inputs, check_inputs
from clipscale.losses.infcl import reference
from clipscale.losses.infcl.ring import circulate

Backend = Literal["auto", "reference", "triton"]
BACKENDS = get_args(Backend)


def select_backend(backend: str = "auto", device: torch.device | str = "cpu", tile_size: int | None = None):
    """The tile primitives (an object with `lse_pass` and `grad_pass`) for tensors on `device`.

    auto: the Triton kernels for CUDA tensors, and for CPU tensors when
    TRITON_INTERPRET=1 (how CI runs them); the PyTorch reference otherwise, or
    when the kernels cannot be imported. `tile_size` sets the reference's tiles
    (the Triton kernels pick their own).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown Inf-CL backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if tile_size is not None and (not isinstance(tile_size, int) or tile_size < 1):
        raise ValueError(f"tile_size must be a positive integer, got {tile_size!r}")
    device = torch.device(device)
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" or (backend == "auto" and (device.type == "cuda" or interpreted)):
        if backend == "triton" and tile_size is not None:
            raise ValueError("tile_size sets the reference backend's tiles; the Triton kernels choose their own")
        kernels = _import_kernels(required=backend == "triton")
        if kernels is not None:
            return kernels
    if tile_size is None:
        return reference
    return SimpleNamespace(
        lse_pass=functools.partial(reference.lse_pass, tile_size=tile_size),
        grad_pass=functools.partial(reference.grad_pass, tile_size=tile_size),
        positive_logits=reference.positive_logits,
    )


def _import_kernels(required: bool):
    try:
        return importlib.import_module(f"{__package__}.kernels")
    except ModuleNotFoundError as missing:
        if required or missing.name not in (f"{__package__}.kernels", "triton"):
            raise
        warnings.warn(f"Inf-CL Triton kernels unavailable ({missing}); using the PyTorch reference", stacklevel=4)
        return None


@dataclass(frozen=True)
class _Plan:
    """Everything the Function needs besides the tensors (see the module docstring for a, c, p)."""

    layout: Layout
    group: object
    primitives: object
    exact: bool
    self_contrast: bool  # mask the global diagonal (NT-Xent)
    partner: torch.Tensor  # p(i): local text row of each image's positive
    row_weight: torch.Tensor  # a_i
    col_weight: torch.Tensor | None  # c_j, None: no column term
    positive_weight: torch.Tensor  # a_i + c_p(i): the weight of x_i,p(i)


def as_autocast_would(exact: bool, *features: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The features in an enclosing autocast's dtype (bf16, fp16), as autocast hands a matmul its
    inputs: the loss's products then run as every other loss's do under autocast (open_clip's
    `image_features @ text_features.T` among them), on tensor cores with float32 accumulation.
    Under CUDA autocast open_clip's features come out float32 (`F.normalize` divides by a norm
    that autocast computes in float32), and float32 inputs would take IEEE float32 dots, about 20x
    slower: 0.9 s of a ViT-B/32 step at 65,536 and 12 s of one at 262,144 on an H200
    (docs/kernels.md). Outside autocast, or with `exact` (IEEE float32 asked for), the inputs'
    dtype decides."""
    first = features[0]
    if exact or not isinstance(first, torch.Tensor) or not torch.is_autocast_enabled(first.device.type):
        return features  # (what is not a tensor is for the input check to name)
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(f.to(dtype) if isinstance(f, torch.Tensor) and f.dtype == torch.float32 else f for f in features)


def _without_autocast(method):
    """The inputs' dtype sets the precision (bf16 in, float32 accumulation), not an
    enclosing autocast, which would run the reference's float32 tiles in bf16."""

    @functools.wraps(method)
    def run(ctx, first_tensor, *args):
        with torch.autocast(first_tensor.device.type, enabled=False):
            return method(ctx, first_tensor, *args)

    return run


class _TiledContrastiveLoss(torch.autograd.Function):
    @staticmethod
    @_without_autocast
    def forward(ctx, image, text, scale, plan: _Plan):
        row_offset = plan.layout.rank * len(image)
        row_lse = None

        def visit(owner, text_block):
            nonlocal row_lse
            rows, cols = plan.primitives.lse_pass(
                image, text_block, scale, row_offset=row_offset, col_offset=owner * len(text),
                mask_diagonal=plan.self_contrast, need_col=plan.col_weight is not None, exact=plan.exact,
            )
            row_lse = rows if row_lse is None else torch.logaddexp(row_lse, rows)
            return cols

        col_lse = circulate([text], visit, torch.logaddexp, plan.group)
        positive = plan.primitives.positive_logits(image, text, plan.partner)  # <I_i, T_p(i)>
        loss = torch.dot(plan.row_weight, row_lse) - scale * torch.dot(plan.positive_weight, positive)
        if col_lse is not None:
            loss = loss + torch.dot(plan.col_weight, col_lse)
        if plan.layout.world > 1:
            dist.all_reduce(loss, group=plan.group)  # every rank summed its own rows and columns
        ctx.save_for_backward(image, text, scale, row_lse, col_lse)
        ctx.plan = plan
        return loss

    @staticmethod
    @_without_autocast
    def backward(ctx, grad_loss):
        image, text, scale, row_lse, col_lse = ctx.saved_tensors
        plan = ctx.plan
        weigh = grad_loss.float() * plan.layout.world  # DDP's convention, see the module docstring
        row_weight = plan.row_weight * weigh
        col_weight = None if col_lse is None else plan.col_weight * weigh
        positive = (plan.partner, plan.positive_weight * weigh)
        scale_grad = torch.zeros(1, dtype=torch.float32, device=image.device)  # += dL/ds, this rank's share
        options = dict(
            row_offset=plan.layout.rank * len(image), mask_diagonal=plan.self_contrast, exact=plan.exact,
            scale_grad=scale_grad,
        )
        if plan.layout.world == 1:
            grad_image, grad_text = plan.primitives.grad_pass(
                image, text, scale, row_lse, col_lse, row_weight, col_weight, col_offset=0,
                positive=positive, out_dtype=image.dtype, **options,
            )
        else:
            grad_image = torch.zeros(image.shape, dtype=torch.float32, device=image.device)
            # The visiting block brings its owner's global column LSE and weights.
            block = [text] if col_lse is None else [text, torch.stack([col_lse, col_weight])]

            def visit(owner, text_block, col_stats=None):
                col_lse_block, col_weight_block = (None, None) if col_stats is None else col_stats
                _, grad_text_block = plan.primitives.grad_pass(
                    image, text_block, scale, row_lse, col_lse_block, row_weight, col_weight_block,
                    col_offset=owner * len(text), grad_image=grad_image,
                    positive=positive if owner == plan.layout.rank else None,  # partners are local
                    **options,
                )
                return grad_text_block

            grad_text = circulate(block, visit, torch.add, plan.group)
            grad_image, grad_text = grad_image.to(image.dtype), grad_text.to(text.dtype)
        grad_scale = scale_grad.to(scale.dtype).reshape(scale.shape)
        return grad_image, grad_text, grad_scale, None  # scale: this rank's share


def _full(n: int, value: float, device) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=32)
def _clip_weights(layout: Layout, device: torch.device):
    """(partner, row_weight, col_weight, positive_weight) of a CLIP layout; cached, so a
    training loop does not rebuild them every step (read-only everywhere)."""
    half_mean = 1.0 / (2 * layout.global_images)
    extra_texts = layout.texts - layout.images
    col_weight = _full(layout.texts, half_mean, device)
    if extra_texts:
        col_weight[layout.images:] = 0.0
    return (torch.arange(layout.images, device=device), _full(layout.images, half_mean, device), col_weight,
            _full(layout.images, 2 * half_mean, device))


@functools.lru_cache(maxsize=32)
def _ntxent_weights(layout: Layout, device: torch.device):
    """(partner, weight) of an NT-Xent layout; cached like `_clip_weights`."""
    rows = layout.images
    return (torch.arange(rows, device=device) + rows // 2) % rows, _full(rows, 1.0 / layout.global_images, device)


def infcl_loss(
    image_features, text_features, logit_scale, group=None, *, backend="auto", tile_size=None, exact=False
):
    """The global symmetric CLIP loss (open_clip's), never materialising the b x b logits.

    Rectangular batches: texts beyond the number of images are extra negatives
    (image->text only). Under autocast float32 features are taken in its dtype
    (`as_autocast_would`); `exact=True` keeps them and forbids TF32 for float32 inputs.
    """
    image_features, text_features = as_autocast_would(exact, image_features, text_features)
    layout, logit_scale = check_clip_inputs(image_features, text_features, logit_scale, group)
    device = image_features.device
    partner, row_weight, col_weight, positive_weight = _clip_weights(layout, device)
    plan = _Plan(
        layout, group, select_backend(backend, device, tile_size), exact, self_contrast=False,
        partner=partner, row_weight=row_weight, col_weight=col_weight, positive_weight=positive_weight,
    )
    return _TiledContrastiveLoss.apply(image_features, text_features, logit_scale, plan)


def ntxent_loss(features, temperature, group=None, *, backend="auto", tile_size=None, exact=False):
    """SimCLR's NT-Xent: features [2b, d] = [view 1; view 2] of b samples, similarity <f_i, f_j> / t.

    The positive of row k is row (k + b) mod 2b *of the same rank*; every other
    row of every rank is a negative; self-similarity is excluded. With several
    ranks this is the usual SimCLR setup: each rank stacks the two views of its
    own samples, and the global batch is the concatenation of the ranks' blocks.
    `temperature` may be a tensor (then it receives a gradient).
    """
    value = temperature.detach() if isinstance(temperature, torch.Tensor) else temperature
    if not float(value) > 0:  # a host read only for a tensor temperature
        raise ValueError(f"temperature must be positive, got {float(value)}")
    (features,) = as_autocast_would(exact, features)
    scale = 1.0 / as_scale(temperature, features)
    layout = check_inputs({"features": features}, scale, group)
    if layout.images % 2:
        raise ValueError(f"features must stack two views [2b, d]; got an odd number of rows ({layout.images})")
    partner, weight = _ntxent_weights(layout, features.device)
    plan = _Plan(
        layout, group, select_backend(backend, features.device, tile_size), exact, self_contrast=True,
        partner=partner, row_weight=weight, col_weight=None, positive_weight=weight,
    )
    return _TiledContrastiveLoss.apply(features, features, scale, plan)


class _TiledLossModule(nn.Module):
    def __init__(self, backend: Backend = "auto", tile_size: int | None = None, exact: bool = False, group=None):
        super().__init__()
        select_backend(backend, "cpu", tile_size)  # fail at build time on a bad option
        self.options = dict(backend=backend, tile_size=tile_size, exact=exact)
        self.group = group


@register_loss("infcl")
class InfCLLoss(_TiledLossModule):
    def forward(self, image_features, text_features, logit_scale):
        return infcl_loss(image_features, text_features, logit_scale, self.group, **self.options)


@register_loss("ntxent", inputs=("features",))
class NTXentLoss(_TiledLossModule):
    def __init__(self, temperature: float = 0.1, backend: Backend = "auto", tile_size: int | None = None,
                 exact: bool = False, group=None):
        super().__init__(backend, tile_size, exact, group)
        self.temperature = temperature

    def forward(self, features):
        return ntxent_loss(features, self.temperature, self.group, **self.options)
