"""What a child forked now sees of the parent's memory: a question answered in the child."""

from __future__ import annotations

import os
from typing import Callable


def answer_in_a_forked_child(question: Callable[[], bytes]) -> bytes:
    """`question()` run in a child forked now, its bytes sent back through a pipe. The child runs
    nothing else and leaves with os._exit, whatever happens (no atexit, no test machinery)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, question())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        got = answer.read()
    os.waitpid(pid, 0)
    return got
