"""What the console says about the steps and the data: the data-wait figure a run records, the
lines StepReport and DataProblems make of the steps, and the library noise kept off the console."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import pytest
import torch.nn as nn

from clipscale import console, metrics
from clipscale.config import load_config
from clipscale.console import PlainProgress, library_noise_kept_off, weights_line
from clipscale.losses import build_loss
from clipscale.metrics import DataProblems, RecordWindow, StepReport, read_metrics
from clipscale.trainer import train

from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run

STEP_S = 0.3  # the slow loss's own time


class SlowLoss(nn.Module):
    """The CLIP loss, STEP_S seconds slower: the step, not the data, sets the pace."""

    def __init__(self):
        super().__init__()
        self.inner = build_loss("vanilla")

    def forward(self, *args):
        time.sleep(STEP_S)
        return self.inner(*args)


def test_data_wait_is_the_time_the_step_waited_for_its_batch_not_the_steps_time(digits_root, tmp_path):
    """With one loader worker a batch ahead and steps of over STEP_S, the data is there when a step
    asks for it: each record's data_wait_s (per step) is a small part of its step_s."""
    cfg = load_config(DIGITS_YAML, tiny_run(digits_root, tmp_path, "train.steps=8", "data.workers=1", "eval.zeroshot=false"))
    train(cfg, loss_fn=SlowLoss())
    records = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    after_start = records[1:]  # the first step's wait is the loader starting
    assert min(r["step_s"] for r in after_start) >= STEP_S
    assert statistics.median(r["data_wait_s"] / r["step_s"] for r in after_start) < 0.25, after_start


