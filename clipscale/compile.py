"""Compiled towers (`model.compile`): on by default on a GPU, compiled once per run folder.

torch.compile turns each tower's forward (and, through AOTAutograd, its backward) into fused
Triton kernels: on an H100 a ViT-B/16 Gradient Cache step runs about 1.5x faster. Gradient
Cache calls each tower alone, so a tower has two graphs, compiled once: without autograd (pass
1) and with it (pass 1's last chunk, pass 2). Shapes are static (`dynamic=False`): the full
chunk and a short last chunk are two graphs each, compiled in the first step and reused by every
later one, instead of one slower dynamic graph.

The compiled code is cached under the run folder (or `model.compile_cache`): a resumed or
requeued run, or a second run pointed at the same cache, reuses it and its first step costs
tracing only (Inductor's FX graph and AOTAutograd caches and the Triton kernels they built).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Graphs of the model's forward: {image, text} x {no grad, grad} x {full chunk, last chunk}, and
# evaluation's batch sizes in eval mode. Past the limit dynamo runs the model eagerly.
RECOMPILE_LIMIT = 64
COMPILE_TIMERS = ("_compile.compile_inner",)  # torch._dynamo's timers of a graph's compilation


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """model.compile as it applies on `device`: "auto" compiles on a GPU only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def compile_towers(model: torch.nn.Module, cache_dir: Path, backend: str = "inductor") -> None:
    """Compile `model`'s forward in place (its state_dict keys stay open_clip's), caching under
    `cache_dir`. `backend`: torch.compile's (the tests use "aot_eager", which needs no compiler)."""
    # Inductor's FX graph, AOTAutograd and Triton caches (the trainer calls this once the run folder is claimed).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir.resolve())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    model.compile(backend=backend, dynamic=False)


def seconds_compiling() -> float:
    """Seconds this process has spent compiling graphs so far (torch._dynamo's own timers)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(name, ())) for name in COMPILE_TIMERS)
