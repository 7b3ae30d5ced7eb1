"""Warnings attributed to the user's line, however deep in ulstore (or in a framework calling it) they arise.

A fixed ``stacklevel`` is right for one call path only: the same commit warning is reached from
``Trajectory.commit`` (three frames deep), from ``ulstore.io.import_checkpoint`` (more), from the DCP
writer (under ``torch.distributed.checkpoint``) and from the CLI.  :func:`warn_at_caller` counts the
frames instead (Python 3.12's ``skip_file_prefixes`` does this; 3.11 is supported).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings

__all__ = ["warn_at_caller", "caller_stacklevel", "held_warnings"]

_held = threading.local()  # .into: the list warn_at_caller appends to on this thread, while held_warnings runs

#: Modules whose frames are never "the caller": ulstore itself, and the frameworks that call it back
#: (``dcp.save`` runs the DCP writer's ``finish``), so the warning names the line of the user's code.
_SKIPPED = ("ulstore", "torch.distributed.checkpoint")


def _skipped(frame) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return any(name == m or name.startswith(m + ".") for m in _SKIPPED)


def caller_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller of this function that names the first
    frame outside ulstore (1: that caller itself, when it is not ulstore's).

    Without such a frame (ulstore's own command line) the outermost frame is named; in a thread ulstore
    started (the publisher's commits), the thread's first frame outside ulstore.
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _skipped(frame):
        frame = frame.f_back
        level += 1
    return level


def warn_at_caller(warning: Warning) -> None:
    """``warnings.warn(warning)`` attributed to the user's line (:func:`caller_stacklevel`), or kept for
    another thread to give (:func:`held_warnings`)."""
    into = getattr(_held, "into", None)
    if into is not None:
        into.append(warning)
        return
    warnings.warn(warning, stacklevel=caller_stacklevel())


@contextlib.contextmanager
def held_warnings(into: list):
    """While this runs, :func:`warn_at_caller` on this thread appends to ``into`` instead of warning: work done
    on a worker thread for a caller who waits for it (a blocking publish) is warned of at the caller's own line,
    by the caller's ``warn_at_caller``, not at the worker thread's."""
    before = getattr(_held, "into", None)
    _held.into = into
    try:
        yield into
    finally:
        _held.into = before
