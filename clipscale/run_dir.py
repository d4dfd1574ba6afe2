"""A run is one run: what to do with `runs/<name>/` is decided before any work, and the
folder is written only once the run has been assembled (a run name is claimed only by a
run that starts: a mistake found while building the data or the model leaves it as it was).
The run folder also reads the checkpoint a run resumes from and marks the run's end.

    folder = open_run_folder(cfg)        # every rank: raises a UserError, or says what will happen
    checkpoint = folder.newest_checkpoint(world, console)   # rank 0 reads it; None for a new run
    folder.has_ended(checkpoint)         # its final weights and end marker are written
    # ... build everything that can fail before training ...
    # (every rank has read the folder before rank 0 changes it: a barrier here)
    if world.is_main:
        for line in folder.apply(): console.say(line)
    # ... train ...
    folder.end(module, world)            # the open_clip weights, then the end marker

- No folder, or an empty one: a new run; the folder is created and remembers
  its configuration in `config.yaml`.
- A folder whose `config.yaml` is this configuration: the run resumes (the
  trainer then says `resuming runs/<name> from step N`). Keys that do not
  change what is trained may differ and take their new values (the schema's
  `on_resume`, clipscale.config).
- Another configuration: a ConfigError listing the keys that differ (old ->
  new) and the ways on: a new `run.name`; `run.resume=false run.overwrite=true`,
  which moves the old folder aside to `runs/<name>.old-<time>` (nothing is
  deleted); or, when only `train.steps` differs, `run.extend_steps=true`, whose
  effect on the learning rate is stated: the configured schedule
  (`optim.lr_scheduler`) is redrawn over the new number of steps
  (`learning_rate(step, ..., total_steps)`), so the rate at the resumed step
  may change from what the old schedule would have given.
- `run.resume=false` on an existing run without `run.overwrite=true`: an error.
- A run that `run.overwrite=true` started is not moved aside by its own job when
  the launcher starts that job again (a Slurm requeue, a torchrun restart): it
  resumes. The folder remembers which job made it (`LAUNCHED_BY`).
- Rank 0 alone reads the checkpoint (the newest that loads, `load_latest`); the other
  ranks receive all of it but the whole model and optimizer (`WHOLE_WEIGHTS`), which the
  checkpoint manager broadcasts as it loads them: no process but one holds the file.
- The end: the model's weights as open_clip's `local-dir:` loads them (`OPEN_CLIP_WEIGHTS`),
  then the end marker naming the last step. A run killed between the two ends again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import yaml

from clipscale.checkpoint import (CHECKPOINTS, WHOLE_WEIGHTS, CheckpointError, check_writable, load_latest, prune,
                                  remove_partial_saves, save_atomic, set_aside, step_checkpoints, write_text_atomic)
from clipscale.checkpoint_manager import model_weights
from clipscale.config import UNSET, Config, ConfigError, config_differences, on_resume
from clipscale.console import Console
from clipscale.distributed import World, broadcast_object
from clipscale.launcher import launch_id
from clipscale.models import OPEN_CLIP_WEIGHTS
from clipscale.optim import learning_rate

CONFIG_FILE = "config.yaml"
LAUNCHED_BY = "launched_by"  # the job that started the run folder (launcher.launch_id), when it had one
END_MARKER = "ended"  # the step of the run's end, written after the open_clip weights


@dataclass(frozen=True)
class RunFolder:
    run_dir: Path
    action: Literal["new", "resume", "overwrite"]
    cfg: Config
    notices: list[str] = field(default_factory=list)  # said when applied: e.g. what an extension does to the lr
    unloadable: list[Path] = field(default_factory=list)  # checkpoints newer than the one resumed from that do not load

    def apply(self) -> list[str]:
        """Rank 0 only, once every rank has planned: create (or move aside and create) the
        folder, clean up killed saves; on a resume, set aside the checkpoints newer than the one
        it resumes from that do not load (`step_<n>.pt.corrupt`) and delete those that
        train.keep_checkpoints no longer keeps (before the first save needs their room); record
        the configuration. The lines to print."""
        notices = list(self.notices)
        if self.action == "overwrite":
            aside = _aside_name(self.run_dir)
            self.run_dir.rename(aside)
            notices.append(f"moved the previous run {self.run_dir} aside to {aside}")
        if self.action == "resume":
            removed = remove_partial_saves(self.run_dir)
            if removed:
                notices.append(f"removed {len(removed)} temporary files of interrupted saves in {self.run_dir}")
            for path in self.unloadable:
                notices.append(f"set {path.name}, which does not load, aside as {set_aside(path)} (no resume reads it; "
                               "delete it once you no longer want to look into it)")
            train = self.cfg.train
            pruned = prune(self.run_dir / CHECKPOINTS, train.keep_checkpoints, train.keep_every)
            if pruned:
                notices.append(f"deleted {len(pruned)} checkpoints that train.keep_checkpoints={train.keep_checkpoints} "
                               f"no longer keeps: {', '.join(path.name for path in reversed(pruned))}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.run_dir / CONFIG_FILE, yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        launcher = launch_id()
        if self.action != "resume" and launcher:
            write_text_atomic(self.run_dir / LAUNCHED_BY, launcher + "\n")
        return notices

    def newest_checkpoint(self, world: World, console: Console) -> dict | None:
        """The checkpoint the run resumes from (None for a new run or one with none yet), read by
        rank 0: the newest that loads, those that do not named. Rank 0 gets all of it, the other
        ranks all but `WHOLE_WEIGHTS`. Says what the run will do."""
        if self.action != "resume":
            return None
        found = None
        if world.is_main:
            try:
                found = load_latest(self.run_dir / CHECKPOINTS, report=console.say, failed_paths=self.unloadable)
            except CheckpointError as err:  # every rank stops with it
                found = err
        checkpoint = found[1] if isinstance(found, tuple) else found
        shared = broadcast_object({key: value for key, value in checkpoint.items() if key not in WHOLE_WEIGHTS}
                                  if isinstance(checkpoint, dict) else checkpoint)
        if isinstance(shared, CheckpointError):
            raise shared
        if not world.is_main:
            checkpoint = shared
        step = checkpoint["step"] if checkpoint else 0
        if step < self.cfg.train.steps:
            console.say(f"resuming {self.run_dir} from step {step}" + ("" if step else " (it has no checkpoint yet)"))
        elif not self.has_ended(checkpoint):  # the loop trains no step, then ends the run
            console.say(f"{self.run_dir} has trained and checkpointed its {step} steps but stopped before its final "
                        "evaluation and weights were written; writing them now")
        return checkpoint

    def has_ended(self, checkpoint: dict | None) -> bool:
        """Whether the run ended at this checkpoint: its final weights and then the end marker,
        naming the checkpoint's step, were written (a run killed between the two ends again)."""
        marker = self.run_dir / END_MARKER
        return (checkpoint is not None and checkpoint["step"] >= self.cfg.train.steps
                and (self.run_dir / OPEN_CLIP_WEIGHTS).is_file() and marker.is_file()
                and marker.read_text().strip() == str(checkpoint["step"]))

    def end(self, module: torch.nn.Module, world: World) -> None:
        """The open_clip weights (open_clip's `local-dir:` loads the run folder), then the end
        marker: written by rank 0, once every rank has given its part of the weights."""
        weights = model_weights(module)
        if world.is_main:
            save_atomic(weights, self.run_dir / OPEN_CLIP_WEIGHTS)
            write_text_atomic(self.run_dir / END_MARKER, f"{self.cfg.train.steps}\n")


