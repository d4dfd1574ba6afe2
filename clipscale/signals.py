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
ignore the stop signals and end when the trainer ends, as they do on any exit
(PyTorch's shutdown, or their watchdog when the trainer is gone).
"""

from __future__ import annotations

import os
import signal

import torch

from clipscale.distributed import all_reduce_max
from clipscale.errors import reporting_rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the stop signals are the trainer's, not the worker's."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
