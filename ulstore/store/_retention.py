"""Retention: :meth:`delete` a step (re-encoding what depended on it) and :meth:`gc` packs (drop, repack).

Crash safety, for both: new bytes first (a new pack: blobs, then the
rewritten table blocks), then each rewritten step document (one PUT each,
logical content unchanged), then removals.  Until the old objects go, old and
new are both readable, so a crash at any point loses nothing; running the
operation again finishes it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import time

import numpy as np

from ..errors import InvalidInputError, RefMovedError
from ._base import TrajectoryBase
from ._chunkcodec import digest, encode_chunk
from ._layout import PACK_SUFFIX, PACKS_DIR, is_pack_id, pack_key, step_key
from ._packs import Location, PackStream
from ._pending import PENDING_DIR
from ._stepdoc import FileRef, StepDoc, TableRef
from ._table_block import encode_block
from ._tables import Piece, TensorTable

__all__ = ["RetentionMixin"]

#: Where gc notes when it retired a repacked pack (deleted once the grace period has passed).
RETIRED_DIR = "gc/retired"


def _blocks_like(d: StepDoc, tables: dict[str, TensorTable]) -> list[list[TensorTable]]:
    """The step's tensors grouped as its table directory groups them."""
    names = sorted(tables)
    out = []
    for ref in d.tables:
        out.append([tables[n] for n in names if ref.first <= n <= ref.last])
    return [b for b in out if b]


