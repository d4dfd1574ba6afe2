"""Process-group setup from torchrun's or SLURM's environment, and rank helpers.

The one home of the process-group helpers (`rank_and_world`, `is_distributed`,
`unwrap`); it imports only torch, so the losses that use it stay usable alone.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
Under `srun` (one task per GPU) SLURM sets SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID instead; MASTER_ADDR / MASTER_PORT must then come from the
sbatch script (slurm/common.sh). A plain `python train.py` is a world of one
and needs no process group (but under train.parallel=fsdp, whose device mesh
needs one, a group of one process in memory).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from clipscale.launcher import launcher_ranks


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


def rank_and_world(group=None) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def is_distributed(group=None) -> bool:
    """More than one process in `group` (the default group when None)."""
    return rank_and_world(group)[1] > 1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DistributedDataParallel (or the model itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def init_distributed(device: str = "auto", group_of_one: bool = False) -> World:
    """The world the launcher started, its process group initialised when it has several processes,
    or with `group_of_one` also for a single one (FSDP shards over a device mesh even then)."""
    rank, world_size, local_rank = launcher_ranks()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("run.device is 'cuda' but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch_device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch_device = torch.device("cpu")
    host_threads_for(torch_device)
    if world_size == 1 and group_of_one and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch_device if use_cuda else None)
    if world_size > 1 and not dist.is_initialized():
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size))
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            store=dist.PrefixStore(attempt_namespace(store, rank, world_size), store),
            rank=rank,
            world_size=world_size,
            device_id=torch_device if use_cuda else None,
        )
    return World(rank, world_size, local_rank, torch_device)


def host_threads_for(device: torch.device) -> None:
    """One intra-op thread for a process that computes on a GPU, as torchrun gives each of its
    processes, unless OMP_NUM_THREADS says otherwise. Its CPU ops are small (a chunk's crop table, a
    batch's token order); split over every core, as torch does by default, each waits for threads
    that the loader's workers keep busy: a 20 us `max` of a crop table took 5-30 ms, about 0.6 s of a
    ViT-B/32 step of 32,768 on a 16-core H200 host (results/bench_e2e_h200_b32_32k_share1_profiled.json)."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


NAMESPACE_KEY = "clipscale/namespace"


def attempt_namespace(store: dist.Store, rank: int, world_size: int, timeout: float = 1800) -> str:
    """A key prefix that only this attempt's processes use in `store`.

    torchrun's agents keep one store across elastic restarts, so the keys of a previous
    attempt's processes are still there: a restarted worker would read the address of a peer
    that died and fail to connect. TORCHELASTIC_RESTART_COUNT cannot tell attempts apart on
    several nodes: each agent counts only its own workers' failures, so after one node's worker
    fails the nodes disagree (pytorch/pytorch#135712). Rank 0 therefore draws a new namespace;
    another rank may first read the previous attempt's, so it announces itself there with a
    nonce of its own and takes the namespace in which rank 0 answers with that nonce."""
    if rank == 0:
        namespace = f"clipscale/{uuid.uuid4().hex}"
        store.set(NAMESPACE_KEY, namespace)
        for other in range(1, world_size):
            store.set(f"{namespace}/ack/{other}", store.get(f"{namespace}/hello/{other}"))  # get waits for it
        return namespace
    nonce, announced = uuid.uuid4().hex.encode(), None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        namespace = store.get(NAMESPACE_KEY).decode()  # waits for the first attempt's rank 0
        if namespace != announced:
            store.set(f"{namespace}/hello/{rank}", nonce)
            announced = namespace
        ack = f"{namespace}/ack/{rank}"
        if store.check([ack]) and store.get(ack) == nonce:
            return namespace
        time.sleep(0.05)
    raise RuntimeError(f"rank {rank}: rank 0 did not answer within {timeout:.0f} s in the process-group store")


# What a collective raises where another process of the job ended under it: gloo's transport finds
# the other end of a pair gone; NCCL's collectives mostly wait until the launcher stops them, or
# report ncclRemoteError ("remote process exited or there was a network error").
PEER_ENDED = ("Connection reset by peer", "Connection closed by peer", "remote process exited")


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another process of the job ended (killed, or
    failed itself): not this process's fault, and the launcher reports the one that ended."""
    return isinstance(err, RuntimeError) and any(reason in str(err) for reason in PEER_ENDED)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _all_reduce(value: float, device: torch.device, op) -> float:
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.item()


def all_reduce_max(value: float, device: torch.device) -> float:
    return _all_reduce(value, device, dist.ReduceOp.MAX)


def all_reduce_sum_list(values: list[int], device: torch.device) -> list[int]:
    """Element-wise sum of integer counters over ranks, in one collective."""
    if not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_gather_floats(value: float, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order, in one collective."""
    if not dist.is_initialized():
        return [value]
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.cat(gathered).tolist()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (pickled: small objects only)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
