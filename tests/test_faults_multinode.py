"""Two torchrun launchers with --nnodes 2 on this machine (a c10d rendezvous, one worker each), as
on two nodes: one launcher's worker is killed mid-run, the whole job restarts on both launchers,
resumes from the latest checkpoint and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

from clipscale.checkpoint import latest_checkpoint

from tiny_runs import DIGITS_YAML, REPO, run_train, tiny_run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


@pytest.mark.xfail(strict=False, reason=(
    "after the restart, node 0's worker fails Gloo's connectFullMesh (connection refused) and its launcher, the c10d "
    "store's host, gives up. Likely cause: clipscale.distributed prefixes the store with TORCHELASTIC_RESTART_COUNT, "
    "which differs between launchers when only one node's worker failed (the other restarts on the membership change "
    "without counting it), and the shared store keeps the previous round's addresses"))
def test_a_worker_killed_on_one_of_two_nodes_restarts_the_job_with_the_same_final_weights(digits_root, tmp_path):
    def overrides(name):  # data.workers as digits.yaml has it
        return tiny_run(digits_root, tmp_path, f"run.name={name}", "train.steps=20", "train.checkpoint_every=10",
                        "run.device=cpu", "eval.zeroshot=false")

    reference = run_train(overrides("reference"), nproc=2)
    assert reference.returncode == 0, reference.stderr[-3000:]

    endpoint, job = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex[:8]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
             "--rdzv-conf", f"is_host={node == 0}", "--max-restarts", "1",
             str(REPO / "train.py"), "--config", DIGITS_YAML, *overrides("killed")],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    checkpoints, metrics = tmp_path / "killed" / "checkpoints", tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 240
    while not ((checkpoints / "step_00000010.pt").exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 14):
        assert all(p.poll() is None for p in launchers) and time.time() < deadline, "the run ended before a worker could be killed"
        time.sleep(0.05)
    os.kill(_children(launchers[1].pid)[0], signal.SIGKILL)  # the second "node"'s worker
    errors = [launcher.communicate(timeout=300)[1] for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], errors[1][-3000:] + errors[0][-3000:]
    assert "exitcode: -9" in errors[1]  # that launcher saw the kill, and the restarted job finished

    final = {name: torch.load(latest_checkpoint(tmp_path / name / "checkpoints"), weights_only=True) for name in ("reference", "killed")}
    assert final["killed"]["step"] == 20
    for key, tensor in final["reference"]["state_dict"].items():
        assert torch.equal(final["killed"]["state_dict"][key], tensor), key
