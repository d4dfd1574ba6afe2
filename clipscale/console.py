"""The run's console: rank 0's progress bar, and one line per event above it.

    console = Console(world.is_main)
    console.say("step 100: checkpoint saved to ...")       # every rank may call it; rank 0 prints
    bar = console.progress_bar(total=steps, initial=start, name=cfg.run.name)

Lines go through `tqdm.write` so an open progress bar is not torn, and are flushed at once
(a Slurm log or a pipe shows them now, not when the buffer fills).
"""

from __future__ import annotations

import sys

from tqdm import tqdm

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
