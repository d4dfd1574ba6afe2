"""`train.py` with the test losses of trainer_plugins.py registered; same arguments."""

import runpy
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # clipscale as train.py finds it; the plugins
import trainer_plugins  # noqa: E402, F401 - registers the losses

TRAIN_PY = str(TESTS.parent / "train.py")
sys.argv = [TRAIN_PY, *sys.argv[1:]]
runpy.run_path(TRAIN_PY, run_name="__main__")
