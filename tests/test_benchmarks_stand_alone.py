"""The benchmarks stand alone: no script or helper of ``benchmarks/`` imports ``tests``.

The test suite is not part of what a benchmark measures, and a change to a test helper must not
change a published figure.  What the benchmarks share lives in their own ``benchmarks/_*.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((REPO / "benchmarks").glob("*.py"))


def imports_of_tests(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, statement) of every import of the ``tests`` package in ``source``, at any depth of the tree
    (inside functions and ``try`` blocks too): ``import tests...``, ``from tests... import ...``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n == "tests" or n.startswith("tests.") for n in names):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_benchmark_imports_tests():
    assert len(BENCHMARKS) >= 5, [p.name for p in BENCHMARKS]  # the scan sees the benchmarks
    bad = [
        f"{p.relative_to(REPO).as_posix()}:{line}: {stmt}"
        for p in BENCHMARKS
        for line, stmt in imports_of_tests(p.read_text(encoding="utf-8"), str(p))
    ]
    assert not bad, "benchmarks import tests (move what they share to benchmarks/_*.py):\n" + "\n".join(bad)


def test_the_scan_finds_every_form_of_import():
    source = """
import os
import tests
import tests.helpers.dcp as jobs
from tests.helpers import dcp
def f():
    try:
        from tests import helpers
    except ImportError:
        pass
from testsuite import x
from . import tests as local
import contests
"""
    assert [line for line, _ in imports_of_tests(source)] == [3, 4, 5, 8]
