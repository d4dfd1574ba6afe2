"""torchrun's elastic restarts: a worker killed mid-run restarts the world (--max-restarts), which
resumes from the latest checkpoint and ends with the weights of an uninterrupted run. On one node,
and with two torchrun launchers with --nnodes 2 on this machine (a c10d rendezvous, one worker
each), as on two nodes, where the whole job restarts on both launchers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from clipscale.checkpoint import latest_checkpoint
from clipscale.distributed import attempt_namespace

from tests.helpers.gloo_world import free_port
from tests.helpers.tiny_runs import DIGITS_YAML, JOB_MARK, REPO, communicate_or_dump, job_env, run_train, tiny_run

pytestmark = pytest.mark.slow


def test_a_restarted_attempt_shares_a_namespace_that_no_earlier_process_wrote_in():
    """The store outlives a killed attempt, with its namespace and rank 1's answer in it; in the
    next attempt ranks 1 and 2 start before rank 0 and read that namespace first."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))

    def attempt(order: tuple[int, ...]) -> dict:
        namespaces = {}

        def worker(rank):  # a client of its own, as each process has
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
            namespaces[rank] = attempt_namespace(client, rank, 3, timeout=30)

        threads = [threading.Thread(target=worker, args=(rank,)) for rank in order]
        for thread in threads:
            thread.start()
            time.sleep(0.5)
        for thread in threads:
            thread.join(timeout=40)
        return namespaces

    earlier = attempt((0, 1, 2))
    now = attempt((1, 2, 0))
    assert len(set(earlier.values())) == 1 and len(now) == 3 and len(set(now.values())) == 1, (earlier, now)
    assert now[0] != earlier[0]


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


STEPS, CHECKPOINT_EVERY, KILL_AFTER = 20, 10, 14  # the kill comes 4 steps past the checkpoint, 6 before the end


def _overrides(digits_root, output_dir, name):  # data.workers as digits.yaml has it; on the CPU for both topologies
    return tiny_run(digits_root, output_dir, f"run.name={name}", f"train.steps={STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
                    "run.device=cpu", "eval.zeroshot=false")


@pytest.fixture(scope="module")
def reference(digits_root, module_tmp) -> dict:
    """The final weights of the run never interrupted, on 2 processes (standalone): both tests' jobs
    are worlds of two that train the same run."""
    output_dir = module_tmp("reference")
    result = run_train(_overrides(digits_root, output_dir, "reference"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(latest_checkpoint(output_dir / "reference" / "checkpoints"), weights_only=True)["state_dict"]


def _killable(checkpoints, metrics) -> bool:
    """A checkpoint written, and steps trained past it that the restarted world must train again."""
    return ((checkpoints / f"step_{CHECKPOINT_EVERY:08d}.pt").exists() and metrics.exists()
            and len(metrics.read_text().splitlines()) >= KILL_AFTER)


def _ends_with_the_reference_weights(run_dir, reference) -> None:
    final = torch.load(latest_checkpoint(run_dir / "checkpoints"), weights_only=True)
    assert final["step"] == STEPS
    for key, tensor in reference.items():
        assert torch.equal(final["state_dict"][key], tensor), key


def test_a_worker_killed_on_one_of_two_nodes_restarts_the_job_with_the_same_final_weights(digits_root, reference, tmp_path):
    endpoint, job = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    env = job_env()
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
             "--rdzv-conf", f"is_host={node == 0}", "--max-restarts", "1",
             str(REPO / "train.py"), "--config", DIGITS_YAML, *_overrides(digits_root, tmp_path, "killed")],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    checkpoints, metrics = tmp_path / "killed" / "checkpoints", tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 240
    while not _killable(checkpoints, metrics):
        assert all(p.poll() is None for p in launchers) and time.time() < deadline, "the run ended before a worker could be killed"
        time.sleep(0.05)
    os.kill(_children(launchers[1].pid)[0], signal.SIGKILL)  # the second "node"'s worker
    errors = [communicate_or_dump(launcher, 300, env[JOB_MARK])[1] for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], errors[1][-3000:] + errors[0][-3000:]
    assert "exitcode: -9" in errors[1]  # that launcher saw the kill, and the restarted job finished
    _ends_with_the_reference_weights(tmp_path / "killed", reference)


# --- one node: a worker killed, restarted by torchrun ------------------------------------------


def test_a_worker_killed_mid_run_is_restarted_from_the_latest_checkpoint(digits_root, reference, tmp_path):
    """SIGKILL one of two torchrun workers after a checkpoint: with --max-restarts 1 the world
    restarts, resumes from latest.pt and ends with the weights of a run never interrupted. The
    job replaces an older run (run.overwrite=true): its restart resumes, it does not move aside
    the run it started itself."""
    older = tmp_path / "killed"  # the run this job replaces
    older.mkdir()
    (older / "config.yaml").write_text("run: {name: killed}\n")
    env = job_env()
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         str(REPO / "train.py"), "--config", DIGITS_YAML, *_overrides(digits_root, tmp_path, "killed"), "run.resume=false",
         "run.overwrite=true"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    checkpoints, metrics = tmp_path / "killed" / "checkpoints", tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 180
    while not _killable(checkpoints, metrics):
        assert agent.poll() is None and time.time() < deadline, "the run ended before a worker could be killed"
        time.sleep(0.05)
    os.kill(_children(agent.pid)[-1], signal.SIGKILL)
    _, stderr = communicate_or_dump(agent, 240, env[JOB_MARK])
    assert agent.returncode == 0, stderr[-3000:]
    assert "exitcode: -9" in stderr  # the agent saw the kill, and the restarted world finished
    assert len(list(tmp_path.glob("killed.old-*"))) == 1, "the restart moved its own run aside as well"
    _ends_with_the_reference_weights(tmp_path / "killed", reference)
