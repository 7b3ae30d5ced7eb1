"""Planning and running one decode request: the reference walk, then fetch, decode and check.

A request (:class:`_Plan`) is planned before anything is fetched: :meth:`_Plan.add`
walks the reference chains depth first over table lookups only, with an
explicit stack (no recursion), cycle detection and hard bounds on depth and
size, so a crafted reference cycle raises :class:`CorruptManifestError`
instead of hanging.  :meth:`_Plan.run` then fetches every blob the plan
needs in coalesced range reads, decodes deps first, checks each decoded
chunk against its content hash, and frees intermediate chunks as soon as
nothing else needs them.  :class:`~._chunk_reader.ChunkReader` makes the plans.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...codec import ApplyPlan, apply_sparse, content_sum, is_sparse_blob
from ...errors import CorruptBlobError, CorruptManifestError, StepNotFoundError, TensorNotFoundError
from ..format._chunkcodec import content_digest, decode_chunk
from ..format._layout import pack_key, step_key
from ..format._packs import Location

if TYPE_CHECKING:
    from ._kept import KeptStep
    from ._table_reader import TableReader

__all__ = [
    "Node",
    "_Plan",
    "_paste",
    "BATCH_BYTES",
    "batched",
    "read_tensors",
    "decode_boxes",
    "materialize",
    "run_batches",
]

_MAX_DEPTH = 1 << 16  # no honest reference chain is this long
_MAX_NODES = 1 << 22

#: (step, tensor name, piece index, chunk coordinate)
Node = tuple[int, str, int, tuple[int, ...]]


def _paste(out: np.ndarray, lo, value: np.ndarray, clo, chi) -> None:
    """Copy the part of ``value`` (the box ``[clo, chi)``) that lies in ``out`` (the box starting at ``lo``)."""
    hi = tuple(a + n for a, n in zip(lo, out.shape))
    a = tuple(max(x, y) for x, y in zip(lo, clo))
    b = tuple(min(x, y) for x, y in zip(hi, chi))
    if any(x >= y for x, y in zip(a, b)):
        return
    dst = tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))
    src = tuple(slice(x - o, y - o) for x, y, o in zip(a, b, clo))
    out[dst] = value[src]


BATCH_BYTES = 32 << 20  # raw bytes of one unit of work of a read


def batched(items: Iterable[tuple]) -> Iterator[list]:
    """``(item, raw bytes)`` pairs cut into lists of about ``BATCH_BYTES`` (one plan and coalesced fetch each)."""
    cur: list = []
    size = 0
    for item, n in items:
        cur.append(item)
        size += n
        if size >= BATCH_BYTES:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


_GRAY, _BLACK = 1, 2


class _Need:
    """What one planned chunk needs: its table row, where its blob is, what it is decoded against."""

    __slots__ = ("content", "t", "p", "i", "shape", "loc", "deps", "lo", "boxes", "memo_key")

    def __init__(self, content, t, p, i, shape):
        self.content, self.t, self.p, self.i, self.shape = content, t, p, i, shape
        self.loc: Location | None = None  # None: the value is at hand already
        self.deps: list[Node] = []
        self.lo: tuple | None = None  # box origin, when the reference is assembled from several chunks
        self.boxes: list = []
        self.memo_key = None


class _Plan:
    """One request: which chunks to decode, in which order, from which bytes (no recursion).

    :meth:`add` walks references depth first with an explicit stack; a chunk
    already on the stack is a cycle.  :meth:`run` fetches every blob the plan
    needs (coalesced), decodes deps first, checks content hashes and frees
    intermediate chunks as soon as nothing else needs them.

    Options: ``kept`` (values a kept step holds, by content), ``lru`` (the
    reader's decoded-chunk cache), ``memo`` (an :class:`_LRU` keyed by *entry*,
    for ``verify``: every entry is decoded at least once, never skipped because
    another entry has the same content), ``prefer_snapshot`` (read a snapshot
    instead of walking the chain).
    """

    def __init__(self, reader: TableReader, *, kept=None, lru=False, fill_lru=True, memo=None, prefer_snapshot=True):
        self.r = reader
        self.kept = kept
        self.lru = lru and reader.cache_bytes > 0
        self.fill_lru = self.lru and fill_lru
        self.memo = memo
        self.prefer_snapshot = prefer_snapshot
        self.state: dict[Node, int] = {}
        self.need: dict[Node, _Need] = {}
        self.values: dict[Node, np.ndarray] = {}
        self.order: list[Node] = []
        self.uses: dict[Node, int] = {}
        self.roots: set[Node] = set()
        #: where to decode a node when this plan decodes it (a view of the caller's array), and
        #: the nodes that were decoded there
        self.outs: dict[Node, np.ndarray] = {}
        self.into: set[Node] = set()

    def content(self, node: Node) -> bytes:
        return self.need[node].content

    def decoded(self, node: Node) -> bool:
        """Whether this plan decoded ``node``'s value itself (a fresh array no cache holds)."""
        return self.need[node].loc is not None and not self.fill_lru

    def _have(self, node: Node, need: _Need, value) -> list[Node]:
        self.values[node] = value
        self.need[node] = need
        return []

    def _expand(self, node: Node) -> list[Node]:
        """Record what ``node`` needs; return the nodes its value depends on."""
        step, name, j, coord = node
        t = self.r.tensor(step, name)
        if not 0 <= j < len(t.pieces):
            raise CorruptManifestError(
                f"reference names piece {j}, which does not exist", step=step, tensor=name, key=step_key(step)
            )
        p = t.pieces[j]
        if len(coord) != len(p.shape) or any(not 0 <= c < g for c, g in zip(coord, p.grid)):
            raise CorruptManifestError(
                f"reference names chunk {coord} outside the grid", step=step, tensor=name, key=step_key(step)
            )
        i = p.index(coord)
        need = _Need(p.content[i].tobytes(), t, p, i, p.region_shape(coord))
        v = self._at_hand(name, need)
        if v is not None:
            return self._have(node, need, v)
        packs = self.r.doc(step).packs
        ref = int(p.ref[i])
        if self.memo is not None:
            need.memo_key = (name, t.dtype.str, t.shape, p.layout, coord, packs[int(p.pack[i])], int(p.off[i]), ref)
            v = self.memo.get(need.memo_key)
            if v is not None:
                return self._have(node, need, v)
        self.need[node] = need
        snap = p.snapshot(i)
        if snap is not None and self.prefer_snapshot:
            need.loc = packs[snap[0]], snap[1], snap[2]
            return []
        need.loc = packs[int(p.pack[i])], int(p.off[i]), int(p.length[i])
        if ref < 0:
            return []
        need.deps, need.lo, need.boxes = self._reference(node, need, ref)
        return need.deps

    def _at_hand(self, name: str, need: _Need) -> np.ndarray | None:
        """The value of a chunk of ``name`` if the kept step or the decoded-chunk cache holds it."""
        t, p, i = need.t, need.p, need.i
        if self.kept is not None:
            kp = self.kept.piece(name, t.dtype, t.shape, p.layout)
            v = kp.get(i, need.content) if kp is not None else None
            if v is not None:
                return v
        if self.lru:
            v = self.r._chunks.get((need.content, t.dtype.str, need.shape))
            if v is not None:
                return v
        return None

    def _reference(self, node: Node, need: _Need, ref: int) -> tuple[list[Node], tuple | None, list]:
        """(deps, box origin or None, boxes) of a chunk coded against step ``ref``: the co-located chunk when
        that step has the same piece layout, else the chunks of its pieces the chunk's box overlaps."""
        step, name, _, coord = node
        t, p = need.t, need.p
        if t.codec != "ulpack":
            raise CorruptManifestError("a zstd chunk names a reference", step=step, tensor=name, key=step_key(step))
        if ref == step:
            raise CorruptManifestError(
                "chunk is coded against its own step", step=step, tensor=name, key=step_key(step)
            )
        try:
            rt = self.r.tensor(ref, name)
        except (StepNotFoundError, TensorNotFoundError) as e:
            raise CorruptManifestError(f"reference is missing: {e}", step=step, tensor=name, key=step_key(step)) from e
        if rt.dtype != t.dtype or rt.shape != t.shape:
            raise CorruptManifestError(
                f"reference step {ref} holds {name!r} as {rt.dtype}{list(rt.shape)}, not {t.dtype}{list(t.shape)}",
                step=step,
                tensor=name,
                key=step_key(step),
            )
        jj = rt.find_piece(p.layout)
        if jj is not None:
            return [(ref, name, jj, coord)], None, []
        # another sharding: assemble the box from the reference step's chunks
        parts = list(rt.overlapping(*p.box(coord)))
        return [(ref, name, k, c) for k, c, _, _ in parts], p.box(coord)[0], [(clo, chi) for _, _, clo, chi in parts]

    def add(self, node: Node, *, root: bool = True) -> None:
        """Plan ``node`` and everything it depends on."""
        if root:
            self.roots.add(node)
        if node in self.state:
            return
        self.state[node] = _GRAY
        stack: list = [(node, None)]
        while stack:
            cur, it = stack[-1]
            if it is None:
                it = iter(self._expand(cur))
                stack[-1] = (cur, it)
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                self.state[cur] = _BLACK
                if cur not in self.values:
                    self.order.append(cur)
                continue
            self.uses[nxt] = self.uses.get(nxt, 0) + 1
            st = self.state.get(nxt)
            if st == _GRAY:
                raise CorruptManifestError(
                    f"reference cycle between steps (step {cur[0]}'s chunk refers back to step {nxt[0]})",
                    step=nxt[0],
                    tensor=nxt[1],
                    key=step_key(nxt[0]),
                )
            if st is None:
                if len(stack) >= _MAX_DEPTH or len(self.state) >= _MAX_NODES:
                    raise CorruptManifestError(
                        "reference chain does not end", step=cur[0], tensor=cur[1], key=step_key(cur[0])
                    )
                self.state[nxt] = _GRAY
                stack.append((nxt, None))

    def run(self) -> None:
        """Fetch and decode everything :meth:`add` planned, wave by wave (a chunk's deps one wave before it).

        A chain of SPARSE deltas is applied in place: its root is decoded once (into the caller's
        array when it has one), then each wave's SPARSE deltas are applied to the values below them
        by one compiled job per dtype (:func:`~ulstore.codec.apply_sparse`: each blob's CRC, reference
        word sum and target checksum checked, all or nothing), in time proportional to the changed
        elements.  Every other blob is decoded whole against its reference.  A chunk some request
        sees (a root, or a value the caches keep) is checked against its content hash; the values a
        chain overwrites in place are checked by the codec's checksums, and by the hash of the chunk
        at the chain's end.
        """
        if not self.order:
            return
        blobs = dict(zip(self.order, self.r.fetch([self.need[n].loc for n in self.order])))  # type: ignore[misc]
        self._route(blobs)
        for wave in self._waves():
            for node in wave:
                if node not in self.applied:
                    self._decode(node, blobs[node])
            self._apply_wave([n for n in wave if n in self.applied], blobs)

    def _route(self, blobs: dict) -> None:
        """Which nodes are SPARSE deltas applied in place on their reference's values (``applied``), which
        values are overwritten so (``fed``: never checked, cached or kept), and where each chain's root is
        decoded: into the caller's array of the chunk at the chain's end, when it has one."""
        self.applied: set[Node] = set()
        self.fed: set[Node] = set()
        self.sums: dict[Node, int] = {}
        if self.memo is not None:  # verify decodes every entry whole
            return
        for node in self.order:
            need = self.need[node]
            if len(need.deps) != 1 or need.lo is not None:
                continue
            dep = need.deps[0]
            if dep in blobs and dep not in self.roots and self.uses[dep] == 1 and is_sparse_blob(blobs[node]):
                self.applied.add(node)
                self.fed.add(dep)
        for node in reversed(self.order):  # the chain's end first: its destination passes down to the root
            out = self.outs.get(node)
            if node in self.applied and out is not None:
                self.outs[self.need[node].deps[0]] = out

    def _waves(self) -> list[list[Node]]:
        """The planned nodes by wave: a node comes one wave after the last of the deps this plan decodes."""
        level: dict[Node, int] = {}
        waves: list[list[Node]] = []
        for node in self.order:
            lv = 1 + max((level[d] for d in self.need[node].deps if d in level), default=-1)
            level[node] = lv
            if lv == len(waves):
                waves.append([])
            waves[lv].append(node)
        return waves

    def _decode(self, node: Node, blob) -> None:
        """Decode ``node``'s blob whole against its reference's values."""
        need = self.need[node]
        assert need.loc is not None
        ref = None
        if need.deps and need.lo is None:
            ref = self.values[need.deps[0]]
        elif need.deps:
            ref = np.empty(need.shape, need.t.dtype)
            for d, (clo, chi) in zip(need.deps, need.boxes):
                _paste(ref, need.lo, self.values[d], clo, chi)
        key = pack_key(need.loc[0])
        out = self.outs.get(node)
        if out is not None and (out.shape != need.shape or out.dtype != need.t.dtype):
            out = None
        value = decode_chunk(blob, ref, need.t.codec, need.t.dtype, need.shape, key=key, out=out)
        if out is not None:
            self.into.add(node)
        if node in self.fed:  # a chain goes on from here, in place: what its first SPARSE delta checks
            if not (value.flags.c_contiguous and value.flags.writeable):
                value = value.copy()
            self.sums[node] = content_sum(value)
        self._done(node, value)

    def _apply_wave(self, nodes: list[Node], blobs: dict) -> None:
        """Apply the SPARSE deltas ``nodes`` in place on their references' values: one job per dtype."""
        if not nodes:
            return
        by_dtype: dict[np.dtype, list[Node]] = {}
        for node in nodes:
            by_dtype.setdefault(self.need[node].t.dtype, []).append(node)
        groups = list(by_dtype.values())
        plans = [
            ApplyPlan.of(
                self.need[g[0]].t.dtype,
                [blobs[n] for n in g],
                [self.values[self.need[n].deps[0]].reshape(-1) for n in g],
                [self.sums[self.need[n].deps[0]] for n in g],
                shapes=[self.need[n].shape for n in g],
            )
            for g in groups
        ]
        done = apply_sparse(plans)
        if done is None:  # nothing was written: decode each whole, for the precise error (or the values)
            for node in nodes:
                self.outs.pop(node, None)
                self._decode(node, blobs[node])
            return
        for node, applied in zip([n for g in groups for n in g], done):
            dep = self.need[node].deps[0]
            if dep in self.into:
                self.into.add(node)
            self.sums[node] = applied.content_sum
            self._done(node, self.values[dep])

    def _done(self, node: Node, value: np.ndarray) -> None:
        """``node``'s value decoded: checked and cached unless a chain overwrites it; its deps released."""
        need = self.need[node]
        if node not in self.fed:
            assert need.loc is not None
            if content_digest(value) != need.content:
                chain = " (the end of a chain of SPARSE deltas applied in place)" if node in self.applied else ""
                raise CorruptBlobError(
                    f"chunk at byte {need.loc[1]} decodes to values that fail its content hash{chain}",
                    step=node[0],
                    tensor=node[1],
                    key=pack_key(need.loc[0]),
                )
            if self.fill_lru:
                self.r._chunks.put((need.content, need.t.dtype.str, need.shape), value, value.nbytes)
            if self.memo is not None:
                self.memo.put(need.memo_key, value, value.nbytes)
        self.values[node] = value
        for d in need.deps:
            self.uses[d] -= 1
            if self.uses[d] == 0 and d not in self.roots:
                self.values.pop(d, None)


