"""`train.chunk_size: auto`: the largest encoder chunk that fits the GPU, from a probe of the real model.

A Gradient Cache step's peak memory is, whatever the chunk: the weights, their gradients
and AdamW's two moments; the whole batch's features and their gradients; and the loss over
the whole batch while the last chunk's graph is still held (`GradCache.reuse_last_chunk`). So
the probe measures what it cannot compute: the loss's peak on random features of the
real batch size (a collective under several processes: every rank probes), and one
chunk's activations at two small chunk sizes, fitted as a line in the chunk size. The
chunk is then the largest divisor of the batch whose activations fit in what is left
of `HEADROOM` of the device's memory, less what the data path keeps there for pass 2. The line
is a guess beyond its two points (a convolution's workspace, say, grows with the batch), so the
chunk it gives is then measured (`verified_chunk`): where that pass takes more than its room, the
line is drawn again through the measurement and the chunk chosen again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from clipscale.checks import RunPlan
from clipscale.console import Console
from clipscale.distributed import World, all_reduce_max
from clipscale.gradcache import encode
from clipscale.parallel import ParallelModel
from clipscale.precision import autocast_factory

HEADROOM = 0.85  # of the device's memory: fragmentation, the allocator's rounding, cuBLAS/NCCL workspaces
PROBE_CHUNKS = (8, 16)
VERIFY_ROUNDS = 4  # chunk passes at the chosen size at most, each drawing the line again where it did not fit


def _peak_above(baseline: int, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline


def _measure(fn, device: torch.device) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    fn()
    return _peak_above(baseline, device)


def _measure_unless_out_of_memory(fn, device: torch.device) -> int | None:
    try:
        return _measure(fn, device)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def chunk_size(plan: RunPlan, model: ParallelModel, loss_fn, world: World, console: Console) -> int:
    """The plan's chunk, or for "auto" the probe's choice (the smallest over the ranks, said on the console)."""
    if plan.chunk != "auto":
        return plan.chunk
    per_rank, module = plan.per_rank_batch, model.module
    chunk, probe = largest_chunk(module, loss_fn, batch_size=per_rank, precision_dtype=plan.autocast_dtype,
                                 image_size=plan.image_size, context_length=module.context_length,
                                 vocab_size=module.vocab_size, reserved=plan.keep_on_device_bytes)
    chunk = int(min(all_reduce_max(-chunk, world.device) * -1, per_rank))  # the smallest over ranks
    shown = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in probe.items())
    console.say(f"train.chunk_size=auto: {chunk} samples per encoder pass ({shown})")
    return chunk


def largest_chunk(module: torch.nn.Module, loss_fn, *, batch_size: int, precision_dtype, image_size: int,
                  context_length: int, vocab_size: int, reserved: int = 0) -> tuple[int, dict]:
    """(chunk size, the probe's figures in GiB) for this process's `batch_size` on `module`'s
    device. `module` is the unwrapped model (no DDP: its backward hooks would all-reduce).
    `reserved`: bytes the step holds on the device beyond what the probe sees (pass-1 chunks
    kept for pass 2: the data path's `KeepBudget`)."""
    device = next(module.parameters()).device
    if device.type != "cuda":
        return batch_size, {"note": "not a CUDA device: the whole batch is one chunk"}
    autocast = autocast_factory(precision_dtype, device)
    trainable = [p for p in module.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * 4 for p in trainable)  # fp32 master weights
    static = torch.cuda.memory_allocated(device) + 3 * param_bytes  # + gradients + AdamW's two moments
    with torch.random.fork_rng(devices=[device]):
        dim = _feature_dim(module, device, autocast, context_length)
        features = 2 * 2 * batch_size * dim * 4  # both towers' features and their gradients, fp32

        def loss_pass():
            image, text = (torch.nn.functional.normalize(torch.randn(batch_size, dim, device=device), dim=-1)
                           .requires_grad_() for _ in range(2))
            scale = torch.tensor(14.0, device=device, requires_grad=True)
            with autocast():
                loss = loss_fn(image, text, scale)
            loss.backward()

        def chunk_pass(size: int):
            images = torch.randn(size, 3, image_size, image_size, device=device)
            texts = torch.randint(1, vocab_size, (size, context_length), device=device)
            with autocast():
                out = encode(module, images, texts)
            torch.autograd.backward([out.image, out.text], [torch.ones_like(out.image), torch.ones_like(out.text)])

        loss_peak = _measure(loss_pass, device)
        small, large = (_measure(lambda: chunk_pass(size), device) for size in PROBE_CHUNKS)
        capacity = HEADROOM * torch.cuda.get_device_properties(device).total_memory
        probe = Probe(capacity, static, features, loss_peak, (small, large), reserved)
        chosen = verified_chunk(batch_size, probe, lambda size: _measure_unless_out_of_memory(lambda: chunk_pass(size), device))
    module.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return chosen


@dataclass(frozen=True)
class Probe:
    """What the probe measured or computed, in bytes."""

    capacity: float  # HEADROOM of the device's memory
    static: int  # what was allocated before, the weights' gradients and AdamW's moments
    features: int  # the whole batch's features and their gradients
    loss_peak: int  # the loss's forward and backward over the whole batch
    chunk_peaks: tuple[int, int]  # one chunk's forward and backward at `chunk_sizes`
    reserved: int = 0  # held by others during the step: pass-1 chunks kept for pass 2
    chunk_sizes: tuple[int, int] = PROBE_CHUNKS

    def activations(self) -> tuple[float, float]:
        """(bytes per sample, bytes whatever the chunk) of a chunk's pass: the line through the two peaks."""
        (small_size, large_size), (small, large) = self.chunk_sizes, self.chunk_peaks
        per_sample = max(1, (large - small) / (large_size - small_size))
        return per_sample, max(0, small - per_sample * small_size)

    def room_for_a_chunk(self) -> float:
        """What a chunk's pass may take beside the rest, the loss's included."""
        return self.capacity - self.reserved - self.static - self.features - self.loss_peak


def chunk_for(batch_size: int, probe: Probe) -> tuple[int, dict]:
    """The largest divisor of `batch_size` whose chunk's activations fit beside the rest, the
    loss's included (Gradient Cache keeps the last chunk's graph while the loss runs, its
    `reuse_last_chunk`), and the figures in GiB; a RuntimeError saying what takes the memory
    when none fits."""
    per_sample, fixed = probe.activations()
    room = probe.room_for_a_chunk() - fixed
    if room < per_sample:
        raise RuntimeError(
            f"train.chunk_size=auto: no chunk fits: {probe.capacity / 2**30:.1f} GiB usable, the model and optimizer "
            f"take {probe.static / 2**30:.1f}, the batch's features {probe.features / 2**30:.1f}, the loss "
            f"{probe.loss_peak / 2**30:.1f}, chunks kept for pass 2 {probe.reserved / 2**30:.1f}, one sample's "
            f"activations {per_sample / 2**20:.1f} MiB. Lower train.batch_size or data.keep_on_device_gib, or use "
            "model.grad_checkpointing."
        )
    fits = min(batch_size, int(room // per_sample))
    chunk = max(d for d in range(1, fits + 1) if batch_size % d == 0)
    gib = 2**30
    return chunk, {"usable_gib": probe.capacity / gib, "static_gib": probe.static / gib,
                   "features_gib": probe.features / gib, "loss_gib": probe.loss_peak / gib,
                   "kept_gib": probe.reserved / gib, "per_sample_mib": per_sample / 2**20, "fits": fits}


def verified_chunk(batch_size: int, probe: Probe, measure: Callable[[int], int | None]) -> tuple[int, dict]:
    """`chunk_for`'s chunk, its pass measured at that size (`measure`: the peak bytes, None where
    the device ran out of memory). Where it takes more than its room, the line is drawn again
    through the smaller probe point and that measurement (out of memory: as if it took twice its
    room) and the chunk chosen again, at most `VERIFY_ROUNDS` passes; the figures say what the
    chosen chunk's pass took (`chunk_gib`)."""
    for _ in range(VERIFY_ROUNDS):
        chunk, figures = chunk_for(batch_size, probe)
        measured = measure(chunk)
        if measured is not None and measured <= probe.room_for_a_chunk():
            return chunk, {**figures, "chunk_gib": measured / 2**30}
        took = measured if measured is not None else 2 * probe.room_for_a_chunk()
        if chunk <= probe.chunk_sizes[0]:
            break
        probe = replace(probe, chunk_sizes=(probe.chunk_sizes[0], chunk), chunk_peaks=(probe.chunk_peaks[0], took))
    raise RuntimeError(f"train.chunk_size=auto: no chunk measured to fit in {VERIFY_ROUNDS} tries: the last, "
                       f"{chunk} samples, took {'more than the device had' if measured is None else f'{measured / 2**30:.1f} GiB'} "
                       f"of the {probe.room_for_a_chunk() / 2**30:.1f} GiB left beside the model, optimizer, features, "
                       "loss and kept chunks. Set train.chunk_size by hand.")


def _feature_dim(module, device, autocast, context_length: int) -> int:
    with torch.no_grad(), autocast():
        return encode(module, None, torch.ones(1, context_length, dtype=torch.long, device=device)).text.shape[-1]
