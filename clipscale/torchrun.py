"""torchrun, ending in one line: `python -m clipscale.torchrun` takes torchrun's arguments.

    python -m clipscale.torchrun --nproc_per_node 2 train.py --config configs/digits.yaml

torchrun itself ends a Ctrl-C (or a SIGTERM to it) with a 25-line `SignalException` traceback and
status 1, after its workers have stopped cleanly, and a worker's failure with a 35-line
`ChildFailedError` report. This runs the same launcher (`torch.distributed.run.main`, the
function the `torchrun` command calls) and ends instead with one line and the status a shell
expects: 128 + the signal (130 for Ctrl-C) when it was stopped, else the status of the worker that
failed first, not of those torchrun stopped after it (2 for a mistake that worker reported in its
`error:` line, which is then the last line).
"""

from __future__ import annotations

import os
import signal
import sys

from clipscale.errors import USER_ERROR_EXIT
from clipscale.launcher import QUIET_LAUNCHER


# A worker killed mid-step leaves the semaphores of its loader's queues behind; its multiprocessing
# resource tracker then warns about them after this launcher's last line (library noise: the
# launcher's line has said what happened). Inherited by the workers and their trackers.
QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


def main(argv: list[str] | None = None) -> int:
    os.environ[QUIET_LAUNCHER] = "1"  # the workers' error lines need no repeat after this launcher's last line
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), QUIET_TRACKER)))
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as err:
        name = signal.Signals(err.sigval).name
        print(f"torchrun: stopped by {name}; its workers were asked to stop (a run checkpoints first, and the "
              "same command resumes it)", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        # The worker that failed first (torchrun records the ones it then stopped as failures too, later).
        rank, failure = min(err.failures.items(), key=lambda item: item[1].timestamp)
        status = failure.exitcode
        if status != USER_ERROR_EXIT:  # the worker's `error:` line has said what to fix
            how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
            print(f"torchrun: worker {rank} {how}" + (f" (and {len(err.failures) - 1} more)" if len(err.failures) > 1
                                                      else ""), file=sys.stderr, flush=True)
        return 128 - status if status < 0 else status
    return 0


if __name__ == "__main__":
    sys.exit(main())
