"""Which process and which job this is, as the launcher says (torchrun, or srun under Slurm).

Read from the environment alone, without torch: train.py reports a mistake in
its configuration from rank 0 only, before torch has been imported; and a run
folder remembers the job that started it (run_dir.py).

Under torchrun, an `error:` line is said twice: when it happens, and once more
after torchrun's own report of the failed workers (its ChildFailedError
traceback, some 35 lines), so that the user's last line is the one that says
what to fix (`repeat_after_torchrun`); `python -m clipscale.torchrun`, which ends in one line of
its own, needs no repeat (`QUIET_LAUNCHER`).
"""

from __future__ import annotations

import os
import subprocess
import sys

QUIET_LAUNCHER = "CLIPSCALE_QUIET_LAUNCHER"  # set by clipscale.torchrun: its workers' errors are not repeated

# Waits for the process argv[1] to end, then writes argv[2] to stderr. A process of its own
# (a session of its own: torchrun kills its workers' process groups), started in milliseconds.
_WRITE_AFTER_EXIT = """
import os, select, sys, time
pid = int(sys.argv[1])
try:
    select.select([os.pidfd_open(pid)], [], [])
except ProcessLookupError:
    pass
except OSError:  # no pidfd_open on this kernel: poll
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
os.write(2, sys.argv[2].encode())
"""


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def launcher_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun or srun set them; (0, 1, 0) otherwise.

    SLURM's task variables count only inside a job step (`srun`): the batch
    script itself also sees SLURM_PROCID=0 and the job's SLURM_NTASKS, and a
    `python train.py` started there directly must not wait for ranks that
    will never come."""
    if "RANK" in os.environ or "SLURM_STEP_ID" not in os.environ:
        return _env_int("RANK", default=0), _env_int("WORLD_SIZE", default=1), _env_int("LOCAL_RANK", default=0)
    return _env_int("SLURM_PROCID", default=0), _env_int("SLURM_NTASKS", default=1), _env_int("SLURM_LOCALID", default=0)


def launch_id() -> str | None:
    """What a launcher keeps when it starts the same job again and changes between jobs: the Slurm
    job id (a requeued job keeps it), else torchrun's run id (its restarts keep it; `--standalone`
    draws a new one per command, and torchrun's default id "none" names no job); None otherwise."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"Slurm job {os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun run {run_id}" if run_id and run_id != "none" else None


def repeat_after_torchrun(line: str) -> None:
    """Under torchrun (whose agent is this worker's parent), have `line` written to stderr once
    more when torchrun has exited, after its report of the failed workers; nothing otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get(QUIET_LAUNCHER):
        return
    subprocess.Popen([sys.executable, "-I", "-S", "-c", _WRITE_AFTER_EXIT, str(os.getppid()), line + "\n"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
