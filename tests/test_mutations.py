"""tests/mutations.py tells a hang from a catch: tests that run past the timeout are killed, with
every process they started, and reported as hung (exit status 1), not as having caught the bug."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.mutations import MUTATIONS, REPO, Mutation, mutated_source, run_tests

HANGING = '''
import subprocess, sys, time
from pathlib import Path

def test_waits_forever():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path("child.pid").write_text(str(child.pid))
    time.sleep(600)
'''


def _verdict(tree: Path, source: str, timeout: float) -> tuple[str, str]:
    (tree / "test_it.py").write_text(source)
    return run_tests(Mutation("m", "a bug", "x.py", "a", "b", ("test_it.py",)), tree, timeout)


@pytest.mark.timeout(120)
def test_tests_that_run_past_the_timeout_are_a_hang_not_a_catch(tmp_path):
    started = time.monotonic()
    verdict, detail = _verdict(tmp_path, HANGING, timeout=15)
    assert verdict == "hung" and detail.startswith("no result within 15 s: killed"), (verdict, detail)
    assert time.monotonic() - started < 60
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):  # SIGKILLed: gone once its parent (pytest, killed too) no longer holds it
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1][:3]:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the hanging test's child process was left running")


@pytest.mark.timeout(120)
def test_a_failing_test_is_a_catch_and_a_passing_one_a_survival(tmp_path):
    assert _verdict(tmp_path, "def test_it():\n    assert 1 == 2\n", timeout=60)[0] == "caught"
    assert _verdict(tmp_path, "def test_it():\n    pass\n", timeout=60)[0] == "survived"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda mutation: mutation.name)
def test_every_mutation_still_applies_to_the_code(mutation):
    """Each bug can still be put in (its text is in its file once) and its tests exist: a change that
    moved the text would otherwise go unnoticed until the whole list is next run."""
    mutated_source(mutation, REPO)
    assert all((REPO / test.split("::")[0]).is_file() for test in mutation.tests)
