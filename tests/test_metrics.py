"""metrics.jsonl survives a crash mid-write and stays strict JSON with non-finite values."""

from __future__ import annotations

import json
import math

import pytest

from clipscale.config import Config
from clipscale.errors import UserError
from clipscale.metrics import MetricsLogger, read_metrics


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
