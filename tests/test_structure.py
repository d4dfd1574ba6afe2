"""The package's shape: no module imports one that imports it back, and the package
metadata names the dependencies that requirements.txt installs."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers.tiny_runs import REPO

PACKAGE = REPO / "clipscale"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, this: str, is_package: bool, modules: set[str]) -> set[str]:
    """The clipscale modules that module `this` imports anywhere (top level or inside a
    function): `from a import b` counts as a.b when that is a module, else as a."""
    package = this if is_package else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != this}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path.read_text(), module_name(path), path.name == "__init__.py", modules)
            for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_of_every_kind():
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e"}
    source = "import p.a\nfrom p import b, name\nfrom .c import thing\ndef f():\n    from p.d import other\n"
    assert imported_modules(source, "p.e", False, modules) == {"p.a", "p.b", "p", "p.c", "p.d"}
    assert imported_modules("from .a import x", "p", True, modules) == {"p.a"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_config_and_the_components_stay_apart():
    """config.py knows the schema only; the checks that need models or losses live above them.
    train.py reads the config and reports its errors (errors.py, launcher.py) before torch loads."""
    graph = import_graph()
    assert not {name for name in graph["clipscale.config"] if name.startswith(("clipscale.models", "clipscale.losses"))}
    assert graph["clipscale.distributed"] == {"clipscale.launcher"}  # the losses use it and stay usable alone
    assert graph["clipscale.launcher"] == set()


def test_no_two_classes_share_a_name():
    """A reader finds a class by its name: one class a name in the package (the checkpoint's
    generators once shared RandomState with Gradient Cache's per-chunk one). The two NoUsableSample
    are the training stream's and an evaluation's, each raised and caught inside its own package."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module_name(path))
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert shared == {"NoUsableSample": ["clipscale.data.shards", "clipscale.eval.datasets"]}, shared


def requirement_set(lines) -> set[str]:
    return {str(Requirement(line)) for line in lines}


def test_package_metadata_names_the_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    listed = [line for line in lines if line and not line.startswith(("#", "-e"))]
    assert requirement_set(project["dependencies"]) == requirement_set(listed)
    assert "-e ." in lines  # the README's install command installs clipscale itself


STEP_PARTS = {"GradCache", "clip_grad_norm_", "unscale_"}  # what a training step is assembled from
STEP_USERS = ["clipscale/trainer.py", "scripts/bench_train.py", "scripts/bench_step.py", "scripts/reproduce/training_step.py"]


def called_names(path: Path) -> set[str]:
    """The names a module calls: f(...) gives f, a.b.f(...) gives f."""
    calls = [node.func for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]
    return {f.id if isinstance(f, ast.Name) else f.attr for f in calls if isinstance(f, (ast.Name, ast.Attribute))}


def test_every_training_step_is_the_one_train_py_runs():
    """The trainer and the benchmarks build clipscale.step.TrainStep; nothing but step.py (and
    gradcache.py, a part of it) assembles a step from its parts or steps an optimizer, so no
    benchmark measures a copy of the step that train.py does not run."""
    for user in STEP_USERS:
        assert "TrainStep" in called_names(REPO / user), f"{user} does not build TrainStep"
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "scripts").rglob("*.py")]):
        if path.relative_to(REPO).as_posix() in ("clipscale/step.py", "clipscale/gradcache.py"):
            continue
        source = path.read_text()
        copied = called_names(path) & STEP_PARTS
        assert not copied, f"{path.relative_to(REPO)} calls {sorted(copied)}: a training step outside clipscale/step.py"
        assert "optimizer.step(" not in source, f"{path.relative_to(REPO)} steps an optimizer outside clipscale/step.py"


def test_the_training_loop_reads_in_one_sitting():
    """Run.fit is next batch, lr, step, then one call each for metrics, evaluation and checkpoint:
    at most 30 lines, the rest lives in the components it calls."""
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    [fit] = [node for run in tree.body if isinstance(run, ast.ClassDef) and run.name == "Run"
             for node in run.body if isinstance(node, ast.FunctionDef) and node.name == "fit"]
    assert fit.end_lineno - fit.lineno + 1 <= 30
