"""The sbatch templates on a real Slurm of two nodes: a 2-process digits job trains and is
evaluated, and a preempted job, on one node or over both, is requeued and resumes on the same
loss curve.

The fixture installs Debian's slurm-wlm and munge when they are missing (as root, with apt),
starts munged, slurmctld and two slurmd (`slurmd -N <node>`: two nodes on this one host, which
Debian's build allows) as root from a slurm.conf in a temporary folder, and stops them at the
end. Where that is impossible the tests are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clipscale.metrics import read_metrics

from tests.helpers.gloo_world import free_port
from tests.helpers.tiny_runs import REPO, tiny_run

pytestmark = pytest.mark.slow

DAEMONS = ("munged", "slurmctld", "slurmd")
NODES = ("n1", "n2")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo", "srun")
SBIN_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
STEPS = 15  # a preemption after step 2 or 3 leaves 12 steps for the notice to arrive; acc1 0.17 at the end
TWO_PROCESSES = {  # sbatch options for a 2-process job: {nodes: options}
    "train_torchrun.sbatch": {  # one torchrun per node, NPROC_PER_NODE workers each
        1: ("--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2"),
        2: ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--export=ALL,NPROC_PER_NODE=1"),
    },
    "train_srun.sbatch": {
        1: ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"),
        2: ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1"),
    },
}


def _missing_programs() -> list[str]:
    return [p for p in DAEMONS + CLIENTS if shutil.which(p, path=SBIN_PATH) is None]


def _install_slurm() -> str | None:
    """Install slurm-wlm and munge with apt if needed; the reason it is impossible otherwise."""
    if not _missing_programs():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(_missing_programs())} missing) and apt-get as root is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        try:
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` took more than 5 minutes"
        if result.returncode != 0:
            return f"`{' '.join(command)}` failed: {result.stderr[-500:]}"
    return None


def _slurm_conf(root: Path, host: str) -> str:
    # proctrack/linuxproc and task/none: no cgroups, which containers often lack. Each node offers
    # 4 CPUs whatever the machine has (config_overrides) so that the 2-process jobs always fit.
    # Two nodes on one host: each slurmd its own port, and %n (the node name) in its files.
    # cred_expire is also how long a requeued job waits before it starts again (default 120 s),
    # and sched_interval how often the scheduler looks again (default 60 s).
    nodes = "\n".join(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=4 RealMemory=2000 "
                      "State=UNKNOWN" for node in NODES)
    return f"""\
