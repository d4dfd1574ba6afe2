"""scripts/bench_e2e.py in a tiny form on the CPU: a clipscale case through train.py and, in the
same command, its ceiling (clipscale's TrainStep on in-memory tensors, the shards' captions),
with the numbers each row must carry. The real numbers come from a GPU. A case that outlives its
budget is stopped: torchrun's workers run in sessions of their own and hold the output pipe, so
killing the launcher alone would leave the benchmark waiting for that pipe forever."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clipscale.profiling import HOST_SYNCS
from tests.helpers.tiny_runs import REPO

sys.path.insert(0, str(REPO / "scripts"))
import bench_e2e  # noqa: E402
import make_synthetic_shards  # noqa: E402

pytestmark = pytest.mark.timeout(400)

TINY_MODEL = ("model.custom={embed_dim: 32, vision_cfg: {image_size: 32, patch_size: 8, width: 64, layers: 2, head_width: 32}, "
              "text_cfg: {context_length: 77, vocab_size: 49408, width: 64, heads: 2, layers: 2}}")


@pytest.fixture(scope="module")
def shards(module_tmp):
    out = module_tmp("shards")
    make_synthetic_shards.main(["--out", str(out), "--shards", "2", "--per-shard", "32", "--size", "32",
                                          "--captions", "web"])
    return f"{out}/synthetic-{{0000..0001}}.tar"


def args_for(shards: str):
    return type("Args", (), {"shards": shards, "set": ["model.name=null", TINY_MODEL]})


@pytest.mark.slow
def test_a_clipscale_case_reports_its_ceiling_and_the_numbers_of_each_row(shards, tmp_path):
    out = tmp_path / "bench.json"
    bench_e2e.main(["--shards", shards, "--workers", "1", "--set", "model.name=null", "--set", TINY_MODEL,
                    "--case", "runner=clipscale,batch=16,chunk=8,steps=3,ceiling_text=cut", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["device"] and record["command"]
    result = record["cases"][0]
    assert result["exit_code"] == 0 and result["steps_done"] == 3
    assert len(result["data_wait_s"]) == len(result["mfu"]) == len(result["text_positions_per_sample"]) == 3
    ceiling = result["ceiling"]
    assert ceiling["exit_code"] == 0 and ceiling["steps_done"] == 5, ceiling.get("log_tail")
    assert ceiling["case"]["batch"] == 16 and ceiling["case"]["chunk"] == "8"
    assert ceiling["console"] == ["text: padding cut; causal kernel: yes", "towers: eager; CUDA graphs: no"]
    assert ceiling["compiled"] is result["compiled"] is False and "void" not in result  # a CPU run compiles nothing
    assert ceiling["data_wait_s"] == [0.0] * 5 and ceiling["mfu"] == [None] * 5  # no peak known for a CPU
    positions = ceiling["text_positions_per_sample"]
    assert len(set(positions)) == 1 and 8 <= positions[0] < 77
    assert all(loss > 0 for loss in ceiling["losses"])
    assert result["of_ceiling"] == pytest.approx(result["samples_per_s"] / ceiling["samples_per_s"])


def test_the_ceiling_follows_the_runs_towers_text_positions_chunk_and_per_process_batch(shards):
    args = args_for(shards)
    ran_full = {"text_positions_per_sample": [None, None]}
    case = {"runner": "clipscale", "batch": "64", "chunk": "16", "steps": "3", "loss": "vanilla"}
    assert bench_e2e.ceiling_case(case, ran_full, args) == {
        "runner": "ceiling", "loss": "vanilla", "batch": 64, "steps": 5, "text": "full", "chunk": "16"}
    assert bench_e2e.ceiling_case(case, {"text_positions_per_sample": [30.5, 30.5]}, args)["text"] == "cut"
    assert bench_e2e.ceiling_case(case, {"text_positions_per_sample": [77.0]}, args)["text"] == "full"
    auto = {**case, "chunk": "auto", "nproc": "2", "ceiling_text": "cut"}
    ceiling = bench_e2e.ceiling_case(auto, {"auto_chunk": "train.chunk_size=auto: 24 samples per encoder pass (...)"}, args)
    assert (ceiling["chunk"], ceiling["batch"], ceiling["text"]) == ("24", 32, "cut")
    assert bench_e2e.ceiling_case({**case, "chunk": "none"}, ran_full, args)["chunk"] == "64"
    towers = {"patch_embed": "conv", "attention": "short"}  # the run's towers are the ceiling's (issue 49's switches)
    assert towers.items() <= bench_e2e.ceiling_case({**case, **towers}, ran_full, args).items()


def test_each_ranks_data_wait_is_read_where_the_run_logged_it(tmp_path):
    """metrics.jsonl of a run of several processes holds every rank's data wait: each step carries it."""
    (tmp_path / "bench").mkdir()
    record = {"step_s": 2.0, "peak_memory_gib": 1.0, "loss": 3.0, "data_wait_s": 0.1, "mfu": None,
              "text_positions_per_sample": 20.0}
    lines = [{**record, "step": 1, "data_wait_s_by_rank": [0.1, 0.4]}, {**record, "step": 2, "data_wait_s_by_rank": [0.1, 0.2]}]
    (tmp_path / "bench" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = bench_e2e.steps_of({"runner": "clipscale", "batch": "64"}, tmp_path, "")
    assert [step["data_wait_s_by_rank"] for step in steps] == [[0.1, 0.4], [0.1, 0.2]]
    (tmp_path / "bench" / "metrics.jsonl").write_text(json.dumps({**record, "step": 1}) + "\n")
    assert "data_wait_s_by_rank" not in bench_e2e.steps_of({"runner": "clipscale", "batch": "64"}, tmp_path, "")[0]


def test_a_ceiling_of_several_processes_takes_each_ones_batch_and_scales_the_fraction(shards):
    """ceiling_nproc: the ceiling beside a run of several processes runs on as many, each with the
    run's batch a process (the run's collectives included); the fraction compares like with like."""
    args = args_for(shards)
    case = {"runner": "clipscale", "batch": "64", "chunk": "8", "steps": "3", "nproc": "4", "ceiling_nproc": "4"}
    ceiling = bench_e2e.ceiling_case(case, {}, args)
    assert (ceiling["batch"], ceiling["nproc"]) == (64, "4")
    assert "nproc" not in bench_e2e.ceiling_case({**case, "ceiling_nproc": "1"}, {}, args)
    result = {"case": case, "samples_per_s": 300.0, "step_s": [1.0] * 4, "ceiling": {"samples_per_s": 400.0, "steady_step_s": 0.8}}
    bench_e2e.of_ceiling(result, 4, 4)
    assert result["of_ceiling"] == pytest.approx(0.75)
    bench_e2e.of_ceiling(result, 4)  # a ceiling of one process: four of them
    assert result["of_ceiling"] == pytest.approx(300 / 1600)


def test_the_window_keeps_the_last_finished_step_only_of_a_run_stopped_before_its_end():
    """The last step of a run that ran all its steps had no next batch beside it: out. A run stopped
    by its budget was preparing the next batch beside its last finished step: in (the million's
    third step in a 10-minute call). A ceiling drops its first two steps."""
    steps = [10.0, 2.0, 2.1, 1.5]
    assert bench_e2e.measured_window({"runner": "clipscale", "steps": "4"}, steps) == [2.0, 2.1]
    assert bench_e2e.measured_window({"runner": "clipscale", "steps": "5"}, steps) == [2.0, 2.1, 1.5]
    assert bench_e2e.measured_window({"runner": "openclip", "steps": "4"}, steps) == [2.0, 2.1]
    assert bench_e2e.measured_window({"runner": "ceiling", "steps": "4"}, steps) == [2.1, 1.5]
    result = {"case": {"runner": "clipscale", "steps": "5"}, "samples_per_s": 1.0, "step_s": steps,
              "ceiling": {"samples_per_s": 1.0, "steady_step_s": 1.5}}
    bench_e2e.of_ceiling(result, 1)
    assert result["of_ceiling_median"] == 0.75  # 1.5 s over 2.0, 2.1 and 1.5 s: their median


@pytest.mark.slow
def test_a_ceiling_runs_in_two_processes_with_its_loss_across_them(shards, tmp_path):
    """runner=ceiling with nproc=2: torchrun's two processes (gloo here) train their halves of the
    batch under DDP, the loss across both; rank 0 writes the steps. Each process holds the same
    weights, captions and pixels as one process of half the batch: only the loss over both halves
    (each sample's duplicate among the negatives) tells them apart."""
    out = tmp_path / "ceiling.json"
    bench_e2e.main(["--shards", shards, "--workers", "1", "--set", "model.name=null", "--set", TINY_MODEL,
                    "--case", "runner=ceiling,batch=16,chunk=4,steps=3,nproc=2",
                    "--case", "runner=ceiling,batch=8,chunk=4,steps=3", "--out", str(out)])
    two, one = json.loads(out.read_text())["cases"]
    assert two["exit_code"] == 0 and two["steps_done"] == 3, two.get("log_tail")
    assert two["console"] == ["text: padding cut; causal kernel: yes", "towers: eager; CUDA graphs: no"]
    assert one["exit_code"] == 0 and two["losses"][0] > one["losses"][0] + 0.1, (two["losses"], one["losses"])


def test_the_ceilings_captions_are_the_shards_own(shards):
    captions = bench_e2e.shard_captions(shards, {"txt"}, 40)
    assert len(captions) == 40 and all(caption.split()[0] in ("red", "green", "blue", "yellow", "purple", "orange",
                                                                  "black", "white") for caption in captions)
    assert len(bench_e2e.shard_captions(shards, {"txt"}, 1000)) == 64  # all there are


# --- a case that outlives its budget ----------------------------------------------------------

HOLDS_THE_PIPE = ("import subprocess, sys, time; "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
                  "time.sleep(60)")


def test_a_killed_case_takes_its_workers_with_it():
    launcher = subprocess.Popen([sys.executable, "-c", HOLDS_THE_PIPE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(2)  # the worker has started
    bench_e2e.kill_tree(launcher.pid)
    launcher.communicate(timeout=10)  # raises if a worker still holds the pipe


@pytest.mark.slow
def test_a_case_stopped_by_the_budget_says_where_each_thread_of_its_run_was(shards, tmp_path):
    """A run still training when the budget ends prints its threads' stacks (SIGUSR2) before it is
    killed; the record keeps them apart from the log's tail."""
    out = tmp_path / "bench.json"
    bench_e2e.main(["--shards", shards, "--workers", "1", "--budget", "45", "--set", "model.name=null", "--set", TINY_MODEL,
                    "--case", "runner=clipscale,batch=16,chunk=8,steps=100000,resampled=1,ceiling=0", "--out", str(out)])
    result = json.loads(out.read_text())["cases"][0]
    # What the run printed after its stacks (an error line of its own, say) is in the stacks' part.
    assert result["exit_code"] == -9, (result.get("log_tail"), result.get("stacks_at_kill", "")[-4000:])
    stacks = result["stacks_at_kill"]  # wherever the run was (on a loaded machine, maybe still building its parts)
    assert stacks.startswith(("Thread 0x", "Current thread 0x")) and 'trainer.py", line' in stacks and "in main" in stacks, stacks
    assert "Thread 0x" not in result["log_tail"] and "[bench_e2e: killed after" in result["log_tail"][-40:]


@pytest.mark.slow
def test_sigterm_stops_the_running_case_and_writes_what_it_ran(shards, tmp_path):
    """A machine's time limit (`timeout`) sends SIGTERM to the benchmark and then to its whole
    process group: the benchmark stops its case at once and still writes the steps it measured,
    instead of dying with nothing written, and leaves no training process behind. GNU timeout's
    second signal reached a million-sample run on an H100 while it was stopping its case, and the
    record came out with no case at all: here more signals follow the first for two seconds."""
    out = tmp_path / "bench.json"
    bench = subprocess.Popen([sys.executable, str(REPO / "scripts" / "bench_e2e.py"), "--shards", shards, "--workers", "1",
                              "--set", "model.name=null", "--set", TINY_MODEL, "--case",
                              "runner=clipscale,batch=16,chunk=8,steps=100000,resampled=1,ceiling=0", "--out", str(out)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started, training, metrics = time.monotonic(), set(), None  # train.py and its loader workers
    while time.monotonic() - started < 240 and not (metrics and metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.5)
        for pid in bench_e2e.process_tree(bench.pid)[1:]:
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                if any(arg.endswith("train.py") for arg in argv):
                    output = next(arg.split("=", 1)[1] for arg in argv if arg.startswith("run.output_dir="))
                    training.add(pid)
                    metrics = Path(output) / "bench" / "metrics.jsonl"
    os.kill(bench.pid, signal.SIGTERM)
    for _ in range(200):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGTERM)
        time.sleep(0.01)
    log, _ = bench.communicate(timeout=60)
    assert bench.returncode == 143, log[-2000:]
    result = json.loads(out.read_text())["cases"][0]
    assert result["stopped"] == "SIGTERM" and result["steps_done"] >= 3 and len(result["step_s"]) == result["steps_done"]
    assert "[bench_e2e: stopped by SIGTERM after" in result["log_tail"][-60:] and "stacks_at_kill" not in result
    time.sleep(1)  # killed workers are reaped by whoever adopted them

    def running(pid: int) -> bool:  # a zombie is dead: a container's first process may never reap it
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        return False

    assert len(training) >= 2 and not [pid for pid in training if running(pid)]


@pytest.mark.slow
def test_a_profiled_ceiling_reports_where_its_step_went(shards, tmp_path):
    out = tmp_path / "ceiling.json"
    bench_e2e.main(["--shards", shards, "--set", "model.name=null", "--set", TINY_MODEL,
                    "--case", "runner=ceiling,batch=16,chunk=8,steps=3,text=cut,profile=1", "--out", str(out)])
    result = json.loads(out.read_text())["cases"][0]
    assert result["steps_done"] == 3, result.get("log_tail")  # the profiled step is not a timed one
    profile = result["profile"]
    assert profile["step_s"] > 0 and profile["gpu_events"] == 0  # a CPU run: no GPU events to count
    assert set(profile["host_syncs"]) == set(HOST_SYNCS)
