"""scripts/bench_e2e.py stops a case that outlives its budget: torchrun's workers run in
sessions of their own and hold the output pipe, so killing the launcher alone left the
benchmark waiting for that pipe forever (seen on two GPUs)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_e2e import kill_tree  # noqa: E402

HOLDS_THE_PIPE = ("import subprocess, sys, time; "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
                  "time.sleep(60)")


def test_a_killed_case_takes_its_workers_with_it():
    launcher = subprocess.Popen([sys.executable, "-c", HOLDS_THE_PIPE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(2)  # the worker has started
    kill_tree(launcher.pid)
    launcher.communicate(timeout=10)  # raises if a worker still holds the pipe
