"""How the model is spread over the processes (`train.parallel`): DDP or FSDP2.

    model = parallelize(module, world, parallel="fsdp", precision="bf16", reduce="chunk", offload=False)
    model.module                the open_clip model (sharded in place under FSDP)
    model(images, texts)        a forward whose backward reduces the gradients (through DDP's wrapper)
    model.sync                  when Gradient Cache's backwards reduce them (GradientSync)
    with gathered(model.module): ... forwards without a backward (the FLOP count, evaluation)

ddp:  every rank holds the whole model, its gradients and AdamW's two moments (16 bytes a
      parameter in fp32); DistributedDataParallel all-reduces the gradients once per step.
fsdp: `torch.distributed.fsdp.fully_shard` over each block of both towers, then the root: a
      rank holds 1/world of every parameter, gradient and moment, and gathers a block's
      parameters only while that block computes (forward, and again in the backward).

open_clip keeps the temperature as a 0-d parameter (`logit_scale`, and `logit_bias` for
SigLIP), which fully_shard refuses ("doesn't support scalar parameters"); giving it a shape
of [1] would change open_clip's checkpoint layout. So the scalars stay replicated, outside
FSDP (`ignored_params`), and their gradient is averaged over the ranks after the step's last
backward (`FSDPSync.finish`), as DDP averages it.

Order (torchtitan's `parallelize`: activation checkpointing, then compile per block, then
fully_shard): checkpointing is inside the towers (open_clip's `set_grad_checkpointing`, set when
the model is built), and under FSDP each block is compiled on its own, not the root, whose
forward holds the FSDP hooks of the blocks' parameters. `nn.Module.compile` only marks a block
to be compiled at its first call, so marking it after fully_shard (the trainer compiles once the
run folder, which holds the compile cache, is claimed) gives the same module as before: the
compiled call runs the block's FSDP hooks eagerly (FSDP2 marks them `torch._dynamo.disable`).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from clipscale.distributed import World, unwrap
from clipscale.errors import UserError
from clipscale.precision import AUTOCAST_DTYPES

SCALARS = ("logit_scale", "logit_bias")  # open_clip's 0-d parameters, replicated under FSDP
FORWARD_METHODS = ("encode_image", "encode_text")  # called by evaluation and the FLOP count


class ParallelError(UserError):
    """train.parallel=fsdp on a model whose towers have no list of blocks to shard."""


class GradientSync:
    """One process, or no wrapper: nothing to reduce."""

    def deferred(self) -> ContextManager:
        """The context of a backward that is not the step's last (Gradient Cache's earlier chunks)."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """After the step's last backward."""


class DDPSync(GradientSync):
    """DDP all-reduces in the step's last backward only (`no_sync` before it)."""

    def __init__(self, ddp: DistributedDataParallel):
        self.ddp = ddp

    def deferred(self) -> ContextManager:
        return self.ddp.no_sync()


class FSDPSync(GradientSync):
    """reduce="chunk": every backward reduce-scatters its gradients into the sharded ones (1/world
    of a gradient held per rank; one reduce-scatter a chunk). reduce="step": the chunks before the
    last accumulate unsharded gradients (the full gradient in fp32 on every rank) and the last
    reduce-scatters them once. Either way the replicated scalars are averaged in `finish`."""

    def __init__(self, module: FSDPModule, reduce: str, scalars: list[nn.Parameter]):
        self.module, self.reduce, self.scalars = module, reduce, scalars

    @contextlib.contextmanager
    def deferred(self):
        if self.reduce == "chunk":
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish(self) -> None:
        for scalar in self.scalars:
            if scalar.grad is not None:  # a sum, then the mean: gloo has no ReduceOp.AVG
                dist.all_reduce(scalar.grad)
                scalar.grad /= dist.get_world_size()


class ParallelModel:
    """The open_clip model as the processes share it: the one handle that the training step, the
    evaluation and the checkpoint take.

    module:         the open_clip model: its towers, scalars and state dict (sharded in place under FSDP).
    sync:           when the backwards reduce the gradients (GradientSync).
    device:         where it computes (under train.fsdp_offload its parameters live on the host).
    Calling it runs the forward whose backward reduces the gradients: through DDP's wrapper under
    DDP, the module itself otherwise."""

    def __init__(self, module: nn.Module, sync: GradientSync, device: torch.device, forward: nn.Module | None = None):
        self.module, self.sync, self.device = module, sync, device
        self.forward = forward if forward is not None else module

    @classmethod
    def of(cls, model: "nn.Module | ParallelModel") -> "ParallelModel":
        """A model as the caller placed it: plain (one process) or in DistributedDataParallel."""
        if isinstance(model, ParallelModel):
            return model
        module = unwrap(model)
        sync = DDPSync(model) if isinstance(model, DistributedDataParallel) else GradientSync()
        return cls(module, sync, next(module.parameters()).device, forward=model)

    def __call__(self, images: torch.Tensor | None, texts: torch.Tensor | None):
        return self.forward(images, texts)


