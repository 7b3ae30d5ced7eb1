"""Which lane this pytest run includes, for helpers that do less work in the fast lane (tests/conftest.py).

The default run (the README's ``python -m pytest -q -n 2``) is the fast lane; ``CI=true`` (``.ci/run``),
``--slow`` or a ``-m`` selection add the slow lane.  :func:`slow_lane` tells which, once ``tests/conftest.py``
has configured the run (:func:`configure`, in ``pytest_configure``, in every xdist worker too).
"""

from __future__ import annotations

import os

__all__ = ["configure", "examples", "slow_lane"]

_slow: bool | None = None


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def configure(config) -> bool:
    """Record whether ``config`` (pytest's) runs the slow lane: in CI (``CI=true``), with ``--slow``, or when the
    command line selects by marker (``-m slow``).  Returns it."""
    global _slow
    _slow = _ci() or bool(config.getoption("--slow")) or bool(config.getoption("markexpr"))
    return _slow


def slow_lane() -> bool:
    """Whether this run includes the slow lane (outside pytest, as in CI: whether ``CI`` is set)."""
    return _ci() if _slow is None else _slow


def examples(full: int) -> int:
    """Hypothesis examples for a property test: ``full`` when the slow lane runs (CI), a quarter (at least 10)
    in the fast lane.  The same property and strategies either way: CI runs every example a release needs,
    a developer's run a sample that still finds a broken encoder in seconds."""
    return full if slow_lane() else max(10, full // 4)
