"""The keys of a sync store and what they name; the documents themselves are in ``_documents``.

Read me first
-------------
- Every JSON object is stored as *canonical* JSON (sorted keys, no spaces,
  ASCII) and carries a ``checksum`` field: blake2b-256 of the canonical JSON
  of the object without that field.  A reader rejects an object that is not
  byte-for-byte canonical or fails its checksum, so a flipped byte is always a
  :class:`~ulstore.errors.CorruptManifestError` naming the key, never a wrong
  chunk table.
- Packs and layouts are content-addressed (their key is the blake2b-256 of
  their bytes); manifests are named by version; ``latest.json`` is the only
  object ever overwritten.
- A chunk is a contiguous range of ``chunk_elems`` elements of a tensor's
  flattened C-order view; chunk ``c`` of a tensor of ``n`` elements covers
  ``[c * chunk_elems, min(n, (c + 1) * chunk_elems))``.

Keys (relative to the store root)::

    sync.json                  {"format": "ulstore.sync/1", "created": ...}   written once
    latest.json                Latest: newest complete version              overwritten, written LAST
    versions/<v:012d>.json     Manifest kind "delta" or "reset"              one per version
    anchors/<v:012d>.json      Manifest kind "anchor": the full state of v   every anchor_every versions
    layouts/<h>.json           Layout: tensor names, dtypes, shapes          content-addressed
    packs/<h>.ulpk             concatenated chunk blobs                      content-addressed

See ``docs/sync.md`` for the guarantees built on this.
"""

from __future__ import annotations

import datetime as _dt
import json

import numpy as np

from ..core.dtypes import dtype_from_name
from ..core.dtypes import dtype_name as _dtype_name
from ..errors import InvalidInputError

__all__ = [
    "FORMAT",
    "SYNC_META",
    "LATEST",
    "VERSIONS_DIR",
    "ANCHORS_DIR",
    "CHUNK_HASH",
    "DELTA",
    "INTRA",
    "RAW",
    "version_key",
    "anchor_key",
    "layout_key",
    "pack_key",
    "parse_version_key",
    "check_version",
    "is_sync_meta",
    "dtype_name",
    "dtype_from_name",
    "now",
]

#: Format tag in every JSON object of a sync store.
FORMAT = "ulstore.sync/1"
SYNC_META = "sync.json"
LATEST = "latest.json"
VERSIONS_DIR = "versions"
ANCHORS_DIR = "anchors"
#: How chunk hashes are computed: zlib's CRC-32 of the chunk's little-endian bytes, 8 hex digits.
#: Independent of ULPack's own checksums, so a codec bug cannot hide behind them.
CHUNK_HASH = "crc32"

# Per-chunk codec tags in manifest entries.
DELTA = "d"  # ULPack blob coded against the same chunk of the parent version
INTRA = "i"  # ULPack blob coded against +0.0 (anchors, new tensors)
RAW = "r"  # the chunk's raw little-endian bytes (integer / bool tensors)
_CODECS = (DELTA, INTRA, RAW)
_KINDS = ("delta", "reset", "anchor")
_MAX_VERSION = 10**12 - 1  # keys are zero-padded to 12 digits so a LIST sorts them


def version_key(version: int) -> str:
    """Key of the manifest of ``version``."""
    return f"{VERSIONS_DIR}/{version:012d}.json"


def anchor_key(version: int) -> str:
    """Key of the anchor manifest of ``version``."""
    return f"{ANCHORS_DIR}/{version:012d}.json"


def layout_key(digest: str) -> str:
    return f"layouts/{digest}.json"


def pack_key(digest: str) -> str:
    return f"packs/{digest}.ulpk"


def parse_version_key(key: str, directory: str) -> int | None:
    """The version named by ``<directory>/<v:012d>.json``, or None for any other key."""
    head, _, name = key.rpartition("/")
    if head != directory or not name.endswith(".json"):
        return None
    stem = name[: -len(".json")]
    return int(stem) if len(stem) == 12 and stem.isdigit() else None


def is_sync_meta(raw) -> bool:
    """Whether ``raw`` is the ``sync.json`` of a store in this format."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def check_version(version) -> int:
    """A version number: an int in [0, 10**12)."""
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
        raise InvalidInputError(f"a version must be an int, got {type(version).__name__}")
    if not 0 <= int(version) <= _MAX_VERSION:
        raise InvalidInputError(f"a version must be in [0, {_MAX_VERSION}], got {version}")
    return int(version)


# -- dtypes -----------------------------------------------------------------------


def dtype_name(dtype: np.dtype) -> str:
    """Name of a storable dtype (``bfloat16``, ``float32``, ``int64``, ``bool``...)."""
    return _dtype_name(dtype, what="ulstore.sync publishes")
