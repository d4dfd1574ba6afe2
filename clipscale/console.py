"""The run's console: rank 0's progress bar, and one line per event above it.

    console = Console(world.is_main)
    console.say("step 100: checkpoint saved to ...")       # every rank may call it; rank 0 prints
    bar = console.progress_bar(total=steps, initial=start, name=cfg.run.name)

Lines go through `tqdm.write` so an open progress bar is not torn, and are flushed at once
(a Slurm log or a pipe shows them now, not when the buffer fills).

Libraries' expected noise stays off the console: `library_noise_kept_off()` drops open_clip's "No
pretrained weights loaded ... initialized randomly" (a run says what it loads, once, in its own
words: `weights_line`), and `native_noise_filtered()` holds back what a native library prints on
file descriptor 2 while it starts (nvImageCodec's "Failed to load nvtiff library!" and its
`[ERROR]` line about that optional extension), letting through every other line, and all of them
when the start fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from typing import Iterator, Optional

from tqdm import tqdm

# open_clip warns on the root logger for any model it builds without its own weights, also when a
# checkpoint loads next; the run says what it loads instead (weights_line).
OPEN_CLIP_RANDOM_INIT = "No pretrained weights loaded for model"
# What nvImageCodec prints at every start where its optional TIFF extension has no libnvtiff.
NVIMGCODEC_NOISE = re.compile(r"nvtiff", re.IGNORECASE)

PERCENT_METRICS = ("acc", "recall")  # fractions shown as percentages


class Console:
    def __init__(self, is_main: bool):
        self.is_main = is_main

    def say(self, line: str) -> None:
        if self.is_main:
            tqdm.write(line)
            sys.stdout.flush()

    def progress_bar(self, total: int, initial: int, name: str) -> tqdm:
        return tqdm(total=total, initial=initial, disable=not self.is_main, desc=name, dynamic_ncols=True)


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


@contextlib.contextmanager
def native_noise_filtered(noise: re.Pattern = NVIMGCODEC_NOISE) -> Iterator[None]:
    """Inside the block, what native code writes to file descriptor 2 is held back; after it,
    every line that does not match `noise` is written to stderr. When the block raises, every
    line is written, noise included: it may say why."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if failed or not noise.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


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
