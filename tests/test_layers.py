"""Imports go one way only: kernels <- codec <- core <- store <- io | sync | dcp <- integrations <- cli (docs/architecture.md).

Every module of the package is parsed (not imported) and each of its imports,
at module level or inside a function, is checked against the layer order.
``ulstore.errors`` and ``ulstore.toytrain`` (with its arithmetic, ``_toymodel``)
are leaves that import nothing else of ulstore and every layer may use; ``ulstore/__init__.py`` is the
facade above everything, and ``ulstore/__main__.py`` (``python -m ulstore``) sits beside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ulstore"

#: layer of each top-level part of the package; a module may import its own layer and lower ones
LAYERS = {
    "errors": 0,
    "_toymodel": 0,
    "toytrain": 0.5,
    "codec": 1,
    "core": 2,
    "store": 3,
    "io": 4,
    "sync": 4,
    "dcp": 4,
    "integrations": 4.5,
    "cli": 5,
    "": 6,
    "__main__": 6,
}
#: parts of one layer that must not import each other
SIBLINGS = {frozenset(pair) for pair in (("io", "sync"), ("io", "dcp"), ("sync", "dcp"))}


def _part(module: str) -> str:
    """``ulstore.store.commit._commit`` -> ``store``; ``ulstore`` -> ``""`` (the facade)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module) of every ulstore module ``path`` imports."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ulstore"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ulstore":
                continue
            if target == "ulstore":  # `from .. import io`: the names are submodules (or package metadata)
                out += [(node.lineno, f"ulstore.{a.name}") for a in node.names if not a.name.startswith("__")]
            else:
                out.append((node.lineno, target))
    return out


def violations(path: Path, root: Path = PACKAGE) -> list[str]:
    source = _part(_module_name(path, root))
    bad = []
    for line, target in imported_modules(path, root):
        dest = _part(target)
        if dest == source or (dest == "errors" and source != "errors"):
            continue
        if (
            LAYERS[dest] >= LAYERS[source]
            if LAYERS[source] == 0
            else (LAYERS[dest] > LAYERS[source] or frozenset({source, dest}) in SIBLINGS)
        ):
            bad.append(f"{path.relative_to(root.parent)}:{line}: {source or 'ulstore'} imports {target}")
    return bad


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_has_a_layer():
    parts = {_part(_module_name(p)) for p in MODULES}
    assert parts <= set(LAYERS), parts - set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layers(path):
    assert violations(path) == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: upward imports inside a function, written relative or absolute, are caught."""
    root = tmp_path / "ulstore"
    (root / "codec").mkdir(parents=True)
    (root / "codec" / "_bad.py").write_text("def f():\n    from ..store import open\n    from .. import cli\n")
    (root / "sync").mkdir()
    (root / "sync" / "_bad.py").write_text("import ulstore.io.checkpoints\nfrom ..core import objects\n")
    assert violations(root / "codec" / "_bad.py", root) == [
        "ulstore/codec/_bad.py:2: codec imports ulstore.store",
        "ulstore/codec/_bad.py:3: codec imports ulstore.cli",
    ]
    assert violations(root / "sync" / "_bad.py", root) == [
        "ulstore/sync/_bad.py:1: sync imports ulstore.io.checkpoints"
    ]


# --- Public doors: a package uses another only through what that package exports --------------------------------


def private_imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """Imports of another package's private module (``ulstore.store._base`` from sync): the door is the ``__init__``."""
    source = _part(_module_name(path, root))
    bad = []
    for line, target in imported_modules(path, root):
        inside = target.split(".")[2:]
        if _part(target) != source and any(part.startswith("_") for part in inside):
            bad.append(f"{path.relative_to(root.parent)}:{line}: {source or 'ulstore'} imports {target}")
    return bad


#: private imports still to be moved behind a door (emptied by the floor-plan work; never grows)
PRIVATE_ALLOWED: set[str] = set()


def test_packages_meet_at_public_doors():
    found = {bad for path in MODULES for bad in private_imports(path)}
    assert found - PRIVATE_ALLOWED == set()
    assert PRIVATE_ALLOWED - found == set(), "an allowed private import is gone: drop it from PRIVATE_ALLOWED"


def test_the_door_checker_sees_private_modules(tmp_path):
    root = tmp_path / "ulstore"
    (root / "sync").mkdir(parents=True)
    (root / "sync" / "_x.py").write_text("from ..store._base import MAIN\nfrom ..store import MAIN\nfrom . import _y\n")
    assert private_imports(root / "sync" / "_x.py", root) == ["ulstore/sync/_x.py:1: sync imports ulstore.store._base"]


# --- No import circles between modules (lazy and TYPE_CHECKING imports count: they are circles a reader follows) ---


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the ulstore modules it imports; ``from pkg import mod`` points at ``pkg.mod`` when that is a module."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in paths and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


#: circles still to be cut (emptied by the floor-plan work; never grows)
CIRCLES_ALLOWED: list[list[str]] = []


def test_no_import_circles():
    circles = import_circles(import_graph())
    assert [c for c in circles if c not in CIRCLES_ALLOWED] == []
    assert [c for c in CIRCLES_ALLOWED if c not in circles] == [], "a circle is gone: drop it from CIRCLES_ALLOWED"


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_the_graph_resolves_submodules(tmp_path):
    root = tmp_path / "ulstore"
    (root / "codec").mkdir(parents=True)
    (root / "codec" / "__init__.py").write_text("from ._a import f\n")
    (root / "codec" / "_a.py").write_text("from . import _b\n")
    (root / "codec" / "_b.py").write_text("def g():\n    from ._a import f\n")
    graph = import_graph(root)
    assert graph["ulstore.codec._a"] == {"ulstore.codec._b"}
    assert import_circles(graph) == [["ulstore.codec._a", "ulstore.codec._b"]]


# --- Names that explain themselves: no two modules of different packages share a basename ------------------------

#: shared basenames still to be renamed (emptied by the floor-plan work; never grows)
SHARED_NAMES_ALLOWED: set[str] = set()


def shared_basenames(paths: list[Path]) -> set[str]:
    """Basenames (``__init__.py`` and ``__main__.py`` aside) held by modules in more than one folder."""
    folders: dict[str, set[Path]] = {}
    for path in paths:
        if path.name not in ("__init__.py", "__main__.py"):
            folders.setdefault(path.name, set()).add(path.parent)
    return {name for name, where in folders.items() if len(where) > 1}


def test_no_two_modules_share_a_name():
    shared = shared_basenames(MODULES)
    assert sorted(shared - SHARED_NAMES_ALLOWED) == []
    assert sorted(SHARED_NAMES_ALLOWED - shared) == [], "a name is no longer shared: drop it from the allowlist"
