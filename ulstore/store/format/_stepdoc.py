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
     "files": {"config.json": [pack, offset, length, size, "<blake3-128 hex of the content>"]},
     "chain": {"packs": ["<32 hex>", ...],   optional: the table directories of the step's ancestors
               "steps": [[step, parent, "<content hex>", [pack, ...], [[first, last, pack, offset, length,
                          "<blake3-128 hex>"], ...]], ...]},
     "anchoring": {"cost": c, "anchor_cost": a, "step_cost": s,     optional (absent in older documents):
                   "anchor": null | {"policy": ..., ...}}}           the read-cost model and why it is an anchor

``anchoring`` (:class:`Anchoring`) carries the modelled cost of reading the
step (fetch plus decode along its chain, ``_read_cost.py``), that of its
chain's anchor and what its own blobs add, so the next commit decides
anchor or delta without walking the chain; on an anchor, ``anchor`` says
why: ``{"policy": "cost", "k": 2.0, "predicted": p, "limit": l}`` (reading
the next step would have cost ``p`` > ``l`` = k x the anchor's read),
``{"policy": "every", "every": 16}`` (``anchor_every``), ``{"policy":
"root"}`` (no parent) or ``{"policy": "asked"}`` (``commit(anchor=True)``).

``tables`` is the directory of table blocks, sorted by tensor name (``first``
and ``last`` are the first and last tensor of each block).

``chain`` (written by commits since 2026-12; absent from an anchor and from
older documents) copies the table directory of each step along the parent
path back to the nearest anchor: the parent first, then its parent, and so
on, each with its own pack list (indices into ``chain["packs"]``, in the
order of that step's ``packs``) and its content checksum.  A reader fetches
the table blocks of a chunk's whole reference chain in one parallel batch
instead of walking step documents one by one; each block is still checked
against its BLAKE3-128, and each decoded chunk against its content hash.
It is bounded (:data:`MAX_CHAIN_STEPS` steps, :data:`MAX_CHAIN_BLOCKS`
directory rows): a longer path is cut, and a reader walks the step
documents beyond the last step listed, as it does for documents without it.
``attributes["ulstore_checksum"]`` is the BLAKE3-128 of the canonical JSON of
the whole document without that field, and the object must be byte for byte
the canonical JSON: a flipped byte is always an error, never a wrong table.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field

from ...core.sealed import canonical_json
from ...errors import CorruptManifestError
from ._chunkcodec import digest
from ._layout import MAX_STEP, check_file_names, is_pack_id, tensor_name_problem
from ._table_block import MAX_BLOCK_RAW

__all__ = [
    "FORMAT",
    "StepDoc",
    "TableRef",
    "FileRef",
    "ChainStep",
    "chain_after",
    "Anchoring",
    "ANCHOR_POLICIES",
    "is_hex128",
    "MAX_CHAIN_STEPS",
    "MAX_CHAIN_BLOCKS",
]

FORMAT = 2
_HEX128 = re.compile(r"^[0-9a-f]{32}\Z")
_MAX = 1 << 62
#: A table block inflates to at most MAX_BLOCK_RAW bytes, so no writer's block is longer than this (Zstd's
#: worst-case growth, the header): a longer directory entry would have a reader fetch it before its hash check
_MAX_BLOCK_BYTES = MAX_BLOCK_RAW + (MAX_BLOCK_RAW >> 7) + (1 << 20)
#: Ancestors a step document's ``chain`` lists at most (a reader walks the documents beyond them).
MAX_CHAIN_STEPS = 512
#: Table directory rows all the ``chain`` entries of a document hold together at most: a few hundred KiB of
#: JSON (a 10k-tensor model has ~10 blocks per step), whatever the chain's length and the model's size.
MAX_CHAIN_BLOCKS = 4096


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


def _find_table(tables, name: str) -> int | None:
    """Index of the row of a sorted table directory whose range holds ``name`` (binary search), or None."""
    lo, hi = 0, len(tables)
    while lo < hi:
        mid = (lo + hi) // 2
        if tables[mid].last < name:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(tables) and tables[lo].first <= name:
        return lo
    return None


@dataclass(frozen=True)
class ChainStep:
    """An ancestor's table directory as a step document's ``chain`` lists it: what a reader needs to fetch and
    check that ancestor's table blocks (and resolve the pack numbers inside them) without its step document.

    ``packs`` and ``tables`` are as in the ancestor's own document; ``content`` is its content checksum.
    """

    step: int
    parent: int | None
    content: str
    packs: tuple[str, ...]
    tables: tuple[TableRef, ...]

    def table_for(self, name: str) -> int | None:
        """Index of the table block that would hold tensor ``name``, or None."""
        return _find_table(self.tables, name)

    @classmethod
    def of(cls, d: StepDoc) -> ChainStep:
        """The entry that names step document ``d``'s directory."""
        return cls(d.step, d.parent, d.content, d.packs, d.tables)


def chain_after(parent: StepDoc) -> tuple[ChainStep, ...]:
    """The ``chain`` of a delta step committed on ``parent``: ``parent``'s directory, then ``parent``'s own
    chain, cut at :data:`MAX_CHAIN_STEPS` steps or :data:`MAX_CHAIN_BLOCKS` directory rows."""
    out: list[ChainStep] = []
    rows = 0
    for entry in (ChainStep.of(parent), *parent.chain):
        rows += len(entry.tables)
        if len(out) >= MAX_CHAIN_STEPS or rows > MAX_CHAIN_BLOCKS:
            break
        out.append(entry)
    return tuple(out)


def _chain_json(chain: tuple[ChainStep, ...]) -> dict:
    """The ``chain`` field: one pack list for all entries (ancestors share most packs), each entry's packs
    as indices into it."""
    packs: list[str] = []
    index: dict[str, int] = {}
    steps = []
    for e in chain:
        numbers = []
        for pid in e.packs:
            if pid not in index:
                index[pid] = len(packs)
                packs.append(pid)
            numbers.append(index[pid])
        steps.append([e.step, e.parent, e.content, numbers, [t.to_json() for t in e.tables]])
    return {"packs": packs, "steps": steps}


#: Why a step is an anchor, and the fields each reason carries besides ``policy``.
ANCHOR_POLICIES = {"cost": ("k", "predicted", "limit"), "every": ("every",), "root": (), "asked": ()}
#: Bound of a stored ``k`` (the cost policy's factor): anything larger is damage, not a setting.
MAX_ANCHOR_K = 1e6


@dataclass(frozen=True)
class Anchoring:
    """The read-cost model of one step, and on an anchor why it is one (see the module docstring).

    Costs are integers in the model's units (``_read_cost.py``): about a byte
    fetched, decode work weighted to match.
    """

    cost: int  # reading this step: fetch and decode of its chain, anchor included
    anchor_cost: int  # reading its chain's anchor (this step's own cost if it is one)
    step_cost: int  # what this step's own blobs add to its parent's cost
    why: dict | None = None  # an anchor's reason: {"policy": ..., fields of ANCHOR_POLICIES[policy]}

    def to_json(self) -> dict:
        return {"cost": self.cost, "anchor_cost": self.anchor_cost, "step_cost": self.step_cost, "anchor": self.why}

    @classmethod
    def of(cls, doc: dict) -> Anchoring | None:
        """The ``anchoring`` field of a step document's body, checked; None if absent (an older writer's)."""
        return cls.parse(doc["anchoring"]) if "anchoring" in doc else None

    @classmethod
    def parse(cls, body) -> Anchoring:
        """Check a stored ``anchoring`` object field by field (crafted values raise ValueError, naming the field)."""
        if not isinstance(body, dict) or set(body) != {"cost", "anchor_cost", "step_cost", "anchor"}:
            raise ValueError(f"malformed anchoring: {str(body)[:100]!r}")
        cost, anchor_cost, step_cost = (_count(body[f], f"anchoring {f}") for f in ("cost", "anchor_cost", "step_cost"))
        why = body["anchor"]
        if why is not None:
            policy = why.get("policy") if isinstance(why, dict) else None
            fields = ANCHOR_POLICIES.get(policy) if isinstance(policy, str) else None
            if fields is None or set(why) != {"policy", *fields}:
                raise ValueError(f"malformed anchor reason: {str(why)[:100]!r}")
            if "k" in why:
                k = why["k"]
                if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= MAX_ANCHOR_K:
                    raise ValueError(f"bad anchor k: {k!r}")
            for f in ("predicted", "limit", "every"):
                if f in why:
                    _count(why[f], f"anchor {f}")
        return cls(cost, anchor_cost, step_cost, why)


def _count(v, what, top=_MAX) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < top:
        raise ValueError(f"bad {what}: {v!r}")
    return v


def _directory(rows, n_packs: int) -> tuple[TableRef, ...]:
    """A table directory from its JSON rows (sorted, non-overlapping, bounded), pack numbers below ``n_packs``."""
    tables: list[TableRef] = []
    for first, last, pack, offset, length, h in rows:
        if tensor_name_problem(first) or tensor_name_problem(last) or not first <= last or not is_hex128(h):
            raise ValueError("malformed table directory entry")
        if tables and first <= tables[-1].last:
            raise ValueError("table directory is not sorted")
        tables.append(
            TableRef(
                first,
                last,
                _count(pack, "pack", n_packs),
                _count(offset, "offset"),
                _count(length, "length", _MAX_BLOCK_BYTES),
                h,
            )
        )
    return tuple(tables)


def _copied_directory(rows, n_packs: int) -> tuple[TableRef, ...]:
    """A table directory as a ``chain`` copies it: :func:`_directory`'s bounds and order, with cheaper checks of
    names and hashes (a document may hold thousands of rows; a reader compares each with the block it fetches:
    the block's hash, and its first and last tensor names, which the block's own parse checks)."""
    tables: list[TableRef] = []
    prev = None
    for first, last, pack, offset, length, h in rows:
        if (
            type(first) is not str
            or type(last) is not str
            or not first <= last
            or (prev is not None and first <= prev)
            or type(h) is not str
            or len(h) != 32
        ):
            raise ValueError("malformed or unsorted table directory entry in the chain")
        if (
            type(pack) is not int
            or type(offset) is not int
            or type(length) is not int
            or not (0 <= pack < n_packs and 0 <= offset < _MAX and 0 <= length < _MAX_BLOCK_BYTES)
        ):
            raise ValueError(f"bad pack, offset or length in the chain: {[pack, offset, length]!r}")
        tables.append(TableRef(first, last, pack, offset, length, h))
        prev = last
    return tuple(tables)


def _chain_entry(row, packs: list[str]) -> ChainStep:
    """One entry of the ``chain`` field, checked on its own (``packs``: the field's pack list)."""
    s, p, content, numbers, tables = row
    if not is_hex128(content):
        raise ValueError("malformed chain content checksum")
    if not isinstance(numbers, list) or len(set(numbers)) != len(numbers) or len(tables) > MAX_CHAIN_BLOCKS:
        raise ValueError("malformed chain entry")
    ids = tuple(packs[_count(i, "chain pack", len(packs))] for i in numbers)
    parent = None if p is None else _count(p, "chain parent", MAX_STEP)
    return ChainStep(_count(s, "chain step", MAX_STEP), parent, content, ids, _copied_directory(tables, len(ids)))


def _parse_chain(body: dict, step: int, parent: int | None) -> tuple[ChainStep, ...]:
    """The ``chain`` field checked: bounded, well formed, and a path along parents from ``parent`` (each
    entry's step is the previous entry's parent; the first is the parent), never through ``step`` or any
    step twice.  (Its copies of content checksums are cache keys only: ``verify`` checks the hash chain
    between the documents themselves.)"""
    if "chain" not in body:
        return ()
    chain = body["chain"]
    if not isinstance(chain, dict) or chain.keys() != {"packs", "steps"}:
        raise ValueError("malformed chain")
    packs, rows = chain["packs"], chain["steps"]
    if not isinstance(packs, list) or not all(is_pack_id(p) for p in packs) or len(set(packs)) != len(packs):
        raise ValueError("malformed chain pack list")
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_CHAIN_STEPS:
        raise ValueError(f"chain must list 1 to {MAX_CHAIN_STEPS} steps")
    if parent is None:
        raise ValueError("a step without a parent has no chain")
    if parent == step:  # refused with its own message once parsed (StepDoc.from_bytes)
        return ()
    out: list[ChainStep] = []
    seen = {step}
    expected: int | None = parent
    n_rows = 0
    for row in rows:
        entry = _chain_entry(row, packs)
        if entry.step != expected or entry.step in seen:
            raise ValueError(f"chain lists step {entry.step} where the parent path has step {expected}")
        n_rows += len(entry.tables)
        if n_rows > MAX_CHAIN_BLOCKS:
            raise ValueError(f"chain lists more than {MAX_CHAIN_BLOCKS} table blocks")
        out.append(entry)
        seen.add(entry.step)
        expected = entry.parent
    return tuple(out)


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
    #: the table directories of the ancestors along the parent path (see the module docstring); () for none
    chain: tuple[ChainStep, ...] = ()
    anchoring: Anchoring | None = None  # None: a document written before the cost model (or by an old writer)

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
        if self.chain:  # absent rather than empty: an anchor's document is as before
            body["chain"] = _chain_json(self.chain)
        if self.anchoring is not None:  # absent otherwise: older documents keep their bytes
            body["anchoring"] = self.anchoring.to_json()
        attributes: dict = {"ulstore": body}
        doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
        attributes["ulstore_checksum"] = _checksum(canonical_json(doc))
        return canonical_json(doc)

    def table_for(self, name: str) -> int | None:
        """Index of the table block that would hold tensor ``name`` (binary search), or None."""
        return _find_table(self.tables, name)

    @functools.cached_property
    def chain_positions(self) -> dict[int, tuple[int, ChainStep]]:
        """step -> (position along the parent path, 1 for the parent; its ``chain`` entry)."""
        return {e.step: (k + 1, e) for k, e in enumerate(self.chain)}

    def named_packs(self) -> set[str]:
        """Every pack the document names: its own, and those of its ``chain``."""
        out = set(self.packs)
        for e in self.chain:
            out.update(e.packs)
        return out

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
        count = _count
        packs = body["packs"]
        if not isinstance(packs, list) or not all(is_pack_id(p) for p in packs) or len(set(packs)) != len(packs):
            raise ValueError("malformed pack list")
        n = len(packs)
        tables = _directory(body["tables"], n)
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
        step = count(body["step"], "step", MAX_STEP)
        parent = None if parent is None else count(parent, "parent", MAX_STEP)
        return cls(
            step=step,
            parent=parent,
            content=content,
            parent_content=parent_content,
            anchor_distance=count(body["anchor_distance"], "anchor distance"),
            packs=tuple(packs),
            tables=tables,
            files=files,
            metadata=body["metadata"],
            created=body["created"],
            chain=_parse_chain(body, step, parent),
            anchoring=Anchoring.of(body),
        )
