"""scripts/bench_loader.py on JPEG shards on the CPU: each case in a process of its own, so one
case's end (its workers stopping, its arenas' memory given back) cannot slow the next one's first
batch, and a case that fails is recorded as such while the others run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.jpeg_shards import write_jpeg_shards
from tests.helpers.tiny_runs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_each_case_runs_in_its_own_process_and_a_failing_one_is_recorded(digits_root, tmp_path):
    (tmp_path / "shards").mkdir()
    urls = write_jpeg_shards(digits_root, tmp_path / "shards")
    shards = urls[0].replace("train-0", "train-{0..2}")
    case = "decoder=loader,batch=64,chunk=32,batches=2"
    out = tmp_path / "bench_loader.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_loader.py"), "--shards", shards, "--workers", "1",
                           "--case", case, "--case", "decoder=bogus,batch=64", "--case", case, "--out", str(out)],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    first, failed, again = json.loads(out.read_text())["cases"]
    for measured in (first, again):
        assert "error" not in measured, measured["error"]
        assert measured["first_batch_s"] > 0 and len(measured["later_batch_s"]) == 1, measured
        assert measured["cores_busy"] > 0  # the CPU seconds of its process and its loader worker
        assert measured["first_batch"]["from_the_loaders_start_s"] > 0
    assert first["process"] != again["process"]
    assert "data.decoder" in failed["error"] and failed["case"]["decoder"] == "bogus"
