"""Contrastive losses behind one interface.

    loss_fn = build_loss("infcl", **options)
    loss = loss_fn(image_features, text_features, logit_scale)

Every loss takes this rank's local, L2-normalised features and the already
exponentiated logit scale, returns the *global* symmetric loss (identical on
every rank) and produces DDP-style gradients: rank r's feature gradient equals
world_size * dL_global/dfeatures_r (docs/losses.md).

Loss modules register themselves with `@register_loss("name", inputs=...)`.
Each registration is a contract known before any work (`loss_contract`): the
model outputs the loss takes, in order (`inputs`), and the options it accepts
with their types (the factory's annotated keyword parameters), so a run
configuration can be checked against it before data, model or process group
exist.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

# What a CLIP model hands its loss (open_clip's dict output, in this order).
CLIP_INPUTS = ("image_features", "text_features", "logit_scale")
# Keyword parameters of a factory that are wiring, not options a configuration sets.
NOT_OPTIONS = ("self", "group")


@dataclass(frozen=True)
class LossContract:
    name: str
    inputs: tuple[str, ...]  # what forward(...) takes, in order
    options: dict[str, Any]  # option name -> accepted type (typing.Any when unannotated)
    any_options: bool  # the factory takes **kwargs: option names cannot be checked


@dataclass(frozen=True)
class _Registered:
    factory: Callable[..., nn.Module]
    inputs: tuple[str, ...]


_REGISTRY: dict[str, _Registered] = {}

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


def register_loss(name: str, *, inputs: tuple[str, ...] = CLIP_INPUTS):
    def decorator(factory):
        _REGISTRY[name] = _Registered(factory, tuple(inputs))
        return factory

    return decorator


def available_losses() -> list[str]:
    """The built-in losses and any registered by user code with @register_loss."""
    return sorted(set(_LOSS_MODULES) | set(_REGISTRY))


def _registered(name: str) -> _Registered:
    if name not in available_losses():
        raise ValueError(f"unknown loss {name!r}; available: {', '.join(available_losses())}")
    if name not in _REGISTRY:
        importlib.import_module(_LOSS_MODULES[name])
    return _REGISTRY[name]


def loss_contract(name: str) -> LossContract:
    registered = _registered(name)
    init = registered.factory.__init__ if inspect.isclass(registered.factory) else registered.factory
    hints = typing.get_type_hints(init)
    parameters = inspect.signature(init).parameters.values()
    options = {
        p.name: hints.get(p.name, Any)
        for p in parameters
        if p.name not in NOT_OPTIONS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    any_options = any(p.kind is p.VAR_KEYWORD for p in parameters)
    return LossContract(name, registered.inputs, options, any_options)


def build_loss(name: str, **options) -> nn.Module:
    return _registered(name).factory(**options)
