"""The paper's Figure S2 claim on digits: every loss gives the same training curve."""

import json
import sys

import pytest

from tests.helpers.tiny_runs import REPO, tiny_run

sys.path.insert(0, str(REPO / "scripts" / "reproduce"))
import loss_curves  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_every_loss_follows_the_same_curve_on_two_processes(digits_root, tmp_path):
    overrides = [o for o in tiny_run(digits_root, tmp_path) if not o.startswith(("run.", "train.log_every", "eval."))]
    result = loss_curves.main(
        ["--steps", "5", "--nproc", "2", "--out", str(tmp_path / "out" / "curves.json"), "--runs", str(tmp_path / "runs"),
         *overrides, "data.workers=0", "eval.zeroshot=false"]
    )
    curves = result["curves"]
    assert set(curves) == {"vanilla", "local", "disco", "infcl"}
    assert all(len(c) == 5 for c in curves.values())
    assert curves["vanilla"][-1] < curves["vanilla"][0]  # it trains
    # Same data, same seed: the curves differ only by float32 rounding.
    for loss, difference in result["max_abs_difference_to_reference"].items():
        assert difference < 1e-5, (loss, difference)
    saved = json.loads((tmp_path / "out" / "curves.json").read_text())
    assert saved["curves"] == curves and saved["command"]
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000
