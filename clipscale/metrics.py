"""Where numbers go: runs/<name>/metrics.jsonl, wandb and TensorBoard (when enabled) and the console.

`RecordWindow` builds a training step's record; `MetricsLogger` writes records. Two reports turn
the steps into console lines, called after every step whatever train.log_every is:
`StepReport` (how long compiling took; whether the steps wait for their data, judged over a
window of steps after the loader's start, with advice that names only knobs this machine has and
a resume accepts) and `DataProblems` (skipped samples, named, and shards cut short, said at the
logged steps, where the totals over ranks are gathered, rate-limited).
Only rank 0 writes. On resume, lines past the checkpoint's step are dropped so
the file always reads as one clean curve, and so is a last line cut short by a
crash or a full disk (with a warning naming the file); that rewrite, like every
evaluation's JSON file, goes to a temporary file renamed over the old one, so a
crash leaves the old file or the new one, never a mix. Every line is strict
JSON: a non-finite number is written as null and its key listed under
"nonfinite" (`{"step": 7, "loss": null, "nonfinite": ["loss"]}`), so any JSON
reader takes the file. TensorBoard's event files (runs/<name>/tensorboard) get
every number of each record as a scalar of that name; on resume its events past
the checkpoint's step are purged the same way.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from clipscale.checkpoint import write_text_atomic
from clipscale.compile import seconds_compiling
from clipscale.config import Config, on_resume
from clipscale.distributed import all_gather_floats
from clipscale.errors import UserError, storage_errors
from clipscale.utilization import peak_bf16_flops

if TYPE_CHECKING:
    from clipscale.step import StepResult

SKIPS_SAID = 3  # skipped samples a data line names, with why
NONFINITE = "nonfinite"  # the key listing a record's values that were NaN or infinite
DATA_COUNTS = ("skipped samples", "shard errors", "captions cut", "images trained black")  # TrainingBatches.error_totals, in its order
TENSORBOARD = "tensorboard"  # the event files' folder in the run folder


def _wandb_mode(mode: str) -> str:
    """'auto' is online only when a key is configured (env or ~/.netrc from `wandb login`)."""
    if mode != "auto":
        return mode
    netrc = Path.home() / ".netrc"
    logged_in = netrc.exists() and "api.wandb.ai" in netrc.read_text()
    return "online" if os.environ.get("WANDB_API_KEY") or logged_in else "offline"


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: Config, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self.tensorboard = None
        if not enabled:
            return
        if self.path.exists():
            kept = [line for line, record in _complete_lines(self.path) if record["step"] <= resume_step]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        if cfg.wandb.enabled:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb.project,
                name=cfg.run.name,
                id=cfg.run.name,
                resume="allow",
                dir=str(run_dir),
                config=cfg.to_dict(),
                mode=_wandb_mode(cfg.wandb.mode),
            )
        if cfg.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            with storage_errors(run_dir / TENSORBOARD, "write"):
                self.tensorboard = SummaryWriter(str(run_dir / TENSORBOARD), purge_step=resume_step + 1)

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values}
        with storage_errors(self.path, "write"), self.path.open("a") as f:
            f.write(strict_json(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, global_step=step)

    def write_json(self, path: Path, values: dict) -> None:
        if self.enabled:
            write_text_atomic(path, strict_json(values, indent=1) + "\n")

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


class RecordWindow:
    """A training step's metrics record: its loss, lr, gradient norm and logit scale, the
    throughput over the steps since the previous record, the peak memory, and the data errors
    (skipped samples, unreadable shards) over all ranks since the previous record and since the
    run began. Its state, the error counts at the previous record, is checkpointed (per rank),
    so the first record after a resume counts from the same record as an uninterrupted run."""

    def __init__(self, batch_size: int, device: torch.device, world_size: int, flops_per_sample: dict[int, int]):
        self.batch_size, self.device, self.world_size = batch_size, device, world_size
        self.flops_per_sample = flops_per_sample  # model FLOPs of a sample by its text length (utilization.py), for `mfu`
        self.peak_flops = peak_bf16_flops(device)
        self.logged_data_errors: list[int] | None = None  # DATA_COUNTS at the previous record
        self._new_window()

    def _new_window(self) -> None:
        self.start, self.steps = time.perf_counter(), 0
        self.data_wait_s = 0.0  # on this rank
        self.text_chunks: list[tuple[int, int]] = []  # (samples, text positions) of the steps' text chunks

    def open(self, data_errors: list[int]) -> None:
        """At the loop's start, with the counts so far (a run that resumes keeps its saved ones)."""
        if self.logged_data_errors is None:
            self.logged_data_errors = data_errors
        self._new_window()

    def step_done(self, data_wait_s: float, text_chunks: list[tuple[int, int]]) -> None:
        self.steps += 1
        self.data_wait_s += data_wait_s
        self.text_chunks += text_chunks

    def record(self, result: StepResult, lr: float, *, logit_scale: float, nonfinite_steps: int,
               data_errors: list[int]) -> dict:
        """The record, and a new window from now."""
        elapsed = time.perf_counter() - self.start
        skipped, shard_errors, captions_cut, black = data_errors
        samples = sum(n for n, _ in self.text_chunks)
        record = {
            "loss": result.loss.item(),
            "lr": lr,
            "logit_scale": logit_scale,
            "grad_norm": result.grad_norm.item(),
            "samples_per_s": self.steps * self.batch_size / elapsed,
            "step_s": elapsed / self.steps,
            "peak_memory_gib": peak_memory_gib(self.device),
            "skipped_samples": skipped - self.logged_data_errors[0],
            "skipped_samples_total": skipped,
            "shard_errors": shard_errors - self.logged_data_errors[1],
            "shard_errors_total": shard_errors,
            "captions_cut_share": (captions_cut - self.logged_data_errors[2]) / (self.steps * self.batch_size),
            "captions_cut_total": captions_cut,
            "images_trained_black": black - self.logged_data_errors[3],  # the GPU decoder's: no decoder took them
            "images_trained_black_total": black,
            "nonfinite_steps": nonfinite_steps,
            "data_wait_s": self.data_wait_s / self.steps,  # per step, on this rank
            "text_positions_per_sample": sum(n * positions for n, positions in self.text_chunks) / samples,
            "time": time.time(),
        }
        if self.world_size > 1:  # where a rank waited for data while the others did not (every rank calls `record`)
            record["data_wait_s_by_rank"] = all_gather_floats(record["data_wait_s"], self.device)
        if self.peak_flops is not None:  # the FLOPs of the text positions computed, not of the padding
            flops = sum(n * self.flops_per_sample[positions] for n, positions in self.text_chunks) / samples
            record["mfu"] = flops * record["samples_per_s"] / self.world_size / self.peak_flops
        self.logged_data_errors = list(data_errors)
        self._new_window()
        return record

    @staticmethod
    def progress_figures(record: dict, context_length: int) -> dict:
        """What the progress line shows of a record: its loss and lr, and the text positions
        computed per sample where cutting the padding computes fewer than the context length."""
        figures = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}"}
        if record["text_positions_per_sample"] < context_length:
            figures["text"] = f"{record['text_positions_per_sample']:.1f}/{context_length} positions"
        return figures

    def state_dict(self) -> dict:
        return {"logged_data_errors": self.logged_data_errors}

    def load_state_dict(self, state: dict) -> None:
        saved = state["logged_data_errors"]
        self.logged_data_errors = saved + [0] * (len(DATA_COUNTS) - len(saved))  # a checkpoint from before some were counted


