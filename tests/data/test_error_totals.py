"""`skipped_samples_total`, `shard_errors_total` and `captions_cut_total` count the whole run: on two
processes reading broken shards, metrics.jsonl's totals are the sums over ranks of the per-rank
counts that the checkpoint keeps (rank 1 meets damage too, so rank 0's own would fall short of the
sum), and so are the console's. How far each rank has read when the last checkpoint is written
depends on its loader's timing, so the per-rank counts may or may not differ between runs (one run
counted the shards cut short as [3, 0]); the sums must hold either way. The run's output goes to
pipes, as to a log file: plain progress lines there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.trainer_harness import checked, newest_checkpoint, shard_run, training_records, write_shards
from tests.helpers.tiny_runs import run_train

pytestmark = pytest.mark.slow

STEPS, BATCH, SHARDS, PER_SHARD = 8, 16, 4, 20  # 80 samples, less the broken: about 2 epochs over 8 steps


@pytest.fixture(scope="module")
def broken_run(module_tmp) -> Path:
    """Four shards with a corrupt JPEG every 7th sample; shards 1 and 3 cut off in the middle
    of a sample at different depths. Each epoch deals two shards to each rank. A text context of 4
    positions cuts every caption ("sample number 12" is 5 tokens with its start and end)."""
    root = module_tmp("error_totals")
    pattern = write_shards(root / "shards", shards=SHARDS, per_shard=PER_SHARD, corrupt_every=7)
    for part, kept in ((1, 0.3), (3, 0.7)):
        path = root / "shards" / f"part-{part:04d}.tar"
        whole = path.read_bytes()
        path.write_bytes(whole[: int(len(whole) * kept) + 700])
    overrides = shard_run(pattern, root, "broken", f"train.steps={STEPS}", f"train.batch_size={BATCH}",
                          "train.log_every=1", "train.checkpoint_every=100", "data.workers=1", "data.shuffle_buffer=4",
                          "model.custom.text_cfg.context_length=4")
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
        assert sum(per_rank) > 0, (key, per_rank)  # the run hit damage; which rank counts a shard cut short is timing's
        assert records[-1][f"{key}_total"] == sum(per_rank), (key, per_rank)
        assert sum(r[key] for r in records) == sum(per_rank)
    # A corrupt JPEG every 7th sample: rank 1's 64 samples hold some, so rank 0's own count falls short of the total.
    assert ranks[1]["skipped_samples"] > 0, ranks
    assert [rank["captions_cut"] for rank in ranks] == [STEPS * BATCH // 2] * 2  # every caption of each rank's batches
    assert records[-1]["captions_cut_total"] == STEPS * BATCH
    assert [r["captions_cut_share"] for r in records] == [1.0] * STEPS


def test_the_console_says_what_was_skipped_and_where_without_raw_warnings(broken_run):
    """The console's data lines (metrics.DataProblems, rate-limited: the first comes after the first
    step that met damage) name a damaged shard, the first samples rank 0 skipped with why, and the
    totals; no Python warning reaches it."""
    console = (broken_run.parent / "console.txt").read_text()
    lines = [line for line in console.replace("\r", "\n").splitlines() if line.startswith("data: ")]
    assert lines, console[-3000:]
    assert " skipped" in lines[0] and "/shards/part-000" in lines[0] and "; so far " in lines[0], lines
    named = [re.search(r"first skipped: (\S+/shards/part-000\d\.tar): sample (\S+) \(([^)]*)", line) for line in lines]
    assert any(named), lines
    shard, key, why = next(found for found in named if found).groups()
    assert why.startswith(("UnidentifiedImageError: ", "OSError: ")), lines
    assert "Warning" not in console, console[-3000:]


def test_the_consoles_totals_are_the_runs_over_both_ranks(broken_run):
    """The last data line (the last step's news is said whatever the rate limit) says the last
    record's totals, which count both ranks; the captions cut are said once, with their share."""
    console = (broken_run.parent / "console.txt").read_text()
    last = [line for line in console.splitlines() if line.startswith("data: ")][-1]
    said = re.search(r"so far ([\d,]+) samples? skipped and ([\d,]+) shards? cut short", last)
    assert said, last
    final = training_records(broken_run)[-1]
    assert [int(n.replace(",", "")) for n in said.groups()] == [final["skipped_samples_total"], final["shard_errors_total"]]
    captions = [line for line in console.splitlines() if line.startswith("text: ")]
    assert captions == [f"text: {BATCH} of {BATCH} captions so far (100.0%) were longer than the text tower's context "
                        "length and are cut to it: the tokenizer keeps a caption's first context_length - 2 tokens and "
                        "ends it with the end-of-text token, and the rest is never seen (metrics.jsonl: captions_cut_share)"]


def test_progress_in_a_log_is_plain_lines(broken_run):
    """No carriage returns or cursor moves (tqdm's redraws) where the output is not a terminal: a
    plain line for the progress, the last one at the last step."""
    console = (broken_run.parent / "console.txt").read_text()
    assert "\r" not in console and "\x1b[" not in console, repr(console[-2000:])
    assert re.search(rf"^broken: step {STEPS}/{STEPS} \(100%\), [\d.]+ steps/s, \d+ s so far, loss=", console, re.MULTILINE), console[-2000:]
