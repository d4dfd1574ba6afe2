"""The lines a run prints besides its progress bar, one per event.

Each function returns the line; the trainer prints it on rank 0 (through
`tqdm.write` while a progress bar is open, so the bar is not torn).
"""

from __future__ import annotations

from pathlib import Path

PERCENT_METRICS = ("acc", "recall")  # fractions shown as percentages


def run_resumed(run_dir: Path, step: int) -> str:
    if step == 0:
        return f"resuming {run_dir} from step 0 (it has no checkpoint yet)"
    return f"resuming {run_dir} from step {step}"


def run_already_complete(run_dir: Path, step: int) -> str:
    return (f"{run_dir} has already trained its {step} steps; to train on, raise train.steps with run.extend_steps=true, "
            "or choose a new run.name")


def run_finishing(run_dir: Path, step: int) -> str:
    return (f"{run_dir} has trained and checkpointed its {step} steps but stopped before its final evaluation "
            "and weights were written; writing them now")


def evaluation_reused(path: Path) -> str:
    return f"the final evaluation had ended before the stop: its results are kept from {path}"


def checkpoint_saved(path: Path, step: int) -> str:
    return f"step {step}: checkpoint saved to {path}"


def stopped_by_signal(signum: int, step: int) -> str:
    return f"stopped by signal {signum} after step {step}; the same command resumes from the checkpoint"


def evaluation_ended(step: int, results: dict) -> str:
    """`step 100: zeroshot_acc1 96.67%, zeroshot_acc5 99.72%` (accuracies and recalls as
    percentages, counts as integers, anything else to 4 significant digits)."""
    return f"step {step}: " + ", ".join(f"{key} {_figure(key, value)}" for key, value in results.items())


def _figure(key: str, value) -> str:
    if isinstance(value, float) and any(word in key for word in PERCENT_METRICS):
        return f"{100 * value:.2f}%"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
