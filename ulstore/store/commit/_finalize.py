"""The finalizer: the records of a step's piece writers -> its tables, step document and ref.

:meth:`Finalizer._finalize` checks that the records agree and tile
every tensor, writes the step's files and table blocks into the commit's
pack, closes it, then creates the step document (the commit point: a
conditional create, so of two writers exactly one wins) and moves the branch
through :meth:`Pending.publish` (``_pending.py``).
"""

from __future__ import annotations

import datetime as _dt
import math
import weakref

import numpy as np

from ...core.dtypes import numpy_dtype
from ...errors import InvalidInputError, StepExistsError
from .._base import TrajectoryBase
from ..format._chunk_tables import TensorTable, content_checksum, pieces_problem
from ..format._chunkcodec import digest, zstd_compress
from ..format._layout import check_tensor_names, step_key
from ..format._packs import PackStream
from ..format._read_cost import PER_READ
from ..format._refs import RefState
from ..format._stepdoc import Anchoring, FileRef, StepDoc, TableRef, chain_after
from ..format._table_block import encode_block
from ._piece_columns import PieceRecord

__all__ = ["Finalizer", "TABLE_BLOCK_BYTES"]

#: Raw bytes of tensor tables gathered into one block (a lazy slice fetches one block).
TABLE_BLOCK_BYTES = 256 << 10


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