class RetentionMixin(TrajectoryBase):
    """delete and gc of :class:`~ulstore.store.Trajectory`."""

    # -- rewriting a step --------------------------------------------------------------

    def _rewrite(
        self,
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
        )

    # -- delete ---------------------------------------------------------------------------

    def delete(self, step) -> None:
        """Delete ``step``; every other step stays readable, exactly.

        Chunks of other steps coded against ``step`` are re-encoded against
        ``step``'s own reference (its entry's reference, or its parent's values
        over the same box, or intra), and steps whose parent was ``step`` are
        re-parented to ``step``'s parent; each such step document is rewritten
        with a single PUT (logical content and checksum unchanged; the hash
        chain follows the new parent).  Refs pointing at ``step`` move to its
        parent (or are removed if it had none).  Packs are not removed: run
        :meth:`gc`.

        Safe against concurrent commits: if a commit on ``step`` or on a step
        that depends on it is in flight, or another delete is, it refuses
        (ConflictError) before changing anything; a commit that would refer to
        a step being deleted refuses likewise (see ``_pending.py``).

        Raises
        ------
        ConflictError
            A commit depending on ``step``, or another delete, is in flight: retry later.
        """
        self._check_writable()
        step = self._resolve(step)
        with self._pending.deleting(step, lambda: self._dependants(step), lambda: self.steps):
            self._delete(step)

    def _dependants(self, step: int) -> set[int]:
        """Steps whose parent is ``step`` or whose chunks are coded against it."""
        out = set()
        for s in self.steps:
            if s == step:
                continue
            if self._reader.doc(s).parent == step or any(
                (p.ref == step).any() for t in self._reader.tables(s).values() for p in t.pieces
            ):
                out.add(s)
        return out

    def _delete(self, step: int) -> None:
        reader = self._reader
        dead = reader.doc(step)
        dead_tables = reader.tables(step)
        pdoc = reader.doc(dead.parent) if dead.parent is not None else None
        stream = PackStream(self._io, self.pack_bytes)
        recoded: dict = {}
        rewritten: list[StepDoc] = []
        try:
            for s in self.steps:
                if s == step:
                    continue
                d = reader.doc(s)
                tables = reader.tables(s)
                stale = any((p.ref == step).any() for t in tables.values() for p in t.pieces)
                if not stale and d.parent != step:
                    continue
                packs = list(d.packs)
                tables = {
                    n: self._recode(s, t, step, dead, dead_tables.get(n), stream, recoded, packs)
                    for n, t in tables.items()
                }
                rewritten.append(
                    self._rewrite(
                        dataclasses.replace(d, packs=tuple(packs)),
                        tables,
                        stream,
                        lambda pid, off, n: (pid, off, n),
                        parent=dead.parent,
                        parent_content=pdoc.content if pdoc is not None else None,
                        reparent=d.parent == step,
                    )
                )
            stream.close()
        except BaseException:
            stream.abort()
            raise
        for nd in self._new_anchor_distances(rewritten, step):
            self._io.put(step_key(nd.step), nd.to_bytes())  # contents unchanged: one atomic PUT
            reader.forget([nd.step])
        for name, target in self.refs.items():
            if target == step:
                try:
                    self._move_ref(name, dead.parent, step)  # compare-and-swap; None deletes the ref
                except RefMovedError:  # moved away from step meanwhile: nothing to do
                    pass
        self._io.delete(step_key(step))
        reader.forget([step])

    def _new_anchor_distances(self, rewritten: list[StepDoc], gone: int) -> list[StepDoc]:
        """The step documents to write once ``gone`` is deleted: ``rewritten``, and every step whose anchor distance changes.

        A step's anchor distance is its parent's plus one, unless it is an anchor
        (0), as a commit sets it.  Chunks re-encoded against the deleted step's
        reference shorten the chains of the steps below it (and a re-parented
        step's parent is one step nearer the root), so their descendants' distances
        change too: their documents are rewritten with the new number (content and
        checksum unchanged).
        """
        docs = {s: self._reader.doc(s) for s in self.steps if s != gone}
        docs.update({d.step: d for d in rewritten})
        new: dict[int, int] = {}
        for start in docs:
            chain, s = [], start
            while s not in new:
                d = docs[s]
                if d.anchor_distance == 0 or d.parent is None or d.parent not in docs or s in chain:
                    new[s] = 0 if d.anchor_distance == 0 or d.parent is None else d.anchor_distance
                    break
                chain.append(s)
                s = d.parent
            for c in reversed(chain):
                if c not in new:
                    new[c] = new[docs[c].parent] + 1  # type: ignore[index]
        out = {d.step: d for d in rewritten}
        for s, d in docs.items():
            if new[s] != d.anchor_distance:
                out[s] = dataclasses.replace(d, anchor_distance=new[s])
        return [out[s] for s in sorted(out)]

    def _recode(
        self, s, t: TensorTable, step, dead: StepDoc, dt: TensorTable | None, stream, recoded, packs: list[str]
    ) -> TensorTable:
        """``t`` (of step ``s``) with every chunk coded against ``step`` re-encoded.

        Pack numbers index ``packs`` (step ``s``'s list, extended here with new packs).
        """
        reader = self._reader
        pieces = []
        for j, p in enumerate(t.pieces):
            rows = np.flatnonzero(p.ref == step)
            if not len(rows):
                pieces.append(p)
                continue
            ref, pack, off, length = p.ref.copy(), p.pack.copy(), p.off.copy(), p.length.copy()

            def number(pid: str) -> int:
                if pid not in packs:
                    packs.append(pid)
                return packs.index(pid)

            same = dt is not None and dt.dtype == t.dtype and dt.shape == t.shape
            dj = dt.find_piece(p.layout) if same and dt is not None else None
            for i in rows:
                coord = tuple(int(x) for x in np.unravel_index(i, p.grid)) if p.grid else ()
                content = p.content[i].tobytes()
                if dj is not None:
                    dp = dt.pieces[dj]  # type: ignore[union-attr]
                    if dp.content[i].tobytes() == content:  # the deleted step's own entry: share it
                        ref[i] = dp.ref[i]
                        loc = (dead.packs[int(dp.pack[i])], int(dp.off[i]), int(dp.length[i]))
                        pack[i], off[i], length[i] = number(loc[0]), loc[1], loc[2]
                        continue
                    new_ref = int(dp.ref[i])
                elif same and dead.parent is not None:
                    new_ref = dead.parent
                else:
                    new_ref = -1
                key = (t.name, p.layout, coord, packs[int(p.pack[i])], int(p.off[i]), new_ref)
                loc = recoded.get(key)
                if loc is None:
                    value = reader.chunk(s, t.name, coord, j)
                    lo, hi = p.box(coord)
                    refv = reader.box(new_ref, t.name, lo, hi) if new_ref >= 0 else None
                    loc = recoded[key] = stream.append(encode_chunk(value, refv, t.codec))
                ref[i] = new_ref
                pack[i], off[i], length[i] = number(loc[0]), loc[1], loc[2]
            pieces.append(Piece(p.offset, p.shape, p.chunks, p.content, ref, pack, off, length, p.snap))
        return TensorTable(t.name, t.dtype, t.shape, t.codec, tuple(pieces))

    # -- gc -------------------------------------------------------------------------------

    def gc(self, *, older_than: float = 0.0, repack_below: float = 0.5) -> dict:
        """Drop packs no step names and repack mostly-dead ones; never loses a live blob.

        Parameters
        ----------
        older_than : float
            Grace period in seconds.  A commit writes its packs before its step
            document, so only packs (and local ``.tmp/`` files) at least this old
            are removed, and a pack emptied by repacking is only removed by a
            later ``gc`` once it has been unused for this long.  While other
            processes may commit, use a grace period longer than a commit takes.
        repack_below : float
            Repack a pack whose live bytes are less than this fraction of it:
            its live blobs are copied to a new pack, the step documents that
            name it are rewritten, then it is dropped.  0 disables repacking.

        Returns
        -------
        dict
            ``packs`` (removed), ``bytes`` (freed), ``repacked`` (packs whose
            live blobs were moved), ``steps_rewritten``.
        """
        self._check_writable()
        if not isinstance(older_than, int | float) or older_than < 0:
            raise InvalidInputError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        io, reader = self._io, self._reader
        self._check_not_symlinked(PACKS_DIR)
        now = time.time()
        listing = {}  # listed FIRST: a pack created after this is never considered
        for key, info in io.find(PACKS_DIR, detail=True).items():
            name = key.rsplit("/", 1)[-1]
            if key == f"{PACKS_DIR}/{name}" and name.endswith(PACK_SUFFIX) and is_pack_id(name[: -len(PACK_SUFFIX)]):
                if info.get("islink"):
                    continue
                listing[name[: -len(PACK_SUFFIX)]] = (int(info.get("size") or 0), _age(info, now))
        retired = self._retired(now)
        reader.forget()
        docs = {s: reader.doc(s) for s in self.steps}
        listed = {pid for d in docs.values() for pid in d.packs}
        live: dict[str, set] = {}
        for s, d in docs.items():
            for pid, off, n in self._locations(s, d):
                live.setdefault(pid, set()).add((off, n))
        removed, freed = [], 0
        for pid, (size, age) in listing.items():
            if pid in listed:
                continue
            grace = retired.get(pid, age)
            if older_than and (grace is None or grace < older_than):
                continue
            removed.append(pid)
            freed += size
        repack = [
            pid
            for pid, (size, _) in listing.items()
            if pid in listed
            and repack_below > 0
            and size
            and sum(n for _, n in live.get(pid, ())) < repack_below * size
        ]
        rewritten = self._repack(repack, docs, live) if repack else 0
        if repack and not older_than:
            removed += repack
            freed += sum(listing[p][0] for p in repack)
        elif repack:
            for pid in repack:
                io.put(f"{RETIRED_DIR}/{pid}", b"")
        io.delete_many([pack_key(p) for p in removed])
        io.delete_many([f"{RETIRED_DIR}/{p}" for p in retired if p in removed or p in listed])
        io.sweep_tmp(older_than)
        # markers of commits/deletes killed mid-way (see _pending.py): past the grace period only
        pending = io.find(PENDING_DIR, detail=True)
        io.delete_many([k for k, info in pending.items() if not older_than or (_age(info, now) or 0.0) >= older_than])
        reader.forget()
        return {"packs": len(removed), "bytes": freed, "repacked": len(repack), "steps_rewritten": rewritten}

    def _retired(self, now: float) -> dict[str, float | None]:
        out = {}
        for key, info in self._io.find(RETIRED_DIR, detail=True).items():
            pid = key.rsplit("/", 1)[-1]
            if is_pack_id(pid):
                out[pid] = _age(info, now)
        return out

    def _check_not_symlinked(self, key: str) -> None:
        if self._io.local and os.path.islink(self._io.path(key)):
            raise InvalidInputError(f"{self._io.path(key)!r} is a symlink; gc never deletes outside the root")

    def _locations(self, s: int, d: StepDoc) -> list[Location]:
        """Every byte range step ``s`` names: blobs, snapshots, files, table blocks."""
        out: list[Location] = [(d.packs[t.pack], t.offset, t.length) for t in d.tables]
        out += [(d.packs[f.pack], f.offset, f.length) for f in d.files.values()]
        for t in self._reader.tables(s).values():
            for p in t.pieces:
                out += [(d.packs[int(a)], int(b), int(c)) for a, b, c in zip(p.pack, p.off, p.length)]
                if p.snap is not None:
                    out += [(d.packs[int(a)], int(b), int(c)) for a, b, c in p.snap if a >= 0]
        return out

    def _repack(self, packs: list[str], docs: dict[int, StepDoc], live: dict[str, set]) -> int:
        """Copy the live blobs of ``packs`` to a new pack and rewrite every step document naming them."""
        reader = self._reader
        gone = set(packs)
        tables_of = {s: reader.tables(s) for s, d in docs.items() if gone & set(d.packs)}
        blocks = {(docs[s].packs[t.pack], t.offset, t.length) for s in tables_of for t in docs[s].tables}
        stream = PackStream(self._io, self.pack_bytes)
        moved: dict[Location, Location] = {}
        try:
            for pid in packs:
                ranges = sorted((pid, off, n) for off, n in live.get(pid, ()) if (pid, off, n) not in blocks)
                for k in range(0, len(ranges), 256):
                    group = ranges[k : k + 256]
                    for loc, data in zip(group, reader.fetch(group)):
                        moved[loc] = stream.append(data)
            new_docs = [
                self._rewrite(
                    docs[s], tables_of[s], stream, lambda pid, off, n: moved.get((pid, off, n), (pid, off, n))
                )
                for s in sorted(tables_of)
            ]
            stream.close()
        except BaseException:
            stream.abort()
            raise
        for nd in new_docs:
            self._io.put(step_key(nd.step), nd.to_bytes())
        reader.forget()
        return len(new_docs)


def _age(info: dict, now: float) -> float | None:
    for k in ("mtime", "LastModified", "created", "last_modified"):
        v = info.get(k)
        if v is None:
            continue
        if isinstance(v, _dt.datetime):
            return now - v.timestamp()
        try:
            return now - float(v)
        except (TypeError, ValueError):
            continue
    return None
