"""Full training steps at a chosen batch, for the memory and speed tables (Tables 1, 2, 4, S1).

One step = GradCache forward/backward at `chunk` samples per encoder pass, the contrastive
loss over the global batch, and a fused AdamW update, under bf16 autocast (the paper's
setting: AMP, AdamW, Gradient Cache at its accumulation size). Data is synthetic: random
pixels and tokens, either on the GPU ("offload off") or as pinned uint8 on the host,
streamed a chunk at a time ("offload on"). Under torchrun every rank runs its share of
the global batch and the losses run across ranks (the Inf-CL ring, DisCo, ...).

An out-of-memory error is a result, not a failure: the probe frees what it allocated and
reports it, agreed over ranks, so a search can go on with a smaller batch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # scripts/bench_*.py
from bench_step import SMOKE_MODEL
from bench_train import build_model, host_images

from clipscale.data.chunks import ChunkSource
from clipscale.distributed import World, init_distributed
from clipscale.distributed import unwrap
from clipscale.gradcache import trainable_towers
from clipscale.losses import build_loss
from clipscale.models import register_custom
from clipscale.step import TrainStep

GIB = 2**30
# Offloaded batches are pinned uint8 on the host; past this share of the machine's memory the
# process would be killed rather than raise, so such a batch counts as not fitting.
HOST_MEMORY_FRACTION = 0.6


def smoke_model_name() -> str:
    """bench_step's tiny model (32 px, 2 layers): a step takes milliseconds on a CPU."""
    return register_custom(SMOKE_MODEL)


def start(device: str = "auto") -> World:
    """torchrun's ranks (NCCL on GPUs, gloo on CPU), or a single process."""
    return init_distributed(device)


@dataclass
class Workload:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    image_size: int
    context_length: int
    vocab_size: int
    feature_dim: int


def load_workload(model_name: str, world: World, lock_image: bool = False) -> Workload:
    model, optimizer = build_model(model_name, world.device)
    if lock_image:  # LiT: the image tower runs forward only; rebuild the optimizer without it
        model.lock_image_tower()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                      weight_decay=0.2, fused=world.device.type == "cuda")
    if world.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[world.device] if world.device.type == "cuda" else None)
    module = unwrap(model)
    image_size = module.visual.image_size
    return Workload(model, optimizer, image_size[0] if isinstance(image_size, tuple) else image_size,
                    module.context_length, module.vocab_size, module.visual.output_dim)


class HostMemoryError(RuntimeError):
    """The host could not pin the offloaded batch."""