ClusterName=clipscale-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
CredType=cred/munge
SlurmctldPort={free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
MinJobAge=600
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """A running Slurm of two nodes; `run` calls its client programs with our slurm.conf."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not this job's, if any
        self.env.update(SLURM_CONF=str(root / "slurm.conf"), PATH=SBIN_PATH, PYTHON=sys.executable,
                        OMP_NUM_THREADS="1", WANDB_MODE="disabled", NPROC_PER_NODE="2",  # torchrun: 2 CPU workers
                        PYTHONFAULTHANDLER="1")  # a job that never ends shows its threads' stacks (stack_dump)

    def run(self, *command: str) -> str:
        result = subprocess.run(command, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"
        return result.stdout

    def start(self) -> str | None:
        """Start the daemons; the reason when they do not come up."""
        (self.root / "munge.key").write_bytes(os.urandom(1024))
        (self.root / "munge.key").chmod(0o400)
        for path in ("state", *(f"spool/{node}" for node in NODES)):
            (self.root / path).mkdir(parents=True)
        (self.root / "slurm.conf").write_text(_slurm_conf(self.root, socket.gethostname().split(".")[0]))
        commands = [
            ["munged", "--force", f"--socket={self.root}/munge.socket", f"--key-file={self.root}/munge.key",
             f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munge.seed"],
            ["slurmctld", "-f", str(self.root / "slurm.conf")],
            *(["slurmd", "-f", str(self.root / "slurm.conf"), "-N", node] for node in NODES),
        ]
        for command in commands:
            result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                return f"{command[0]} did not start: {result.stderr[-500:]} {self._log_tails()}"
        deadline = time.time() + 30
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True).stdout.strip()
            if state == "idle":
                return None
            time.sleep(0.5)
        return f"the nodes did not become idle within 30 s (states {state!r}) {self._log_tails()}"

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--state=RUNNING,PENDING", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for daemon in (*(f"slurmd-{node}" for node in NODES), "slurmctld", "munged"):
            pid_file = self.root / f"{daemon}.pid"
            if pid_file.exists():
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
                _wait_for_exit(pid)

    def _log_tails(self) -> str:
        return " | ".join(f"{log.name}: {log.read_text()[-300:]}" for log in self.root.glob("*.log"))

    def submit(self, template: str, *args: str, options: tuple = ()) -> str:
        return self.run("sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--time=10",  # options may say otherwise (the last --nodes wins)
                        f"--output={self.root}/job-%j.out", *options, f"slurm/{template}", *args).strip()

    def job(self, job_id: str) -> dict:
        fields = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(re.findall(r"(\w+)=(\S+)", fields))

    def wait_until_done(self, job_id: str, timeout: float = 240) -> dict:
        deadline = time.time() + timeout
        while (job := self.job(job_id))["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            if time.time() > deadline:
                raise AssertionError(f"job {job_id} still {job['JobState']} ({job['Reason']}) after {timeout} s; "
                                     f"its processes' stacks: {self.stack_dump(job_id)}")
            time.sleep(0.5)
        return job

    def stack_dump(self, job_id: str) -> str:
        """Where a job that never ended stands: SIGABRT to each of its Python processes (found by the
        job id in their environment), whose fault handler writes every thread's stack to the job's
        output before it dies; that output's end."""
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                is_python = "python" in (environ.parent / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                if is_python and f"SLURM_JOB_ID={job_id}".encode() in environ.read_bytes().split(b"\0"):
                    os.kill(int(environ.parent.name), signal.SIGABRT)
            except (OSError, ValueError):  # ended meanwhile, or not ours to read
                continue
        time.sleep(5)
        return self.full_output(job_id)[-12000:]

    def output(self, job_id: str) -> str:
        path = self.root / f"job-{job_id}.out"
        return self.full_output(job_id)[-3000:] if path.exists() else "(no output)"

    def full_output(self, job_id: str) -> str:
        # The nodes' tasks append to one file, each its own buffered writes: one node's bytes can
        # split another's multi-byte character (the progress bar's blocks).
        return (self.root / f"job-{job_id}.out").read_bytes().decode(errors="replace")


def _wait_for_exit(pid: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(module_tmp):
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a one-node Slurm here runs its daemons as root; this test is not running as root")
    reason = _install_slurm()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(module_tmp("slurm"))
    try:
        reason = cluster.start()
        if reason:
            pytest.skip(f"Slurm could not be started here: {reason}")
        yield cluster
    finally:
        cluster.stop()


def _overrides(digits_root: Path, output_dir: Path) -> list[str]:
    # data.workers as digits.yaml has it: the preemption notice also reaches the loader workers
    return tiny_run(digits_root, output_dir, f"train.steps={STEPS}", "train.checkpoint_every=100", "run.device=cpu")


def _curve(run_dir: Path) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m}


@pytest.fixture(scope="module")
def uninterrupted(cluster, digits_root, module_tmp) -> Path:
    """The digits job through the torchrun template (one node, 2 processes on gloo), then the
    evaluation template on its final checkpoint once it has succeeded."""
    output_dir = module_tmp("torchrun")
    train = cluster.submit("train_torchrun.sbatch", "--config", "configs/digits.yaml", *_overrides(digits_root, output_dir),
                           options=TWO_PROCESSES["train_torchrun.sbatch"][1])
    manifest = json.loads((digits_root / "manifest.json").read_text())
    evaluation = cluster.submit(
        "eval.sbatch", "--checkpoint", str(output_dir / "tiny"), "--task", "wds",
        "--data", str(digits_root / f"val-{{0000..{len(manifest['val_shards']) - 1:04d}}}.tar"),
        "--classnames", str(digits_root / "classnames.txt"), "--templates", str(digits_root / "templates.txt"),
        "--device", "cpu", "--workers", "0", "--no-progress", "--output", str(output_dir / "eval.json"),
        options=(f"--dependency=afterok:{train}", "--ntasks-per-node=1", "--cpus-per-task=1"),
    )
    for job_id in (train, evaluation):
        assert cluster.wait_until_done(job_id)["JobState"] == "COMPLETED", cluster.output(job_id)
    return output_dir


def test_digits_job_trains_and_evaluates(uninterrupted):
    curve = _curve(uninterrupted / "tiny")
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1] - 0.3, curve
    in_training = json.loads((uninterrupted / "tiny" / "eval" / f"step_{STEPS:08d}.json").read_text())
    script = json.loads((uninterrupted / "eval.json").read_text())["metrics"]
    assert script["acc1"] == pytest.approx(in_training["zeroshot_acc1"], abs=1e-9)
    assert script["acc1"] > 0.1  # better than chance (ten classes) after 15 tiny steps


# Each template once and each node count once (all four took about 57 s each of CI's 25 minutes):
# the uninterrupted job is torchrun's on one node.
@pytest.mark.parametrize(("template", "nodes"), [("train_srun.sbatch", 1), ("train_torchrun.sbatch", 2)],
                         ids=["train_srun.sbatch-one node", "train_torchrun.sbatch-two nodes"])
def test_preempted_job_is_requeued_and_resumes_on_the_same_curve(cluster, uninterrupted, digits_root, tmp_path, template, nodes):
    """A preemption notice mid-run checkpoints and requeues the job; the requeued job continues
    the loss curve of the uninterrupted job (same world size, so the same data and steps). Over
    two nodes the notice reaches the processes of both, and they meet again at the first node's
    address when the job starts again."""
    job_id = cluster.submit(template, "--config", "configs/digits.yaml", *_overrides(digits_root, tmp_path),
                            options=TWO_PROCESSES[template][nodes])
    metrics = tmp_path / "tiny" / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING") and time.time() < deadline, cluster.output(job_id)
        time.sleep(0.1)
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)  # what --signal=B:USR1@180 sends before the time limit

    job = cluster.wait_until_done(job_id)
    log = cluster.full_output(job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1" and job["NumNodes"] == str(nodes), log[-3000:]
    stopped = re.search(r"stopped by signal \d+ after step (\d+)", log)
    assert stopped and int(stopped.group(1)) < STEPS, log[-3000:]
    reference, resumed = _curve(uninterrupted / "tiny"), _curve(tmp_path / "tiny")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-6), step
