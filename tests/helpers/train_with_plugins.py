"""`train.py` with the test losses of trainer_plugins.py registered; same arguments."""

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[0] = str(REPO)  # as when train.py runs: the repository first, not this folder (and the tests' helpers)
import tests.helpers.trainer_plugins  # noqa: E402, F401 - registers the losses

TRAIN_PY = str(REPO / "train.py")
sys.argv = [TRAIN_PY, *sys.argv[1:]]
runpy.run_path(TRAIN_PY, run_name="__main__")
