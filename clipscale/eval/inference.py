"""What every evaluation does around the model: eval mode, no grad, autocast, progress.

Evaluation runs in the middle of training, so the model's train/eval mode is
restored afterwards, and a DDP wrapper is looked through (DDP's forward would
try to synchronise buffers and is not what `encode_image` needs).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from clipscale.compile import begin_graph_step
from clipscale.console import on_terminal
from clipscale.distributed import is_distributed, unwrap
from clipscale.precision import Autocast, autocast_factory


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """Yield the unwrapped model in eval mode without autograd; restore its mode afterwards."""
    inner = unwrap(model)
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            yield inner
    finally:
        inner.train(was_training)


def normalised_float(features: torch.Tensor, what: str) -> torch.Tensor:
    """L2-normalise in float32 (bf16 features are re-normalised at full precision).

    Non-finite features would compare False against everything and silently
    rank first, so they are an error here.
    """
    features = features.float()
    if not torch.isfinite(features).all():
        raise ValueError(f"{what} features contain NaN or Inf; the model cannot be evaluated")
    return F.normalize(features, dim=-1)


def encode_images(model, images: torch.Tensor, device, autocast: Autocast) -> torch.Tensor:
    begin_graph_step()  # the previous batch's features were copied out (normalised_float)
    with autocast_factory(autocast, device)():
        features = model.encode_image(images.to(device, non_blocking=True), normalize=True)
    return normalised_float(features, "image")


def encode_texts(model, tokenizer, texts: list[str], device, autocast: Autocast) -> torch.Tensor:
    begin_graph_step()
    with autocast_factory(autocast, device)():
        features = model.encode_text(tokenizer(texts).to(device, non_blocking=True), normalize=True)
    return normalised_float(features, "text")


def progress_bar(iterable: Iterable, enabled: bool, desc: str, total: Optional[int] = None):
    """A tqdm bar on rank 0 only, so a multi-GPU run prints one bar, not one per rank; none where
    stderr is a file (its redraws are noise there, and the results follow in one line)."""
    on_main_rank = not is_distributed() or dist.get_rank() == 0
    if total is None and hasattr(iterable, "__len__"):
        try:
            total = len(iterable)
        except TypeError:  # an IterableDataset's loader may not know its length
            total = None
    return tqdm(iterable, desc=desc, total=total, disable=not (enabled and on_main_rank and on_terminal()), leave=False)


def say_skipped(name: str, skips, total: int) -> None:
    """One line on stderr where this rank skipped samples (`clipscale.eval.datasets.Skips`): how many,
    of how many over all ranks, and the first few with their reasons; the results' num_skipped holds the total."""
    if not skips.count:
        return
    rank = f" (rank {dist.get_rank()})" if is_distributed() else ""
    tqdm.write(f"eval {name}{rank}: {skips.summary()} of {total:,}; its results' num_skipped counts them",
               file=sys.stderr)
