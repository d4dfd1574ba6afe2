"""A reused run name refuses a change to a loss option as it refuses a change of loss: the
options (Inf-CL's `exact` and `tile_size`, ...) change what is trained."""

from __future__ import annotations

import pytest

from clipscale.config import ConfigError, load_config
from clipscale.run_dir import open_run_folder

from tiny_runs import DIGITS_YAML


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """A plain start, as if by `python` (these tests may themselves run inside a Slurm job)."""
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def _config(tmp_path, options: str):
    return load_config(DIGITS_YAML, [f"run.output_dir={tmp_path}", "run.name=tiny", "loss.name=infcl",
                                     f"loss.options={options}"])


@pytest.mark.parametrize("started, resumed, difference", [
    ("{exact: false}", "{exact: true}", "loss.options.exact: False -> True"),
    ("{backend: reference, tile_size: 8}", "{backend: reference, tile_size: 16}", "loss.options.tile_size: 8 -> 16"),
    ("{}", "{exact: true}", "loss.options.exact: (unset) -> True"),
], ids=["exact", "tile_size", "added"])
def test_a_resume_with_another_loss_option_is_refused_naming_the_key(tmp_path, started, resumed, difference):
    open_run_folder(_config(tmp_path, started)).apply()
    assert open_run_folder(_config(tmp_path, started)).action == "resume"
    with pytest.raises(ConfigError) as raised:
        open_run_folder(_config(tmp_path, resumed))
    assert "holds a run with another configuration (" in str(raised.value)
    assert difference in str(raised.value)
