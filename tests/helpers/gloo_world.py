"""Run a function in a real multi-process gloo world and collect what each rank returns.

    results = run_in_gloo_world(worker, world_size=3, args=(...), timeout=120)

`backend="nccl"` runs one process per GPU (rank r on cuda:r) instead.

`worker(rank, world_size, *args)` must be a module-level function (it is
pickled into spawned processes). The process group is initialised before it
runs and destroyed after; its return value (tensors are fine) comes back in
rank order. A rank that raises makes the whole call raise with that rank's
traceback; a world that does not finish within `timeout` seconds is killed.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback

import torch

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, worker, args, results, backend):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        out = worker(rank, world_size, *args)
        # Tensors put on a queue live in shared memory that vanishes with this
        # process; serialised bytes outlive it.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback travels to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_in_gloo_world(worker, world_size: int, args: tuple = (), timeout: float = 120.0, backend: str = "gloo") -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, port, worker, args, results, backend), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, object] = {}
    try:
        while len(collected) < world_size:
            try:
                rank, status, payload = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{backend} world of {world_size} did not finish within {timeout}s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(world_size)]
