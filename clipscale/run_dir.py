"""A run is one run: what to do with `runs/<name>/` is decided before any work, and the
folder is written only once the run has been assembled (a run name is claimed only by a
run that starts: a mistake found while building the data or the model leaves it as it was).

    plan = plan_run(cfg)          # every rank: raises a UserError, or says what will happen
    # ... build everything that can fail before training ...
    # (every rank has read the folder before rank 0 changes it: a barrier here)
    if world.is_main:
        for line in plan.apply(): console.say(line)

- No folder, or an empty one: a new run; the folder is created and remembers
  its configuration in `config.yaml`.
- A folder whose `config.yaml` is this configuration: the run resumes (the
  trainer then says `resuming runs/<name> from step N`). Keys that do not
  change what is trained may differ and take their new values (`IGNORED`).
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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from clipscale.checkpoint import CHECKPOINTS, check_writable, remove_partial_saves, step_checkpoints, write_text_atomic
from clipscale.config import Config, ConfigError
from clipscale.launcher import launch_id
from clipscale.optim import learning_rate

CONFIG_FILE = "config.yaml"
LAUNCHED_BY = "launched_by"  # the job that started the run folder (launcher.launch_id), when it had one
# Keys that change where or how the run is computed, recorded or evaluated (or the name of its
# folder), not the weights it trains (train.chunk_size and train.offload: Gradient Cache gives
# the same gradients; train.parallel: DDP and FSDP give the same), so a resumed run may change
# them. A prefix covers its whole section.
IGNORED = (
    "run.name", "run.resume", "run.overwrite", "run.extend_steps", "run.output_dir", "run.device",
    "model.compile", "model.grad_checkpointing", "model.channels_last",
    "model.compile_cache", "data.decode_workers", "data.decoder", "data.device_decoder", "data.keep_on_device_gib",  # the decoder: the same samples and crops, pixels within rounding
    "train.chunk_size", "train.offload", "train.log_every", "train.checkpoint_every",
    "train.parallel", "train.fsdp_reduce", "train.fsdp_offload",  # DDP and FSDP train the same weights (tests/test_fsdp*.py)
    "train.keep_checkpoints", "train.keep_every", "train.max_nonfinite_steps",
    "eval", "wandb",
)
UNSET = "(unset)"


@dataclass(frozen=True)
class RunPlan:
    run_dir: Path
    action: Literal["new", "resume", "overwrite"]
    config: dict
    notices: list[str] = field(default_factory=list)  # said when applied: e.g. what an extension does to the lr

    def apply(self) -> list[str]:
        """Rank 0 only, once every rank has planned: create (or move aside and create) the
        folder, clean up killed saves, record the configuration. The lines to print."""
        notices = list(self.notices)
        if self.action == "overwrite":
            aside = _aside_name(self.run_dir)
            self.run_dir.rename(aside)
            notices.append(f"moved the previous run {self.run_dir} aside to {aside}")
        if self.action == "resume":
            removed = remove_partial_saves(self.run_dir)
            if removed:
                notices.append(f"removed {len(removed)} temporary files of interrupted saves in {self.run_dir}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.run_dir / CONFIG_FILE, yaml.safe_dump(self.config, sort_keys=False))
        launcher = launch_id()
        if self.action != "resume" and launcher:
            write_text_atomic(self.run_dir / LAUNCHED_BY, launcher + "\n")
        return notices


def plan_run(cfg: Config) -> RunPlan:
    """Check that the run folder can be written and decide what the run does with it; a
    UserError (ConfigError, StorageError) when the configuration does not say what the user means."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    check_writable(run_dir)
    new = cfg.to_dict()
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return RunPlan(run_dir, "new", new)
    restarted = cfg.run.overwrite and _started_by_this_job(run_dir)
    if cfg.run.overwrite and not restarted:
        return RunPlan(run_dir, "overwrite", new)
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
    differences = config_differences(saved, new)
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
        return RunPlan(run_dir, "resume", new, [*notices, notice])
    return RunPlan(run_dir, "resume", new, notices)


def _started_by_this_job(run_dir: Path) -> bool:
    marker = run_dir / LAUNCHED_BY
    launcher = launch_id()
    return launcher is not None and marker.is_file() and marker.read_text().strip() == launcher


def config_differences(old: dict, new: dict) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} for every key that differs and changes the run.
    A key the old config lacks (a newer clipscale's) counts at its default value."""
    old_flat, new_flat = _flatten(old), _flatten(new)
    defaults = _flatten(Config().to_dict())
    differences = {}
    for key in sorted(old_flat.keys() | new_flat.keys()):
        if any(key == ignored or key.startswith(ignored + ".") for ignored in IGNORED):
            continue
        before = old_flat.get(key, defaults.get(key, UNSET))
        after = new_flat.get(key, UNSET)
        if before != after:
            differences[key] = (before, after)
    return differences


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


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
