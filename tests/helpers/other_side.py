"""Forced interleavings with real processes: run "the other side" in a subprocess at a critical call.

:func:`at_call` hooks one method of a trajectory's object client (``put``,
``create``, ``get``, ``replace_if``, ``delete_if``...) so that when it is
called with a key matching a pattern, an action runs first (once); the call
then proceeds.  :func:`other_side` is the usual action: a separate Python
process that opens the same trajectory and runs a snippet against it (a gc,
a delete, a commit, a publish), and returns what it printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

__all__ = ["at_call", "other_side"]

_PRELUDE = """
import json, sys, warnings
import numpy as np
import ulstore
url, options = sys.argv[1], json.loads(sys.argv[2])
result = None
try:
{body}
except Exception as e:
    result = {{"error": type(e).__name__, "message": str(e)}}
print("RESULT " + json.dumps(result))
"""


def other_side(url: str, options: dict | None, body: str, *, timeout: float = 120) -> object:
    """Run ``body`` (Python, indented by this function) in a new process; returns its ``result`` variable.

    The snippet sees ``url``, ``options`` (storage options), ``np`` and
    ``ulstore``; it sets ``result`` to something JSON-serialisable.  An
    exception becomes ``{"error": type name, "message": ...}``.
    """
    code = _PRELUDE.format(body="\n".join("    " + line for line in body.strip("\n").splitlines()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code, url, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def at_call(io, method, key_pattern: str, action) -> dict:
    """Run ``action()`` the first time ``io.<method>(key, ...)`` is called with ``key`` matching ``key_pattern``.

    ``method``: a name, or a tuple of names sharing the one action (those ``io`` lacks are skipped: the same
    test then runs against clients older than a method).  Returns a record: ``ran`` (the action's return
    value, once it ran) and ``calls`` (the matching keys seen).  The hook stays until the object is dropped.
    """
    record: dict = {"calls": []}
    pattern = re.compile(key_pattern)

    def hook(real):
        def hooked(key, *args, **kwargs):
            if pattern.search(key):
                record["calls"].append(key)
                if "ran" not in record:
                    record["ran"] = action()
            return real(key, *args, **kwargs)

        return hooked

    for name in (method,) if isinstance(method, str) else method:
        if hasattr(io, name):
            setattr(io, name, hook(getattr(io, name)))
    return record
