"""The step document: one small, sealed JSON object per step, written last (the commit point).

``steps/<step>/zarr.json`` is a valid Zarr v3 group document whose
``attributes["ulstore"]`` holds step-level data only, so it stays small at
any model size::

    {"format": 2, "step": 1001, "parent": 1000,
     "content": "<blake3-128 hex>",         logical checksum of the step (_tables.content_checksum)
     "parent_content": "<hex>" | null,      the parent's "content": the hash chain
     "anchor_distance": 3, "created": "...", "metadata": {...user JSON...},
     "packs": ["<32 hex>", ...],            every pack the step's tables, files and entries point into
     "tables": [[first, last, pack, offset, length, "<blake3-128 hex>"], ...],
     "files": {"config.json": [pack, offset, length, size, "<blake3-128 hex of the content>"]}}

``tables`` is the directory of table blocks, sorted by tensor name (``first``
and ``last`` are the first and last tensor of each block).
``attributes["ulstore_checksum"]`` is the BLAKE3-128 of the canonical JSON of
the whole document without that field, and the object must be byte for byte
the canonical JSON: a flipped byte is always an error, never a wrong table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ...core.sealed import canonical_json
from ...errors import CorruptManifestError
from ._chunkcodec import digest
from ._layout import MAX_STEP, check_file_names, is_pack_id, tensor_name_problem
from ._table_block import MAX_BLOCK_RAW

__all__ = ["FORMAT", "StepDoc", "TableRef", "FileRef", "is_hex128"]

FORMAT = 2
_HEX128 = re.compile(r"^[0-9a-f]{32}\Z")
_MAX = 1 << 62
#: A table block inflates to at most MAX_BLOCK_RAW bytes, so no writer's block is longer than this (Zstd's
#: worst-case growth, the header): a longer directory entry would have a reader fetch it before its hash check
_MAX_BLOCK_BYTES = MAX_BLOCK_RAW + (MAX_BLOCK_RAW >> 7) + (1 << 20)


def _not_canonical(doc, key: str) -> str:
    """Why a JSON step document is not canonical: a zarr write (which re-indents and adds attributes), or damage."""
    try:
        attrs = dict(doc["attributes"])
        checksum = attrs.pop("ulstore_checksum")
        body = attrs.pop("ulstore")
        sealed = {"zarr_format": 3, "node_type": "group", "attributes": {"ulstore": body}}
        intact = checksum == _checksum(canonical_json(sealed))
        extra = sorted(set(doc) - {"zarr_format", "node_type", "attributes"})
    except Exception:  # not even the shape of a step document: plain damage
        return "step document is not in canonical form"
    added = f"attributes added: {sorted(attrs)}; " if attrs else ""
    fields = f"fields added: {extra}; " if extra else ""
    state = (
        "its sealed fields are intact (no tensor data is lost), but a step document must stay byte for byte as "
        "ulstore wrote it"
        if intact
        else "its sealed fields changed too"
    )
    return (
        f"step document was rewritten outside ulstore, as a plain zarr write does (e.g. setting an attribute "
        f"on the group {key.rsplit('/', 1)[0]!r}): {added}{fields}{state}. Steps are immutable: never write into a "
        "trajectory with zarr; put metadata into commit(..., metadata=...) of a new step (docs/layout.md)"
    )


def is_hex128(value) -> bool:
    return isinstance(value, str) and _HEX128.match(value) is not None


def _checksum(body: bytes) -> str:
    return digest(body).hex()


_TAIL = b'},"node_type":"group","zarr_format":3}'


def _unsealed(canonical: bytes, doc: dict, checksum) -> bytes:
    """The canonical JSON of ``doc`` once ``ulstore_checksum`` was popped from its attributes.

    ``canonical`` is that of ``doc`` before the pop.  For a document of the shape :meth:`StepDoc.to_bytes`
    writes it is cut out of ``canonical`` rather than serialised again (a follower parses a step document
    per version): keys sort ``attributes < node_type < zarr_format`` and ``ulstore < ulstore_checksum``, so
    the checksum's entry is the last of the attributes, right before ``_TAIL``; anything else is dumped.
    """
    if (
        is_hex128(checksum)
        and doc.keys() == {"attributes", "node_type", "zarr_format"}
        and doc["attributes"].keys() == {"ulstore"}
        and doc["node_type"] == "group"
        and type(doc["zarr_format"]) is int
        and doc["zarr_format"] == 3
    ):
        sealed_tail = b',"ulstore_checksum":"' + checksum.encode() + b'"' + _TAIL
        if canonical.endswith(sealed_tail):
            return canonical[: len(canonical) - len(sealed_tail)] + _TAIL
    return canonical_json(doc)


@dataclass(frozen=True)
class TableRef:
    """Where one table block is: its tensor range, location and BLAKE3-128."""

    first: str
    last: str
    pack: int
    offset: int
    length: int
    hash: str

    def to_json(self) -> list:
        return [self.first, self.last, self.pack, self.offset, self.length, self.hash]


@dataclass(frozen=True)
class FileRef:
    """A file of the step: a Zstd blob of ``size`` bytes whose content hashes to ``hash``."""

    pack: int
    offset: int
    length: int
    size: int
    hash: str

    def to_json(self) -> list:
        return [self.pack, self.offset, self.length, self.size, self.hash]


@dataclass(frozen=True)
class StepDoc:
    """Everything stored about one step but its chunk tables."""

    step: int
    parent: int | None
    content: str
    parent_content: str | None
    anchor_distance: int
    packs: tuple[str, ...]
    tables: tuple[TableRef, ...]
    files: dict[str, FileRef] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    created: str = ""

    def to_bytes(self) -> bytes:
        """The step's ``zarr.json``: canonical JSON, sealed."""
        body = {
            "format": FORMAT,
            "step": self.step,
            "parent": self.parent,
            "content": self.content,
            "parent_content": self.parent_content,
            "anchor_distance": self.anchor_distance,
            "created": self.created,
            "metadata": self.metadata,
            "packs": list(self.packs),
            "tables": [t.to_json() for t in self.tables],
            "files": {k: f.to_json() for k, f in self.files.items()},
        }
        attributes: dict = {"ulstore": body}
        doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
        attributes["ulstore_checksum"] = _checksum(canonical_json(doc))
        return canonical_json(doc)

    def table_for(self, name: str) -> int | None:
        """Index of the table block that would hold tensor ``name`` (binary search), or None."""
        lo, hi = 0, len(self.tables)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.tables[mid].last < name:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self.tables) and self.tables[lo].first <= name:
            return lo
        return None

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, step: int | None = None) -> StepDoc:
        """Parse and check a step document.

        Raises
        ------
        CorruptManifestError
            The bytes are not a well-formed step document with a matching checksum.
        """
        try:
            doc = json.loads(data)
            # the stored bytes must be exactly the canonical form, and the checksum
            # covers the whole document: no flipped byte can go unnoticed
            canonical = canonical_json(doc)
            if canonical != bytes(data):
                raise CorruptManifestError(_not_canonical(doc, key), step=step, key=key)
            attrs = doc["attributes"]
            checksum = attrs.pop("ulstore_checksum")
            if checksum != _checksum(_unsealed(canonical, doc, checksum)):
                raise CorruptManifestError("step document fails its checksum", step=step, key=key)
            body = attrs["ulstore"]
            if body["format"] != FORMAT:
                raise CorruptManifestError(f"unknown step document format {body['format']!r}", step=step, key=key)
            m = cls._parse(body)
        except CorruptManifestError:
            raise
        except Exception as e:  # JSON, missing fields, wrong types: all one thing to the caller
            raise CorruptManifestError(
                f"step document is malformed: {type(e).__name__}: {str(e)[:200]}", step=step, key=key
            ) from e
        if step is not None and m.step != step:
            raise CorruptManifestError(f"step document is for step {m.step}", step=step, key=key)
        if m.parent == m.step:  # a parent walk would never end (a later step may be a parent: an older checkpoint
            # added on top of a newer one; so loops of two or more steps are found by the walks themselves)
            raise CorruptManifestError(
                f"step document names step {m.step} as its own parent (a parent is another step)", step=m.step, key=key
            )
        return m

    @classmethod
    def _parse(cls, body: dict) -> StepDoc:
        def count(v, what, top=_MAX) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < top:
                raise ValueError(f"bad {what}: {v!r}")
            return v

        packs = body["packs"]
        if not isinstance(packs, list) or not all(is_pack_id(p) for p in packs) or len(set(packs)) != len(packs):
            raise ValueError("malformed pack list")
        n = len(packs)
        tables: list[TableRef] = []
        for first, last, pack, offset, length, h in body["tables"]:
            if tensor_name_problem(first) or tensor_name_problem(last) or not first <= last or not is_hex128(h):
                raise ValueError("malformed table directory entry")
            if tables and first <= tables[-1].last:
                raise ValueError("table directory is not sorted")
            tables.append(
                TableRef(
                    first,
                    last,
                    count(pack, "pack", n),
                    count(offset, "offset"),
                    count(length, "length", _MAX_BLOCK_BYTES),
                    h,
                )
            )
        files = {}
        check_file_names(body["files"])
        for name, (pack, offset, length, size, h) in body["files"].items():
            if not is_hex128(h):
                raise ValueError("malformed file entry")
            files[name] = FileRef(
                count(pack, "pack", n), count(offset, "offset"), count(length, "length"), count(size, "file size"), h
            )
        parent, content, parent_content = body["parent"], body["content"], body["parent_content"]
        if not is_hex128(content) or not (parent_content is None or is_hex128(parent_content)):
            raise ValueError("malformed content checksums")
        if not isinstance(body["metadata"], dict) or not isinstance(body["created"], str):
            raise ValueError("malformed metadata")
        return cls(
            step=count(body["step"], "step", MAX_STEP),
            parent=None if parent is None else count(parent, "parent", MAX_STEP),
            content=content,
            parent_content=parent_content,
            anchor_distance=count(body["anchor_distance"], "anchor distance"),
            packs=tuple(packs),
            tables=tuple(tables),
            files=files,
            metadata=body["metadata"],
            created=body["created"],
        )
