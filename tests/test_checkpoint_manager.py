"""The checkpoint manager on parts of its own (a linear model, counters): what a checkpoint holds,
what a resume restores, and the line it says when the data order cannot go on."""

from __future__ import annotations

import pytest
import torch

from clipscale.checkpoint import CHECKPOINTS, load_latest
from clipscale.checkpoint_manager import CheckpointManager, GlobalGenerators, ModelAndOptimizer
from clipscale.config import load_config
from clipscale.distributed import World

from tests.helpers.tiny_runs import DIGITS_YAML


class Counter:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Step(Counter):
    def state_dict(self) -> dict:
        return {"step": self.value, "scaler": None}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["step"]


def _manager(tmp_path, *overrides, data=0, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # the optimizer has state to save
    cfg = load_config(DIGITS_YAML, [f"run.output_dir={tmp_path}", *overrides])
    said = []
    console = type("Console", (), {"say": lambda self, line: said.append(line)})()
    parts = {"model": ModelAndOptimizer(model, optimizer, World(), sharded=False), "step": Step(),
             "data": Counter(data), "rng": GlobalGenerators(torch.device("cpu"))}
    return CheckpointManager(tmp_path / CHECKPOINTS, cfg, World(), console, parts), parts, said


def _saved(tmp_path, *overrides, step=6):
    manager, parts, _ = _manager(tmp_path, *overrides, data=17, seed=1)
    parts["step"].value = step
    manager.save(step, stopping=True)
    return load_latest(tmp_path / CHECKPOINTS)[1], parts


def test_a_resume_restores_every_part(tmp_path):
    checkpoint, saved = _saved(tmp_path)
    assert sorted(checkpoint) == ["config", "data", "epoch", "name", "optimizer", "rng", "scaler", "state_dict", "step"]
    manager, parts, said = _manager(tmp_path / "resumed")
    assert manager.load(checkpoint) == 6 and said == []
    assert parts["data"].value == 17 and parts["step"].value == 6
    model = parts["model"]
    assert all(torch.equal(a, b) for a, b in zip(model.module.parameters(), saved["model"].module.parameters()))
    assert model.optimizer.state_dict()["state"][0]["exp_avg"].equal(saved["model"].optimizer.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("change, line", [
    (["data.workers=2"], "resuming data.workers: 1 -> 2: the epoch goes on, what is left of it dealt to the new ranks and workers"),
    (["train.log_every=5", "data.decoder=loader"],
     "resuming data.decoder: 'auto' -> 'loader', train.log_every: 10 -> 5: the data order goes on from the checkpoint"),
])
def test_a_resume_says_what_changed_knobs_do_to_the_data_order(tmp_path, change, line):
    checkpoint, _ = _saved(tmp_path)
    manager, parts, said = _manager(tmp_path / "resumed", *change)
    manager.load(checkpoint)
    assert said == [line]
    assert parts["data"].value == 17


class EveryRank(Counter):
    """A part that takes every saved rank's state, as the data stream does (`load_every_rank`)."""

    def load_every_rank(self, saved: list[dict]) -> str:
        self.value = sum(state["value"] for state in saved)
        return f"took {len(saved)} ranks' states"


def test_a_resume_on_another_world_size_gives_every_ranks_state_to_the_part_that_takes_them(tmp_path):
    """The data part finds its share of every saved rank's state; the metrics' totals (the same on
    every rank) come from rank 0's; the generators, one per rank, start afresh."""
    checkpoint, _ = _saved(tmp_path)
    checkpoint["rng"] *= 2  # saved by two ranks
    checkpoint["data"] *= 2
    checkpoint["metrics"] = [{"value": 5}, {"value": 5}]
    manager, parts, said = _manager(tmp_path / "resumed")
    parts["data"] = manager.per_rank["data"] = EveryRank()
    parts["metrics"] = manager.per_rank["metrics"] = Counter()
    rng_before = torch.get_rng_state()
    manager.load(checkpoint)
    assert said == ["resuming on 1 process from a run on 2: the epoch goes on, what is left of it dealt to the new "
                    "ranks and workers", "took 2 ranks' states"]
    assert parts["data"].value == 34 and parts["metrics"].value == 5
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_the_epoch_counts_epochs_of_train_num_samples_per_epoch(tmp_path):
    """open_clip_train's --resume reads `epoch` as the epochs done: 7 steps of 128 samples are one
    epoch of 600 (5 steps, the last partial) and two fifths of the next."""
    by_epochs = ["train.steps=null", "train.epochs=4", "train.num_samples_per_epoch=600", "train.batch_size=128"]
    assert _saved(tmp_path / "epochs", *by_epochs, step=7)[0]["epoch"] == 1
    assert _saved(tmp_path / "steps", step=7)[0]["epoch"] == 0  # a run counted in steps has done no epoch
