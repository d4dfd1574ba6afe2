"""A tiny CLIP, its batches, and the plain step that Gradient Cache's gradients are held to.

"Plain" here means: one graph over the whole batch, one loss, one backward. With dropout on, a
random mask depends on how many samples an encoder call sees, so the plain step calls the encoders
on the same chunks, in the same order, from the same RNG state; then every mask is the same and
the gradients must agree to rounding.
"""

from __future__ import annotations

import contextlib

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F

from clipscale.gradcache import GradCache, encode

CONTEXT, VOCAB = 16, 1000


# name -> (autocast dtype, whether a GradScaler scales the loss)
PRECISIONS = {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, True)}


def tiny_clip(dropout: float = 0.1) -> open_clip.CLIP:
    """A 2-layer ViT + 2-layer text transformer, with patch dropout and MLP dropout in every block."""
    torch.manual_seed(0)
    model = open_clip.CLIP(
        embed_dim=32,
        vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2, head_width=32, patch_dropout=dropout),
        text_cfg=dict(context_length=CONTEXT, vocab_size=VOCAB, width=64, heads=2, layers=2),
    )
    if dropout:
        for block in (*model.visual.transformer.resblocks, *model.transformer.resblocks):
            block.mlp.add_module("dropout", nn.Dropout(dropout))
    return model.train()


def make_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=generator)
    texts = torch.randint(1, VOCAB, (n, CONTEXT), generator=generator)
    return images, texts


def float64_clip_loss(image, text, logit_scale):
    """The full-matrix symmetric CLIP loss in float64, single process: the gold reference."""
    logits = logit_scale.double() * image.double() @ text.double().T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def scaler_for(precision: str) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10) if PRECISIONS[precision][1] else None


def autocast_for(precision: str):
    dtype = PRECISIONS[precision][0]
    return (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext


def plain_step(model, loss_fn, images, texts, chunk_size, precision="fp32"):
    """One graph over the whole batch; encoders called per chunk (see the module docstring)."""
    # One autocast region per chunk, as in GradCache: inside one region autocast caches each
    # weight's low-precision copy, and the chunks' weight gradients would then be summed in
    # bf16/fp16 before the cast back -- a rounding difference of the order of bf16's epsilon.
    scaler, autocast = scaler_for(precision), autocast_for(precision)
    outs = []
    for s in range(0, len(images), chunk_size):
        with autocast():
            outs.append(encode(model, images[s : s + chunk_size], texts[s : s + chunk_size]))
    with autocast():
        loss = loss_fn(torch.cat([o.image for o in outs]), torch.cat([o.text for o in outs]), outs[0].scalars[0])
    (scaler.scale(loss) if scaler else loss).backward()
    return loss.detach()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)  # same names with or without DDP
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Worst over parameters of max|got - want| / max|want|; every parameter must have a gradient."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want)


def gradcache_grads(model, loss_fn, images, texts, chunk_size, precision="fp32", seed=1, **options):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    step = GradCache(model, loss_fn, chunk_size, autocast=PRECISIONS[precision][0], scaler=scaler_for(precision), **options)
    loss = step(images, texts)
    return loss, grads_of(model)


def plain_grads(model, loss_fn, images, texts, chunk_size, precision="fp32", seed=1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = plain_step(model, loss_fn, images, texts, chunk_size, precision)
    return loss, grads_of(model)
