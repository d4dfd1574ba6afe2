"""Stop signals, delivered for real to a whole process group (as Slurm, torchrun and a terminal
do), to a process that iterates a DataLoader with worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from clipscale.worker_server import worker_context
from tests.helpers.tiny_runs import JOB_MARK, REPO, communicate_or_dump, job_env

# Iterates a DataLoader with 2 workers (ignore_stop_signals as worker_init_fn unless argv[1] is
# "plain") under a StopRequest. After a stop request it takes 8 more batches, more than the
# loader holds prefetched (2 workers x 2), so the workers must still be producing, then exits
# 128 + signal. With argv[2] == "wait" it never stops by itself (for the second Ctrl-C).
LOADER = """
import sys, time, torch
from clipscale.errors import run_main
from clipscale.signals import StopRequest, ignore_stop_signals

class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(10**9):
            time.sleep(0.02)
            yield i

def main():
    init = None if sys.argv[1] == "plain" else ignore_stop_signals
    loader = torch.utils.data.DataLoader(Counting(), batch_size=None, num_workers=2, worker_init_fn=init)
    after_request = 0
    with StopRequest() as stop:
        for batch in loader:
            print("batch", batch, flush=True)
            after_request += bool(stop.signum)
            if after_request == 8 and sys.argv[2] != "wait":
                print("stopping on signal", stop.signum, flush=True)
                return 128 + stop.signum

run_main(main)  # as train.py runs its main
"""


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.Popen([sys.executable, "-c", LOADER, *args], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(process: subprocess.Popen, text: str, seen: list[str]) -> None:
    for line in process.stdout:
        seen.append(line)
        if text in line:
            return
    pytest.fail(f"the process ended before printing {text!r}: {''.join(seen)[-3000:]}")


def _ended(process: subprocess.Popen, seen: list[str]) -> str:
    """The whole output once the process has ended, and its loader workers with it."""
    output = "".join(seen) + process.communicate(timeout=60)[0]
    deadline = time.time() + 10  # orphaned workers notice within 5 s (their watchdog's interval)
    while _group_alive(process.pid):
        assert time.time() < deadline, f"loader workers outlived their process: {output[-3000:]}"
        time.sleep(0.1)
    return output


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group_after_batches(process: subprocess.Popen, signum: int, seen: list[str]) -> None:
    for _ in range(3):  # the workers are up and producing
        _read_until(process, "batch", seen)
    os.killpg(process.pid, signum)  # the trainer and its loader workers alike


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_loader_workers_outlive_a_stop_signal_to_the_process_group(signum):
    process, seen = _start("ignoring", "stop"), []
    _signal_group_after_batches(process, signum, seen)
    output = _ended(process, seen)
    assert process.returncode == 128 + signum, output[-3000:]
    assert f"stopping on signal {signum}" in output and "killed by signal" not in output


def test_without_it_a_process_group_sigterm_kills_the_workers_first():
    """Why the workers need ignore_stop_signals: PyTorch's own worker handler dies of it (and the
    run ends in one line naming the signal, as any loader worker's end does)."""
    process, seen = _start("plain", "stop"), []
    _signal_group_after_batches(process, signal.SIGTERM, seen)
    output = _ended(process, seen)
    assert process.returncode == 1 and "is killed by signal: Terminated" in output, output[-3000:]
    assert output.count("error:") == 1 and "Traceback" not in output, output[-3000:]


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_aborts_at_once_in_one_line_with_status_130():
    process, seen = _start("ignoring", "wait"), []
    _signal_group_after_batches(process, signal.SIGINT, seen)
    _read_until(process, "Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again aborts at once", seen)
    _read_until(process, "batch", seen)  # the first Ctrl-C did not stop it
    os.killpg(process.pid, signal.SIGINT)
    output = _ended(process, seen)
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output and "stopping on signal" not in output
    assert output.rstrip().splitlines()[-1].startswith("interrupted (Ctrl-C): stopped at once"), output[-3000:]



# Each rank of a torchrun job (gloo's threads running) starts a loader worker that reports its OS
# parent, after forking the fork server as train.py does (init_distributed) or leaving it to
# multiprocessing (argv[1] == "late").
JOB_LOADER = """
import os, sys, torch, torch.distributed as dist
from clipscale.signals import ignore_stop_signals
from clipscale.worker_server import start_worker_server, worker_context

class ParentOfWorker(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield os.getppid()

def command_line(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()

if __name__ == "__main__":  # not again in the worker, which imports this module for its dataset's class
    if sys.argv[1] != "late":
        start_worker_server()
    dist.init_process_group("gloo")
    context = worker_context()
    loader = torch.utils.data.DataLoader(ParentOfWorker(), batch_size=None, num_workers=1,
                                         worker_init_fn=ignore_stop_signals, multiprocessing_context=context)
    parent = next(iter(loader))
    # One string with its newline, so one write: the two ranks share the job's stdout, and print's
    # separate writes of each argument and of `end` (unbuffered, as the job runs) interleaved
    # ("rankrank 0 ...", and a line run into the next: "forked Truerank 0 ...").
    print(f"rank {dist.get_rank()} trainer {os.getpid()} parent {parent} served {context is not None} "
          f"forked {command_line(parent) == command_line(os.getpid())}\\n", end="", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("server", ["forked", "late"])
def test_a_jobs_loader_workers_start_from_a_fork_server_and_a_lone_process_forks_them(tmp_path, server):
    """In a job of two, each rank's loader worker is not forked from the trainer (whose gloo threads
    may hold the interpreter's thread-state lock at the fork): its OS parent is the fork server,
    itself forked from the trainer at its start (the trainer's command line: nothing imported anew),
    or, where the run did not start it, multiprocessing's own. A process alone forks its workers."""
    script = tmp_path / "job_loader.py"
    script.write_text(JOB_LOADER)
    env = job_env()
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), server],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = communicate_or_dump(job, 120, env[JOB_MARK])
    reports = [line.split() for line in stdout.splitlines() if line.startswith("rank ")]
    assert job.returncode == 0 and len(reports) == 2, stdout[-2000:] + stderr[-2000:]
    for _, rank, _, trainer, _, parent, _, served, _, forked in reports:
        assert served == "True" and parent != trainer and forked == str(server == "forked"), reports
    assert worker_context() is None
