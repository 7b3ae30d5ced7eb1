"""Install hints name a command that works for the user's install (#38 item 8).

A user who installed from source with ``pip install -e .`` was told ``pip install ulstore[torch]``: that
would fetch some other ulstore from an index.  Every hint comes from one helper,
:func:`ulstore.core.install.install_command`, which reads how ulstore was installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ulstore.core import install

PACKAGE = Path(install.__file__).resolve().parents[1]


class _Dist:
    def __init__(self, direct_url):
        self.direct_url = direct_url

    def read_text(self, name):
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


def _installed(monkeypatch, direct_url, running=None):
    """ulstore installed as ``direct_url.json`` says ("missing": not installed), its code running from the
    source tree ``running`` (None: from site-packages)."""
    monkeypatch.setattr(install, "_running_tree", lambda: None if running is None else Path(running).resolve())

    def distribution(name):
        assert name == "ulstore"
        if direct_url == "missing":
            raise importlib.metadata.PackageNotFoundError(name)
        return _Dist(direct_url)

    monkeypatch.setattr(install.importlib.metadata, "distribution", distribution)


def test_an_editable_install_is_told_to_install_its_own_directory(monkeypatch):
    _installed(
        monkeypatch,
        {"url": "file:///home/me/src/ulstore%20x", "dir_info": {"editable": True}},
        "/home/me/src/ulstore x",
    )
    assert install.install_command("torch") == 'pip install -e "/home/me/src/ulstore x[torch]"'
    assert install.install_command() == 'pip install -e "/home/me/src/ulstore x"'
    _installed(monkeypatch, {"url": "file:///home/me/src/ulstore", "dir_info": {}})  # `pip install /dir`
    assert install.install_command("plot") == 'pip install "/home/me/src/ulstore[plot]"'


def test_an_install_from_an_index_or_url_is_told_the_package_name(monkeypatch):
    for direct in (
        None,
        {"url": "https://x/ulstore-0.1.0.whl", "archive_info": {}},
        {"url": "https://g/u", "vcs_info": {}},
    ):
        _installed(monkeypatch, direct)
        assert install.install_command("torch") == 'pip install "ulstore[torch]"', direct


def test_a_source_tree_never_installed_is_told_to_install_itself(monkeypatch):
    _installed(monkeypatch, "missing", "/src/checkout")
    assert install.install_command("torch") == 'pip install -e "/src/checkout[torch]"'
    # another checkout installed, this one running (first on sys.path): this one
    _installed(monkeypatch, {"url": "file:///src/main", "dir_info": {"editable": True}}, "/src/worktree")
    assert install.install_command("torch") == 'pip install -e "/src/worktree[torch]"'
    monkeypatch.undo()
    assert install._running_tree() == PACKAGE.parent  # (these tests run from a checkout)


def test_every_hint_uses_the_helper(monkeypatch, tmp_path):
    _installed(monkeypatch, {"url": "file:///opt/ulstore-src", "dir_info": {"editable": True}}, "/opt/ulstore-src")
    want = 'pip install -e "/opt/ulstore-src[torch]"'
    from ulstore.core import torch as core_torch
    from ulstore.errors import InvalidInputError

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(InvalidInputError) as e:
        core_torch.import_torch()
    assert want in str(e.value)
    monkeypatch.delitem(sys.modules, "torch")

    from ulstore.cli import _plot

    monkeypatch.setattr(_plot, "has_matplotlib", lambda: False)
    with pytest.raises(InvalidInputError) as e:
        _plot.check_matplotlib()
    assert 'pip install -e "/opt/ulstore-src[plot]"' in str(e.value)
    # no hint anywhere in the package names an extra by hand
    literal = re.compile(r"pip install[^\n]*ulstore\[")
    offenders = [
        str(p)
        for p in PACKAGE.rglob("*.py")
        if p.name != "install.py" and literal.search(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, offenders


def test_ulstore_dcp_without_torch_says_how_to_install_it():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import ulstore.dcp\nexcept ImportError as e:\n    print(e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    from ulstore.core.install import install_command

    assert "ulstore.dcp needs PyTorch" in p.stdout and install_command("torch") in p.stdout, p.stdout
