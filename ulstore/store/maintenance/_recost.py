"""Read costs after a delete: every remaining step's ``anchoring`` recomputed, a step re-anchored where needed.

A step document keeps the modelled cost of reading the step
(``format/_read_cost.py``: its parent's plus what its own blobs add; an
anchor's its own), so a delete that removes a step inside a chain changes the
figures of everything below it: the children of the deleted step are coded
against its parent now (re-encoded chunks, or the deleted step's own blobs,
which they take over), so what their blobs add is recomputed from their new
tables, and every descendant's running cost follows.

Where a delete would make a step's read cost more than ``k`` x its chain's
anchor's (and more than before the delete: the cost policy's ``k``), the step
is **materialised**: every chunk of it coded against a reference is re-encoded
intra (a chunk with a snapshot takes its snapshot), so it becomes an anchor
(reason ``{"policy": "cost", ...}``: reading it as a delta would cost
``predicted`` > ``limit``), and its descendants' entries that were its own
blobs are pointed at the new intra blobs, so their reads (and costs) start
from it.  The usual case is the delete of an anchor: its children's changed
chunks are re-encoded intra against nothing, their unchanged ones share the
deleted anchor's intra blobs, and re-parented onto the end of the chain
before, they would read it all over again.  Nothing is decoded to re-anchor a
step whose chunks are all intra already.

A fixed-count trajectory (``anchor_every=N``: no ``k``) bounds chains by
distance instead: a commit makes a step an anchor when its distance from its
chain's anchor would reach N.  A delete that removes an anchor re-parents its
children onto the end of the chain before, whose distances would then run
past N; the step whose distance would reach N is materialised the same way
(reason ``{"policy": "every", "every": N}``), so every remaining step's chain
stays within N steps, as its commits made it.  Usually that is the deleted
anchor's first child, whose chunks are all intra already: nothing is decoded.
"""

from __future__ import annotations

import numpy as np

from ..format._chunk_tables import Piece, TensorTable
from ..format._chunkcodec import encode_chunk
from ..format._read_cost import HEADER_BYTES, PER_READ, own_cost
from ..format._stepdoc import Anchoring, StepDoc

__all__ = ["Recoster"]


