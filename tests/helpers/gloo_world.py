"""Run a function in a real multi-process gloo world and collect what each rank returns.

    results = run_in_gloo_world(worker, world_size=3, args=(...), timeout=120)

`backend="nccl"` runs one process per GPU (rank r on cuda:r) instead.

`worker(rank, world_size, *args)` must be a module-level function (it is
pickled into the processes, which start as spawned ones would: see _context).
The process group is initialised before it runs and destroyed after; its
return value (tensors are fine) comes back in rank order. A rank that raises
makes the whole call raise with that rank's traceback; a world that does not
finish within `timeout` seconds is killed.
"""

from __future__ import annotations

import io
import multiprocessing.forkserver
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


def _entry(rank, world_size, port, worker, args, results, backend, environment):
    os.environ.clear()
    os.environ.update(environment)  # the caller's, as a spawned process has it (a forkserver's is its own start's)
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


# What every world's processes import, imported once in a forkserver instead of once a process (a spawned
# process takes seconds to import them). See _context.
PRELOAD = ["torch", "torch.distributed", "open_clip", "clipscale.models", "clipscale.losses", "clipscale.gradcache",
           "clipscale.parallel", "clipscale.step", "clipscale.eval"]
# Variables that the processes read at run time only (_entry gives them the caller's values), which change
# under a session: pytest's for each test, and those an in-process compile sets (clipscale.compile's cache
# folder, Inductor's C++ builder's OpenMP flags). Any other difference from the forkserver's start: spawn.
RUN_TIME_ONLY = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}
_forkserver_environment: dict | None = None


def forkserver_started() -> bool:
    """Whether this process's forkserver runs (started by us, or by other code with its own environment)."""
    return multiprocessing.forkserver._forkserver._forkserver_pid is not None


def _context(backend: str):
    """gloo worlds fork from a forkserver that has PRELOAD imported, when the environment is the one
    it was started in: a process forked from it then starts as a spawned process would, with the
    same variables (TRITON_INTERPRET=1 among them: Triton reads it when first imported), less the
    imports. Otherwise, and on a machine with CUDA, spawned processes."""
    global _forkserver_environment
    environment = {k: v for k, v in os.environ.items() if k not in RUN_TIME_ONLY}
    if torch.cuda.is_available():  # the GPU suite's worlds start as they always have
        return mp.get_context("spawn")
    if backend == "gloo" and _forkserver_environment is None and not forkserver_started():
        mp.set_forkserver_preload(PRELOAD)  # it starts with its first process, in this environment
        _forkserver_environment = environment
    if backend == "gloo" and environment == _forkserver_environment:
        return mp.get_context("forkserver")
    return mp.get_context("spawn")


def run_in_gloo_world(worker, world_size: int, args: tuple = (), timeout: float = 120.0, backend: str = "gloo") -> list:
    ctx = _context(backend)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, port, worker, args, results, backend, dict(os.environ)), daemon=True)
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