class StepReport:
    """Console lines about the steps, from every step (not only the logged ones):

    - after the first step of this process, how long compiling the towers took (when compiled);
    - once a run, when the steps waited for their data: judged over the first `window` steps after
      the first (whose wait is the loader starting), and only when the median step waited over
      `threshold` of its time, so one slow piece among fast ones says nothing. The advice names
      only what would help on this machine and what a resume accepts (the schema's `on_resume`).

        report = StepReport(cfg, batches.path, compiled, gpu=world.device.type == "cuda")
        for line in report.after_step(batch.data_wait_s): console.say(line)
    """

    def __init__(self, cfg: Config, path, compiled: bool, gpu: bool, window: int = 20, threshold: float = 0.1):
        self.cfg, self.path, self.compiled, self.gpu = cfg, path, compiled, gpu
        # this process's share of the machine's cores (torchrun says how many processes share it)
        self.cores = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.window, self.threshold = window, threshold
        self.steps = 0
        self.last = time.perf_counter()
        self.shares: list[float] = []  # each judged step's wait / its time
        self.waited = self.elapsed = 0.0

    def after_step(self, data_wait_s: float) -> list[str]:
        now, self.steps = time.perf_counter(), self.steps + 1
        elapsed, self.last = now - self.last, now
        if self.steps == 1:
            return [f"compiling the towers took {seconds_compiling():.0f} s of the first step ({self.path.describe()})"
                    ] if self.compiled else []
        if len(self.shares) >= self.window:
            return []
        self.shares.append(min(1.0, data_wait_s / max(elapsed, 1e-9)))
        self.waited, self.elapsed = self.waited + data_wait_s, self.elapsed + elapsed
        if len(self.shares) < self.window or sorted(self.shares)[len(self.shares) // 2] <= self.threshold:
            return []
        return [f"steps 2-{self.window + 1} waited for their data {100 * self.waited / self.elapsed:.0f}% of the time "
                f"({self.path.describe()}): {self.advice()}"]

    def advice(self) -> str:
        data = self.cfg.data
        knobs = []
        if data.workers < self.cores and on_resume("data.workers") is not None:
            knobs.append(f"more data.workers (now {data.workers}, with {_count(self.cores, 'core')} for this process)")
        if self.gpu and self.path.decoder != "device" and on_resume("data.decoder") is not None:
            knobs.append("data.decoder=device to decode on the GPU")
        if self.path.arenas and on_resume("data.worker_decode_share") is not None:
            knobs.append("a lower data.worker_decode_share, so the GPU decodes the rest of the JPEGs")
        if knobs:
            return "a resume accepts " + ", or ".join(knobs)
        if data.workers >= self.cores:
            return (f"data.workers={data.workers} already uses this process's {_count(self.cores, 'core')}: the machine's "
                    "cores are the limit")
        return "data.workers sets the loader's processes, and a resume of this run does not accept a change; a new run may"


class DataProblems:
    """Console lines for data problems: samples skipped (undecodable, missing a member) and shards
    cut short, each line saying how many since the previous line, in which shard, the first few
    samples skipped (where and why) and the totals so far; at most one line every `interval_s`
    seconds (what happens meanwhile is summed into the next line), except after the run's last
    step (`steps` of them in this process), whose line brings the totals to the end.

    `after_step` is called after every step with the shards the problems were last seen in and the
    (where, why) of the first samples skipped (this rank's pieces' records), and, at the steps that
    gather them (a collective: the trainer's logged steps, the last among them), the run's totals
    over all ranks; it returns the line when one is due. A step without totals says nothing.

    Captions longer than the context length are cut, not skipped: the first step with totals that
    counts a cut one gets a line with the share cut so far (of `batch_size` captions a step), once;
    metrics.jsonl has the share at every record."""

    def __init__(self, interval_s: float = 60.0, totals: tuple[int, ...] = (0, 0, 0, 0), steps: int | None = None,
                 batch_size: int = 0):
        self.interval_s = interval_s
        # (skipped samples, shard errors, images trained black) at the previous line (a resume: the checkpoint's)
        self.said = (totals[0], totals[1], totals[3])
        self.captions_cut_before = totals[2]  # at this process's start
        self.captions_said = False
        self.steps, self.batch_size, self.steps_done = steps, batch_size, 0
        self.shards: list[str] = []
        self.skips: list[tuple[str, str]] = []  # (where, why) of the first samples skipped since the last line
        self.next_at = 0.0

    def after_step(self, totals: Sequence[int] | None, shards: Sequence[str] = (),
                   skips: Sequence[tuple[str, str]] = ()) -> list[str]:
        """`totals`: DATA_COUNTS over all ranks since the run began, or None."""
        self.steps_done += 1
        self.shards += [shard for shard in shards if shard not in self.shards]
        self.skips += list(skips)[: SKIPS_SAID - len(self.skips)]
        if totals is None:
            return []
        skipped_total, shard_errors_total, captions_cut_total, black_total = totals
        lines = self.captions_line(captions_cut_total)
        skipped, cut, black = skipped_total - self.said[0], shard_errors_total - self.said[1], black_total - self.said[2]
        last = self.steps_done == self.steps
        if not (skipped or cut or black) or (time.monotonic() < self.next_at and not last):
            return lines
        self.next_at = time.monotonic() + self.interval_s
        news = [text for count, text in ((skipped, _count(skipped, "sample") + " skipped"),
                                         (cut, _count(cut, "shard") + " cut short"),
                                         (black, _count(black, "image") + " trained black (no decoder took its bytes)"))
                if count]
        where = ""
        if self.shards:
            where = f" in {self.shards[-1]}" + (f" and {len(self.shards) - 1} other shards" if len(self.shards) > 1 else "")
        named = ""
        if self.skips:
            named = "; first skipped: " + ", ".join(f"{place} ({why})" for place, why in self.skips)
        self.said, self.shards, self.skips = (skipped_total, shard_errors_total, black_total), [], []
        blacks = f", {_count(black_total, 'image')} trained black" if black_total else ""
        return [*lines, f"data: {' and '.join(news)}{where}{named}; so far {_count(skipped_total, 'sample')} skipped and "
                f"{_count(shard_errors_total, 'shard')} cut short{blacks} (metrics.jsonl: skipped_samples, shard_errors"
                f"{', images_trained_black' if black_total else ''})"]

    def captions_line(self, captions_cut_total: int) -> list[str]:
        cut = captions_cut_total - self.captions_cut_before
        if self.captions_said or not cut:
            return []
        self.captions_said = True
        captions = self.steps_done * self.batch_size
        return [f"text: {cut:,} of {captions:,} captions so far ({100 * cut / captions:.1f}%) were longer than the text "
                "tower's context length and are cut to it: the tokenizer keeps a caption's first context_length - 2 "
                "tokens and ends it with the end-of-text token, and the rest is never seen (metrics.jsonl: "
                "captions_cut_share)"]


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def peak_memory_gib(device: torch.device) -> float:
    """The most memory the run has held: on a GPU what PyTorch's allocator took from the device
    (reserved), not what its tensors used (allocated). A step's blocks replayed as CUDA graphs use
    memory of the graphs' own pools, which the allocated figure leaves out: ViT-B/32's ceiling at
    chunk 4,096 held 129 GiB of an H200 while it said 8.7 (results/bench_ceiling_h200_b32_chunks_memory.json)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def strict_json(record: dict, **options) -> str:
    """`record` as JSON without NaN or Infinity (which strict readers reject): each non-finite
    top-level number becomes null and its key is listed under "nonfinite"."""
    nonfinite = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
    if nonfinite:
        record = {**{key: None if key in nonfinite else value for key, value in record.items()}, NONFINITE: nonfinite}
    return json.dumps(record, allow_nan=False, **options)


def _complete_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of every line of a metrics file. A last line that is cut short is
    dropped with a warning; an unreadable line before it is a UserError naming it."""
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            records.append((line, json.loads(line)))
        except json.JSONDecodeError as err:
            if number == len(lines):
                warnings.warn(f"{path}: dropped its last line, cut short by an interrupted write: {line[:80]!r}", stacklevel=3)
                break
            raise UserError(f"{path} line {number} is not JSON ({err.msg}); remove or repair that line") from None
    return records


def read_metrics(path: Path) -> list[dict]:
    return [record for _, record in _complete_lines(Path(path))]
