"""Errors the user can fix, reported as one line; everything else keeps its traceback.

A `UserError` (a bad config value, a YAML syntax error, a missing file, a full
disk, a read-only folder) is printed by rank 0 as `error: <message>` (under
torchrun once more after torchrun's report, see launcher.py), and every rank
exits with status 2. A Ctrl-C that Python turns into KeyboardInterrupt (before the trainer's
own handler is installed, or a second one while it writes its checkpoint) is one line and
status 130, as a shell reports a Ctrl-C. A collective that fails because another process of the
job ended (`distributed.lost_a_peer`) is one line from rank 0 and status 1: the launcher names the
process that ended. A loader worker process that ended (killed, or out of host memory) is one line
from the rank whose worker it was, and status 1. Any other exception is a bug: its traceback stays.
Entry points run their main function through `run_main`:

    if __name__ == "__main__":
        run_main(main)
"""

from __future__ import annotations

import errno
import gc
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from clipscale.launcher import launcher_ranks, repeat_after_torchrun

USER_ERROR_EXIT = 2  # what argparse uses for a bad command line
INTERRUPTED_EXIT = 128 + 2  # killed by SIGINT, as a shell says it
PEER_ENDED_EXIT = 1  # another process of the job ended under a collective
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


class UserError(Exception):
    """A problem the user can fix from its message alone (no traceback is shown)."""


class StorageError(UserError):
    """A folder that cannot be written: full disk, quota, read-only, permissions."""


@contextmanager
def storage_errors(path: Path, doing: str) -> Iterator[None]:
    """Report a full disk or an unwritable folder as a StorageError naming `path`;
    other OS errors are not the user's and pass through."""
    try:
        yield
    except OSError as err:
        reason = STORAGE_ERRNOS.get(err.errno)
        if reason is None:
            raise
        raise StorageError(f"cannot {doing} {path}: {reason}") from err


def reporting_rank() -> bool:
    """Whether this process prints user errors: rank 0 of the launcher's world (or a single process)."""
    return launcher_ranks()[0] == 0


def _close_progress_bars() -> None:
    """A progress bar that the error left open would have the message continue its line."""
    from tqdm import tqdm

    for bar in list(tqdm._instances):
        bar.close()


def loader_worker_ended(err: BaseException | None) -> BaseException | None:
    """torch's DataLoader error for a worker process that ended, in `err` or what caused it (its
    SIGCHLD handler raises it wherever the main thread is; the batch stream wraps it): the first
    raised, which names the signal where there was one; else None."""
    found = None
    while err is not None:
        if isinstance(err, RuntimeError) and str(err).startswith("DataLoader worker (pid"):
            found = err
        err = err.__cause__ or err.__context__
    return found


def run_main(main: Callable[[], object]) -> None:
    """Call `main` and exit with its return value where that is an exit status (an int),
    else 0; a UserError exits 2 on every rank, printed by rank 0 only as `error: ...`; a
    KeyboardInterrupt exits 130, and a peer's end under a collective 1, each said in one line by rank 0;
    a data loader worker's end 1, said by its rank."""
    try:
        status = main()
    except KeyboardInterrupt:
        if reporting_rank():
            _close_progress_bars()
            print("\ninterrupted (Ctrl-C): stopped at once; a checkpoint being written is left out, the ones before "
                  "it stay, and the same command resumes from the newest", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT)
    except UserError as err:
        if reporting_rank():
            _close_progress_bars()
            print(f"error: {err}", file=sys.stderr, flush=True)
            repeat_after_torchrun(f"error: {err}")
        sys.exit(USER_ERROR_EXIT)
    except RuntimeError as err:
        from clipscale.distributed import lost_a_peer  # torch: imported once a run has failed

        ended = loader_worker_ended(err)
        if ended is not None:  # said by the rank whose worker it was: the others see only their peer's end
            _close_progress_bars()
            print(f"error: {ended} (a data loader worker process ended: killed by a signal, or by the kernel when the "
                  "host ran out of memory, which `dmesg` says); the checkpoints written so far stay and the same command "
                  "resumes from the newest", file=sys.stderr, flush=True)
            sys.exit(PEER_ENDED_EXIT)
        if not lost_a_peer(err):
            raise
        if reporting_rank():
            _close_progress_bars()
            print("stopped: another process of this job ended while they worked together (the launcher says which)",
                  file=sys.stderr, flush=True)
        sys.exit(PEER_ENDED_EXIT)
    finally:
        # What the process leaves is torch's and open_clip's objects, which the interpreter's last
        # collections would walk for over a second (1.5 s -> 0.3 s a process on a CPU, docs/benchmarks.md
        # "Starting"); what must end has ended (files closed, processes joined), and atexit's functions still run.
        gc.freeze()
    sys.exit(status if isinstance(status, int) else 0)
