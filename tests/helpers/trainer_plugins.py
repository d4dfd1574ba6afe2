"""Losses registered for trainer tests: a real loss with faults scripted per call; kill points;
a record of the checkpoint files each process reads and of the samples its steps use; a loss that records which GPUs its
process holds a context on.

Imported by tests that train in-process and by `train_with_plugins.py`, which runs the
real `train.py` with these losses registered (train.py has no plugin option of its own)
and, when the environment names one (KILL_AT), a kill point (`install_kill_point`),
(READS_TO) the record of reads (`record_checkpoint_reads`), and (USED_TO) the record of the
samples the steps used (`record_used_samples`).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
from pathlib import Path

import torch

from clipscale.losses import build_loss, register_loss

KILL_AT = "CLIPSCALE_TEST_KILL_AT"  # "<when>:<file name prefix>" or "metrics_line", see install_kill_point
READS_TO = "CLIPSCALE_TEST_READS_TO"  # a folder: see record_checkpoint_reads
USED_TO = "CLIPSCALE_TEST_USED_TO"  # a folder: see record_used_samples


class _InfGradient(torch.autograd.Function):
    """Identity forward; an infinite gradient backward: the loss stays finite, the gradients do not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.inf)


@register_loss("scripted_faults")
class ScriptedFaults(torch.nn.Module):
    """`inner` (any registered loss), except on the listed calls of this process (1-based):

    nan_loss_calls:  the returned loss is NaN, its gradients are the inner loss's (finite);
    inf_grad_calls:  the loss is finite, the image features' gradient is infinite;
    overflow_calls:  the loss times 1e6, which overflows fp16 gradients under a GradScaler;
    signal_calls:    `signal_name` (SIGUSR1) to this process during the step (only on rank
                     `signal_rank` if given, and only `signal_times` times per `signal_marker`
                     file, one line each, so a resumed run goes on); with `signal_group`, to its
                     whole process group, its loader workers too, as Slurm signals a job's processes.
    """

    def __init__(self, inner="vanilla", inner_options=None, nan_loss_calls=(), inf_grad_calls=(), overflow_calls=(),
                 signal_calls=(), signal_rank=None, signal_marker=None, signal_name="SIGUSR1", signal_times=1,
                 signal_group=False):
        super().__init__()
        self.inner = build_loss(inner, **(inner_options or {}))
        self.nan_loss_calls, self.inf_grad_calls = set(nan_loss_calls), set(inf_grad_calls)
        self.overflow_calls, self.signal_calls = set(overflow_calls), set(signal_calls)
        self.signal_rank, self.signal_marker = signal_rank, signal_marker
        self.signum, self.signal_times, self.signal_group = signal.Signals[signal_name], signal_times, signal_group
        self.calls = 0

    def forward(self, image, text, *scalars):
        self.calls += 1
        if self.calls in self.inf_grad_calls:
            image = _InfGradient.apply(image)
        loss = self.inner(image, text, *scalars)
        if self.calls in self.nan_loss_calls:
            loss = loss + math.nan  # a constant: the gradients stay finite
        if self.calls in self.overflow_calls:
            loss = loss * 1e6
        if self.calls in self.signal_calls and self._signal_here():
            if self.signal_group:
                os.killpg(os.getpgrp(), self.signum)
            else:
                os.kill(os.getpid(), self.signum)
        return loss

    def _signal_here(self) -> bool:
        if self.signal_rank is not None and int(os.environ.get("RANK", "0")) != self.signal_rank:
            return False
        if self.signal_marker is not None:
            marker = Path(self.signal_marker)
            sent = marker.read_text().count("\n") if marker.exists() else 0
            if sent >= self.signal_times:
                return False
            marker.write_text("signalled\n" * (sent + 1))
        return True


