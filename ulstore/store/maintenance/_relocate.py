"""A step document with its bytes at new places: what delete and gc write for a step they rewrite.

Both :meth:`Trajectory.delete` (re-encoded chunks) and :meth:`Trajectory.gc`
(repacked packs) move some of a step's blobs; :func:`relocated_doc` maps every
location of the step through ``move``, re-encodes its table blocks (grouped as
before) into the new pack and returns the document to PUT.  Its logical
content, and so its content checksum, never changes.

A document's ``chain`` copies its ancestors' table directories, so once some
documents change, :func:`rechained` gives every document whose copy went stale
its chain anew (both gc and delete write those too).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..format._chunk_tables import Piece, TensorTable
from ..format._chunkcodec import digest
from ..format._packs import PackStream
from ..format._stepdoc import FileRef, StepDoc, TableRef, chain_after
from ..format._table_block import encode_block

__all__ = ["relocated_doc", "rechained"]


def _blocks_like(d: StepDoc, tables: dict[str, TensorTable]) -> list[list[TensorTable]]:
    """The step's tensors grouped as its table directory groups them."""
    names = sorted(tables)
    out = []
    for ref in d.tables:
        out.append([tables[n] for n in names if ref.first <= n <= ref.last])
    return [b for b in out if b]


def relocated_doc(
    d: StepDoc,
    tables: dict[str, TensorTable],
    stream: PackStream,
    move,
    *,
    parent=None,
    parent_content=None,
    reparent: bool = False,
) -> StepDoc:
    """A new step document for ``d`` whose locations are mapped by ``move`` and tables re-encoded into ``stream``.

    ``move(pack id, offset, length)`` returns the blob's new location (or
    the same).  The logical content (and its checksum) does not change.
    """
    packs: list[str] = []
    index: dict[str, int] = {}

    def number(pid: str) -> int:
        if pid not in index:
            index[pid] = len(packs)
            packs.append(pid)
        return index[pid]

    new_tables = []
    for name in sorted(tables):
        t = tables[name]
        pieces = []
        for p in t.pieces:
            locs = [move(d.packs[int(p.pack[i])], int(p.off[i]), int(p.length[i])) for i in range(p.n)]
            snap = None
            if p.snap is not None:
                snap = np.full((p.n, 3), -1, np.int64)
                for i in range(p.n):
                    s = p.snapshot(i)
                    if s is not None:
                        pid, off, n = move(d.packs[s[0]], s[1], s[2])
                        snap[i] = (number(pid), off, n)
            pieces.append(
                Piece(
                    p.offset,
                    p.shape,
                    p.chunks,
                    p.content,
                    p.ref,
                    np.array([number(loc[0]) for loc in locs], np.int64),
                    np.array([loc[1] for loc in locs], np.int64),
                    np.array([loc[2] for loc in locs], np.int64),
                    snap,
                )
            )
        new_tables.append(TensorTable(name, t.dtype, t.shape, t.codec, tuple(pieces)))
    files = {}
    for name, f in d.files.items():
        pid, off, n = move(d.packs[f.pack], f.offset, f.length)
        files[name] = FileRef(number(pid), off, n, f.size, f.hash)
    refs = []
    by_name = {t.name: t for t in new_tables}
    for block in _blocks_like(d, by_name):
        raw = encode_block(block)
        pid, off, n = stream.append(raw)
        refs.append(TableRef(block[0].name, block[-1].name, number(pid), off, n, digest(raw).hex()))
    return StepDoc(
        step=d.step,
        parent=parent if reparent else d.parent,
        content=d.content,
        parent_content=parent_content if reparent else d.parent_content,
        anchor_distance=d.anchor_distance,
        packs=tuple(packs),
        tables=tuple(refs),
        files=files,
        metadata=d.metadata,
        created=d.created,
        chain=d.chain,  # (as it was: rechained() brings it up to date)
        anchoring=d.anchoring,
    )


def rechained(docs: dict[int, StepDoc], changed: list[StepDoc]) -> list[StepDoc]:
    """``changed`` (documents about to replace some of ``docs``) and every other document of ``docs`` whose
    ``chain`` must change with them, each with the chain its parent's new document gives (by step).

    A document that has a chain, or is changed, gets ``chain_after(its parent)`` if it is a delta (anchor
    distance above 0) whose parent is in ``docs``, else none; one without a chain that is not changed (an
    anchor, a document older than chains) keeps none.  Parents before children; a parent loop (crafted
    documents) leaves the documents on it as they are.
    """
    final = {**docs, **{d.step: d for d in changed}}
    out = {d.step: d for d in changed}
    done: dict[int, StepDoc] = {}
    for start in sorted(final):
        path, on_path, s = [], set(), start
        while s in final and s not in done and s not in on_path:  # up to a step already settled (or the root)
            path.append(s)
            on_path.add(s)
            s = final[s].parent  # type: ignore[assignment]
        if s in on_path:  # a loop: leave it to verify(), which reports it
            done.update({x: final[x] for x in path})
            continue
        for s in reversed(path):
            d = final[s]
            if d.chain or s in out:
                p = done.get(d.parent) if d.parent is not None else None
                chain = chain_after(p) if p is not None and d.anchor_distance else ()
                if chain != d.chain:
                    d = out[s] = dataclasses.replace(d, chain=chain)
            done[s] = d
    return [out[s] for s in sorted(out)]
