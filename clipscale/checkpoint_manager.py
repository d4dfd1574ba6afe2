"""The checkpoint manager: saves the parts of a run and brings them back (torchtitan's
CheckpointManager). It is built after the parts, from a dict of them, and does nothing else:
which checkpoint to resume from and the run's end are the run folder's (clipscale.run_dir),
the files themselves (atomic writes, `latest`, pruning) checkpoint.py's.

    parts = {"model": ModelAndOptimizer(module, optimizer, world, sharded=...),
             "step": train_step, "data": stream_state, "metrics": window, "rng": GlobalGenerators(device)}
    manager = CheckpointManager(run_dir / CHECKPOINTS, cfg, world, console, parts)
    start = manager.load(checkpoint)       # the step the run starts from; 0 without a checkpoint
    manager.save(step, stopping)           # at train.checkpoint_every, on a stop signal, at the last step

A checkpoint is one dict in open_clip's layout, so (whole) `open_clip.load_checkpoint`,
`open_clip.create_model(name, pretrained=path)` and open_clip_train's --resume read it:

    "model"   "state_dict", "optimizer" (open_clip's keys): the model and the optimizer, whole; or
              "sharded": the folder of their shards beside the step file (train.parallel=fsdp)
    "step"    its keys at the top level, rank 0's: "step", "scaler" (open_clip's key), "nonfinite_steps"
    others    per rank, a list by rank under the part's name: "data" (the batch source's cursors and
              data-error counts), "metrics" (the counts at the previous record), "rng" (the global
              random generators: dropout, patch dropout)
    and       "name", "config", and "epoch": the epochs completed, of train.num_samples_per_epoch
              samples (open_clip_train's --train-num-samples; 0 for a run not counted in epochs)

The data part takes every saved rank's state and finds its own share on whatever shape the run
has now (`load_every_rank`: the epoch goes on where it stopped, clipscale.data.shards); the
console says where, as it says which keys that a resume may change (clipscale.config,
`on_resume`) differ from the checkpoint's. The other per-rank parts are restored on the world
size that saved them; on another, the metrics' logged totals (the same on every rank) come from
rank 0's and the generators start afresh from run.seed + rank.

A whole checkpoint is read by rank 0 alone (clipscale.run_dir), which broadcasts the model and
optimizer one tensor at a time: the other ranks never hold the file, nor the whole model when
it is sharded. Either layout loads into a replicated (DDP) or a sharded (FSDP,
`clipscale.parallel`) model, on any number of processes: DCP reshards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from clipscale.checkpoint import (CheckpointError, error_in_one_line, replace_folder, save_checkpoint, sharded_folder,
                                  step_file, temporary_name)
from clipscale.config import FREE, REDEAL, Config, config_differences, on_resume, steps_per_epoch
from clipscale.console import Console
from clipscale.distributed import World, all_gather_objects
from clipscale.errors import storage_errors

SHARED = ("model", "step")  # the parts saved once, at the top level; every other part is saved per rank
SAME_ON_EVERY_RANK = ("metrics",)  # per-rank parts whose saved states are equal: any world size takes rank 0's


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# Whole tensors on rank 0's host (an empty dict on the other ranks), gathered from the shards under FSDP.
GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_weights(module: torch.nn.Module) -> dict:
    """The model's state dict with open_clip's keys and whole tensors, on rank 0 (every rank calls it)."""
    return get_model_state_dict(module, options=GATHERED)


class ModelAndOptimizer:
    """The model's weights and the optimizer's state, saved by every rank.

    whole (train.parallel=ddp): in the step file, under "state_dict" and "optimizer" (open_clip's
        keys), gathered on rank 0; the optimizer in torch's own layout, its parameters numbered in
        the order of its groups (DCP names them; the numbers are what
        `torch.optim.Optimizer.load_state_dict` and open_clip_train read). Loaded from rank 0's
        copy: the other ranks receive it tensor by tensor and keep what they hold of it.
    sharded (train.parallel=fsdp): in a folder of torch.distributed.checkpoint beside the step
        file, each rank writing its own shards (no rank holds the whole model), named in the step
        file under "sharded"."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World, sharded: bool):
        self.module, self.optimizer, self.world, self.sharded = module, optimizer, world, sharded

    def save(self, folder: Path, step: int) -> dict:
        """What the step file holds of them (on rank 0; every rank calls it)."""
        if not self.sharded:
            return {"state_dict": model_weights(self.module), "optimizer": self.numbered_optimizer_state()}
        name = sharded_folder(step)
        tmp = Path(all_gather_objects(str(temporary_name(folder / name)))[0])  # rank 0's name, on every rank
        with storage_errors(tmp, "write"):
            tmp.mkdir(parents=True, exist_ok=True)
            dcp.save(self.sharded_state(), checkpoint_id=tmp)  # returns on rank 0 once every rank's part is written
        if self.world.is_main:
            replace_folder(tmp, folder / name)
        return {"sharded": name}

    def load(self, checkpoint: dict, folder: Path) -> None:
        """From the step file (rank 0's holds the whole weights, which it gives up here) or the
        shards it names."""
        if "sharded" not in checkpoint:
            # Without a process group, this process is the whole world and holds the whole file.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
            weights, optimizer = checkpoint.pop("state_dict", {}), checkpoint.pop("optimizer", {})
            set_model_state_dict(self.module, weights, options=options)
            set_optimizer_state_dict(self.module, self.optimizer, self.named_optimizer_state(optimizer), options=options)
            return
        state = self.sharded_state()
        shards = folder / checkpoint["sharded"]
        try:
            dcp.load(state, checkpoint_id=shards)
        except dcp.CheckpointException as err:  # raised on every rank when any rank's read fails
            # Falling back to the checkpoint before it would take the search over checkpoints here, after
            # the model is built (the run folder judges step files before that); the line names the way on.
            named_by = folder / step_file(checkpoint["step"])
            rank, (cause, _) = next(iter(err.failures.items()))  # str(err) is every rank's traceback
            raise CheckpointError(f"the shards in {shards} do not load (rank {rank}: {error_in_one_line(cause)}); "
                                  f"move {named_by} aside to resume from the checkpoint before it") from None
        set_model_state_dict(self.module, state["model"])
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])

    def sharded_state(self) -> dict:
        return {"model": get_model_state_dict(self.module),
                "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}

    def numbered_optimizer_state(self) -> dict:
        named = get_optimizer_state_dict(self.module, self.optimizer, options=GATHERED)
        if not named:  # the ranks other than 0
            return {}
        number = {name: k for k, name in enumerate(name for group in named["param_groups"] for name in group["params"])}
        groups = [{**group, "params": [number[name] for name in group["params"]]} for group in named["param_groups"]]
        return {"state": {number[name]: value for name, value in named["state"].items()}, "param_groups": groups}

    def named_optimizer_state(self, numbered: dict) -> dict:
        """The optimizer state with parameter names for numbers; {} as given (the ranks that receive it)."""
        if not numbered:
            return {}
        names = {id(p): name for name, p in self.module.named_parameters()}
        ordered = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        groups = [{**group, "params": [ordered[k] for k in group["params"]]} for group in numbered["param_groups"]]
        return {"state": {ordered[k]: value for k, value in numbered["state"].items()}, "param_groups": groups}


class GlobalGenerators:
    """This rank's global random generators: the CPU's, and the CUDA device's when it trains on one."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device).cpu()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


class CheckpointManager:
    """Saves the parts every train.checkpoint_every steps, on a stop signal and at the last step,
    keeping train.keep_checkpoints (and train.keep_every); restores them from a checkpoint."""

    def __init__(self, folder: Path, cfg: Config, world: World, console: Console, parts: dict[str, Stateful]):
        self.folder, self.cfg, self.world, self.console = folder, cfg, world, console
        self.model: ModelAndOptimizer = parts["model"]
        self.step = parts["step"]
        self.per_rank = {name: part for name, part in parts.items() if name not in SHARED}

    def load(self, checkpoint: dict | None) -> int:
        """Restore every part from `checkpoint` (None: a new run, nothing to restore); the step the
        run starts from. Every rank calls it, with rank 0's whole checkpoint or the others' share."""
        if checkpoint is None:
            return 0
        self.model.load(checkpoint, self.folder)
        self.step.load_state_dict(checkpoint)
        self.say_changes(checkpoint)
        same_world = len(checkpoint["rng"]) == self.world.world_size
        for name, part in self.per_rank.items():
            saved = checkpoint.get(name)  # a part the checkpoint does not hold keeps its fresh state
            if saved is None:
                continue
            if hasattr(part, "load_every_rank"):
                self.console.say(part.load_every_rank(saved))
            elif same_world or name in SAME_ON_EVERY_RANK:
                part.load_state_dict(saved[self.world.rank if same_world else 0])
        return checkpoint["step"]

    def say_changes(self, checkpoint: dict) -> None:
        """Says in one line what differs from the checkpoint among the keys a resume may change and
        in the world size, and what that does to the data order."""
        saved_on = len(checkpoint["rng"])
        changed = {key: values for key, values in config_differences(checkpoint["config"], self.cfg.to_dict()).items()
                   if on_resume(key) in (FREE, REDEAL)}
        reshaped = saved_on != self.world.world_size or any(on_resume(key) == REDEAL for key in changed)
        processes = f"{self.world.world_size} process" + ("" if self.world.world_size == 1 else "es")
        said = [f"on {processes} from a run on {saved_on}"] if saved_on != self.world.world_size else []
        said += [f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items()]
        if said:
            effect = ("the epoch goes on, what is left of it dealt to the new ranks and workers" if reshaped
                      else "the data order goes on from the checkpoint")
            self.console.say(f"resuming {', '.join(said)}: {effect}")

    def save(self, step: int, stopping: bool = False) -> None:
        """At the interval, on a stop signal, at the last step; every rank calls it (each contributes
        its per-rank parts and its shards), rank 0 writes."""
        if not (stopping or step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.steps):
            return
        per_rank = all_gather_objects({name: part.state_dict() for name, part in self.per_rank.items()})
        shared = [self.model.save(self.folder, step), self.step.state_dict()]
        if not self.world.is_main:
            return
        epoch_steps = steps_per_epoch(self.cfg.train)
        checkpoint = {"name": self.cfg.run.name, "epoch": step // epoch_steps if epoch_steps else 0,
                      "config": self.cfg.to_dict()}
        for state in shared:
            assert not state.keys() & checkpoint.keys(), f"two parts save {state.keys() & checkpoint.keys()}"
            checkpoint.update(state)
        checkpoint.update({name: [rank[name] for rank in per_rank] for name in self.per_rank})
        path = save_checkpoint(self.folder, step, checkpoint, keep=self.cfg.train.keep_checkpoints,
                               keep_every=self.cfg.train.keep_every)
        self.console.say(f"step {step}: checkpoint saved to {path}")
