"""Triton programs in the interpreter (TRITON_INTERPRET=1, CPU tensors) for the tests that need
them, without leaving the variable set for the other test modules.

Triton reads the variable when a program is decorated (its module's import) and again when it
is launched: the test modules import through `import_interpreted` and set it again per test.
"""

from __future__ import annotations

import contextlib
import importlib
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


def import_interpreted(*names: str) -> list:
    """The named modules with their programs decorated for the interpreter: imported under
    TRITON_INTERPRET=1, or reloaded in the order given when an earlier import in this process
    decorated them without it (the first module's INTERPRET flag tells)."""
    with interpreter_env():
        modules = [importlib.import_module(name) for name in names]
        if not modules[0].INTERPRET:
            modules = [importlib.reload(module) for module in modules]
    return modules
