"""The compiled kernels' stubs (``ulstore/codec/_kernels.pyi``) name what the compiled modules export, no more, no less."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import ulstore.codec

CODEC = Path(ulstore.codec.__file__).parent
BUILDS = ("_kernels", "_kernels_x86_64_v3")


def stub_names(path: Path) -> set[str]:
    """Public names a stub defines (functions, classes, annotated constants); ``from x import *`` follows x."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and [a.name for a in node.names] == ["*"]:
            names |= stub_names(path.with_name(f"{node.module}.pyi"))
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("name", BUILDS)
def test_each_build_has_a_stub_of_its_exports(name):
    try:
        module = importlib.import_module(f"ulstore.codec.{name}")
    except ImportError:
        pytest.skip(f"{name} is not built here")
    exported = {n for n in dir(module) if not n.startswith("_") and n != "np"}  # (numpy, imported by the source)
    assert stub_names(CODEC / f"{name}.pyi") == exported


def test_the_stub_reader_sees_definitions(tmp_path):
    (tmp_path / "a.pyi").write_text("X: int\ndef f() -> None: ...\nclass C: ...\ndef _g() -> None: ...\n")
    (tmp_path / "b.pyi").write_text("from a import *\n")
    assert stub_names(tmp_path / "b.pyi") == {"X", "f", "C"}
