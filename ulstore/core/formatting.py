"""Human-readable sizes and counts, for reports, the CLI, the demo and the examples; URLs without credentials;
what to say about a step, ref or name that does not exist (the closest that do); tensors whose dtype or shape
moved, in words (what a commit and an import warn)."""

from __future__ import annotations

import bisect
import difflib
import math
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "human_bytes",
    "binary_bytes",
    "plural",
    "strip_ansi",
    "redact_url",
    "credentials",
    "redact",
    "close_matches",
    "did_you_mean",
    "missing_step_message",
    "describe_retyped",
    "retyped_message",
]

#: Up to this many steps, "no such step" lists them all; beyond, the nearest ones.
_LIST_ALL = 8

# CSI sequences (colours, bold: ESC [ ... letter) and the two-character escapes
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# the userinfo of a URL: after "scheme://", up to the last "@" before the host (no "/", whitespace or quote)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#\s'\"<>`]*)@")


def human_bytes(n: float) -> str:
    """Decimal units, at most three significant digits.

    Examples
    --------
    >>> human_bytes(999), human_bytes(3_600_000), human_bytes(45_170_000), human_bytes(1.5e9)
    ('999 B', '3.6 MB', '45.2 MB', '1.5 GB')
    """
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def binary_bytes(n: int) -> str:
    """``4194304`` -> ``'4 MiB'`` (chunk sizes are powers of two more often than not).

    >>> binary_bytes(4 << 20), binary_bytes(1536), binary_bytes(12)
    ('4 MiB', '1.5 KiB', '12 B')
    """
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def plural(count: int, word: str) -> str:
    """``plural(1, "step") == "1 step"``, ``plural(3, "step") == "3 steps"``.

    >>> plural(1, "step"), plural(1200, "blob")
    ('1 step', '1,200 blobs')
    """
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colours, bold), e.g. from a library's error message.

    >>> strip_ansi("\\x1b[1mdo this only if you trust it\\x1b[0m.")
    'do this only if you trust it.'
    """
    return _ANSI.sub("", text)


def redact_url(url) -> str:
    """``url`` as it may be shown: the user and password of every ``scheme://user:password@`` replaced by ``***``.

    Every URL ulstore keeps for messages (``Trajectory.url``, ``ObjectStore.url``, a Publisher's or
    Follower's ``url``, the CLI's output) goes through this.

    >>> redact_url("http://user:secret@host:8080/run"), redact_url("filecache::s3://KEY:SECRET@bucket/run")
    ('http://***@host:8080/run', 'filecache::s3://***@bucket/run')
    >>> redact_url("s3://bucket/run-7"), redact_url("/data/runs/a@b")
    ('s3://bucket/run-7', '/data/runs/a@b')
    """
    return _USERINFO.sub(lambda m: f"{m['scheme']}***@" if m["userinfo"] else m[0], str(url))


def credentials(url) -> tuple[str, ...]:
    """The userinfo parts (``user:password``) of ``url``, for :func:`redact` to remove wherever they appear.

    >>> credentials("s3://KEY:SECRET@bucket/run"), credentials("s3://bucket/run")
    (('KEY:SECRET',), ())
    """
    return tuple(m["userinfo"] for m in _USERINFO.finditer(str(url)) if m["userinfo"])


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` without credentials: each of ``secrets`` (see :func:`credentials`) before an ``@``, and the
    userinfo of every URL in it, become ``***``.

    ``secrets`` catch a backend's message about a path that holds the URL's userinfo without its scheme
    (s3fs takes ``s3://KEY:SECRET@bucket`` for a bucket named ``KEY:SECRET@bucket``).

    >>> redact('Invalid bucket name "KEY:SECRET@bucket"', ("KEY:SECRET",))
    'Invalid bucket name "***@bucket"'
    >>> redact("GET failed on 'http://u:pw@host/x': 404")
    "GET failed on 'http://***@host/x': 404"
    """
    for secret in secrets:
        text = text.replace(f"{secret}@", "***@")
    return redact_url(text)


