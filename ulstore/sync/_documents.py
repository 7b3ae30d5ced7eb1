"""The three small JSON documents of a sync store: Layout, Manifest, Latest (see ``_layout`` for the keys).

Every one is stored as *canonical* JSON carrying a ``checksum`` field
(:func:`ulstore.core.sealed.seal`); a reader rejects an object that is not
byte-for-byte canonical or fails its checksum, so a flipped byte is always a
:class:`~ulstore.errors.CorruptManifestError` naming the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..core.dtypes import dtype_from_name
from ..core.sealed import address as blob_address
from ..core.sealed import open_sealed, seal
from ..errors import CorruptManifestError, DtypeError
from ._layout import _CODECS, _KINDS, CHUNK_HASH, FORMAT, dtype_name

__all__ = ["TensorSpec", "Layout", "Entry", "Manifest", "Latest"]


def _sealed(body: dict) -> bytes:
    """Canonical JSON of ``body`` plus its checksum field."""
    return seal(body)


def _open_sealed(raw, key: str, what: str) -> dict:
    """Parse and check a sealed object: canonical bytes, valid checksum, our format."""
    if raw is None:
        raise CorruptManifestError(f"{what} is missing", key=key)
    doc = open_sealed(raw, lambda why: CorruptManifestError(f"{what} {why}", key=key))
    if doc.get("format") != FORMAT:
        raise CorruptManifestError(f"{what} has format {doc.get('format')!r}, expected {FORMAT!r}", key=key)
    return doc


def _need(cond, key: str, what: str, why: str) -> None:
    if not cond:
        raise CorruptManifestError(f"{what} is malformed: {why}", key=key)


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one published tensor."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.kind not in "biu"

    def n_chunks(self, chunk_elems: int) -> int:
        return -(-self.size // chunk_elems)

    def chunk_range(self, chunk: int, chunk_elems: int) -> tuple[int, int]:
        start = chunk * chunk_elems
        return start, min(self.size, start + chunk_elems)


@dataclass(frozen=True)
class Layout:
    """The tensor table of a version: names (in publication order), dtypes, shapes, chunking.

    Stored once per distinct table at ``layouts/<digest>.json``; manifests name it
    by digest, so a version manifest carries only what changed.
    """

    chunk_elems: int
    tensors: tuple[TensorSpec, ...]
    index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "index", {t.name: i for i, t in enumerate(self.tensors)})

    def to_bytes(self) -> bytes:
        return _sealed(
            {
                "format": FORMAT,
                "chunk_elems": self.chunk_elems,
                "chunk_hash": CHUNK_HASH,
                "tensors": [[t.name, dtype_name(t.dtype), list(t.shape)] for t in self.tensors],
            }
        )

    @property
    def digest(self) -> str:
        return blob_address(self.to_bytes())

    @property
    def total_elements(self) -> int:
        return sum(t.size for t in self.tensors)

    @classmethod
    def from_bytes(cls, raw, key: str) -> Layout:
        doc = _open_sealed(raw, key, "layout")
        what = "layout"
        _need(_is_uint(doc.get("chunk_elems")) and doc["chunk_elems"] > 0, key, what, "chunk_elems")
        _need(doc.get("chunk_hash") == CHUNK_HASH, key, what, f"chunk_hash is not {CHUNK_HASH!r}")
        rows = doc.get("tensors")
        _need(isinstance(rows, list), key, what, "tensors is not a list")
        tensors = []
        for row in rows:
            _need(isinstance(row, list) and len(row) == 3 and isinstance(row[0], str), key, what, "tensor row")
            _need(isinstance(row[2], list) and all(map(_is_uint, row[2])), key, what, f"shape of {row[0]!r}")
            try:
                dtype = dtype_from_name(row[1])
            except DtypeError as e:
                raise CorruptManifestError(f"layout is malformed: {e}", key=key) from None
            tensors.append(TensorSpec(row[0], dtype, tuple(row[2])))
        _need(len({t.name for t in tensors}) == len(tensors), key, what, "duplicate tensor names")
        if blob_address(bytes(raw)) != key.rsplit("/", 1)[-1].split(".")[0]:
            raise CorruptManifestError("layout does not match its address", key=key)
        return cls(doc["chunk_elems"], tuple(tensors))


@dataclass(frozen=True)
class Entry:
    """One coded chunk: where its blob sits and what its decoded bytes hash to."""

    tensor: int  # index into the layout
    chunk: int
    codec: str  # DELTA, INTRA or RAW
    pack: int  # index into Manifest.packs
    offset: int
    length: int
    hash: str  # CHUNK_HASH of the decoded chunk, 8 hex digits

    def row(self) -> list:
        return [self.tensor, self.chunk, self.codec, self.pack, self.offset, self.length, self.hash]


@dataclass(frozen=True)
class Manifest:
    """What one version (kind ``delta``/``reset``) or one anchor (kind ``anchor``) holds.

    ``delta``: ``entries`` are the chunks that changed since ``parent``, coded
    against it (or intra for new tensors).  ``reset``: no delta; a follower must
    load ``anchors/<version>`` (first version, or a publisher that could not
    resume).  ``anchor``: every chunk of the state, intra-coded; its
    ``version_checksum`` binds it to the version manifest of the same number.
    ``anchor`` (the field) is the newest anchor at or before ``version``.
    """

    kind: str
    version: int
    parent: int | None
    parent_checksum: str | None
    anchor: int
    layout: str
    packs: tuple[tuple[str, int], ...]
    entries: tuple[Entry, ...]
    created: str
    metadata: dict
    version_checksum: str | None = None
    checksum: str = ""

    def body(self) -> dict:
        return {
            "format": FORMAT,
            "kind": self.kind,
            "version": self.version,
            "parent": self.parent,
            "parent_checksum": self.parent_checksum,
            "anchor": self.anchor,
            "layout": self.layout,
            "packs": [list(p) for p in self.packs],
            "chunks": [e.row() for e in self.entries],
            "created": self.created,
            "metadata": self.metadata,
            "version_checksum": self.version_checksum,
        }

    def to_bytes(self) -> bytes:
        return _sealed(self.body())

    def sealed(self) -> tuple[Manifest, bytes]:
        """This manifest with its checksum filled in, and its bytes."""
        raw = self.to_bytes()
        checksum = json.loads(raw)["checksum"]
        return Manifest(**{**self.__dict__, "checksum": checksum}), raw

    @classmethod
    def from_bytes(cls, raw, key: str, *, version: int, kind: str | None = None) -> Manifest:
        """Parse and validate; ``version`` (and ``kind``) must be what ``key`` promises."""
        doc = _open_sealed(raw, key, "manifest")
        what = "manifest"
        _need(doc.get("kind") in _KINDS, key, what, f"kind {doc.get('kind')!r}")
        _need(doc.get("version") == version, key, what, f"it is for version {doc.get('version')!r}, not {version}")
        if kind is not None:
            _need(
                doc["kind"] == kind if kind == "anchor" else doc["kind"] != "anchor", key, what, f"kind {doc['kind']!r}"
            )
        parent = doc.get("parent")
        _need(parent is None or (_is_uint(parent) and parent < version), key, what, "parent")
        _need(parent is None or isinstance(doc.get("parent_checksum"), str), key, what, "parent_checksum")
        _need(_is_uint(doc.get("anchor")) and doc["anchor"] <= version, key, what, "anchor")
        _need(isinstance(doc.get("layout"), str), key, what, "layout")
        _need(isinstance(doc.get("metadata"), dict) and isinstance(doc.get("created"), str), key, what, "metadata")
        packs = doc.get("packs")
        _need(
            isinstance(packs, list)
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _is_uint(p[1]) for p in packs),
            key,
            what,
            "packs",
        )
        entries = []
        for row in doc.get("chunks") or []:
            ok = (
                isinstance(row, list)
                and len(row) == 7
                and all(_is_uint(row[i]) for i in (0, 1, 3, 4, 5))
                and row[2] in _CODECS
                and isinstance(row[6], str)
                and len(row[6]) == 8
                and row[3] < len(packs)
                and row[4] + row[5] <= packs[row[3]][1]
            )
            _need(ok, key, what, f"chunk entry {row!r}")
            entries.append(Entry(*row))
        if doc["kind"] == "anchor":
            _need(
                isinstance(doc.get("version_checksum"), str) and doc["anchor"] == version, key, what, "anchor binding"
            )
        if doc["kind"] == "reset":
            _need(not entries and doc["anchor"] == version, key, what, "a reset carries no chunks")
        return cls(
            kind=doc["kind"],
            version=version,
            parent=parent,
            parent_checksum=doc.get("parent_checksum"),
            anchor=doc["anchor"],
            layout=doc["layout"],
            packs=tuple((p[0], p[1]) for p in packs),
            entries=tuple(entries),
            created=doc["created"],
            metadata=doc["metadata"],
            version_checksum=doc.get("version_checksum"),
            checksum=doc["checksum"],
        )


@dataclass(frozen=True)
class Latest:
    """The pointer to the newest complete version (``latest.json``).

    Written last by every publish: everything it names (the version manifest,
    its packs and layout, the anchor manifest of ``anchor`` and its packs)
    exists when a reader can see it.
    """

    version: int
    checksum: str  # of versions/<version>.json
    anchor: int
    anchor_checksum: str  # of anchors/<anchor>.json
    updated: str

    def to_bytes(self) -> bytes:
        return _sealed(
            {
                "format": FORMAT,
                "version": self.version,
                "manifest_checksum": self.checksum,
                "anchor": self.anchor,
                "anchor_checksum": self.anchor_checksum,
                "updated": self.updated,
            }
        )

    @classmethod
    def from_bytes(cls, raw, key: str) -> Latest:
        doc = _open_sealed(raw, key, "latest pointer")
        what = "latest pointer"
        _need(
            _is_uint(doc.get("version")) and _is_uint(doc.get("anchor")) and doc["anchor"] <= doc["version"],
            key,
            what,
            "version/anchor",
        )
        _need(
            isinstance(doc.get("manifest_checksum"), str) and isinstance(doc.get("anchor_checksum"), str),
            key,
            what,
            "checksums",
        )
        return cls(
            doc["version"], doc["manifest_checksum"], doc["anchor"], doc["anchor_checksum"], str(doc.get("updated", ""))
        )