class Finalizer:
    """Tables, files, the step document and the ref move of one step (see the module docstring)."""

    def __init__(self, trajectory: TrajectoryBase):
        # a proxy, not a reference: the trajectory owns this object, and a trajectory dropped
        # must free its caches and kept step at once (no cycle left for the garbage collector)
        self._t = weakref.proxy(trajectory)

    def _tables(self, step, records, parent, pdoc, anchor) -> tuple[list[TensorTable], list[str]]:
        """The tensor tables of ``records`` (checked, see :meth:`_gather`) and the packs they point into."""
        tensors, packs = self._gather(step, records, parent, pdoc, anchor)
        index = {p: i for i, p in enumerate(packs)}
        remaps: dict[tuple, np.ndarray] = {}  # one pack-number map per list of pack ids (most records share a few)
        tables = [
            TensorTable(n, t[0], t[1], t[2], tuple(r.piece(index, remaps) for r in t[3])) for n, t in tensors.items()
        ]
        return tables, packs

    def _finalize(
        self,
        step,
        records,
        parent,
        stream: PackStream,
        *,
        branch: RefState | None,
        metadata,
        files,
        anchor,
        created=None,
    ):
        """Tables and files into ``stream``, close it, then the commit point and the ref move.

        ``branch``: the branch as read before the commit (None: move no ref);
        it moves by compare-and-swap, through :meth:`Pending.publish` (which
        first refuses a commit on a step being deleted, or on a head whose
        previous commit was interrupted; see ``_pending.py``).
        """
        pdoc = self._t._reader.doc(parent) if parent is not None else None
        tables, packs = self._tables(step, records, parent, pdoc, anchor)
        index = {p: i for i, p in enumerate(packs)}

        def number(pid: str) -> int:
            if pid not in index:
                index[pid] = len(packs)
                packs.append(pid)
            return index[pid]

        file_refs = _file_refs(files, pdoc, stream, number)
        table_refs = []
        for block in _blocks(tables):
            raw = encode_block(block)
            pid, off, n = stream.append(raw)
            table_refs.append(TableRef(block[0].name, block[-1].name, number(pid), off, n, digest(raw).hex()))
        stream.close()
        refs = [p.ref for t in tables for p in t.pieces]
        all_refs = np.concatenate(refs) if refs else np.zeros(0, np.int64)
        distance = pdoc.anchor_distance + 1 if pdoc is not None and _has_delta(tables, all_refs) else 0
        doc = StepDoc(
            step=step,
            parent=parent,
            content=content_checksum(tables, {k: f.hash for k, f in file_refs.items()}, metadata),
            parent_content=pdoc.content if pdoc is not None else None,
            anchor_distance=distance,
            packs=tuple(packs),
            tables=tuple(table_refs),
            files=file_refs,
            metadata=metadata,
            created=created or _now(),
            # a delta names its ancestors' table directories, so that a read of any of its chunks fetches the
            # table blocks of the whole reference chain in one parallel batch (no document walk)
            chain=chain_after(pdoc) if distance and pdoc is not None else (),
            anchoring=_anchoring(pdoc, anchor, records),
        )
        key = step_key(step)

        def create() -> None:  # the commit point: conditional create, so of two writers exactly one wins
            try:
                self._t._io.create(key, doc.to_bytes())
            except FileExistsError:
                raise StepExistsError("another writer committed this step first", step=step, key=key) from None
            self._t._reader.remember(doc, tables)

        def parent_content() -> str | None:  # the parent as stored now (another writer may have replaced it)
            stored = self._t._reader.stored_doc(parent)
            if stored is None or stored.content != doc.parent_content:
                self._t._reader.forget([parent])  # a retry reads the parent anew
            return None if stored is None else stored.content

        refers = {int(r) for r in np.unique(all_refs) if r >= 0}
        self._t._pending.publish(
            step,
            parent,
            refers,
            create,
            refs=self._t._refs,
            branch=branch,
            existing=self._t._committed,
            parent_content=parent_content if parent is not None else None,
            coded_against=doc.parent_content,
            still_mine=lambda: self._t._reader.stored_doc(step) == doc,
        )

    def _gather(self, step, records: list[PieceRecord], parent, pdoc, anchor) -> tuple[dict, list[str]]:
        """Check the records of one step agree and tile their tensors; group them by tensor; list their packs."""
        tensors = _by_tensor(step, records, parent, pdoc.content if pdoc is not None else None, anchor)
        check_tensor_names(tensors)
        grids: dict[tuple, int] = {}  # chunks of each piece layout (a step of ~10,000 tensors has a few dozen)
        packs: list[str] = []
        seen: set[str] = set()
        last: tuple = ()
        out = {}
        for name in sorted(tensors):
            dtype, shape, codec, rs = tensors[name]
            if len(rs) > 1:
                rs.sort(key=lambda r: r.offset)
            why = pieces_problem(shape, [r.layout for r in rs])
            if why is not None:
                raise InvalidInputError(f"pieces do not tile the tensor: {why}", step=step, tensor=name)
            for r in rs:
                n = grids.get(key := (r.piece_shape, r.chunks))
                if n is None:
                    n = grids[key] = math.prod(-(-s // c) for s, c in zip(r.piece_shape, r.chunks))
                if not (len(r.content) == len(r.ref) == len(r.pack) == len(r.off) == len(r.length) == n):
                    raise InvalidInputError("a record's columns do not match its chunk grid", step=step, tensor=name)
                if r.packs != last:  # (consecutive records mostly name the same packs)
                    last = r.packs
                    for pid in r.packs:
                        if pid not in seen:
                            seen.add(pid)
                            packs.append(pid)
            out[name] = (dtype, shape, codec, rs)
        return out, packs


def _by_tensor(step, records: list[PieceRecord], parent, parent_content, anchor) -> dict[str, tuple]:
    """name -> (dtype, shape, codec, [records]) of a step's records, each checked to be of this step, parent
    and anchoring, and to agree with the other pieces of its tensor on dtype, shape and codec."""
    tensors: dict[str, tuple] = {}
    dtypes: dict[str, np.dtype] = {}  # (a step has a few dtypes and ~10,000 records)
    for r in records:
        if not isinstance(r, PieceRecord):
            raise InvalidInputError(f"finalize takes PieceRecords, got {type(r).__name__}")
        if (r.step, r.parent, r.anchor) != (step, parent, anchor) or r.parent_content != parent_content:
            raise InvalidInputError(
                f"a record was written for step {r.step} on parent {r.parent} (anchor={r.anchor}), "
                f"not step {step} on {parent} (anchor={anchor})",
                step=step,
                tensor=r.name,
            )
        dtype = dtypes.get(r.dtype)
        if dtype is None:
            dtype = dtypes[r.dtype] = numpy_dtype(r.dtype)
        shape = tuple(r.shape)
        t = tensors.setdefault(r.name, (dtype, shape, r.codec, []))
        if t[0] != dtype or t[1] != shape or t[2] != r.codec:
            raise InvalidInputError("pieces of one tensor disagree on dtype or shape", step=step, tensor=r.name)
        t[3].append(r)
    return tensors


def _file_refs(files: dict, pdoc: StepDoc | None, stream: PackStream, number) -> dict[str, FileRef]:
    """Where each file of a step is: the parent's blob of the same content, one of this step's (a file
    given twice under two names), else appended to ``stream``; ``number``: a pack id's index in the step."""
    refs: dict[str, FileRef] = {}
    for name in sorted(files):
        data = files[name]
        h = digest(data).hex()
        old = pdoc.files.get(name) if pdoc is not None else None
        if old is None and pdoc is not None:  # the same content under another name
            old = next((f for f in pdoc.files.values() if f.hash == h), None)
        if old is not None and old.hash == h and pdoc is not None:
            refs[name] = FileRef(number(pdoc.packs[old.pack]), old.offset, old.length, old.size, h)
            continue
        same = next((f for f in refs.values() if f.hash == h), None)
        if same is not None:
            refs[name] = same
            continue
        pid, off, n = stream.append(zstd_compress(data))
        refs[name] = FileRef(number(pid), off, n, len(data), h)
    return refs


def _anchoring(pdoc: StepDoc | None, anchor: bool, records: list[PieceRecord]) -> Anchoring | None:
    """The step's read-cost model (``_read_cost.py``): an anchor's is its own blobs' plus the fixed cost of a
    read (``PER_READ``); a delta's adds its new blobs' to its parent's.  None if the parent has none (written
    before the model): the chain's cost is unknown."""
    own = sum(int(r.cost) for r in records)
    whys = {repr(r.why) for r in records}
    if len(whys) > 1:
        raise InvalidInputError(f"the records of one step disagree on why it is an anchor: {sorted(whys)}")
    why = records[0].why if records else None
    if anchor or pdoc is None:
        if why is None:  # records made without a reason (an older writer's): say what is known
            why = {"policy": "root"} if pdoc is None else {"policy": "asked"}
        own += PER_READ
        return Anchoring(own, own, own, why)
    pa = pdoc.anchoring
    if pa is None:
        return None
    return Anchoring(pa.cost + own, pa.anchor_cost, own, None)


def _has_delta(tables: list[TensorTable], refs: np.ndarray) -> bool:
    """Whether a chunk of the step is read through a reference (not a snapshot): the step is no anchor.
    ``refs``: every piece's ``ref`` column, concatenated (what decides it when no piece has snapshots)."""
    if not (refs >= 0).any():
        return False
    if all(p.snap is None for t in tables for p in t.pieces):
        return True
    return any(
        bool(((p.ref >= 0) & ((p.snap[:, 0] < 0) if p.snap is not None else True)).any())
        for t in tables
        for p in t.pieces
    )


def _blocks(tables: list[TensorTable]) -> list[list[TensorTable]]:
    """Consecutive tensors (sorted by name) grouped into blocks of about ``TABLE_BLOCK_BYTES`` raw."""
    out: list[list[TensorTable]] = []
    size = 0
    for t in tables:
        n = 64 + len(t.name) + sum(24 * len(t.shape) + 45 * p.n for p in t.pieces)
        if not out or size + n > TABLE_BLOCK_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out