def parallelize(module: nn.Module, world: World, *, parallel: str = "ddp", precision: str = "fp32",
                reduce: str = "chunk", offload: bool = False) -> ParallelModel:
    """`module` on the world's device(s), as train.parallel says. Under fsdp the module may be on
    the CPU: each rank then moves only its shards to the device."""
    if parallel == "fsdp":
        return shard(module, world, precision, reduce, offload)
    module = module.to(world.device)
    if not world.distributed:
        return ParallelModel(module, GradientSync(), world.device)
    ddp = DistributedDataParallel(module, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    return ParallelModel(module, DDPSync(ddp), world.device, forward=ddp)


def shard(module: nn.Module, world: World, precision: str, reduce: str, offload: bool) -> ParallelModel:
    mesh = init_device_mesh(world.device.type, (world.world_size,))
    # bf16: bf16 parameters in compute, fp32 gradient reduction; fp32: nothing cast (fp16: refused by the config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if AUTOCAST_DTYPES[precision] is torch.bfloat16 else MixedPrecisionPolicy()
    # pinned host memory for the copies to the GPU (pinning needs CUDA: the CPU tests run the unpinned path)
    host = CPUOffloadPolicy(pin_memory=world.device.type == "cuda")
    options = dict(mesh=mesh, mp_policy=policy, offload_policy=host if offload else OffloadPolicy())
    scalars = [getattr(module, name) for name in SCALARS if isinstance(getattr(module, name, None), nn.Parameter)]
    for scalar in scalars:  # replicated: fully_shard neither shards nor moves them
        scalar.data = scalar.data.to(world.device)
    blocks = [block for _, blocks in tower_blocks(module) for block in blocks]
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(module, ignored_params=set(scalars), **options)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(module, name)
    return ParallelModel(module, FSDPSync(module, reduce, scalars), world.device)


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Forwards without a backward (the FLOP count at start, evaluation) with every parameter
    gathered first and kept gathered throughout: no collective runs inside a forward, so each
    process may run its own number of them (an evaluation's per-rank share of a set), at the cost
    of the whole model's compute-dtype parameters on every GPU meanwhile. Afterwards every module
    is resharded: FSDP keeps the root gathered after a forward, for a backward, and until then the
    model's parameters would be whole copies, not the shards the optimizer and checkpoints use."""
    if not isinstance(model, FSDPModule):
        yield
        return
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the root first
    model.set_reshard_after_forward(False)  # the root's own setting already; the blocks' for now
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            if module is not model:
                module.set_reshard_after_forward(True, recurse=False)
            module.reshard()


# Lists of blocks by their usual names (open_clip, timm, Hugging Face): one of these holds a tower's
# blocks even when it has a single one (digits' one-layer text tower).
BLOCK_LISTS = ("resblocks", "blocks", "stages", "layers", "layer")


def tower_blocks(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """(tower, its list of blocks) for the image and the text tower: open_clip's
    `transformer.resblocks`, a timm trunk's `blocks` or `stages`, a Hugging Face encoder's
    `layer`/`layers` (any of BLOCK_LISTS, even of one block); else the largest list of two or more
    modules of one class in the tower."""
    text = module.text if hasattr(module, "text") else module.transformer  # CustomTextCLIP, or CLIP's own text tower
    found = []
    for tower, root in (("image", module.visual), ("text", text)):
        homogeneous = [(name.rsplit(".", 1)[-1], m) for name, m in root.named_modules()
                       if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 1 and len({type(child) for child in m}) == 1]
        lists = [m for name, m in homogeneous if name in BLOCK_LISTS] or [m for _, m in homogeneous if len(m) > 1]
        if not lists:
            raise ParallelError(f"train.parallel=fsdp: the {tower} tower ({type(root).__name__}) has no list of blocks "
                                "to shard; use train.parallel=ddp")
        found.append((tower, max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))))
    return found