# -- requests: whole tensors, boxes, chunks into place; each cut into batches of one plan --


def read_tensors(
    reader: TableReader,
    step: int,
    names=None,
    *,
    kept: KeptStep | None = None,
    refresh_kept: bool = False,
) -> dict[str, np.ndarray]:
    """Decode whole tensors of ``step`` (all by default) into fresh arrays.

    With ``kept`` (whose lock the caller holds), chunks whose reference
    chain reaches values the kept step holds decode against them; with
    ``refresh_kept`` the kept step becomes this step, overwritten in place.
    """
    tables = reader.tables(step)
    if names is None:
        names = list(tables)
    else:
        names = list(names)
        for n in names:
            if n not in tables:
                raise TensorNotFoundError("no such tensor", step=step, tensor=n)
    out = {n: np.empty(tables[n].shape, tables[n].dtype) for n in names}
    targets = []
    for n in names:
        t = tables[n]
        for j, p in enumerate(t.pieces):
            kp = kept.ensure(n, t.dtype, t.shape, p.layout, p.n) if kept is not None and refresh_kept else None
            base = tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape))
            dest = out[n][base] if p.shape else out[n]
            for i, c in enumerate(p.coords()):
                targets.append(((step, n, j, c), dest, p.region(c), kp, i))
    materialize(reader, targets, kept=kept)
    if kept is not None and refresh_kept:
        kept.retain({n: {p.layout for p in tables[n].pieces} for n in names})
        kept.step, kept.origin = step, "read"
    return out


