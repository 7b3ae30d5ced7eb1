"""The other side of a forced interleaving, as a snippet: a separate process that opens the same trajectory and
runs a few lines against it (a gc, a delete, a commit, a publish, with whatever patch the race needs).

Used as the callback of :func:`tests.helpers.interleave.interleave`::

    with interleave(on=("put", r"^steps/"), run=lambda call: other_side(url, options, "result = 1")) as il:
        traj.delete(3)
"""

from __future__ import annotations

import json

from .interleave import run_python

__all__ = ["other_side"]

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
print(json.dumps(result))
"""


def other_side(url: str, options: dict | None, body: str, *, timeout: float = 120) -> object:
    """Run ``body`` (Python, indented by this function) in a new process; returns its ``result`` variable.

    The snippet sees ``url``, ``options`` (storage options), ``np`` and ``ulstore``, and sets ``result`` to
    something JSON-serialisable.  An exception becomes ``{"error": type name, "message": ...}``.
    """
    code = _PRELUDE.format(body="\n".join("    " + line for line in body.strip("\n").splitlines()))
    return run_python(code, url, json.dumps(options), timeout=timeout)
