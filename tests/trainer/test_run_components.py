"""`train` takes prebuilt components: a test hands it a loss object, in this process, without
registering it or rewriting sys.argv."""

from __future__ import annotations

from clipscale.config import load_config
from clipscale.metrics import read_metrics
from clipscale.trainer import train

from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run
from tests.helpers.trainer_plugins import ScriptedFaults


def test_an_injected_loss_is_the_one_the_run_trains_with(digits_root, tmp_path):
    loss = ScriptedFaults(nan_loss_calls=[2])  # the configured loss (vanilla) never gives a NaN
    train(load_config(DIGITS_YAML, tiny_run(digits_root, tmp_path, "train.steps=3", "data.workers=0")), loss_fn=loss)
    assert loss.calls == 3
    records = [m for m in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in records] == [1, 2, 3]
    assert [m.get("nonfinite") for m in records] == [None, ["loss"], None] and records[2]["nonfinite_steps"] == 1
