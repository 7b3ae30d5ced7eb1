"""The first hour of a new user, replayed from the outside in a fresh venv (tests/smoke/newcomer.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("newcomer.sh")


@pytest.mark.slow
def test_a_newcomer_follows_the_readme_and_finds_what_they_reach_for():
    if shutil.which("git") is None:
        raise AssertionError("git is needed: the script clones the committed tree, as a new user gets it")
    p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    assert "the first hour holds" in p.stdout