def synthetic_batch(work: Workload, local_batch: int, device: torch.device, offload: bool):
    """Random images and tokens: pinned uint8 on the host (offload), or float images on the device."""
    mean = torch.tensor(OPENAI_DATASET_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(OPENAI_DATASET_STD, device=device).view(1, 3, 1, 1) * 255
    normalise = lambda pixels: (pixels.float() - mean) / std
    shape = (local_batch, 3, work.image_size, work.image_size)
    tokens = torch.randint(1, work.vocab_size, (local_batch, work.context_length), dtype=torch.int32)
    if offload:
        try:
            images = host_images(local_batch, work.image_size, pin=device.type == "cuda")
        except RuntimeError as error:  # a CUDA error, not torch.OutOfMemoryError: cudaHostAlloc failed
            if "out of memory" not in str(error):
                raise
            raise HostMemoryError(f"pinning the offloaded batch failed ({error})") from error
        return ChunkSource.of_tensor(images, normalise), ChunkSource.of_tensor(tokens)
    return normalise(torch.randint(0, 256, shape, dtype=torch.uint8, device=device)), tokens.to(device)


class SampledEncoders:
    """A memory probe: the model's forward runs for real on a few chunks of each Gradient Cache
    pass and returns stand-in features on the others.

    A step's peak memory is what is alive at its fullest moment: the batch (on the device, or
    pinned on the host), the model and AdamW state, the full-batch features and their
    gradients, the loss over the whole global batch, and one chunk's activations. None of it
    depends on how many chunks the encoders actually run, because the chunks run one after
    the other. So the probe runs, per step, the first chunk of pass 1 (no graph), and the first
    and the final chunk of pass 2 (the final one is DDP's synchronised backward) for real, and
    everything else at full size; a step at a million samples then takes seconds, not an
    hour. `max_batch.py --probe memory` checks it against a full step at its first batch.
    """

    REAL_NO_GRAD_CALLS = 2  # pass 1's first chunk: an image-only and a text-only call

    def __init__(self, model: torch.nn.Module, chunk: int, chunks: int, feature_dim: int, dtype: torch.dtype):
        self.model, self.chunks = model, chunks
        device = model.logit_scale.device
        generator = torch.Generator(device="cpu").manual_seed(0)
        stand_in = torch.nn.functional.normalize(torch.randn(chunk, feature_dim, generator=generator), dim=-1)
        self.stand_in = stand_in.to(device=device, dtype=dtype)
        self.real_forward = model.forward
        self.calls = {True: 0, False: 0}  # grad-enabled, no-grad calls so far in this step
        self.calls_per_chunk = sum(trainable_towers(model))  # pass 2 calls each trained tower alone

    def forward(self, image=None, text=None):
        grad = torch.is_grad_enabled()
        call = self.calls[grad]
        self.calls[grad] += 1
        real = call // self.calls_per_chunk in (0, self.chunks - 1) if grad else call < self.REAL_NO_GRAD_CALLS
        if real:
            return self.real_forward(image, text)
        scale = self.model.logit_scale
        # Depending on a parameter gives the stand-ins a (tiny) graph for pass 2's backward.
        stand_in = lambda inputs: None if inputs is None else self.stand_in[: len(inputs)] * (1 + 0 * scale)
        out = {"image_features": stand_in(image), "text_features": stand_in(text), "logit_scale": scale.exp()}
        if getattr(self.model, "logit_bias", None) is not None:
            out["logit_bias"] = self.model.logit_bias
        return out

    def __enter__(self):
        self.model.forward = self.forward  # nn.Module.__call__ (and DDP's) look forward up on the instance
        return self

    def __exit__(self, *exc):
        del self.model.forward


def agree(failed: bool, device: torch.device) -> bool:
    """True on every rank if the probe failed on any."""
    if not dist.is_initialized():
        return failed
    flag = torch.tensor([float(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # Pinned host blocks are cached too: the offloaded batches of earlier probes would
        # otherwise stay pinned, and the next large one fails to pin (cudaHostAlloc OOM).
        torch._C._host_emptyCache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def training_step(work: Workload, world: World, loss_name: str, global_batch: int, chunk: int, offload: bool,
                  loss_options: dict | None = None, memory_probe: bool = False) -> dict:
    """One full step at `global_batch`: {"step_s", "peak_gib", "loss"} or {"error": ...}.

    memory_probe: the encoders run on a few chunks only (SampledEncoders); the step's peak
    memory is measured, its time and loss mean nothing. Pass 2 then re-encodes every chunk
    (reuse_last_chunk off), the memory-lean order for every loss."""
    local_batch = global_batch // world.world_size
    host_bytes = global_batch * (3 * work.image_size**2 + 4 * work.context_length)  # all ranks of one machine
    if offload and host_bytes > HOST_MEMORY_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        return {"error": f"host memory: the offloaded batch would take {host_bytes / GIB:.0f} GiB"}
    release(world.device)
    result = {}
    module = unwrap(work.model)
    autocast = torch.bfloat16 if world.device.type == "cuda" else None
    probe = contextlib.nullcontext()
    if memory_probe:
        probe = SampledEncoders(module, chunk, -(-local_batch // chunk), work.feature_dim, autocast or torch.float32)
    try:
        images, texts = synthetic_batch(work, local_batch, world.device, offload)
        step = TrainStep(work.model, build_loss(loss_name, **(loss_options or {})), work.optimizer,
                         chunk_size=min(chunk, local_batch), precision="bf16" if autocast is not None else "fp32",
                         reuse_last_chunk=not memory_probe)
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        started = time.perf_counter()
        with probe:
            loss = step(images, texts).loss
        result = {"loss": float(loss)}  # float() waits for the device
        result["step_s"] = time.perf_counter() - started
        result["peak_gib"] = peak_gib(world.device)
    except HostMemoryError:
        result = {"error": "host memory: pinning failed"}
    except torch.OutOfMemoryError:
        result = {"error": "out of memory"}
    finally:
        images = texts = step = probe = None  # drop the batch before the allocator is emptied
        work.optimizer.zero_grad(set_to_none=True)
        release(world.device)
    if agree("error" in result, world.device):
        return {"error": result.get("error", "out of memory")}
    return result


def loss_memory_gib(loss_name: str, world: World, global_batch: int, feature_dim: int,
                    loss_options: dict | None = None) -> float | None:
    """Peak memory that the loss alone adds, forward and backward, on this rank's bf16 features
    (the paper's "loss memory"); None on a CPU, "out of memory" when it does not fit."""
    local_batch = global_batch // world.world_size
    release(world.device)
    failed = False
    try:
        features = torch.nn.functional.normalize(torch.randn(2, local_batch, feature_dim, device=world.device), dim=-1)
        image, text = (f.to(torch.bfloat16).requires_grad_() for f in features)
        del features
        scale = torch.tensor(1 / 0.07, device=world.device, requires_grad=True)
        before = torch.cuda.memory_allocated(world.device) if world.device.type == "cuda" else 0
        release(world.device)
        build_loss(loss_name, **(loss_options or {}))(image, text, scale).backward()
        extra = (peak_gib(world.device) - before / GIB) if world.device.type == "cuda" else None
    except torch.OutOfMemoryError:
        failed = True
    finally:
        image = text = None
        release(world.device)
    return "out of memory" if agree(failed, world.device) else extra
