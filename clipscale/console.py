"""The run's console: rank 0's progress bar, and one line per event above it.

    console = Console(world.is_main)
    console.say("step 100: checkpoint saved to ...")       # every rank may call it; rank 0 prints
    bar = console.progress_bar(total=steps, initial=start, name=cfg.run.name)

Lines go through `tqdm.write` so an open progress bar is not torn, and are flushed at once
(a Slurm log or a pipe shows them now, not when the buffer fills). The bar is tqdm's only on a
terminal: its redraws are carriage returns and cursor moves, which a log file keeps as noise, so
where stderr is a file or a pipe a plain line says the same every half minute (`PlainProgress`).

Libraries' expected noise stays off the console: `library_noise_kept_off()` drops open_clip's "No
pretrained weights loaded ... initialized randomly" (a run says what it loads, once, in its own
words: `weights_line`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator, Optional

from tqdm import tqdm

# open_clip warns on the root logger for any model it builds without its own weights, also when a
# checkpoint loads next; the run says what it loads instead (weights_line).
OPEN_CLIP_RANDOM_INIT = "No pretrained weights loaded for model"

PERCENT_METRICS = ("acc", "recall")  # fractions shown as percentages


class Console:
    def __init__(self, is_main: bool):
        self.is_main = is_main

    def say(self, line: str) -> None:
        if self.is_main:
            tqdm.write(line)
            sys.stdout.flush()

    def progress_bar(self, total: int, initial: int, name: str) -> tqdm | PlainProgress:
        if not on_terminal():
            return PlainProgress(total, initial, name, enabled=self.is_main)
        return tqdm(total=total, initial=initial, disable=not self.is_main, desc=name, dynamic_ncols=True)


def on_terminal() -> bool:
    """Whether progress bars (written to stderr) reach a terminal rather than a file or a pipe."""
    return sys.stderr.isatty()


class PlainProgress:
    """The progress bar where stderr is a file or a pipe (a Slurm log, `2> train.log`): one plain
    line at most every `interval_s` seconds and one at the end, with what tqdm's bar would show.

        digits: step 120/200 (60%), 3.41 steps/s, 35 s so far, loss=3.2956, lr=8.44e-04

    The figures (`set_postfix`) are those of the step they were set at, which the trainer does
    after that step's `update`, at its logged steps. So a line that falls due at a step is said
    once that step's figures could have come: at its `set_postfix` (then they are that step's),
    or else at the next `update` or `close`, which name the step the figures are from:
    `loss=3.2956, lr=8.44e-04 (logged at step 110)`.
    """

    def __init__(self, total: int, initial: int, name: str, enabled: bool = True, interval_s: float = 30.0):
        self.total, self.n, self.name, self.enabled, self.interval_s = total, initial, name, enabled, interval_s
        self.start_n, self.start = initial, time.monotonic()
        self.next_at = self.start + interval_s
        self.postfix = ""
        self.postfix_n = initial  # the step the figures are from
        self.said_n = initial  # the step of the last line
        self.due_at: Optional[float] = None  # when a line fell due that is not said yet

    def update(self, steps: int = 1) -> None:
        if self.due_at is not None:  # no figures came for the step the line fell due at
            self._say()
        self.n += steps
        now = time.monotonic()
        if now >= self.next_at:
            self.due_at, self.next_at = now, now + self.interval_s

    def set_postfix(self, figures: dict) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in figures.items())
        self.postfix_n = self.n
        if self.due_at is not None:
            self._say()

    def close(self) -> None:
        if self.due_at is not None or self.n != self.said_n:
            self._say()

    def _say(self) -> None:
        now = self.due_at if self.due_at is not None else time.monotonic()
        self.due_at, self.said_n = None, self.n
        if not self.enabled:
            return
        elapsed = now - self.start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        figures = ""
        if self.postfix:
            figures = f", {self.postfix}" + ("" if self.postfix_n == self.n else f" (logged at step {self.postfix_n})")
        line = (f"{self.name}: step {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%), {rate:.3g} steps/s, "
                f"{elapsed:.0f} s so far{figures}")
        print(line, file=sys.stderr, flush=True)


def _not_open_clip_random_init(record: logging.LogRecord) -> bool:
    return OPEN_CLIP_RANDOM_INIT not in record.getMessage()


@contextlib.contextmanager
def library_noise_kept_off() -> Iterator[None]:
    """Inside the block, open_clip's random-initialisation warning stays off the console (the
    filter is one function: nested blocks add it once, and the outermost takes it off)."""
    root = logging.getLogger()
    added = _not_open_clip_random_init not in root.filters
    root.addFilter(_not_open_clip_random_init)
    try:
        yield
    finally:
        if added:
            root.removeFilter(_not_open_clip_random_init)


def weights_line(pretrained: Optional[str], resumed_from: Optional[str], seed: int) -> str:
    """What the run's weights start from, in one line: the checkpoint it resumes, the
    model.pretrained file, or a random initialisation from run.seed."""
    if resumed_from is not None:
        return f"weights: from {resumed_from}"
    if pretrained is not None:
        return f"weights: model.pretrained {pretrained}"
    return f"weights: initialised at random (run.seed {seed})"


def figures(results: dict) -> str:
    """`zeroshot_acc1 96.67%, zeroshot_acc5 99.72%`: accuracies and recalls as percentages,
    counts as integers, anything else to 4 significant digits."""
    return ", ".join(f"{key} {_figure(key, value)}" for key, value in results.items())


def _figure(key: str, value) -> str:
    if isinstance(value, float) and any(word in key for word in PERCENT_METRICS):
        return f"{100 * value:.2f}%"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
