"""The GPU reproduction scripts (Tables 1, 2, 4, S1): their --smoke path runs on a CPU and
writes a well-formed JSON with its provenance, and a PNG. The GPU numbers themselves come
from running them on the device (docs/benchmarks.md says how)."""

import json
import sys

import pytest
from tests.helpers.tiny_runs import REPO

from clipscale.distributed import World

sys.path.insert(0, str(REPO / "scripts" / "reproduce"))
import ablation_tiling
import max_batch
import step_time
import training_step

LOSSES = {"vanilla", "local", "disco", "infcl"}


def saved(path):
    record = json.loads(path.read_text())
    assert {"device", "versions", "date", "command"} <= set(record)
    assert path.with_suffix(".png").stat().st_size > 10_000
    return record


@pytest.mark.timeout(120)
def test_max_batch_searches_every_loss_and_offload_and_the_open_clip_baseline(tmp_path):
    out = tmp_path / "max_batch.json"
    max_batch.main(["--smoke", "--out", str(out)])
    record = saved(out)
    assert {(s["loss"], s["offload"]) for s in record["searches"]} == {(loss, o) for loss in LOSSES for o in (False, True)}
    for search in record["searches"] + record["baseline_open_clip_train"]:
        # A CPU never runs out of memory: every search climbs to the --max-batch cap of the smoke run.
        assert search["max_batch"] == 32 and search["max_batch_is"] == "lower bound (--max-batch)"
        assert all(p["step_s"] > 0 for p in search["probes"])


def test_search_bisects_between_the_last_fit_and_the_first_failure():
    fits = lambda batch: {"step_s": 0.0} if batch <= 5000 else {"error": "out of memory"}
    result = max_batch.Search(fits, 1024, resolution=256, multiple=128, deadline=float("inf"), limit=10**6, world=World()).run()
    assert result["max_batch_is"] == "exact" and result["first_failing_batch"] - result["max_batch"] <= 256
    assert 5000 - 256 < result["max_batch"] <= 5000 and result["max_batch"] % 128 == 0


@pytest.mark.timeout(60)
def test_ablation_tiling_runs_the_three_levels(tmp_path):
    out = tmp_path / "ablation.json"
    ablation_tiling.main(["--smoke", "--out", str(out)])
    rows = saved(out)["rows"]
    assert [r["variant"] for r in rows] == ["no tiling (vanilla)", "cross-GPU tiling only", "cross- and in-GPU tiling"]
    assert rows[1]["options"] == {"backend": "reference", "tile_size": 64}  # one tile per rank's block
    assert all(r["step_s"] > 0 for r in rows)


@pytest.mark.timeout(60)
def test_step_time_times_every_loss_at_every_batch(tmp_path):
    out = tmp_path / "step_time.json"
    step_time.main(["--smoke", "--out", str(out)])
    rows = saved(out)["rows"]
    assert {(r["loss"], r["batch"]) for r in rows} == {(loss, b) for loss in LOSSES for b in (16, 32)}
    assert all(r["step_s"] > 0 and r["epoch_h"] > 0 for r in rows)


def test_an_offloaded_batch_beyond_host_memory_counts_as_not_fitting(monkeypatch):
    world = training_step.start("cpu")
    work = training_step.load_workload(training_step.smoke_model_name(), world)
    monkeypatch.setattr(training_step, "HOST_MEMORY_FRACTION", 1e-12)
    result = training_step.training_step(work, world, "infcl", 16, 8, offload=True)
    assert result["error"].startswith("host memory")
    assert "step_s" in training_step.training_step(work, world, "infcl", 16, 8, offload=False)


@pytest.mark.parametrize("batch, real_image_calls", [(8, 1), (32, 3)])
def test_the_memory_probe_runs_the_encoders_on_a_few_chunks_only(batch, real_image_calls):
    """4 chunks: pass 1's first chunk and pass 2's first and final chunk run for real (a single
    chunk is a plain step: one real call); the step still ends with a finite loss."""
    world = training_step.start("cpu")
    work = training_step.load_workload(training_step.smoke_model_name(), world)
    calls = []
    hook = work.model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        result = training_step.training_step(work, world, "infcl", batch, 8, offload=True, memory_probe=True)
    finally:
        hook.remove()
    assert len(calls) == real_image_calls
    assert result["loss"] == result["loss"] and result["step_s"] > 0
    assert "forward" not in vars(work.model)  # the real forward is back
