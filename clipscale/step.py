"""One training step, the object that `train.py` and every benchmark run: Gradient Cache's passes,
then the update as open_clip_train makes it (docs/architecture.md, step 7), and its own state
for the checkpoint (the GradScaler, the non-finite count).

    step = TrainStep(model, loss_fn, optimizer, chunk_size=512, precision="bf16", grad_clip=1.0)
    result = step(images, texts, lr)   # device tensors or chunk sources (clipscale.data.chunks)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from clipscale.gradcache import GradCache
from clipscale.losses.common import NonFiniteError
from clipscale.parallel import ParallelModel
from clipscale.precision import AUTOCAST_DTYPES

MAX_LOGIT_SCALE = math.log(100)  # open_clip clamps the learnable temperature at 100


class NonFiniteStepsError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient."""


@dataclass
class StepResult:
    loss: torch.Tensor  # on the device; NaN when the loss itself refused non-finite features
    grad_norm: torch.Tensor
    applied: bool  # False: non-finite, the weights were not touched
    logit_scale: torch.Tensor  # the exponentiated scale after the update, on the device
    text_chunks: list[tuple[int, int]]  # (samples, text positions computed) of each text chunk of pass 1


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, device: torch.device) -> torch.Tensor:
    """The global gradient norm (on `device`), and the gradients scaled down to `max_norm` where it
    is above. Sharded gradients (FSDP's DTensors) add their squares over all ranks, on `device`:
    with train.fsdp_offload the shards live on the host, where NCCL does not reach. Replicated
    gradients (DDP's, FSDP's scalars) count once: every rank holds the same."""
    with_grad = [p for p in parameters if p.grad is not None]
    sharded = [p for p in with_grad if isinstance(p.grad, DTensor)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
    replicated = [p for p in with_grad if not isinstance(p.grad, DTensor)]
    squares = torch.nn.utils.get_total_norm([p.grad.to_local() for p in sharded]).to(device) ** 2
    dist.all_reduce(squares, group=sharded[0].grad.device_mesh.get_group())
    if replicated:
        squares += torch.nn.utils.get_total_norm([p.grad for p in replicated]).to(device) ** 2
    norm = squares.sqrt()
    for group in (sharded, replicated):
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


class TrainStep:
    """forward/backward, unscale, clip, non-finite policy, optimizer, logit-scale clamp.

    model:      the open_clip model: plain, DDP-wrapped, or as `clipscale.parallel.parallelize`
                placed it (sharded by FSDP, say); optimizer: over its parameters.
    chunk_size: per-process encoder sub-batch; a batch of one chunk takes the plain step.
    precision:  fp32 | bf16 | fp16 (autocast; fp16 with a GradScaler, whose state is in
                `state_dict`).
    grad_clip:  max global gradient norm, or None.
    max_nonfinite_steps: consecutive skipped steps before NonFiniteStepsError.
    text_order: Gradient Cache's (`clipscale.caption_length.LengthSortedTexts`), or None.
    cuda_graphs: the towers' blocks are replayed as CUDA graphs (`compile_towers(cuda_graphs=True)`).
                They hand out gradients in the graphs' memory, which the next chunk's replay
                overwrites: every gradient is kept allocated between steps and zeroed in place, so
                each backward accumulates into memory of its own. And pass 1 keeps no graph of its
                last chunk (no `reuse_last_chunk`): a chunk's saved activations in the graphs'
                memory would be overwritten by the text chunks encoded before its backward.
    """

    def __init__(self, model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer, *, chunk_size: int,
                 precision: str = "fp32", grad_clip: float | None = 1.0, max_nonfinite_steps: int = 10,
                 reuse_last_chunk: bool = True, text_order=None, cuda_graphs: bool = False):
        self.model = ParallelModel.of(model)
        self.optimizer = optimizer
        self.grad_clip = grad_clip if grad_clip is not None else math.inf
        self.max_nonfinite_steps = max_nonfinite_steps
        self.scaler = torch.amp.GradScaler(self.model.device.type) if precision == "fp16" else None
        self.gradcache = GradCache(self.model, loss_fn, chunk_size, autocast=AUTOCAST_DTYPES[precision], scaler=self.scaler,
                                   reuse_last_chunk=reuse_last_chunk and not cuda_graphs, text_order=text_order)
        self.cuda_graphs = cuda_graphs
        self.nonfinite_total = 0
        self.nonfinite_in_a_row = 0
        self.steps = 0

    def __call__(self, images, texts, lr: float | None = None) -> StepResult:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        # A GradScaler unscales and updates only after a backward: with no gradient it has no
        # inf check to update from, and it raises.
        scaled = self.scaler is not None
        if self.cuda_graphs:
            for parameter in self.model.module.parameters():
                if parameter.requires_grad and parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
        try:
            loss = self.gradcache(images, texts)
        except NonFiniteError:  # raised on every rank alike, before any backward
            loss, scaled = torch.tensor(math.nan), False
        if scaled:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(list(self.model.module.parameters()), self.grad_clip, self.model.device)
        applied = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
        if applied and scaled:
            self.scaler.step(self.optimizer)
        elif applied:
            self.optimizer.step()
        if scaled:
            self.scaler.update()  # after an fp16 overflow this lowers the loss scale
        self.optimizer.zero_grad(set_to_none=not self.cuda_graphs)
        logit_scale = self.model.module.logit_scale
        with torch.no_grad():
            logit_scale.clamp_(0, MAX_LOGIT_SCALE)
        self.steps += 1
        self._count(applied)
        return StepResult(loss, grad_norm, applied, logit_scale.detach().exp(), self.gradcache.text_chunks)

    def _count(self, applied: bool) -> None:
        if applied:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_total += 1
        self.nonfinite_in_a_row += 1
        if self.nonfinite_in_a_row > self.max_nonfinite_steps:
            raise NonFiniteStepsError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (last at step {self.steps}); "
                "stopping. Lower optim.lr, check the data, or use train.precision=bf16/fp32."
            )

    def state_dict(self) -> dict:
        """The steps taken, the GradScaler's state ("scaler", open_clip's key) and the non-finite count."""
        return {"step": self.steps, "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "nonfinite_steps": self.nonfinite_total}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.nonfinite_total = state.get("nonfinite_steps", 0)
        self.steps = state["step"]
