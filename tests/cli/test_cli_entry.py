"""How ``ulstore`` is started: ``python -m ulstore``, and a bare ``ulstore`` (help on stdout, exit 0, as pip)."""

from __future__ import annotations

import subprocess
import sys

from ulstore import cli


def _python_m(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)


def test_python_m_ulstore_is_the_command():
    p = _python_m("ulstore", "--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ulstore ")
    p = _python_m("ulstore", "log", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: ulstore log"), p.stderr


def test_bare_ulstore_prints_the_help_and_exits_0(capsys):
    assert cli.main([]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: ulstore") and "commands:" in captured.out
    assert captured.err == ""
    p = _python_m("ulstore")
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout == _python_m("ulstore", "--help").stdout