@register_loss("gpus_in_use")
class GpusInUse(torch.nn.Module):
    """`inner`, which also writes, at its `at_call`-th call, the indices of the GPUs on which this
    process or a process it started (the JPEG decoding process) holds a CUDA context (NVML's compute
    processes) to `folder`/rank<RANK>.json. By then the step's data threads and the decoding process
    (batch gathering, decoding ahead) have done their CUDA work."""

    def __init__(self, folder, inner="vanilla", at_call=2):
        super().__init__()
        self.inner, self.folder, self.at_call, self.calls = build_loss(inner), Path(folder), at_call, 0

    def forward(self, image, text, *scalars):
        self.calls += 1
        if self.calls == self.at_call:
            import pynvml

            pynvml.nvmlInit()
            ours = {os.getpid(), *(child.pid for child in multiprocessing.active_children())}
            held = [index for index in range(pynvml.nvmlDeviceGetCount())
                    if ours & {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(
                        pynvml.nvmlDeviceGetHandleByIndex(index))}]
            (self.folder / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(held))
        return self.inner(image, text, *scalars)


def install_kill_point(spec: str) -> None:
    """SIGKILL this process at the first event `spec` names, as a power cut or the OOM killer would:

    create:NAME         the temporary file of an atomic write to NAME* is about to be created
    before_rename:NAME  that temporary file is written and synced, not yet renamed to NAME*
    after_rename:NAME   NAME* has just taken its final name
    metrics_line        half of the first metrics.jsonl line of a step's record has been written
    """
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if spec == "metrics_line":
        from clipscale.metrics import MetricsLogger, strict_json

        log = MetricsLogger.log

        def log_half_then_die(self, step, values):
            if self.enabled and "loss" in values:
                line = strict_json({"step": step, **values})
                with self.path.open("a") as f:
                    f.write(line[: len(line) // 2])
                die()
            log(self, step, values)

        MetricsLogger.log = log_half_then_die
        return
    when, name = spec.split(":")
    replace, open_file = os.replace, os.open

    def killing_replace(source, target, *args, **kwargs):
        if when == "before_rename" and Path(target).name.startswith(name):
            die()
        replace(source, target, *args, **kwargs)
        if when == "after_rename" and Path(target).name.startswith(name):
            die()

    def killing_open(path, flags, *args, **kwargs):
        if when == "create" and Path(path).name.startswith(f".{name}"):  # the temporary file is .<name>.<pid>-...
            die()
        return open_file(path, flags, *args, **kwargs)

    os.replace, os.open = killing_replace, killing_open


def record_checkpoint_reads(folder: str) -> None:
    """Each process appends the name of every .pt file it torch.loads to <folder>/rank<RANK>."""
    load = torch.load

    def recording_load(f, *args, **kwargs):
        if isinstance(f, (str, Path)) and Path(f).suffix == ".pt":
            with open(Path(folder) / f"rank{os.environ.get('RANK', '0')}", "a") as record:
                record.write(Path(f).name + "\n")
        return load(f, *args, **kwargs)

    torch.load = recording_load


def record_used_samples(folder: str) -> None:
    """Each rank appends the (epoch, key) of every sample of each piece its steps used (the stream's
    `StreamState.update`) to <folder>/rank<RANK>-<pid>.jsonl, a line a piece (the loader keeps the
    keys, which a run's pieces leave out)."""
    from clipscale.data.shards import ShardStream, StreamState

    update, init = StreamState.update, ShardStream.__init__

    def keeping_keys(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "keep_keys": True})

    ShardStream.__init__ = keeping_keys

    def recording_update(self, piece):
        with open(Path(folder) / f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.jsonl", "a") as record:
            record.write(json.dumps(piece["sample_keys"]) + "\n")
        update(self, piece)

    StreamState.update = recording_update


if os.environ.get(KILL_AT):
    install_kill_point(os.environ[KILL_AT])
if os.environ.get(READS_TO):
    record_checkpoint_reads(os.environ[READS_TO])
if os.environ.get(USED_TO):
    record_used_samples(os.environ[USED_TO])
