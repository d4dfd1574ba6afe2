"""`skipped_samples_total` and `shard_errors_total` count the whole run: on two processes reading
broken shards, metrics.jsonl's totals are the sums over ranks of the per-rank counts that the
checkpoint keeps (every rank's count above zero, so rank 0's own would fall short of the sum).
How far each rank has read when the last checkpoint is written depends on its loader's timing, so
the per-rank counts may or may not differ between runs; the sums must hold either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.trainer_harness import checked, newest_checkpoint, shard_run, training_records, write_shards
from tests.helpers.tiny_runs import run_train

pytestmark = pytest.mark.slow

STEPS, BATCH, SHARDS, PER_SHARD = 8, 16, 4, 20  # 80 samples, less the broken: about 2 epochs over 8 steps


@pytest.fixture(scope="module")
def broken_run(module_tmp) -> Path:
    """Four shards with a corrupt JPEG every 7th sample; shards 1 and 3 cut off in the middle
    of a sample at different depths. Each epoch deals two shards to each rank."""
    root = module_tmp("error_totals")
    pattern = write_shards(root / "shards", shards=SHARDS, per_shard=PER_SHARD, corrupt_every=7)
    for part, kept in ((1, 0.3), (3, 0.7)):
        path = root / "shards" / f"part-{part:04d}.tar"
        whole = path.read_bytes()
        path.write_bytes(whole[: int(len(whole) * kept) + 700])
    overrides = shard_run(pattern, root, "broken", f"train.steps={STEPS}", f"train.batch_size={BATCH}",
                          "train.log_every=1", "train.checkpoint_every=100", "data.workers=1", "data.shuffle_buffer=4")
    done = checked(run_train(overrides, nproc=2, timeout=240))
    (root / "console.txt").write_text(done.stdout + done.stderr)
    return root / "broken"


def test_two_processes_log_the_sum_over_ranks_of_skipped_samples_and_shard_errors(broken_run):
    records = training_records(broken_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    ranks = newest_checkpoint(broken_run)["data"]
    assert len(ranks) == 2
    for key in ("skipped_samples", "shard_errors"):
        per_rank = [rank[key] for rank in ranks]
        assert all(per_rank), (key, per_rank)  # both ranks hit damage
        assert records[-1][f"{key}_total"] == sum(per_rank), (key, per_rank)
        assert sum(r[key] for r in records) == sum(per_rank)


def test_the_console_says_what_was_skipped_and_where_without_raw_warnings(broken_run):
    """The console's data lines (metrics.DataProblems, rate-limited: the first comes after the first
    step that met damage) name a damaged shard and the totals; no Python warning reaches it."""
    console = (broken_run.parent / "console.txt").read_text()
    lines = [line for line in console.replace("\r", "\n").splitlines() if line.startswith("data: ")]
    assert lines, console[-3000:]
    assert " skipped" in lines[0] and "/shards/part-000" in lines[0] and "; so far " in lines[0], lines
    assert "Warning" not in console, console[-3000:]
