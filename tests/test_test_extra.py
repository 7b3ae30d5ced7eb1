"""The ``test`` extra installs every optional package the tests import.

Tests use ``pytest.importorskip`` for torch and a few others so that a plain
``pip install -e .`` can still run the rest; this test makes sure that in the
README's (and CI's) ``pip install -e ".[test]"`` none of those skips can happen.
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
#: distribution name -> module the tests import
MODULES = {
    "moto": "moto.server",
    "pytest-timeout": "pytest_timeout",
    "pytest-xdist": "xdist",
    "distributed": "distributed",
}


def test_every_test_dependency_is_importable():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    checked = []
    for line in extra:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue  # e.g. torch on Pythons it has no wheel for: its tests skip there, by design
        module = MODULES.get(req.name, req.name.replace("-", "_"))
        importlib.import_module(module)  # ImportError here: the extra did not install it
        checked.append(req.name)
    assert {"moto", "s3fs", "zstandard", "zipnn", "hypothesis"} <= set(checked), checked
    # what the tests also import through moto[server] and s3fs
    for module in ("boto3", "safetensors.numpy", "matplotlib", "torch"):
        if module != "torch" or "torch" in checked:
            importlib.import_module(module)


def test_the_test_extra_resolves_fast_on_a_fresh_venv():
    """#38.17: no exact pin a new user's resolver must match (torch is a range up to the tested release), and
    boto3 is bounded to the botocore window aiobotocore allows: unbounded, pip tried boto3 releases one by one
    for minutes on a fresh venv (measured: 2 min 41 s to resolve with the bound, no backtracking)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    reqs = {Requirement(line).name: Requirement(line) for line in extra}
    pinned = {n for n, r in reqs.items() if any(s.operator == "==" for s in r.specifier)}
    assert pinned <= {"ruff", "mypy"}, pinned  # (the linters: CI's verdict must not change under a release)
    assert {s.operator for s in reqs["torch"].specifier} == {">=", "<="}
    assert {s.operator for s in reqs["boto3"].specifier} == {">=", "<"}
    assert "pytest-xdist" in reqs  # the README's command runs on both cores
