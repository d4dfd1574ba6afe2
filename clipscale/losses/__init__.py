"""Contrastive losses behind one interface.

    loss_fn = build_loss("infcl", **options)
    loss = loss_fn(image_features, text_features, logit_scale)

Every loss takes this rank's local, L2-normalised features and the already
exponentiated logit scale, returns the *global* symmetric loss (identical on
every rank) and produces DDP-style gradients: rank r's feature gradient equals
world_size * dL_global/dfeatures_r. See DESIGN.md, "Contracts / Loss".

Loss modules register themselves with `@register_loss("name")`.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch.nn as nn

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}

# Modules imported lazily on first use, so `import clipscale.losses` stays cheap
# and a broken optional loss cannot stop the others from being built.
_LOSS_MODULES = {
    "vanilla": "clipscale.losses.vanilla",
    "local": "clipscale.losses.local",
    "disco": "clipscale.losses.disco",
    "infcl": "clipscale.losses.infcl.loss",
    "ntxent": "clipscale.losses.infcl.loss",
    "siglip": "clipscale.losses.siglip",
}


def register_loss(name: str):
    def decorator(factory):
        _REGISTRY[name] = factory
        return factory

    return decorator


def available_losses() -> list[str]:
    """The built-in losses and any registered by user code with @register_loss."""
    return sorted(set(_LOSS_MODULES) | set(_REGISTRY))


def build_loss(name: str, **options) -> nn.Module:
    if name not in available_losses():
        raise ValueError(f"unknown loss {name!r}; available: {', '.join(available_losses())}")
    if name not in _REGISTRY:
        importlib.import_module(_LOSS_MODULES[name])
    return _REGISTRY[name](**options)