@dataclass
class FakePath:
    decoder: str = "loader"
    arenas: bool = False

    def describe(self) -> str:
        return f"training images decoded by {self.decoder}"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def report_of(steps, *, workers=1, cores=8, gpu=False, compiled=False, accepted=("data.workers", "data.decoder"),
              monkeypatch) -> list[str]:
    """The lines of a StepReport over `steps`, each (seconds, of which waiting for data)."""
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    monkeypatch.setattr(metrics, "on_resume", lambda key: "free" if key in accepted else None)
    monkeypatch.setattr(metrics.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(metrics, "seconds_compiling", lambda: 53.0)
    cfg = load_config(DIGITS_YAML, [f"data.workers={workers}"])
    report = StepReport(cfg, FakePath(), compiled=compiled, gpu=gpu, window=10)
    lines = []
    for seconds, waited in steps:
        clock.now += seconds
        lines += report.after_step(waited)
    return lines


def test_one_slow_batch_among_fast_ones_is_not_advice(monkeypatch):
    """One step waited and the others did not: the window's total wait is a third of its time, but
    the median step did not wait. The first step's wait (the loader starting) never counts."""
    steps = [(60.0, 59.0)] + [(0.2, 0.0001)] * 4 + [(1.2, 1.0)] + [(0.2, 0.0001)] * 19
    assert report_of(steps, monkeypatch=monkeypatch) == []


def test_steps_that_wait_get_one_line_naming_knobs_a_resume_accepts(monkeypatch):
    waiting = [(1.0, 0.9)] + [(1.0, 0.3)] * 30
    lines = report_of(waiting, gpu=True, monkeypatch=monkeypatch)
    assert lines == ["steps 2-11 waited for their data 30% of the time (training images decoded by loader): a resume "
                     "accepts more data.workers (now 1, with 8 cores for this process), or data.decoder=device to "
                     "decode on the GPU"]
    # No GPU: no decoder advice. Workers a resume refuses: not named.
    assert report_of(waiting, monkeypatch=monkeypatch)[0].endswith(
        "a resume accepts more data.workers (now 1, with 8 cores for this process)")
    assert report_of(waiting, accepted=("data.decoder",), monkeypatch=monkeypatch)[0].endswith(
        "data.workers sets the loader's processes, and a resume of this run does not accept a change; a new run may")
    assert report_of(waiting, workers=8, monkeypatch=monkeypatch)[0].endswith(
        "data.workers=8 already uses this process's 8 cores: the machine's cores are the limit")
    assert report_of(waiting, workers=1, cores=1, monkeypatch=monkeypatch)[0].endswith(
        "data.workers=1 already uses this process's 1 core: the machine's cores are the limit")


def test_the_compile_line_follows_the_first_step_whatever_the_log_interval(monkeypatch):
    lines = report_of([(60.0, 1.0), (0.2, 0.0)], compiled=True, monkeypatch=monkeypatch)
    assert lines == ["compiling the towers took 53 s of the first step (training images decoded by loader)"]
    assert report_of([(60.0, 1.0)], compiled=False, monkeypatch=monkeypatch) == []


def test_data_problems_are_one_line_at_a_time_with_the_shard_and_the_totals(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "monotonic", clock)
    problems = DataProblems(interval_s=60, steps=6)
    assert problems.after_step((0, 0, 0, 0)) == []
    assert problems.after_step((3, 0, 0, 0), ["shards/00012.tar"]) == [
        "data: 3 samples skipped in shards/00012.tar; so far 3 samples skipped and 0 shards cut short "
        "(metrics.jsonl: skipped_samples, shard_errors)"]
    clock.now = 30  # within the interval: summed into the next line
    assert problems.after_step((4, 1, 0, 0), ["shards/00040.tar"]) == []
    assert problems.after_step((9, 1, 0, 0), ["shards/00041.tar"]) == []
    clock.now = 61
    assert problems.after_step((9, 1, 0, 0)) == [
        "data: 6 samples skipped and 1 shard cut short in shards/00041.tar and 1 other shards; so far 9 samples "
        "skipped and 1 shard cut short (metrics.jsonl: skipped_samples, shard_errors)"]
    clock.now = 62  # the last step's news is said within the interval: the console's totals end as the run's
    assert problems.after_step((10, 1, 0, 0)) == [
        "data: 1 sample skipped; so far 10 samples skipped and 1 shard cut short (metrics.jsonl: skipped_samples, shard_errors)"]
    resumed = DataProblems(totals=(10, 1, 0, 0))  # a resume starts from the checkpoint's totals
    assert resumed.after_step((10, 1, 0, 0)) == []


def test_images_no_decoder_took_are_said_as_trained_black():
    """The GPU decoder's images that nothing decoded (trained black) are data news as skips are."""
    problems = DataProblems(interval_s=0, steps=3)
    assert problems.after_step((0, 0, 0, 2)) == [
        "data: 2 images trained black (no decoder took its bytes); so far 0 samples skipped and 0 shards cut short, "
        "2 images trained black (metrics.jsonl: skipped_samples, shard_errors, images_trained_black)"]
    assert problems.after_step((0, 0, 0, 2)) == []
    assert DataProblems(totals=(0, 0, 0, 2)).after_step((0, 0, 0, 2)) == []  # a resume: said before it


def test_a_data_line_names_the_first_samples_skipped_and_why(monkeypatch):
    """Up to three skipped samples since the previous line, as the pieces named them (a shard and
    key, or a table's image file); a step without the totals over ranks says nothing and keeps them."""
    clock = Clock()
    monkeypatch.setattr(metrics.time, "monotonic", clock)
    problems = DataProblems(interval_s=60, steps=4)
    assert problems.after_step(None, ["a.tar"], [("a.tar: sample 0007", "OSError: image file is truncated")]) == []
    assert problems.after_step((2, 0, 0, 0), ["b.tar"], [("images/3.png", "cannot read the file: no such file")]) == [
        "data: 2 samples skipped in b.tar and 1 other shards; first skipped: a.tar: sample 0007 (OSError: image file "
        "is truncated), images/3.png (cannot read the file: no such file); so far 2 samples skipped and 0 shards cut "
        "short (metrics.jsonl: skipped_samples, shard_errors)"]
    clock.now = 61
    many = [(f"c.tar: sample {i}", "an empty caption") for i in range(5)]
    assert problems.after_step((7, 0, 0, 0), ["c.tar"], many) == [
        "data: 5 samples skipped in c.tar; first skipped: c.tar: sample 0 (an empty caption), c.tar: sample 1 (an empty "
        "caption), c.tar: sample 2 (an empty caption); so far 7 samples skipped and 0 shards cut short (metrics.jsonl: "
        "skipped_samples, shard_errors)"]


def test_captions_cut_are_said_once_with_their_share(monkeypatch):
    problems = DataProblems(totals=(0, 0, 5, 0), batch_size=320)  # a resume: 5 cut before it
    assert problems.after_step((0, 0, 5, 0)) == []
    assert problems.after_step((0, 0, 88, 0)) == [
        "text: 83 of 640 captions so far (13.0%) were longer than the text tower's context length and are cut to it: "
        "the tokenizer keeps a caption's first context_length - 2 tokens and ends it with the end-of-text token, and "
        "the rest is never seen (metrics.jsonl: captions_cut_share)"]
    assert problems.after_step((0, 0, 90, 0)) == []


class CountedBatches:
    """A run's data for `Run.report`: counts the collectives asked for (error_totals)."""

    def __init__(self):
        self.totals_asked = 0
        self.stream = self

    def error_totals(self) -> list[int]:
        self.totals_asked += 1
        return [self.totals_asked, 0, 0, 0]

    def take_problem_shards(self) -> list[str]:
        return ["a.tar"]

    def take_skips(self) -> list[tuple[str, str]]:
        return [("a.tar: sample 1", "an empty caption")]


@pytest.mark.parametrize("start_step", [0, 7])
def test_the_report_gathers_the_data_totals_over_ranks_only_at_the_steps_that_log(start_step, monkeypatch):
    """error_totals is a blocking all-reduce: Run.report asks for it at the logged steps and the
    last one (the same steps on every rank), not every step, and a line says the news then."""
    from types import SimpleNamespace

    from clipscale.trainer import Run

    monkeypatch.setattr(metrics.time, "monotonic", Clock())
    cfg = load_config(DIGITS_YAML, ["train.steps=23", "train.log_every=5"])
    said, batches = [], CountedBatches()
    run = SimpleNamespace(cfg=cfg, start_step=start_step, batches=batches, console=SimpleNamespace(say=said.append),
                          step_report=SimpleNamespace(after_step=lambda wait: []),
                          data_problems=DataProblems(interval_s=0, steps=23 - start_step))
    asked_at = []
    for step in range(start_step + 1, 24):
        before = batches.totals_asked
        Run.report(run, 0.0)
        if batches.totals_asked > before:
            asked_at.append(step)
    assert asked_at == [step for step in (5, 10, 15, 20, 23) if step > start_step]
    assert len(said) == len(asked_at) and all("first skipped: a.tar: sample 1 (an empty caption)" in line for line in said)


def test_the_progress_line_shows_the_text_positions_where_the_padding_cut_computes_fewer():
    record = {"loss": 3.14159, "lr": 0.002, "text_positions_per_sample": 27.94}
    assert RecordWindow.progress_figures(record, 77) == {"loss": "3.1416", "lr": "2.00e-03", "text": "27.9/77 positions"}
    assert RecordWindow.progress_figures({**record, "text_positions_per_sample": 77.0}, 77) == {"loss": "3.1416", "lr": "2.00e-03"}


def test_plain_progress_is_a_line_every_interval_and_one_at_the_end(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(console.time, "monotonic", clock)
    progress = PlainProgress(total=10, initial=2, name="digits", interval_s=30)
    progress.set_postfix({"loss": "3.1416"})
    for now in (10, 20, 31, 40):
        clock.now = now
        progress.update(1)
    progress.close()
    assert capsys.readouterr().err.splitlines() == [
        "digits: step 5/10 (50%), 0.0968 steps/s, 31 s so far, loss=3.1416 (logged at step 2)",
        "digits: step 6/10 (60%), 0.1 steps/s, 40 s so far, loss=3.1416 (logged at step 2)"]


def test_the_progress_line_shows_the_figures_of_its_own_step_or_names_theirs(monkeypatch, capsys):
    """As the trainer calls it: update() after every step, then set_postfix() with that step's loss
    and lr at its logged steps (every 10th here). A line that falls due at a logged step shows that
    step's figures, not the previous record's; one due at another step names the step of its figures."""
    clock = Clock()
    monkeypatch.setattr(console.time, "monotonic", clock)
    progress = PlainProgress(total=40, initial=0, name="digits", interval_s=30)
    for step in range(1, 41):
        clock.now = {20: 31, 25: 65}.get(step, clock.now + 0.1)
        progress.update(1)
        if step % 10 == 0:
            progress.set_postfix({"loss": f"{100 - step}.0", "lr": f"{step}e-04"})
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" s so far, ")[1] for line in lines] == [
        "loss=80.0, lr=20e-04", "loss=80.0, lr=20e-04 (logged at step 20)", "loss=60.0, lr=40e-04"]
    assert [line.split(",")[0] for line in lines] == ["digits: step 20/40 (50%)", "digits: step 25/40 (62%)",
                                                      "digits: step 40/40 (100%)"]


def test_open_clips_random_init_warning_is_kept_off_and_our_line_says_what_loads(caplog):
    noise = "No pretrained weights loaded for model 'x'. Model initialized randomly."
    with caplog.at_level(logging.WARNING):
        with library_noise_kept_off(), library_noise_kept_off():  # nested: one filter, taken off by the outer
            logging.warning(noise)
            logging.warning("something else")
        logging.warning(noise)  # after the run: open_clip speaks again (other code in the process may want it)
    assert [r.getMessage() for r in caplog.records] == ["something else", noise]
    assert weights_line(None, None, 0) == "weights: initialised at random (run.seed 0)"
    assert weights_line("b32.pt", "runs/x/checkpoints/step_00000100.pt", 0) == \
        "weights: from runs/x/checkpoints/step_00000100.pt"


