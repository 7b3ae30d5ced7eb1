"""Imports go one way only: kernels <- codec <- core <- store <- io | sync | dcp <- cli (docs/architecture.md).

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
    "cli": 5,
    "": 6,
    "__main__": 6,
}
#: parts of one layer that must not import each other
SIBLINGS = {frozenset(pair) for pair in (("io", "sync"), ("io", "dcp"), ("sync", "dcp"))}


def _part(module: str) -> str:
    """``ulstore.store._commit`` -> ``store``; ``ulstore`` -> ``""`` (the facade)."""
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
