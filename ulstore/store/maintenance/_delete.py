"""Deleting a step: :meth:`delete` re-encodes what depended on it, re-parents its children, moves refs.

Crash safety: new bytes first (a new pack: re-encoded blobs, then the
rewritten table blocks), then each rewritten step document (one PUT each,
logical content unchanged), then the ref moves and the step document's
removal.  Until the deleted step goes, old and new are both readable, so a
crash at any point loses nothing; deleting again finishes it.  Packs are not
removed here: :meth:`gc` (``_gc.py``) does that.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from ...errors import ConflictError, CorruptManifestError, RefMovedError, StepExistsError
from .._base import TrajectoryBase
from ..format._chunk_tables import Piece, TensorTable
from ..format._chunkcodec import encode_chunk
from ..format._layout import check_ref_name, check_step, step_key
from ..format._packs import PackStream
from ..format._read_cost import HEADER_BYTES
from ..format._stepdoc import StepDoc
from ._recost import Recoster
from ._relocate import rechained, relocated_doc

__all__ = ["Deleter"]

#: Attempts of a delete whose step documents another process rewrites meanwhile (each starts from a fresh read).
_ATTEMPTS = 4


class Deleter:
    """The delete and discard of a trajectory."""

    def __init__(self, trajectory: TrajectoryBase):
        # a proxy, not a reference: the trajectory owns this object, and a trajectory dropped
        # must free its caches and kept step at once (no cycle left for the garbage collector)
        self._t = weakref.proxy(trajectory)

    def delete(self, step) -> None:
        """Delete ``step``; every other step stays readable, exactly.

        Chunks of other steps coded against ``step`` are re-encoded against
        ``step``'s own reference (its entry's reference, or its parent's values
        over the same box, or intra); a chunk that carries a snapshot (a full
        copy, stored by an anchor commit) takes it as its entry instead, with
        nothing decoded or encoded.  Steps whose parent was ``step`` are
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
        self._t._check_writable()
        step = self._t._resolve(step)
        with self._t._pending.deleting(
            step, lambda: self._dependants(step), lambda: self._t.steps, self._t._refs
        ) as beat:
            for _ in range(_ATTEMPTS):
                self._t._reader.forget_docs()  # documents as stored now (their tables stay cached by hash)
                if self._delete(step, beat):
                    return
        raise ConflictError(
            f"another process kept rewriting the step documents delete({step}) rewrites; nothing was lost (every "
            "step stays readable): run the delete again",
            step=step,
        )

    def discard(self, step, *, branch: str = "main") -> None:
        """Delete ``step`` if it is an interrupted commit on ``branch``: created, never put on the branch.

        What a restarted writer does with the step its killed predecessor
        created but never published.  Unlike :meth:`delete`, it never moves a
        ref: the branch is first **fenced** (a new entry of its log, its head
        unchanged), so the interrupted commit, should it still be running
        somewhere, fails its compare-and-swap and can never put the step on the
        branch afterwards; then the step is deleted if no ref points at it.

        Raises
        ------
        ConflictError
            The step's commit may still be running: its intent (``pending/``) is
            within its lease and its writer is not known to be dead.  Retry later.
        StepExistsError
            A ref points at the step: it was published, it is no orphan.
        """
        self._t._check_writable()
        step = check_step(step)
        name = check_ref_name(branch)
        if self._t._reader.stored_doc(step) is None:
            return
        live = [i for i in self._t._pending.intents(step) if i.live()]
        if live:
            raise ConflictError(
                f"step {step} is being committed right now by another writer ({live[0].writer}); it is no orphan "
                "until that commit ends or its lease expires: retry later",
                step=step,
                key=live[0].key,
            )
        for _ in range(16):
            state = self._t._refs.read(name)
            if state.step == step:
                break
            try:
                self._t._refs.move(state, state.step)  # the fence
                break
            except RefMovedError:
                continue
        on = sorted(n for n, s in self._t.refs.items() if s == step)
        if on:
            raise StepExistsError(
                f"step {step} is on ref {on[0]!r}: it was published, not interrupted; nothing was deleted",
                step=step,
            )
        self.delete(step)

    def _dependants(self, step: int) -> set[int]:
        """Steps whose parent is ``step`` or whose chunks are coded against it."""
        out = set()
        for s in self._t.steps:
            if s == step:
                continue
            if self._t._reader.doc(s).parent == step or any(step in b.refs() for b in self._t._reader.blocks(s)):
                out.add(s)
        return out

    def _delete(self, step: int, beat=lambda: None) -> bool:
        """One attempt; False if a step document it rewrites changed meanwhile (nothing is lost: run it again).

        Every rewrite is a compare-and-swap against the document this attempt
        read (:meth:`ObjectStore.replace_if`), and so is the removal of the
        deleted step's own document: a document another process rewrote is
        never overwritten with a stale version, and a removed one never comes back.
        """
        reader = self._t._reader
        read = {s: reader.doc(s) for s in self._t.steps}  # what every compare-and-swap below compares against
        if step not in read:
            return not self._t._io.exists(step_key(step))
        dead = read[step]
        _refuse_parent_loop(step, read)
        dead_tables = reader.tables(step)
        pdoc = reader.doc(dead.parent) if dead.parent is not None else None
        stream = PackStream(self._t._io, self._t.pack_bytes)
        recoded: dict = {}
        heads: dict = {}  # (pack id, offset) -> first bytes of a blob written here (its kind, for the costs)
        new_tables: dict[int, dict] = {}
        new_packs: dict[int, list[str]] = {}
        try:
            for s, d in read.items():
                beat()  # a long delete renews its marker's lease: gc keeps deferring to it
                if s == step or not any(step in b.refs() for b in reader.blocks(s)):
                    continue
                new_packs[s] = list(d.packs)
                new_tables[s] = {
                    n: self._recode(s, t, step, dead, dead_tables.get(n), stream, (recoded, heads), new_packs[s])
                    for n, t in reader.tables(s).items()
                }
            pcontent = pdoc.content if pdoc is not None else None
            rewritten = self._rewritten(read, step, pcontent, (new_tables, new_packs, heads), stream)
            stream.close()
        except BaseException:
            stream.abort()
            raise
        for nd in self._new_anchor_distances(read, rewritten, step):
            # contents unchanged: one atomic compare-and-swap against the document read
            if not self._t._io.replace_if(step_key(nd.step), nd.to_bytes(), read[nd.step].to_bytes()):
                return False
            reader.forget([nd.step])
        for name, target in self._t.refs.items():
            if target == step:
                try:
                    self._t._move_ref(name, dead.parent, step)  # compare-and-swap; None deletes the ref
                except RefMovedError:  # moved away from step meanwhile: nothing to do
                    pass
        if not self._t._io.delete_if(step_key(step), dead.to_bytes()):
            return not self._t._io.exists(step_key(step))  # gone: another delete finished it; else changed: again
        reader.forget([step])
        return True

    def _rewritten(self, read: dict[int, StepDoc], gone: int, pcontent, recoded: tuple, stream) -> list[StepDoc]:
        """The step documents a delete of ``gone`` rewrites (before anchor distances and chains): its children
        re-parented (``pcontent``: its parent's content), the steps whose tables changed (``recoded``: new
        tables and pack lists by step, the first bytes of the blobs written; more if a step is re-anchored)
        with their table blocks written into ``stream``, and every step whose read-cost figures change
        (:class:`Recoster`)."""
        tables, packs, heads = recoded
        dead = read[gone]
        retabled = set(tables)
        docs = {
            s: dataclasses.replace(d, parent=dead.parent, parent_content=pcontent) if d.parent == gone else d
            for s, d in read.items()
            if s != gone
        }
        changed = set(tables) | {s for s, d in read.items() if d.parent == gone}
        k = self._t.anchor_cost  # the cost policy's k; without it the fixed count bounds chains by distance
        every = self._t.anchor_every if k is None else None
        recost = Recoster(self._t._reader, docs, tables, packs, heads, stream, changed, k, every)
        anchoring = recost.run()
        out = []
        for s, d in docs.items():
            nd = dataclasses.replace(d, anchoring=anchoring[s])
            if s in recost.anchored:
                nd = dataclasses.replace(nd, anchor_distance=0)
            if s in retabled or s in recost.retabled or s in recost.anchored:
                nd = relocated_doc(
                    dataclasses.replace(nd, packs=tuple(packs[s])), tables[s], stream, lambda pid, off, n: (pid, off, n)
                )
            if nd != read[s]:
                out.append(nd)
        return out

    @staticmethod
    def _new_anchor_distances(read: dict[int, StepDoc], rewritten: list[StepDoc], gone: int) -> list[StepDoc]:
        """The step documents to write once ``gone`` is deleted: ``rewritten``, every step whose anchor distance
        changes, and every step whose ``chain`` does (:func:`rechained`).

        A step's anchor distance is its parent's plus one, unless it is an anchor
        (0), as a commit sets it.  Chunks re-encoded against the deleted step's
        reference shorten the chains of the steps below it (and a re-parented
        step's parent is one step nearer the root), so their descendants' distances
        change too: their documents are rewritten with the new number (content and
        checksum unchanged).
        """
        docs = {s: d for s, d in read.items() if s != gone}
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
        # the chains of the steps below copy directories that change here (and the deleted step's): anew
        return rechained({s: d for s, d in read.items() if s != gone}, [out[s] for s in sorted(out)])

    def _recode(
        self, s, t: TensorTable, step, dead: StepDoc, dt: TensorTable | None, stream, memo, packs: list[str]
    ) -> TensorTable:
        """``t`` (of step ``s``) with every chunk coded against ``step`` re-encoded (or, where the chunk carries
        a snapshot, its snapshot made its entry).

        Pack numbers index ``packs`` (step ``s``'s list, extended here with new packs); ``memo``: the blobs
        re-encoded so far (shared by the steps that share an entry) and the first bytes of each by location.
        """
        reader = self._t._reader
        recoded, heads = memo
        pieces = []
        for j, p in enumerate(t.pieces):
            rows = np.flatnonzero(p.ref == step)
            if not len(rows):
                pieces.append(p)
                continue
            ref, pack, off, length = p.ref.copy(), p.pack.copy(), p.off.copy(), p.length.copy()
            snap = p.snap.copy() if p.snap is not None else None

            def number(pid: str) -> int:
                if pid not in packs:
                    packs.append(pid)
                return packs.index(pid)

            same = dt is not None and dt.dtype == t.dtype and dt.shape == t.shape
            dj = dt.find_piece(p.layout) if same and dt is not None else None
            for i in rows:
                if snap is not None and snap[i, 0] >= 0:
                    # the chunk's full copy (an intra blob of its values) becomes its entry: nothing is decoded
                    # or encoded, and the chunk no longer depends on any step (pruning the steps before a
                    # snapshot step re-encodes nothing)
                    ref[i], (pack[i], off[i], length[i]), snap[i] = -1, snap[i], -1
                    continue
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
                    blob = encode_chunk(value, refv, t.codec)
                    loc = recoded[key] = stream.append(blob)
                    heads[loc[:2]] = bytes(memoryview(blob)[:HEADER_BYTES])
                ref[i] = new_ref
                pack[i], off[i], length[i] = number(loc[0]), loc[1], loc[2]
            pieces.append(Piece(p.offset, p.shape, p.chunks, p.content, ref, pack, off, length, snap))
        return TensorTable(t.name, t.dtype, t.shape, t.codec, tuple(pieces))


def _refuse_parent_loop(step: int, docs: dict[int, StepDoc]) -> None:
    """Refuse to delete a step whose ancestors lead back to it (crafted documents): re-parenting its children to
    its parent would make one of them its own parent, and refs would move onto the loop."""
    seen, s = {step}, docs[step].parent
    while s is not None and s in docs:
        if s in seen:
            raise CorruptManifestError(
                f"parent links loop through step {s} (crafted step documents; verify() reports them): nothing was "
                "deleted",
                step=step,
                key=step_key(step),
            )
        seen.add(s)
        s = docs[s].parent
