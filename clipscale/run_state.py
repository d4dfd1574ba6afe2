"""What a checkpoint holds, captured and restored by the same code.

open_clip's keys (`state_dict` of the unwrapped model, `optimizer`, `epoch`, `name`), so
`open_clip.load_checkpoint` and `open_clip.create_model(name, pretrained=path)` read it,
plus what exact resumption needs: `step`, the training step's own state (GradScaler,
non-finite count), and every rank's data-stream position and RNG states.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from clipscale.config import Config
from clipscale.data.shards import StreamState
from clipscale.distributed import World, all_gather_objects
from clipscale.step import TrainStep


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).cpu()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class RunState:
    def __init__(self, cfg: Config, module: torch.nn.Module, step: TrainStep, stream_state: StreamState, world: World,
                 samples_per_epoch: int):
        self.cfg, self.module, self.step, self.stream_state, self.world = cfg, module, step, stream_state, world
        self.samples_per_epoch = samples_per_epoch
        self.logged_data_errors: list[int] | None = None  # [skipped, shard errors] over ranks at the last record
        self._rng: dict | None = None

    def capture(self, step_number: int) -> dict | None:
        """The checkpoint after `step_number` steps, on rank 0 (None elsewhere). Every rank calls it."""
        streams = all_gather_objects(asdict(self.stream_state))
        rngs = all_gather_objects(rng_state(self.world.device))
        if not self.world.is_main:
            return None
        return {
            "name": self.cfg.run.name,
            "epoch": step_number * self.cfg.train.batch_size // max(1, self.samples_per_epoch),
            "step": step_number,
            "state_dict": self.module.state_dict(),
            "optimizer": self.step.optimizer.state_dict(),
            **self.step.state_dict(),
            "config": self.cfg.to_dict(),
            "data": streams,
            "rng": rngs,
            "logged_data_errors": self.logged_data_errors,
        }

    def restore(self, checkpoint: dict) -> int:
        """Load a checkpoint written by `capture`; returns its step number. The data stream
        continues exactly where it was when the world size is the same; otherwise the data
        order restarts (each rank's stream depends on the number of ranks). The RNG state is
        set by `restore_rng`, once the data loader has drawn its own seeds."""
        self.module.load_state_dict(checkpoint["state_dict"])
        self.step.optimizer.load_state_dict(checkpoint["optimizer"])
        self.step.load_state_dict(checkpoint, checkpoint["step"])
        if len(checkpoint["data"]) == self.world.world_size:
            for key, value in checkpoint["data"][self.world.rank].items():
                setattr(self.stream_state, key, value)
            self._rng = checkpoint["rng"][self.world.rank]
            self.logged_data_errors = checkpoint.get("logged_data_errors")
        elif self.world.is_main:
            print(f"resuming on {self.world.world_size} processes from a run on {len(checkpoint['data'])}: "
                  "the data order restarts")
        return checkpoint["step"]

    def restore_rng(self) -> None:
        """The restored run's RNG state. Call it after everything that draws from the global RNG
        at start-up whether or not the run resumes (a DataLoader's iterator draws its base seed),
        so the first step after a resume draws what the uninterrupted run drew."""
        if self._rng is not None:
            set_rng_state(self._rng, self.world.device)