def open_run_folder(cfg: Config) -> RunFolder:
    """Check that the run folder can be written and decide what the run does with it; a
    UserError (ConfigError, StorageError) when the configuration does not say what the user means."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    check_writable(run_dir)
    new = cfg.to_dict()
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return RunFolder(run_dir, "new", cfg)
    restarted = cfg.run.overwrite and _started_by_this_job(run_dir)
    if cfg.run.overwrite and not restarted:
        return RunFolder(run_dir, "overwrite", cfg)
    notices = [f"run.overwrite=true, but {run_dir} was started by this same {launch_id()}, which its launcher has "
               "started again: resuming it instead of moving it aside"] if restarted else []
    steps_done = max((step for step, _ in step_checkpoints(run_dir / CHECKPOINTS)), default=0)
    ways_on = (f"choose a new run.name to keep both, or add run.resume=false run.overwrite=true to move "
               f"{run_dir} aside to {run_dir}.old-<time> and start afresh")
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        raise ConfigError(f"{run_dir} is not empty and has no {CONFIG_FILE}, so it is not a clipscale run: {ways_on}")
    if not cfg.run.resume and not restarted:
        raise ConfigError(f"run.resume=false, but {run_dir} already holds a run (at step {steps_done}): {ways_on}")
    saved = yaml.safe_load(saved_path.read_text()) or {}
    differences = {key: values for key, values in config_differences(saved, new).items() if on_resume(key) is None}
    steps = differences.get("train.steps")
    only_steps = list(differences) == ["train.steps"]
    if differences and not (only_steps and cfg.run.extend_steps):
        listed = "; ".join(f"{key}: {_show(old)} -> {_show(now)}" for key, (old, now) in differences.items())
        extend = ""
        if only_steps:
            extend = f"; or, to train on to {steps[1]} steps, add run.extend_steps=true ({_schedule_change(cfg, steps[0], steps_done)})"
        raise ConfigError(f"{run_dir} holds a run with another configuration ({listed}): {ways_on}{extend}")
    if steps:
        if cfg.train.steps < steps_done:
            raise ConfigError(f"train.steps={cfg.train.steps}: {run_dir} is already at step {steps_done}")
        notice = f"extending {run_dir} from {steps[0]} to {steps[1]} steps: {_schedule_change(cfg, steps[0], steps_done)}"
        return RunFolder(run_dir, "resume", cfg, [*notices, notice])
    return RunFolder(run_dir, "resume", cfg, notices)


def _started_by_this_job(run_dir: Path) -> bool:
    marker = run_dir / LAUNCHED_BY
    launcher = launch_id()
    return launcher is not None and marker.is_file() and marker.read_text().strip() == launcher


def _show(value) -> str:
    return value if value is UNSET else repr(value)


def _schedule_change(cfg: Config, old_steps: int, step: int) -> str:
    """What redrawing optim.lr_scheduler over cfg.train.steps does at `step` and after it."""
    optim, steps = cfg.optim, cfg.train.steps
    lr = {total: learning_rate(step, optim, total) for total in (old_steps, steps)}
    after = {
        "cosine": f"decays to 0 at step {steps}",
        "const": f"stays there to step {steps}",
        "const-cooldown": f"cools down to {optim.lr_cooldown_end:.3g} over the last {optim.lr_cooldown_steps} steps, to step {steps}",
    }[optim.lr_scheduler]
    return (f"the {optim.lr_scheduler} learning-rate schedule is redrawn over {steps} steps, so at step {step} the lr "
            f"goes from {lr[old_steps]:.3g} to {lr[steps]:.3g} and then {after}")


def _aside_name(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    suffix = 1
    while aside.exists():  # a second overwrite within the same second
        aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{suffix}")
        suffix += 1
    return aside
