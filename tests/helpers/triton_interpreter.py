"""TRITON_INTERPRET=1 for a moment, without leaving it set for the other test modules.

Triton decorates its own library (`tl.sum`, `tl.max`, ...) when `triton.language` is first
imported, in the mode the variable names then (tests/conftest.py imports it under this). Our
programs read the variable at each launch (`clipscale.triton_modes`): the test modules that run
them in the interpreter set it per test.
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def interpreter_env():
    """TRITON_INTERPRET=1 inside, the environment as it was after."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