def close_matches(wanted: str, names: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Up to ``n`` of ``names`` closest to ``wanted`` (a typo's likely targets), best first; ``[]`` if none is close.

    >>> close_matches("layers.0.atn.weight", ["embed.weight", "layers.0.attn.weight", "layers.0.mlp.weight"])
    ['layers.0.attn.weight', 'layers.0.mlp.weight']
    """
    return difflib.get_close_matches(str(wanted), list(names), n=n, cutoff=cutoff)


def did_you_mean(wanted: str, names: Iterable[str], n: int = 3, cutoff: float = 0.6) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the :func:`close_matches` of ``wanted``, or ``""``."""
    close = close_matches(wanted, names, n=n, cutoff=cutoff)
    if not close:
        return ""
    quoted = [repr(c) for c in close]
    return (
        "; did you mean " + (" or ".join([", ".join(quoted[:-1]), quoted[-1]]) if len(quoted) > 1 else quoted[0]) + "?"
    )


def missing_step_message(where: str, wanted, steps: Sequence[int], refs: Iterable[str] = (), listing: str = "") -> str:
    """What to say about step or ref ``wanted`` that is not in trajectory ``where``: the steps or refs that are.

    ``steps`` sorted; ``listing`` says how to list them all (a long run shows the nearest few).

    >>> missing_step_message("runs/a", 150, [100, 200, 300])
    'no step 150 in runs/a; its steps are 100, 200, 300'
    >>> missing_step_message("runs/a", 7, list(range(0, 100, 10)), listing="`ulstore log runs/a` lists them")
    'no step 7 in runs/a; the nearest are 0, 10, 20 (10 steps from 0 to 90: `ulstore log runs/a` lists them)'
    >>> missing_step_message("runs/a", "mian", [100], refs=["main"])
    "no step or ref named 'mian' in runs/a; did you mean 'main'? (refs: main)"
    """
    if isinstance(wanted, str):
        refs = sorted(refs)
        text = f"no step or ref named {wanted!r} in {where}" + did_you_mean(wanted, refs, n=1, cutoff=0.5)
        return text + (f" (refs: {', '.join(refs)})" if refs else " (it has no refs)")
    if not steps:
        return f"no step {wanted}: {where} has no steps yet"
    if len(steps) <= _LIST_ALL:
        return f"no step {wanted} in {where}; its steps are {', '.join(map(str, steps))}"
    i = bisect.bisect_left(steps, wanted)
    near = steps[max(0, i - 2) : i + 2]
    return (
        f"no step {wanted} in {where}; the nearest are {', '.join(map(str, near))} "
        f"({len(steps)} steps from {steps[0]} to {steps[-1]}{': ' + listing if listing else ''})"
    )


def describe_retyped(changed, limit: int = 2) -> str:
    """Tensors whose dtype or shape moved (name -> ((old shape, dtype), (new shape, dtype))) in words, the
    ``limit`` largest (by their old size) first.

    Examples
    --------
    >>> import numpy as np
    >>> f2, f4 = np.dtype(np.float16), np.dtype(np.float32)
    >>> describe_retyped({"w": (((4, 2), f2), ((4, 2), f4)), "b": (((3,), f4), ((5,), f4))})
    "'w' float16 4x2 -> float32 4x2, 'b' float32 3 -> float32 5"
    >>> describe_retyped({"w": (((3,), f4), ((3,), f4.newbyteorder("S")))})
    "'w' float32 3 -> float32 big-endian 3"
    """

    def spec(shape, dtype) -> str:
        # a byte order is named when it is not the machine's: float32 stored and '>f4' given differ by it alone
        order = "" if dtype.isnative else f" {'big' if dtype.byteorder == '>' else 'little'}-endian"
        return f"{dtype.name}{order} {'x'.join(map(str, shape)) or 'scalar'}"

    def size(name: str) -> int:
        shape, dtype = changed[name][0]
        return math.prod(shape) * dtype.itemsize

    order = sorted(changed, key=lambda n: (-size(n), n))
    text = ", ".join(f"{n!r} {spec(*changed[n][0])} -> {spec(*changed[n][1])}" for n in order[:limit])
    return text + (f" and {len(order) - limit} more" if len(order) > limit else "")


def retyped_message(step, parent, changed) -> str:
    """What a step whose tensors ``changed`` (:func:`describe_retyped`) dtype or shape against ``parent`` says:
    those are stored whole, why, and (for a dtype) how to keep delta-coding.

    Examples
    --------
    >>> import numpy as np
    >>> retyped_message(3, 2, {"w": (((4,), np.dtype(np.float16)), ((4,), np.dtype(np.float32)))})
    "step 3: 1 tensor has another dtype or shape than in parent step 2 ('w' float16 4 -> float32 4), so it is \
stored whole, not as a delta against it (a delta needs its parent's dtype and shape; keep tensors in the \
parent's dtype to keep delta-coding them)"
    """
    one = len(changed) == 1
    text = (
        f"step {step}: {plural(len(changed), 'tensor')} {'has' if one else 'have'} another dtype or shape than in "
        f"parent step {parent} ({describe_retyped(changed)}), so {'it is' if one else 'they are'} stored whole, "
        f"not as {'a delta' if one else 'deltas'} against it (a delta needs its parent's dtype and shape"
    )
    if any(old[1] != new[1] for old, new in changed.values()):
        text += "; keep tensors in the parent's dtype to keep delta-coding them"
    return text + ")"
