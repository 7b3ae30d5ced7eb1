"""How to install what an optional feature needs, in words that work for *this* install of ulstore.

A source checkout installed with ``pip install -e .`` has no ``ulstore`` on PyPI to add an
extra to: ``pip install "ulstore[torch]"`` would fetch another ulstore (or fail).  Every hint
that names a pip command gets it from :func:`install_command`, which reads how ulstore was
installed (PEP 610 ``direct_url.json``) and names the same source again.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["install_command", "install_source"]

_DIST = "ulstore"


def install_source() -> tuple[str, bool] | None:
    """``(local directory, editable)`` if this ulstore runs from, or was installed from, a directory; None if it
    was installed from an index, a wheel or a VCS URL.

    The distribution's ``direct_url.json`` says how it was installed; where the code running is a source
    tree other than the one it names (a second checkout first on ``sys.path``, a tree never installed),
    the running tree is the one to install.
    """
    running = _running_tree()
    named = _installed_from()
    if named is not None and (running is None or _same(named[0], running)):
        return named
    return (str(running), True) if running is not None else None


def _running_tree() -> Path | None:
    """The source checkout this module runs from (``ulstore/core/install.py`` in it), or None (site-packages)."""
    tree = Path(__file__).resolve().parents[2]
    return tree if (tree / "pyproject.toml").is_file() and (tree / _DIST).is_dir() else None


def _installed_from() -> tuple[str, bool] | None:
    """``(directory, editable)`` from the installed distribution's PEP 610 record, if it was a local directory."""
    try:
        dist = importlib.metadata.distribution(_DIST)
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    if not isinstance(direct, dict) or "dir_info" not in direct:
        return None
    url = urlparse(str(direct.get("url", "")))
    if url.scheme != "file":
        return None
    return unquote(url.path), bool((direct.get("dir_info") or {}).get("editable"))


def _same(directory: str, tree: Path) -> bool:
    try:
        return Path(directory).resolve() == tree
    except OSError:
        return False


def install_command(extra: str | None = None) -> str:
    """The pip command that adds the optional dependencies ``extra`` (``"torch"``, ``"plot"``...) to this ulstore.

    ``pip install -e "/path/to/checkout[torch]"`` for an editable install (``pip install -e .``),
    ``pip install "/path/to/checkout[torch]"`` for one from a local directory, else
    ``pip install "ulstore[torch]"``.  Without ``extra``: the command that (re)installs ulstore itself.

    >>> install_command("torch").endswith('[torch]"')
    True
    """
    source = install_source()
    suffix = f"[{extra}]" if extra else ""
    if source is None:
        return f'pip install "{_DIST}{suffix}"'
    directory, editable = source
    return f'pip install {"-e " if editable else ""}"{directory}{suffix}"'
