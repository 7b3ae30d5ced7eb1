"""Canonical JSON, checksums and content addresses: the bytes every small document is stored as.

- :func:`canonical_json`: compact, key-sorted, ASCII JSON, so one value has one
  byte string, and a stored document can be required to *be* that string.
- :func:`address`: blake2b-256 hex of bytes, the name of a content-addressed
  object (store blobs, sync packs and layouts).
- :func:`digest128`: blake2b-128 hex (decoded-chunk content hashes, store
  manifest checksums).
- :func:`seal` / :func:`open_sealed`: a JSON object carrying the checksum of
  its own canonical form (without the checksum field) in a top-level field,
  checked byte for byte on read, so a flipped byte is always an error.
- :func:`plain_json`: a user's value (step metadata) as the plain JSON it will
  read back as, or a named error where JSON would change or refuse it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import InvalidInputError

__all__ = ["canonical_json", "address", "digest128", "seal", "open_sealed", "plain_json"]


#: json.dumps with these options builds a new encoder at every call; one shared encoder writes the same bytes
#: (its encode keeps no state between calls, so threads may share it) without that fixed cost
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def canonical_json(obj) -> bytes:
    """Compact, key-sorted, ASCII JSON: one byte string per value."""
    return _CANONICAL.encode(obj).encode()


def address(data) -> str:
    """blake2b-256 of ``data``, hex: the name of a content-addressed object."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def digest128(data) -> str:
    """blake2b-128 of ``data``, hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def seal(body: dict, field: str = "checksum") -> bytes:
    """Canonical JSON of ``body`` plus ``field``: the :func:`address` of the canonical JSON of ``body``."""
    return canonical_json({**body, field: address(canonical_json(body))})


def open_sealed(raw, bad: Callable[[str], Exception], field: str = "checksum") -> dict:
    """Parse a sealed object: JSON, byte-for-byte canonical, with a valid ``field`` checksum.

    ``bad(reason)`` builds the exception to raise; returns the whole document.
    """
    raw = bytes(raw)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(field), str):
        raise bad("has no checksum")
    body = {k: v for k, v in doc.items() if k != field}
    try:
        canonical = canonical_json(doc)
    except (TypeError, ValueError) as e:
        raise bad(f"holds a non-JSON value: {e}") from None
    if canonical != raw:
        raise bad("is not canonical JSON (altered?)")
    if address(canonical_json(body)) != doc[field]:
        raise bad("fails its checksum")
    return doc


def plain_json(value, what: str = "metadata"):
    """``value`` as the plain JSON it reads back as: dicts with ``str`` keys, lists, str, int, float, bool, None.

    NumPy scalars become the Python values they hold (``np.float32(1.5)`` -> ``1.5``, exactly for float16,
    float32 and float64; ``np.int64`` -> int; ``np.bool_`` -> bool).  What JSON would silently change
    (a non-string key: ``{1: 2}`` reads back as ``{"1": 2}``; a tuple reads back as a list) or cannot hold
    (NaN, infinities: canonical JSON has none; sets, arrays, other objects) raises
    :class:`InvalidInputError` naming its path, ``what['a'][0]``.

    >>> plain_json({"lr": np.float32(0.5), "ids": [np.int64(3)]})
    {'lr': 0.5, 'ids': [3]}
    >>> plain_json({"opt": {1: 2}})
    Traceback (most recent call last):
    ...
    ulstore.errors.InvalidInputError: metadata['opt']: key 1 (int) is not a string: JSON would read it back as '1'; use str keys
    """
    try:
        return _plain(value, what, set())
    except RecursionError:
        raise InvalidInputError(f"{what} is nested too deeply to store as JSON") from None


def _plain(v, path: str, open_: set[int]):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return _finite(float(v), path)
    if isinstance(v, np.generic):
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, np.integer):
            return int(v)
        if isinstance(v, (np.float16, np.float32, np.float64)):  # (exact as a Python float)
            return _finite(float(v), path)
        if isinstance(v, np.str_):
            return str(v)
    if isinstance(v, (Mapping, list)):
        if id(v) in open_:
            raise InvalidInputError(f"{path}: contains itself; JSON cannot hold a cycle")
        open_.add(id(v))
        if isinstance(v, list):
            out: list | dict = [_plain(x, f"{path}[{i}]", open_) for i, x in enumerate(v)]
        else:
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise InvalidInputError(f"{path}: key {k!r} ({type(k).__name__}) is not a string{_as_key(k)}")
                out[str(k)] = _plain(x, f"{path}[{k!r}]", open_)
        open_.discard(id(v))
        return out
    if isinstance(v, tuple):
        raise InvalidInputError(f"{path}: a tuple would read back as a list: pass a list")
    kind = type(v).__name__
    hint = " (use .tolist())" if isinstance(v, np.ndarray) else ""
    raise InvalidInputError(
        f"{path}: a {kind} is not JSON{hint}; metadata holds dicts with str keys, lists, str, finite numbers, "
        "bools and None"
    )


def _as_key(k) -> str:
    """What JSON makes of the non-string key ``k``, and what to do."""
    try:
        (back,) = json.loads(json.dumps({k: 0}))
    except (TypeError, ValueError):
        return ": JSON keys are strings; use str keys"
    return f": JSON would read it back as {back!r}; use str keys"


def _finite(x: float, path: str) -> float:
    if not math.isfinite(x):
        raise InvalidInputError(f"{path}: {x} is not a finite number; JSON cannot hold NaN or infinities")
    return x
