"""The checkpoint manager: one object saves a run, brings it back and marks its end.

A run is made of the parts a checkpoint holds:

    the weights (`Weights`: every rank saves and loads its part)
        "state_dict", "optimizer" (open_clip's keys): the model and the optimizer, whole; or
        "sharded": the folder of their shards beside the step file (train.parallel=fsdp)
    shared, with `state_dict()` and `load_state_dict(state)` (rank 0 saves its copy, every rank
    loads it); their keys are the checkpoint's own
        TrainStep    "step", "scaler" (open_clip's key), "nonfinite_steps"
    per rank (every rank's is saved, each rank loads its own), under the name given:
        "data"     StreamState     the batch source's cursors and data-error counts
        "rng"      RandomState     the global random generators (dropout, patch dropout): the manager's own
        "metrics"  RecordWindow    the data-error counts at the previous metrics record

A checkpoint is their union plus `name`, `epoch` and `config`: open_clip's layout, so (whole)
`open_clip.load_checkpoint` and `open_clip.create_model(name, pretrained=path)` read it. The
files themselves (atomic writes, `latest`, pruning, the newest that loads) are checkpoint.py's.
The model and optimizer states go through torch.distributed.checkpoint's state dicts (`Weights`),
whole in the step file or sharded beside it, and either loads into a replicated (DDP) or a sharded
(FSDP, `clipscale.parallel`) model: a run resumes on another world size, and from DDP to FSDP and
back.

    manager = CheckpointManager(run_dir, cfg, world, console)
    checkpoint = manager.newest()          # before any work; None for a new run
    manager.has_ended(checkpoint)          # the end marker names this checkpoint's step
    ... build the model from the base seed, then the other parts ...
    start = manager.start(checkpoint, weights=Weights(...), shared=[...], per_rank={"data": ..., "metrics": ...},
                          samples_per_epoch=n)
    ... open the batch source at the restored cursors; for each step: ...
    manager.after_step(step, stopping)     # at the interval, on a stop signal, at the end
    manager.end(model)                     # the open_clip weights, then the end marker

Seeds as open_clip sets them: the model is built from the base seed (the same initial weights
on every rank); `start` then seeds the random generators with seed + rank, so dropout masks
differ between ranks, or restores every part, generators included. Nothing that runs between
`start` and the first step draws from the global generators: the data loader draws its worker
seeds from a generator of its own, and the loader workers seed each sample themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from clipscale.checkpoint import (CHECKPOINTS, CheckpointError, error_in_one_line, load_latest, replace_folder, save_atomic,
                                  save_checkpoint, sharded_folder, step_file, temporary_name, write_text_atomic)
from clipscale.errors import storage_errors
from clipscale.config import Config
from clipscale.console import Console
from clipscale.distributed import World, all_gather_objects
from clipscale.models import OPEN_CLIP_WEIGHTS

END_MARKER = "ended"  # in the run folder, the step of the run's end, written after the open_clip weights


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# Whole tensors on rank 0's host (an empty dict on the other ranks), gathered from the shards under FSDP.
GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
WHOLE = StateDictOptions(full_state_dict=True)  # loading: every rank holds the whole state and keeps its shards


def model_weights(module: torch.nn.Module) -> dict:
    """The model's state dict with open_clip's keys and whole tensors, on rank 0 (every rank calls it)."""
    return get_model_state_dict(module, options=GATHERED)


class Weights:
    """The model's weights and the optimizer's state, saved by every rank.

    whole (train.parallel=ddp): in the step file, under "state_dict" and "optimizer" (open_clip's
        keys), gathered on rank 0; the optimizer in torch's own layout, its parameters numbered in
        the order of its groups (DCP names them; the numbers are what
        `torch.optim.Optimizer.load_state_dict` and open_clip_train read).
    sharded (train.parallel=fsdp): in a folder of torch.distributed.checkpoint beside the step
        file, each rank writing its own shards (no rank holds the whole model), named in the step
        file under "sharded".
    Either loads into a model of either kind, on any number of processes: DCP reshards."""

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
        if "sharded" not in checkpoint:
            set_model_state_dict(self.module, checkpoint["state_dict"], options=WHOLE)
            set_optimizer_state_dict(self.module, self.optimizer, self.named_optimizer_state(checkpoint["optimizer"]),
                                     options=WHOLE)
            return
        state = self.sharded_state()
        shards = folder / checkpoint["sharded"]
        try:
            dcp.load(state, checkpoint_id=shards)
        except dcp.CheckpointException as err:  # raised on every rank when any rank's read fails
            # Falling back to the checkpoint before it would take the search over checkpoints here, after
            # the model is built (load_latest judges step files before that); the line names the way on.
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
        names = {id(p): name for name, p in self.module.named_parameters()}
        ordered = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        groups = [{**group, "params": [ordered[k] for k in group["params"]]} for group in numbered["param_groups"]]
        return {"state": {ordered[k]: value for k, value in numbered["state"].items()}, "param_groups": groups}


class RandomState:
    """This rank's global random generators: the CPU's, and the CUDA device's when it trains on one."""

    def __init__(self, device: torch.device):
        self.device = device

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

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
    """When to save (every train.checkpoint_every steps, on a stop signal, at the last step), what
    to keep (train.keep_checkpoints, train.keep_every), which checkpoint to resume from (the
    newest that loads), and the sign that the run has ended."""

    def __init__(self, run_dir: Path, cfg: Config, world: World, console: Console):
        self.run_dir, self.cfg, self.world, self.console = run_dir, cfg, world, console
        self.folder = run_dir / CHECKPOINTS
        self.rng = RandomState(world.device)
        self.weights: Weights | None = None
        self.shared: list[Stateful] = []
        self.per_rank: dict[str, Stateful] = {"rng": self.rng}
        self.samples_per_epoch = 0

    def newest(self) -> dict | None:
        """The newest checkpoint that loads (those that do not are named), or None; says what the run will do."""
        found = load_latest(self.folder, report=self.console.say)
        checkpoint = found[1] if found else None
        step = checkpoint["step"] if checkpoint else 0
        if step < self.cfg.train.steps:
            self.console.say(f"resuming {self.run_dir} from step {step}" + ("" if step else " (it has no checkpoint yet)"))
        elif not self.has_ended(checkpoint):  # the loop trains no step, then ends the run
            self.console.say(f"{self.run_dir} has trained and checkpointed its {step} steps but stopped before its final "
                             "evaluation and weights were written; writing them now")
        return checkpoint

    def has_ended(self, checkpoint: dict | None) -> bool:
        """Whether the run ended at this checkpoint: its final weights and then the end marker,
        naming the checkpoint's step, were written (a run killed between the two ends again)."""
        marker = self.run_dir / END_MARKER
        return (checkpoint is not None and checkpoint["step"] >= self.cfg.train.steps
                and (self.run_dir / OPEN_CLIP_WEIGHTS).is_file() and marker.is_file()
                and marker.read_text().strip() == str(checkpoint["step"]))

    def start(self, checkpoint: dict | None, *, weights: Weights, shared: list[Stateful], per_rank: dict[str, Stateful],
              samples_per_epoch: int) -> int:
        """Track the parts; seed the random generators with seed + rank, or restore every part from
        `checkpoint`. Returns the step the run starts from. The per-rank parts are restored only on
        the world size that saved them: each rank's data stream depends on the number of ranks."""
        self.weights, self.shared, self.samples_per_epoch = weights, shared, samples_per_epoch
        self.per_rank = {**per_rank, "rng": self.rng}
        saved_on = len(checkpoint["rng"]) if checkpoint is not None else 0  # ranks
        per_rank_saved = saved_on == self.world.world_size
        if not per_rank_saved:
            self.rng.seed(self.cfg.run.seed + self.world.rank)
        if checkpoint is None:
            return 0
        weights.load(checkpoint, self.folder)
        for part in shared:
            part.load_state_dict(checkpoint)
        if not per_rank_saved:
            self.console.say(f"resuming on {self.world.world_size} processes from a run on {saved_on}: "
                             "the data order restarts")
        for name, part in self.per_rank.items():
            if per_rank_saved and name in checkpoint:  # "metrics": not in checkpoints from before it
                part.load_state_dict(checkpoint[name][self.world.rank])
        return checkpoint["step"]

    def after_step(self, step: int, stopping: bool) -> None:
        if stopping or step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.steps:
            self.save(step)

    def save(self, step: int) -> None:
        """Every rank calls it (each contributes its per-rank parts and its shards); rank 0 writes."""
        per_rank = all_gather_objects({name: part.state_dict() for name, part in self.per_rank.items()})
        shared = [self.weights.save(self.folder, step), *(part.state_dict() for part in self.shared)]
        if not self.world.is_main:
            return
        checkpoint = {"name": self.cfg.run.name, "epoch": step * self.cfg.train.batch_size // max(1, self.samples_per_epoch),
                      "config": self.cfg.to_dict()}
        for state in shared:
            assert not state.keys() & checkpoint.keys(), f"two parts save {state.keys() & checkpoint.keys()}"
            checkpoint.update(state)
        checkpoint.update({name: [rank[name] for rank in per_rank] for name in self.per_rank})
        path = save_checkpoint(self.folder, step, checkpoint, keep=self.cfg.train.keep_checkpoints,
                               keep_every=self.cfg.train.keep_every)
        self.console.say(f"step {step}: checkpoint saved to {path}")

    def end(self, module: torch.nn.Module) -> None:
        """Rank 0: the open_clip weights (open_clip's `local-dir:` loads the run folder), then the
        end marker. Every rank calls it, after the final checkpoint and evaluation."""
        weights = model_weights(module)
        if self.world.is_main:
            save_atomic(weights, self.run_dir / OPEN_CLIP_WEIGHTS)
            write_text_atomic(self.run_dir / END_MARKER, f"{self.cfg.train.steps}\n")
