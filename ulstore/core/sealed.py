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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

__all__ = ["canonical_json", "address", "digest128", "seal", "open_sealed"]


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
