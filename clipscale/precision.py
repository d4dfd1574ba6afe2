"""The one way a forward pass runs under train.precision: step, Gradient Cache, memory probe and evaluation."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Union

import torch

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# None (full precision), an autocast dtype, or a factory of context managers (a test's own).
Autocast = Optional[Union[torch.dtype, Callable[[], ContextManager]]]


def autocast_factory(autocast: Autocast, device: torch.device) -> Callable[[], ContextManager]:
    """A zero-argument factory of the context every forward pass enters; a fresh context each call,
    since one torch.autocast context must not be entered twice at once."""
    if autocast is None:
        return contextlib.nullcontext
    if isinstance(autocast, torch.dtype):
        return lambda: torch.autocast(torch.device(device).type, dtype=autocast)
    return autocast
