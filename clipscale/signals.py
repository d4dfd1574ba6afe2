"""Stopping on a signal without losing the work, and loader workers that outlive it.

SIGTERM and SIGUSR1 (what Slurm, scancel and torchrun send before stopping a
job) and a first Ctrl-C (SIGINT) ask the trainer to finish its step, write a
checkpoint on every rank and exit with 128 + the signal number; a second
Ctrl-C aborts at once (KeyboardInterrupt), for a user who does not want to wait.

These signals usually reach every process of the job: Slurm signals all
processes of a step, a terminal and torchrun (`os.killpg`) a process group.
DataLoader worker processes would die of them (PyTorch's worker handler ends a
worker on any SIGTERM that its parent did not send) and the trainer would then
fail with "DataLoader worker (pid ...) is killed by signal" before it could
checkpoint. `ignore_stop_signals` is the loaders' `worker_init_fn`: workers
ignore the stop signals unless the trainer itself sends them, and end when the
trainer ends them, as on any exit (also when they start from a fork server:
clipscale/worker_server.py).

SIGUSR2 stops nothing: a process that gets it prints where each of its threads is to stderr and
goes on (`print_stacks_on_signal`), the trainer, its fork server and its loader workers alike, so
`kill -USR2 <pid>` shows what a run that seems stuck is doing (scripts/bench_e2e.py sends it to the
training processes before it stops a case that outlived its time).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

import torch

from clipscale.distributed import all_reduce_max
from clipscale.errors import reporting_rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STACKS_SIGNAL = signal.SIGUSR2  # prints every thread's stack (its default action would end the process)


def print_stacks_on_signal() -> None:
    """From now on STACKS_SIGNAL prints every thread's Python stack to stderr (faulthandler: no
    ptrace rights or py-spy needed) and the process goes on."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)


class StopRequest:
    """Installs the handlers (in the main thread) until `restore`; also a context manager.

        with StopRequest() as stop:
            for step in ...:
                ...
                signum = stop.requested(device)   # the same on every rank
                if signum: checkpoint, then exit 128 + signum
    """

    def __init__(self):
        self.signum = 0  # the first stop signal received
        self.interrupted = False  # a Ctrl-C came: the next one aborts
        self.announce = reporting_rank()
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        print_stacks_on_signal()

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the checkpoint
            self.interrupted = True
            if self.announce:  # os.write: print could re-enter a write to stderr that this signal interrupted
                os.write(2, b"\nCtrl-C: stopping after this step with a checkpoint; Ctrl-C again aborts at once\n")
        self.signum = self.signum or signum

    def requested(self, device: torch.device) -> int:
        """The signal any rank received (0 for none): a collective, so ranks stop at the same step."""
        return int(all_reduce_max(self.signum, device))

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        faulthandler.unregister(STACKS_SIGNAL)

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn` (and the JPEG decoding process's start): the stop signals are the
    trainer's, not the worker's.

    SIGINT and SIGUSR1 are ignored. SIGTERM is ignored unless the trainer sent it: the
    DataLoader's shutdown and multiprocessing's exit end a worker that way (and would wait
    for it forever). A Python handler cannot see who sent a signal, so SIGTERM is blocked
    (the worker has no other thread yet, and the threads it starts inherit the mask) and a
    thread takes it with sigwaitinfo, which can."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    print_stacks_on_signal()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    trainer = multiprocessing.parent_process()  # not os.getppid(): a fork server is the parent of its workers
    threading.Thread(target=_exit_on_sigterm_from, args=(trainer.pid,), name="sigterm-from-trainer", daemon=True).start()
    threading.Thread(target=_exit_with, args=(trainer,), name="ends-with-trainer", daemon=True).start()


def _exit_with(trainer: multiprocessing.process.BaseProcess) -> None:
    """End when the trainer has ended, killed too. PyTorch's worker watches its OS parent, which is
    the fork server here; and the server lives as long as any process it started (each holds its
    liveness pipe): a killed trainer's workers would outlive it, holding its output."""
    multiprocessing.connection.wait([trainer.sentinel])
    os._exit(0)


def _exit_on_sigterm_from(trainer: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != trainer:
        pass
    os._exit(0)  # as PyTorch's own worker handler does on its parent's SIGTERM
