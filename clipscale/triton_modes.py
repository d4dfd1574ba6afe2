"""Triton programs compiled for the GPU or run in Triton's interpreter, chosen at each launch.

`@triton.jit` fixes a program's mode when it decorates it, reading TRITON_INTERPRET then. A
module of programs imported once would keep the mode of whoever imported it first, and a test
that sets the variable later would have to reload it. So the host code does not import its
programs' module: at each launch it asks `programs(name, interpreting())` for that module as
decorated for the mode Triton is in now (TRITON_INTERPRET, read at the call). Each mode's copy
is executed once, into a module object of its own, and kept for the process, as long as the
compiled programs and the autotuner's choices that it holds: a second call in the same mode
finds them warm. A module of programs names its mode in its `INTERPRET` constant.

One limit is Triton's own: its library (`tl.sum`, `tl.max`, ...) is decorated when
`triton.language` is first imported, so in practice a process runs its programs in one mode.
Training and the GPU test suite compile; the CPU test session imports Triton for the
interpreter before anything else (tests/conftest.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from types import ModuleType

import triton
from triton import knobs

# The autotuners' timings kept in Triton's cache (TRITON_CACHE_DIR, else ~/.triton/cache), keyed by
# the program's source, the GPU's architecture, the key's values and the configs: a later process (a
# resumed or requeued job) launches the best config at once instead of compiling and timing every
# one again, 12-15 s of a first step at 65,536 on an H200 (results/pyspy_h200_b32_65k_first_step_2467fba.txt).
# Triton keeps them from 3.4 on; older ones tune in every process.
KEEP_TUNING = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def interpreting() -> bool:
    """Whether Triton runs the programs launched now in its interpreter (TRITON_INTERPRET=1),
    read at each call."""
    return bool(knobs.runtime.interpret)


@functools.cache
def programs(name: str, interpret: bool) -> ModuleType:
    """Module `name` (dotted), its Triton programs decorated for the interpreter (`interpret`,
    normally `interpreting()` at the call) or the compiler. Cached: one module object per mode
    for the process (see the module docstring); the first mode asked for gets the ordinary
    import, the other a copy of its own."""
    imported = importlib.import_module(name)
    if imported.INTERPRET == interpret:
        return imported
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # @triton.jit reads the mode now
    if module.INTERPRET != interpret:
        raise RuntimeError(f"{name}: decorated for the interpreter = {module.INTERPRET}, asked for {interpret}: "
                           "set TRITON_INTERPRET as you mean to run")
    return module