class Recoster:
    """New ``anchoring`` figures of the step documents a delete leaves, and the steps it re-anchors.

    ``docs``: every remaining step's document as it will be written (parents as after the delete);
    ``tables``/``packs``: the new tables and pack lists of the steps whose tables the delete rewrites (others
    are read with ``reader``, as stored); ``heads``: the first bytes of the blobs the delete wrote into
    ``stream`` (not readable until it closes); ``changed``: the steps whose tables or parent changed (what
    their blobs add is recomputed; the others' stored figure is kept); ``k``: the cost policy's factor (None:
    a fixed-count trajectory, re-anchored by distance instead); ``every``: the fixed count's N (a step whose
    distance from its anchor would reach it is re-anchored; None or 0: no bound by distance).
    """

    def __init__(
        self, reader, docs: dict[int, StepDoc], tables: dict, packs: dict, heads: dict, stream, changed, k, every=None
    ):
        self.reader, self.docs, self.tables, self.packs = reader, docs, tables, packs
        self.heads, self.stream, self.changed, self.k = heads, stream, set(changed), k
        self.every = every or None
        self.distance: dict[int, int] = {}  # every step's distance from its anchor, as the delete leaves it
        self.anchored: set[int] = set()  # steps made anchors here
        self.retabled: set[int] = set()  # steps whose tables materialising changed (beyond ``changed``)

    def _tables(self, s: int) -> dict[str, TensorTable]:
        if s not in self.tables:
            self.tables[s] = dict(self.reader.tables(s))
            self.packs[s] = list(self.docs[s].packs)
        return self.tables[s]

    def _packs(self, s: int) -> list[str]:
        self._tables(s)
        return self.packs[s]

    def _headers(self, locations) -> list:
        out: list = [self.heads.get(loc[:2]) for loc in locations]
        rest = [i for i, h in enumerate(out) if h is None]
        if rest:
            for i, view in zip(rest, self.reader.fetch([locations[i] for i in rest])):
                out[i] = view
        return out

    def own(self, s: int, anchor: bool) -> int:
        """What step ``s``'s blobs add to its read (an anchor: all of them, plus ``PER_READ``)."""
        if anchor:
            return own_cost(self._tables(s), self._packs(s), None, (), self._headers) + PER_READ
        p = self.docs[s].parent
        assert p is not None
        return own_cost(self._tables(s), self._packs(s), self._tables(p), self._packs(p), self._headers)

    def _order(self) -> list[int]:
        """Every step, parents first (a parent loop, crafted documents: its steps last, as they are)."""
        done: set[int] = set()
        out: list[int] = []
        for start in sorted(self.docs):
            path, on_path, s = [], set(), start
            while s in self.docs and s not in done and s not in on_path:
                path.append(s)
                on_path.add(s)
                s = self.docs[s].parent  # type: ignore[assignment]
            out.extend(reversed(path))
            done.update(path)
        return out

    def run(self) -> dict[int, Anchoring | None]:
        """The new ``anchoring`` of every step (re-anchoring as it goes: see :attr:`anchored`)."""
        new: dict[int, Anchoring | None] = {}
        for s in self._order():
            new[s] = self._one(s, new)
        return new

    def _one(self, s: int, new: dict) -> Anchoring | None:
        d = self.docs[s]
        a = d.anchoring
        if self._too_far(s):
            self._materialise(s)
            mine = self.own(s, True)
            return Anchoring(mine, mine, mine, {"policy": "every", "every": self.every})
        if a is None:
            return None  # written before the cost model: unknown, as a commit on it would have it
        if a.why is not None or d.parent is None:  # an anchor stays one (a root: its chunks are all intra now)
            own = self.own(s, True) if s in self.changed else a.step_cost
            return Anchoring(own, own, own, a.why or {"policy": "root"})
        pa = new.get(d.parent) if d.parent is not None else None
        if pa is None:
            return None
        own = self.own(s, False) if s in self.changed else a.step_cost
        cost = pa.cost + own
        limit = int(self.k * pa.anchor_cost) if self.k is not None else None
        if limit is not None and cost > limit and cost > a.cost:
            self._materialise(s)
            self.distance[s] = 0
            mine = self.own(s, True)
            return Anchoring(mine, mine, mine, {"policy": "cost", "k": self.k, "predicted": cost, "limit": limit})
        return Anchoring(cost, pa.anchor_cost, own, None)

    def _too_far(self, s: int) -> bool:
        """Record ``s``'s distance from its anchor (parents are done first; an anchor's is 0, as is a root's; a
        parent outside the documents, crafted ones, keeps the stored figure) and whether it reaches the fixed
        count's N and is further than before the delete (then ``s`` becomes an anchor: its distance 0; a chain
        that a session's smaller ``anchor_every`` would cut, but the delete did not lengthen, is left as it is)."""
        d = self.docs[s]
        if d.anchor_distance == 0 or d.parent is None:
            self.distance[s] = 0
            return False
        far = self.distance.get(d.parent)
        self.distance[s] = d.anchor_distance if far is None else far + 1
        if self.every is None or self.distance[s] < self.every or self.distance[s] <= d.anchor_distance:
            return False
        self.distance[s] = 0
        return True

    # -- re-anchoring -------------------------------------------------------------------------------------

    def _materialise(self, s: int) -> None:
        """Make every chunk of ``s`` intra (re-encoded, or its snapshot), and point its descendants' entries
        that were those blobs at the new ones."""
        self.anchored.add(s)
        self.changed.add(s)
        moved: dict[tuple, tuple] = {}  # old location -> new intra location
        tables, packs = self._tables(s), self._packs(s)
        for name, t in list(tables.items()):
            pieces = []
            for j, p in enumerate(t.pieces):
                rows = np.flatnonzero(p.ref >= 0)
                if not len(rows):
                    pieces.append(p)
                    continue
                ref, pack, off, length = p.ref.copy(), p.pack.copy(), p.off.copy(), p.length.copy()
                for i in rows:
                    old = (packs[int(p.pack[i])], int(p.off[i]), int(p.length[i]))
                    loc = moved.get(old)
                    if loc is None:
                        loc = moved[old] = self._intra(s, t, p, j, int(i), packs)
                    ref[i] = -1
                    pack[i], off[i], length[i] = _number(packs, loc[0]), loc[1], loc[2]
                pieces.append(Piece(p.offset, p.shape, p.chunks, p.content, ref, pack, off, length, p.snap))
            tables[name] = TensorTable(t.name, t.dtype, t.shape, t.codec, tuple(pieces))
        for c in self._descendants(s):
            if _redirect(self._tables(c), self._packs(c), moved):
                self.retabled.add(c)

    def _intra(self, s: int, t: TensorTable, p: Piece, j: int, i: int, packs: list[str]) -> tuple:
        """The location of an intra blob of chunk ``i`` of piece ``j`` of ``t`` (step ``s``): its snapshot, or
        its values (read from the stored step, whose content is the same) encoded anew."""
        snap = p.snapshot(i)
        if snap is not None:
            return packs[snap[0]], snap[1], snap[2]
        coord = tuple(int(x) for x in np.unravel_index(i, p.grid)) if p.grid else ()
        blob = encode_chunk(self.reader.chunk(s, t.name, coord, j), None, t.codec)
        loc = self.stream.append(blob)
        self.heads[loc[:2]] = bytes(memoryview(blob)[:HEADER_BYTES])
        return loc

    def _descendants(self, s: int) -> list[int]:
        kids: dict[int, list[int]] = {}
        for c, d in self.docs.items():
            if d.parent is not None:
                kids.setdefault(d.parent, []).append(c)
        out, todo, seen = [], list(kids.get(s, ())), {s}
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            out.append(c)
            todo.extend(kids.get(c, ()))
        return out


def _number(packs: list[str], pid: str) -> int:
    if pid not in packs:
        packs.append(pid)
    return packs.index(pid)


def _redirect(tables: dict[str, TensorTable], packs: list[str], moved: dict) -> bool:
    """Point the entries of ``tables`` at a location ``moved`` names at the new (intra) one; whether any was."""
    hit = False
    for name, t in list(tables.items()):
        pieces = []
        for p in t.pieces:
            locs = [(packs[int(p.pack[i])], int(p.off[i]), int(p.length[i])) for i in range(p.n)]
            rows = [i for i, loc in enumerate(locs) if loc in moved and p.ref[i] >= 0]
            if not rows:
                pieces.append(p)
                continue
            hit = True
            ref, pack, off, length = p.ref.copy(), p.pack.copy(), p.off.copy(), p.length.copy()
            for i in rows:
                pid, o, n = moved[locs[i]]
                ref[i], pack[i], off[i], length[i] = -1, _number(packs, pid), o, n
            pieces.append(Piece(p.offset, p.shape, p.chunks, p.content, ref, pack, off, length, p.snap))
        tables[name] = TensorTable(t.name, t.dtype, t.shape, t.codec, tuple(pieces))
    return hit
