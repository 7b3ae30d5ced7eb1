"""Which lane a run is in is decided in one place, tests/helpers/lanes.py: a test that read ``CI`` itself could
run fewer examples in CI (the slow lane, where all of them belong) than on a developer's machine."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent
_READS_CI = re.compile(r"""environ(?:\.get\(|\[)\s*["']CI["']|getenv\(\s*["']CI["']""")


def test_only_the_lanes_helper_reads_ci():
    readers = [
        str(p.relative_to(ROOT.parent))
        for p in sorted(ROOT.rglob("*.py"))
        if p.name != "lanes.py" and _READS_CI.search(p.read_text(encoding="utf-8"))
    ]
    assert readers == [], f"use tests.helpers.lanes (slow_lane(), examples(full)) instead of reading CI: {readers}"


def test_examples_are_all_of_them_in_the_slow_lane(monkeypatch):
    from tests.helpers import lanes

    monkeypatch.setattr(lanes, "_slow", True)
    assert lanes.examples(120) == 120
    monkeypatch.setattr(lanes, "_slow", False)
    assert lanes.examples(120) == 30
