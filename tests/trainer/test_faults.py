"""What clusters and people do to a run, end to end through train.py: a stop signal to the whole
process group with loader workers on, Ctrl-C, a damaged newest checkpoint, a reused run name, and
the lines the console prints about them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from clipscale.checkpoint import latest_checkpoint, step_checkpoints
from clipscale.metrics import read_metrics

from tests.helpers.tiny_runs import DIGITS_YAML, REPO, run_train, tiny_run

pytestmark = pytest.mark.slow

STEPS = 12


def _overrides(digits_root: Path, output_dir: Path, *extra: str) -> list[str]:
    # data.workers as digits.yaml has it (1): the signals reach the loader worker too
    return tiny_run(digits_root, output_dir, f"train.steps={STEPS}", "train.checkpoint_every=100", "run.device=cpu",
                    "eval.zeroshot=false", *extra)


def _start_in_own_group(overrides: list[str], nproc: int = 1) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.Popen([*launcher, str(REPO / "train.py"), "--config", DIGITS_YAML, *overrides], cwd=REPO, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(process: subprocess.Popen, metrics: Path, steps: int) -> None:
    deadline = time.time() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert process.poll() is None and time.time() < deadline, "the run ended before it could be signalled"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_signal_to_the_process_group_checkpoints_and_the_same_command_resumes(digits_root, tmp_path, signum):
    overrides = _overrides(digits_root, tmp_path)
    run = _start_in_own_group(overrides)
    _wait_for_steps(run, tmp_path / "tiny" / "metrics.jsonl", 3)
    os.killpg(run.pid, signum)  # the trainer and its loader worker, as a terminal or Slurm deliver it
    output = run.communicate(timeout=120)[0]
    assert run.returncode == 128 + signum, output[-3000:]
    assert "killed by signal" not in output, output[-3000:]
    stopped = int(output.split(f"stopped by signal {signum} after step ")[1].split(";")[0])
    checkpoints = tmp_path / "tiny" / "checkpoints"
    assert step_checkpoints(checkpoints)[0][0] == stopped < STEPS
    assert f"step {stopped}: checkpoint saved to {checkpoints / f'step_{stopped:08d}.pt'}" in output, output[-3000:]
    if signum == signal.SIGTERM:
        # What a harder kill leaves: a metrics line cut short, a save's temporary file.
        metrics = tmp_path / "tiny" / "metrics.jsonl"
        with metrics.open("a") as f:
            f.write('{"step": %d, "loss": 2.3' % (stopped + 1))
        killed_save = checkpoints / f".step_{stopped + 1:08d}.pt.999-0a1b2c3d.tmp"
        killed_save.write_bytes(b"half a checkpoint")
        resumed = run_train(overrides)
        output = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, output[-3000:]
        assert f"resuming {tmp_path / 'tiny'} from step {stopped}" in output
        assert f"{metrics}: dropped its last line" in output and not killed_save.exists(), output[-3000:]
        assert [m["step"] for m in read_metrics(metrics)] == list(range(1, STEPS + 1))


def test_a_process_group_sigterm_under_torchrun_checkpoints_on_every_rank(digits_root, tmp_path):
    """torchrun passes SIGTERM on to each worker's process group: its loader workers get it too."""
    run = _start_in_own_group(_overrides(digits_root, tmp_path), nproc=2)
    _wait_for_steps(run, tmp_path / "tiny" / "metrics.jsonl", 3)
    os.killpg(run.pid, signal.SIGTERM)
    output = run.communicate(timeout=120)[0]
    assert "killed by signal" not in output and output.count("stopped by signal 15 after step ") == 1, output[-3000:]  # rank 0 says it
    checkpoint = torch.load(latest_checkpoint(tmp_path / "tiny" / "checkpoints"), weights_only=True)
    assert len(checkpoint["data"]) == 2 and 3 <= checkpoint["step"] < STEPS  # both ranks' cursors, mid-run


def _losses(run_dir: Path) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m}


def test_a_damaged_newest_checkpoint_falls_back_and_retrains_the_same_steps(digits_root, tmp_path):
    overrides = _overrides(digits_root, tmp_path, "train.steps=4", "train.checkpoint_every=2")
    first = run_train(overrides)
    assert first.returncode == 0, first.stderr[-3000:]
    curve = _losses(tmp_path / "tiny")
    newest = tmp_path / "tiny" / "checkpoints" / "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    again = run_train(overrides)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert f"checkpoint {newest} does not load" in output and f"resuming {tmp_path / 'tiny'} from step 2" in output
    assert _losses(tmp_path / "tiny") == curve  # steps 3 and 4 again, exactly
    assert torch.load(newest, weights_only=True)["step"] == 4


