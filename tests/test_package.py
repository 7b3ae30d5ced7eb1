"""The ``ulstore`` package itself: subpackages reachable as attributes, lazily, without torch."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_ulstore_imports_neither_torch_nor_the_heavy_subpackages():
    got = _run(
        "import sys, ulstore\n"
        "print(sorted(m for m in ('torch', 'ulstore.dcp', 'ulstore.sync', 'ulstore.io', 'ulstore.cli') "
        "if m in sys.modules))"
    )
    assert got == "[]"


# one interpreter each (1.3 s of CPU), one module __getattr__ for every name: sync and io in the fast lane, all of them
# in the slow lane;
# dcp in test_dcp_writer_after_a_bare_import (one interpreter importing torch, not two)
@pytest.mark.parametrize(
    "name",
    [
        "sync",
        "io",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("toytrain", "cli", "store", "codec", "core", "errors")),
    ],
)
def test_subpackages_are_attributes_of_ulstore_after_a_bare_import(name):
    got = _run(f"import ulstore, importlib\nprint(ulstore.{name} is importlib.import_module('ulstore.{name}'))")
    assert got == "True"


def test_dcp_writer_after_a_bare_import():
    """``ulstore.dcp`` is the subpackage after a bare import, and its Writer and Reader are there."""
    got = _run(
        "import ulstore, importlib\n"
        "print(ulstore.dcp is importlib.import_module('ulstore.dcp'), ulstore.dcp.Writer.__name__, ulstore.dcp.Reader.__name__)"
    )
    assert got == "True Writer Reader"


def test_subpackages_are_listed_by_dir_and_unknown_names_still_raise():
    import ulstore

    assert {"dcp", "sync", "io", "cli"} <= set(dir(ulstore))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ulstore.nope  # noqa: B018