def decode_boxes(reader: TableReader, step: int, requests: list, *, cache: bool = True) -> list[np.ndarray]:
    """The values over each box ``(name, lo, hi)`` of ``step``, fresh arrays: the chunks of all of them
    planned together, in batches of about ``_BATCH_BYTES`` (one coalesced fetch each) on ``threads``
    threads, each chunk decoded once per batch however many boxes it overlaps."""
    outs, parts = [], []
    for name, lo, hi in requests:
        t = reader.tensor(step, name)
        out = np.empty(tuple(b - a for a, b in zip(lo, hi)), t.dtype)
        outs.append(out)
        for j, c, clo, chi in t.overlapping(lo, hi):
            size = math.prod(b - a for a, b in zip(clo, chi)) * t.dtype.itemsize
            parts.append((((step, name, j, c), out, lo, clo, chi), size))

    def run(batch):
        plan = _Plan(reader, lru=True, fill_lru=cache)
        for node, *_ in batch:
            plan.add(node)
        plan.run()
        for node, out, lo, clo, chi in batch:
            _paste(out, lo, plan.values[node], clo, chi)

    run_batches(reader.threads, run, list(batched(parts)))
    return outs


def materialize(reader: TableReader, targets, *, kept: KeptStep | None = None, lru: bool = False) -> None:
    """Decode chunks into place: ``targets`` = ``(node, dest array or None, region, kept piece or None, index)``.

    Work is split into batches of about ``_BATCH_BYTES`` raw bytes (one
    plan, one coalesced fetch each) run on ``threads`` threads.
    """
    batches = list(
        batched(
            (
                tgt,
                math.prod(s.stop - s.start for s in tgt[2]) * (tgt[3] if tgt[1] is None else tgt[1]).dtype.itemsize,
            )
            for tgt in targets
        )
    )

    def run(batch):
        plan = _Plan(reader, kept=kept, lru=lru)
        for node, dest, region, kp, _ in batch:
            plan.add(node, root=True)
            if dest is not None and kp is None and not plan.fill_lru:  # decode straight into the caller's array
                view = dest[region] if region else dest
                if view.flags.c_contiguous and view.flags.writeable:
                    plan.outs[node] = view
        plan.run()
        for node, dest, region, kp, i in batch:
            value = plan.values[node]
            if node in plan.into:
                continue
            if dest is not None:
                if region:
                    dest[region] = value
                else:
                    dest[...] = value
            if kp is not None and kp.arrays[i] is not value:
                if plan.decoded(node):
                    kp.adopt(i, value, plan.content(node))  # decoded here: nobody else has it
                else:
                    kp.put(i, value, plan.content(node))

    run_batches(reader.threads, run, batches)


def run_batches(threads: int, run, batches: list) -> None:
    """``run(batch)`` for every batch, on up to ``threads`` threads."""
    if threads == 1 or len(batches) <= 1:
        for b in batches:
            run(b)
    else:
        with cf.ThreadPoolExecutor(min(threads, len(batches))) as pool:
            for f in [pool.submit(run, b) for b in batches]:
                f.result()
