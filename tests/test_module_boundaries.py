"""What a module of clipscale/ may reach in another, and what state it may keep.

- No module imports a private name (`_x`) of another clipscale module: not by `from m import _x`,
  not as `m._x` through an imported module, not a private module itself. What another module
  needs is public, or lives where it belongs.
- The tiled loss (clipscale/losses/infcl/) and the data path (clipscale/data/) keep no
  module-level mutable state: module-level values are constants (tuples, frozensets, read-only
  mappings, numbers, strings), no function rebinds a module global, and a cache
  (`functools.cache` / `lru_cache`) says in its docstring what it keeps and for how long.

Each check runs on a source with the fault put in by hand first, so it is seen to find it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.tiny_runs import REPO

PACKAGE = REPO / "clipscale"
STATELESS = [PACKAGE / "losses" / "infcl", PACKAGE / "data"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(source: str, this: str, is_package: bool) -> list[str]:
    """`line: what` for each private name of another clipscale module that module `this` reaches."""
    package = this if is_package else this.rpartition(".")[0]
    found, modules = [], set()  # the local names bound to clipscale modules (or to names in them)

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        return ".".join(anchor + ([node.module] if node.module else []))

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "clipscale":
                    if any(is_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    modules.add(alias.asname or "clipscale")
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node)
            if base.split(".")[0] != "clipscale":
                continue
            for alias in node.names:
                if is_private(alias.name) or any(is_private(part) for part in base.split(".")):
                    found.append(f"{node.lineno}: from {base} import {alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_import_scan_finds_each_kind():
    this = "clipscale.data.shards"
    assert private_imports("from clipscale.losses.infcl.kernels import _split\n", this, False) == [
        "1: from clipscale.losses.infcl.kernels import _split"]
    assert private_imports("from .sources import _decode\n", this, False) == ["1: from clipscale.data.sources import _decode"]
    assert private_imports("from ..losses.infcl import kernels as K\nK._split(1, 2, 3)\n", this, False) == ["2: K._split"]
    assert private_imports("import clipscale.data.sources\nclipscale.data.sources._decode()\n", this, False) == [
        "2: clipscale.data.sources._decode"]
    assert private_imports("from clipscale.data import _internal\n", this, False) == ["1: from clipscale.data import _internal"]
    fine = ("from clipscale.data.sources import DATA_ERRORS\nimport torch\ntorch._dynamo.reset()\n"
            "from torch import _C\nself._buffer = 1\nclipscale_name = __name__\n")
    assert private_imports(fine, this, False) == []


def test_no_module_imports_a_private_name_of_another():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        reached = private_imports(path.read_text(), module_name(path), path.name == "__init__.py")
        if reached:
            found[str(path.relative_to(REPO))] = reached
    assert found == {}, f"private names of other modules: {found}"


MUTABLE_CONSTRUCTORS = {"list", "dict", "set", "bytearray", "Counter", "defaultdict", "deque", "OrderedDict",
                        "SimpleNamespace", "local", "Queue"}
CACHES = {"cache", "lru_cache", "cached_property"}


def mutable_module_state(source: str) -> list[str]:
    """`line: what` for each piece of module-level mutable state in a module's source."""
    tree = ast.parse(source)
    found = []

    def top_level(body):  # module statements, including those under a top-level if / try
        for node in body:
            yield node
            for block in ("body", "orelse", "finalbody", "handlers"):
                if isinstance(node, (ast.If, ast.Try, ast.With)) and getattr(node, block, None):
                    yield from top_level(getattr(node, block))

    for node in top_level(tree.body):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]
            if all(name.startswith("__") for name in names):  # __all__ and the like
                continue
            value = node.value
            called = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else (
                value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None)
            mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
            if mutable or called in MUTABLE_CONSTRUCTORS or isinstance(node, ast.AugAssign):
                found.append(f"{node.lineno}: {', '.join(names)} = {ast.unparse(value)[:60]}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{node.lineno}: global {', '.join(node.names)}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = {ast.unparse(d.func if isinstance(d, ast.Call) else d).rpartition(".")[2] for d in node.decorator_list}
            if decorators & CACHES and "cache" not in (ast.get_docstring(node) or "").lower():
                found.append(f"{node.lineno}: {node.name}, a cache its docstring does not describe")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_the_state_scan_finds_each_kind():
    source = '''
import collections, functools
counts = collections.Counter()
SEEN = set()
TABLE = {"a": 1}
ROWS = [n for n in range(3)]
if True:
    hidden = []
enabled = True
def turn_off():
    global enabled
    enabled = False
@functools.lru_cache(maxsize=None)
def undocumented(x):
    """Twice x."""
    return 2 * x
'''
    assert [line.split(":")[0] for line in mutable_module_state(source)] == ["3", "4", "5", "6", "8", "11", "14"]
    fine = '''
import functools
from types import MappingProxyType
__all__ = ["f"]
NAMES = ("a", "b")
RADIUS = MappingProxyType({"a": 1})
@functools.cache
def f(x):
    """x squared; cached for the process (a pure function)."""
    return x * x
'''
    assert mutable_module_state(fine) == []


def test_the_loss_kernels_and_the_data_path_keep_no_module_state():
    found = {}
    for folder in STATELESS:
        for path in sorted(folder.rglob("*.py")):
            state = mutable_module_state(path.read_text())
            if state:
                found[str(path.relative_to(REPO))] = state
    assert found == {}, f"module-level mutable state: {found}"
