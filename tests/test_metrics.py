"""Where the numbers go: metrics.jsonl survives a crash mid-write and stays strict JSON with
non-finite values; wandb logs offline without a key; TensorBoard's event files hold the logged
scalars and, after a resume, one curve."""

from __future__ import annotations

import json
import math

import pytest

from clipscale.config import Config, load_config
from clipscale.errors import UserError
from clipscale.metrics import TENSORBOARD, MetricsLogger, read_metrics

from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run


def _strict(line: str) -> dict:
    """json.loads as a strict reader (JavaScript's JSON.parse, jq, ...): NaN and Infinity are errors."""
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=reject)


def test_a_partial_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    with pytest.warns(UserWarning, match=f"{path}: dropped its last line, cut short"):
        logger = MetricsLogger(tmp_path, Config(), enabled=True, resume_step=3)
    logger.log(4, {"loss": 0.25})
    assert [m["step"] for m in read_metrics(path)] == [1, 2, 3, 4]


def test_a_damaged_line_before_the_last_is_a_user_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(UserError, match=f"{path} line 2 is not JSON"):
        MetricsLogger(tmp_path, Config(), enabled=True, resume_step=3)


def test_non_finite_values_are_written_as_null_with_a_flag(tmp_path):
    logger = MetricsLogger(tmp_path, Config(), enabled=True)
    logger.log(1, {"loss": math.nan, "lr": 1e-3, "grad_norm": math.inf})
    logger.log(2, {"loss": 0.5, "lr": 1e-3, "grad_norm": 2.0})
    logger.write_json(tmp_path / "eval" / "step_00000002.json", {"step": 2, "zeroshot_acc1": -math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [_strict(line) for line in lines] == [
        {"step": 1, "loss": None, "lr": 1e-3, "grad_norm": None, "nonfinite": ["loss", "grad_norm"]},
        {"step": 2, "loss": 0.5, "lr": 1e-3, "grad_norm": 2.0},
    ]
    assert _strict((tmp_path / "eval" / "step_00000002.json").read_text())["nonfinite"] == ["zeroshot_acc1"]


def test_wandb_logs_offline_without_a_key(digits_root, tmp_path, monkeypatch):
    from clipscale.trainer import train

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from a `wandb login`
    overrides = tiny_run(digits_root, tmp_path, "data.workers=0", "eval.zeroshot=false", "train.steps=2", "wandb.enabled=true")
    train(load_config(DIGITS_YAML, overrides))
    runs = list((tmp_path / "tiny" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_logged_scalars(knob_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(knob_run / TENSORBOARD))
    events.Reload()
    records = [r for r in read_metrics(knob_run / "metrics.jsonl") if "loss" in r]
    for key in ("loss", "lr", "grad_norm", "logit_scale"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [r["step"] for r in records], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in records], rel=1e-6), key


def test_tensorboard_resume_drops_the_events_past_the_checkpoint(tmp_path):
    """As metrics.jsonl: a run resumed from step 3 rewrites steps 4 and 5, and TensorBoard shows one curve."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(DIGITS_YAML, ["tensorboard.enabled=true"])
    first = MetricsLogger(tmp_path, cfg, enabled=True)
    for step in range(1, 6):
        first.log(step, {"loss": float(step), "note": "not a number"})
    first.close()
    resumed = MetricsLogger(tmp_path, cfg, enabled=True, resume_step=3)
    for step in (4, 5):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / TENSORBOARD))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert events.Tags()["scalars"] == ["loss"]
