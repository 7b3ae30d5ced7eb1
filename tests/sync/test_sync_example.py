"""The weight-sync example runs as a script: trainer + replica process + HTTP control messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real multi-process jobs: the slow lane (CI=true, --slow)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "weight_sync_http.py"


def test_weight_sync_http_example(tmp_path):
    p = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "7", "--anchor-every", "3", "--url", str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all versions exact: True" in p.stdout
    assert p.stdout.count(": exact") == 8 and "DIFFERENT" not in p.stdout
