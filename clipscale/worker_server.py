"""Where the loader workers of a distributed job come from: a fork server forked from the trainer
at its start, before it has any thread.

A DataLoader forks its workers from the process that iterates it. In a job, by then, the trainer
has threads that are not Python's (gloo's and NCCL's) which briefly take the interpreter's
thread-state lock to call into Python; a worker forked at that instant inherits the lock taken and
waits for it forever in `PyOS_AfterFork_Child` (seen: a world of two hung at its start, rank 0's
loader worker stuck there, rank 1 waiting for rank 0 in DDP's first broadcast).

multiprocessing's "forkserver" start method is the cure: workers fork from a server process that
has no threads. Its own server starts as a new interpreter, though, importing torch and the data
path again (seconds for every rank of every run: minutes over the test suite). `start_worker_server`
instead forks the server from the trainer itself at the very start of a distributed run, while
the trainer is still one thread (`train`, before `init_distributed`): the server has everything imported already, and its workers
start as fast as forked ones. `worker_context` is the DataLoaders' `multiprocessing_context`.
A process alone keeps plain fork: it has no such threads.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import threading
from multiprocessing import connection, resource_tracker

from clipscale.launcher import launcher_ranks
from clipscale.signals import print_stacks_on_signal


def in_a_job() -> bool:
    return launcher_ranks()[1] > 1


def worker_context() -> multiprocessing.context.BaseContext | None:
    """The `multiprocessing_context` of a loader with workers: the fork server in a job of
    several processes (started by `start_worker_server`, else by multiprocessing itself), None
    (plain fork) in a process alone."""
    return multiprocessing.get_context("forkserver") if in_a_job() else None


def start_worker_server() -> None:
    """In a job of several processes, fork multiprocessing's fork server from this process now: call
    it before the process group (its threads) and CUDA exist. Its fork server then runs with
    everything this process has imported, and multiprocessing uses it instead of starting its own.
    Where that cannot be done safely (a thread already running; a Python whose fork server wants
    more than this knows how to give), multiprocessing starts its own server when a loader first
    needs it."""
    server = multiprocessing.forkserver._forkserver
    if not in_a_job() or threading.active_count() > 1 or hasattr(server, "_forkserver_authkey"):
        return
    with server._lock:
        if server._forkserver_pid is not None:
            return
        resource_tracker.ensure_running()  # before the fork: the server and its workers share this one
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            # Every process that may ask for a worker holds the write end of the "alive" pipe; when
            # all of them have ended, the server reads its end's EOF and ends too.
            alive_r, alive_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The fork server's life, in the forked child: the trainer's stop signals are not its own (it
    ends when the trainer does); each worker it forks sets its own (`ignore_stop_signals`)."""
    status = 1
    try:
        os.close(alive_w)
        for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(stop, signal.SIG_IGN)
        print_stacks_on_signal()  # as its trainer and workers: SIGUSR2 to the process group ends none of them
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
        status = 0
    finally:
        os._exit(status)
