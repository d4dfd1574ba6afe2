"""Process-group setup from torchrun's or SLURM's environment, and rank helpers.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
Under `srun` (one task per GPU) SLURM sets SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID instead; MASTER_ADDR / MASTER_PORT must then come from the
sbatch script. A plain `python train.py` is a world of one and needs no
process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def init_distributed(device: str = "auto") -> World:
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("run.device is 'cuda' but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch_device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch_device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world_size,
            device_id=torch_device if use_cuda else None,
        )
    return World(rank, world_size, local_rank, torch_device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _all_reduce(value: float, device: torch.device, op) -> float:
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.item()


def all_reduce_sum(value: float, device: torch.device) -> float:
    return _all_reduce(value, device, dist.ReduceOp.SUM)


def all_reduce_max(value: float, device: torch.device) -> float:
    return _all_reduce(value, device, dist.ReduceOp.MAX)


def all_gather_objects(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
