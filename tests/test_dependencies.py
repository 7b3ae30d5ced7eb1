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
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ulstore"
#: parts of the package that are only usable with an extra installed, and that extra
PART_EXTRAS = {"dcp": "torch"}


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(line).name) for line in requirements}


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported by the module's own body (not in functions, not under TYPE_CHECKING)."""
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_module_level_imports_are_declared_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _names(project["dependencies"])
    extras = {name: _names(lines) for name, lines in project["optional-dependencies"].items()}
    distributions = packages_distributions()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0] if path.parent != PACKAGE else ""
        allowed = core | extras.get(PART_EXTRAS.get(part, ""), set())
        for module in _module_level_imports(path):
            if module in sys.stdlib_module_names or module in ("ulstore", "__future__"):
                continue
            dists = {canonicalize_name(d) for d in distributions.get(module, [module])}
            if not dists & allowed:
                missing.append(f"{path.relative_to(ROOT)}: import {module} ({', '.join(sorted(dists))})")
    assert not missing, "not in [project].dependencies:\n" + "\n".join(missing)


def _all_imports(path: Path) -> set[str]:
    """Top-level names imported anywhere in the module (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_import_is_a_dependency_or_in_an_extra():
    """What a function imports on demand (torch, matplotlib...) must be in an extra a user can install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _names(project["dependencies"]).union(*map(_names, project["optional-dependencies"].values()))
    distributions = packages_distributions()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module in _all_imports(path) - set(sys.stdlib_module_names) - {"ulstore", "__future__"}:
            dists = {canonicalize_name(d) for d in distributions.get(module, [module])}
            if not dists & declared:
                missing.append(f"{path.relative_to(ROOT)}: import {module} ({', '.join(sorted(dists))})")
    assert not missing, "in no dependency list of pyproject.toml:\n" + "\n".join(missing)


def test_the_check_sees_an_undeclared_import(tmp_path):
    """The parser finds module-level imports and leaves function-level ones alone."""
    module = tmp_path / "m.py"
    module.write_text("import blake3\nfrom numcodecs import zstd\n\ndef f():\n    import torch\n")
    assert _module_level_imports(module) == {"blake3", "numcodecs"}
    assert _all_imports(module) == {"blake3", "numcodecs", "torch"}