def test_a_reused_run_name_resumes_stops_or_moves_aside_but_never_mixes_two_runs(digits_root, tmp_path):
    overrides = _overrides(digits_root, tmp_path, "train.steps=3")
    run_dir = tmp_path / "tiny"
    assert run_train(overrides).returncode == 0
    config, metrics = (run_dir / "config.yaml").read_text(), (run_dir / "metrics.jsonl").read_text()

    again = run_train(overrides)  # the same command once more: nothing to do, nothing appended
    assert again.returncode == 0 and f"{run_dir} has already trained its 3 steps" in again.stdout + again.stderr
    assert (run_dir / "metrics.jsonl").read_text() == metrics

    other = run_train([*overrides, "loss.name=infcl", "optim.lr=5e-4"])
    assert other.returncode == 2 and "loss.name: 'vanilla' -> 'infcl'; optim.lr: 0.002 -> 0.0005" in other.stderr, other.stderr[-3000:]
    afresh = run_train([*overrides, "run.resume=false"])
    assert afresh.returncode == 2 and "run.resume=false, but" in afresh.stderr, afresh.stderr[-3000:]
    assert (run_dir / "config.yaml").read_text() == config and (run_dir / "metrics.jsonl").read_text() == metrics

    replaced = run_train([*overrides, "loss.name=infcl", "run.resume=false", "run.overwrite=true"])
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    [aside] = tmp_path.glob("tiny.old-*")
    assert (aside / "metrics.jsonl").read_text() == metrics and (aside / "config.yaml").read_text() == config
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m] == [1, 2, 3]

    # More steps change the learning-rate schedule: only with an explicit extension, which says how.
    overrides = [*overrides, "loss.name=infcl"]
    longer = run_train([*overrides, "train.steps=5"])
    assert longer.returncode == 2 and "train.steps: 3 -> 5" in longer.stderr and "run.extend_steps=true" in longer.stderr, longer.stderr[-3000:]
    extended = run_train([*overrides, "train.steps=5", "run.extend_steps=true"])
    output = extended.stdout + extended.stderr
    assert extended.returncode == 0 and f"extending {run_dir} from 3 to 5 steps: the cosine learning-rate schedule" in output, output[-3000:]
    assert f"resuming {run_dir} from step 3" in output
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m] == [1, 2, 3, 4, 5]


def test_the_console_says_once_what_happened_beside_the_progress_bar(digits_root, tmp_path):
    """Two processes: a checkpoint and an evaluation each get one line (from rank 0), the
    evaluation's with its figure; the final accuracy is the one in eval/step_<n>.json."""
    result = run_train(_overrides(digits_root, tmp_path, "train.steps=4", "train.checkpoint_every=2", "eval.every_n_steps=2",
                                  "eval.zeroshot=true", "data.workers=0"), nproc=2)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    checkpoints = tmp_path / "tiny" / "checkpoints"
    for step in (2, 4):
        assert output.count(f"step {step}: checkpoint saved to {checkpoints / f'step_{step:08d}.pt'}\n") == 1, output[-3000:]
    final = json.loads((tmp_path / "tiny" / "eval" / "step_00000004.json").read_text())
    assert output.count(f"step 4: zeroshot_acc1 {100 * final['zeroshot_acc1']:.2f}%, zeroshot_acc5 ") == 1, output[-3000:]
    assert output.count("step 2: zeroshot_acc1 ") == 1


def test_a_run_killed_after_its_final_checkpoint_ends_on_the_next_start(digits_root, tmp_path):
    """A run has its final checkpoint before its final evaluation and the open_clip weights (written
    last). Killed while writing the weights, the same command writes them and keeps the evaluation
    it had (no second one, no second record). Killed during the evaluation, it evaluates once and
    writes them. Only then does it count as ended."""
    overrides = _overrides(digits_root, tmp_path, "train.steps=2", "train.checkpoint_every=2", "eval.zeroshot=true")
    run_dir = tmp_path / "tiny"
    assert run_train(overrides).returncode == 0
    evaluation, weights = run_dir / "eval" / "step_00000002.json", run_dir / "open_clip_pytorch_model.bin"
    assert weights.stat().st_mtime_ns >= evaluation.stat().st_mtime_ns  # the weights last: they mark the end
    expected = json.loads(evaluation.read_text())
    metrics = run_dir / "metrics.jsonl"

    def evaluation_records() -> int:
        return sum(record == expected for record in read_metrics(metrics))

    def ends_again(output_says: str) -> None:
        finished = run_train(overrides)
        output = finished.stdout + finished.stderr
        assert finished.returncode == 0, output[-3000:]
        assert f"{run_dir} has trained and checkpointed its 2 steps but stopped before its final evaluation" in output
        assert output_says in output, output[-3000:]
        assert json.loads(evaluation.read_text()) == expected and evaluation_records() == 1
        final = torch.load(step_checkpoints(run_dir / "checkpoints")[0][1], weights_only=True)["state_dict"]
        written = torch.load(weights, weights_only=True)
        assert written.keys() == final.keys() and all(torch.equal(written[key], final[key]) for key in final)

    assert evaluation_records() == 1
    weights.unlink()  # killed while writing the weights
    ends_again(f"the final evaluation had ended before the stop: its results are kept from {evaluation}")

    weights.unlink()  # killed during the evaluation: neither its record, its results nor the weights
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if json.loads(line) != expected))
    evaluation.unlink()
    ends_again("step 2: " + next(key for key in expected if key != "step"))  # the evaluation's console line

    again = run_train(overrides)
    assert f"{run_dir} has already trained its 2 steps" in again.stdout + again.stderr, again.stderr[-3000:]


@pytest.mark.timeout(300)
def test_ctrl_c_under_clipscale_torchrun_ends_in_one_line_with_status_130(digits_root, tmp_path):
    """A terminal's Ctrl-C reaches the launcher's process group (torchrun starts each worker in a
    session of its own and passes the signal on): the workers checkpoint and stop, and the
    launcher ends without torchrun's SignalException traceback, with the shell's 130."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    run = subprocess.Popen([sys.executable, "-m", "clipscale.torchrun", "--standalone", "--nproc-per-node", "2",
                            str(REPO / "train.py"), "--config", DIGITS_YAML, *_overrides(digits_root, tmp_path)],
                           cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    _wait_for_steps(run, tmp_path / "tiny" / "metrics.jsonl", 3)
    os.killpg(run.pid, signal.SIGINT)
    output = run.communicate(timeout=120)[0]
    assert run.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    assert output.count("stopped by signal 2 after step ") == 1, output[-3000:]
    assert output.rstrip().splitlines()[-1].startswith("torchrun: stopped by SIGINT"), output[-3000:]
    assert 3 <= step_checkpoints(tmp_path / "tiny" / "checkpoints")[0][0] < STEPS
