"""Planning and running one decode request: the reference walk, then fetch, decode and check.

A request (:class:`_Plan`) is planned before anything is fetched: :meth:`_Plan.add`
walks the reference chains depth first over table lookups only, with an
explicit stack (no recursion), cycle detection and hard bounds on depth and
size, so a crafted reference cycle raises :class:`CorruptManifestError`
instead of hanging.  :class:`_Job` then runs a request's plans, one batch each: every blob a plan
needs fetched in coalesced range reads, then decoded wave by wave (deps first): whole
decodes through the codec's :func:`~ulstore.codec.decode_blobs`, chains of SPARSE deltas
applied in place on their root by :func:`~ulstore.codec.apply_sparse`.  Each chunk a
request sees is checked against its content hash, and intermediate values are freed as
soon as nothing else needs them.  :class:`~._chunk_reader.ChunkReader` makes the plans.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...codec import ApplyPlan, apply_sparse, content_sum, decode_blobs, is_sparse_blob
from ...errors import CorruptBlobError, CorruptManifestError, StepNotFoundError, TensorNotFoundError, UlstoreError
from ..format._chunkcodec import ULPACK, content_digest, decode_chunk
from ..format._layout import pack_key, step_key
from ..format._packs import Location
from ._column_plan import ColumnPlan, column_plan

if TYPE_CHECKING:
    from ._kept import KeptStep
    from ._table_reader import TableReader

__all__ = [
    "Node",
    "_Plan",
    "_paste",
    "BATCH_BYTES",
    "batched",
    "decode_workers",
    "SPLIT_BYTES",
    "read_tensors",
    "decode_boxes",
    "materialize",
    "read_job",
    "materialize_job",
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
#: the least raw bytes a read is cut into batches for its threads (about 2 ms of decoding: below that a
#: second thread costs more to start, plan and fetch for than it saves)
SPLIT_BYTES = 1 << 20


def decode_workers(reader: TableReader) -> int:
    """How many threads decode one read at once: ``reader.threads``, at most one per processor this
    process may run on (decoding is CPU-bound; ``threads`` beyond that hide I/O latency, not compute)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(reader.threads, cpus))


def batched(items: Iterable[tuple], parts: int = 1) -> Iterator[list]:
    """``(item, raw bytes)`` pairs cut, in order, into lists of at most about ``BATCH_BYTES`` (one plan and
    coalesced fetch each), and into at least ``parts`` lists of about equal bytes (one per thread that
    decodes them) when each holds ``SPLIT_BYTES`` or more: a step smaller than ``BATCH_BYTES`` is still
    decoded by every thread, not by one while the others wait.
    """
    pairs = list(items)
    total = sum(n for _, n in pairs)
    count = max(1, -(-total // BATCH_BYTES), min(parts, total // SPLIT_BYTES))
    if total == 0 or count == 1:
        if pairs:
            yield [item for item, _ in pairs]
        return
    cur: list = []
    k = done = 0
    for item, n in pairs:
        at = min(count - 1, (2 * done + n) * count // (2 * total))  # the batch the item's middle byte falls in
        if at != k and cur:
            yield cur
            cur = []
        k = at
        cur.append(item)
        done += n
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
        self.batch: list = []  # the requests this plan serves (a job's batch)
        #: step -> (its table directory, the chain positions it was found in, its position there): the
        #: directory a step document names for an ancestor, or that step's own document
        self.dirs: dict[int, tuple] = {}
        self.prefetched: set[tuple[int, str]] = set()
        #: blobs fetched already, by location (a :class:`~._column_plan.ColumnPlan` that handed the batch over)
        self.have: dict = {}

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
        t = self.r.table_in(self._dir(step)[0], name)
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
        packs = self._dir(step)[0].packs
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
            rt = self.r.table_in(self._ancestor(step, ref, name), name)
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

    def _dir(self, step: int) -> tuple:
        """(directory, chain positions, position) of ``step`` in this plan; its own document if not met yet."""
        got = self.dirs.get(step)
        if got is None:
            d = self.r.doc(step)
            got = self.dirs[step] = (d, d.chain_positions, 0)
        return got

    def _ancestor(self, step: int, ref: int, name: str):
        """The table directory of ``ref``, which a chunk of ``step`` is coded against: from the chain that
        named ``step``'s directory if it lists ``ref`` (further along the parent path than ``step``, else the
        chain is damaged), else ``ref``'s own document (its blocks for ``name`` and its chain's fetched at once).
        """
        _, positions, here = self._dir(step)
        hit = positions.get(ref)
        if hit is None:
            if ref not in self.dirs:
                self.r.prefetch_for(ref, name)  # a document without a chain, or beyond a cut one: walk on from it
            return self._dir(ref)[0]
        k, entry = hit
        if k <= here:
            raise CorruptManifestError(
                f"a chunk of step {step} is coded against step {ref}, which the step document's chain lists as "
                f"no ancestor of step {step}",
                step=step,
                tensor=name,
                key=step_key(step),
            )
        if ref not in self.dirs:
            self.dirs[ref] = (entry, positions, k)
        return self.dirs[ref][0]

    def add(self, node: Node, *, root: bool = True) -> None:
        """Plan ``node`` and everything it depends on."""
        if root:
            self.roots.add(node)
            if node[:2] not in self.prefetched:  # the tensor's table blocks along the whole chain, in one batch
                self.prefetched.add(node[:2])
                self.r.prefetch_for(node[0], node[1])
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
        """Fetch and decode everything :meth:`add` planned (:class:`_Job`, this plan alone)."""
        _Job(self.r, [self], _same, _nothing).run()

    # -- the run, a wave at a time (what :meth:`_Job.run` calls) --

    def start(self) -> list[list[Node]]:
        """Fetch every blob planned; route the chains (:meth:`_route`); the planned nodes by wave."""
        self.blobs: dict[Node, object] = {}
        if self.order:
            locs = [self.need[n].loc for n in self.order]
            todo = [loc for loc in locs if loc not in self.have]
            got = dict(zip(todo, self.r.fetch(todo))) if todo else {}  # type: ignore[arg-type]
            self.blobs = {n: self.have[loc] if loc in self.have else got[loc] for n, loc in zip(self.order, locs)}
        self._route()
        return self._waves()

    def _route(self) -> None:
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
            if dep in self.blobs and dep not in self.roots and self.uses[dep] == 1 and is_sparse_blob(self.blobs[node]):
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

    def begin_wave(self, wave: list[Node]) -> tuple[list[Node], list[Node]]:
        """``(ULPack blobs to decode whole, SPARSE deltas to apply in place)`` of ``wave``; Zstd chunks
        (no reference, no ULPack) are decoded here."""
        whole, applied = [], []
        for node in wave:
            if node in self.applied:
                applied.append(node)
            elif self.need[node].t.codec == ULPACK:
                whole.append(node)
            else:
                self._decode(node)
        return whole, applied

    def _reference_of(self, need: _Need) -> np.ndarray | None:
        if need.deps and need.lo is None:
            return self.values[need.deps[0]]
        if not need.deps:
            return None
        ref = np.empty(need.shape, need.t.dtype)
        for d, (clo, chi) in zip(need.deps, need.boxes):
            _paste(ref, need.lo, self.values[d], clo, chi)
        return ref

    def _out(self, node: Node) -> np.ndarray | None:
        """Where to decode ``node``: the caller's array it was routed to, if it fits."""
        need = self.need[node]
        out = self.outs.get(node)
        if out is not None and (out.shape != need.shape or out.dtype != need.t.dtype):
            return None
        return out

    def door_args(self, nodes: list[Node]) -> tuple[list, list, list, list]:
        """``(blobs, references, outs, shapes)`` of ``nodes`` for :func:`~ulstore.codec.decode_blobs`."""
        outs = []
        for node in nodes:
            out = self._out(node)
            outs.append(np.empty(self.need[node].shape, self.need[node].t.dtype) if out is None else out)
        refs = [self._reference_of(self.need[n]) for n in nodes]
        return [self.blobs[n] for n in nodes], refs, outs, [self.need[n].shape for n in nodes]

    def took(self, nodes: list[Node], outs: list, sums: list) -> None:
        """What :func:`~ulstore.codec.decode_blobs` decoded into ``outs``: checked, kept, its deps released."""
        for node, value, s in zip(nodes, outs, sums):
            if value is self.outs.get(node):
                self.into.add(node)
            if node in self.fed:
                self.sums[node] = content_sum(value) if s is None else s
            self._done(node, value)

    def one_by_one(self, nodes: list[Node]) -> None:
        """Decode ``nodes`` one at a time (:func:`decode_chunk`: the error names the blob's pack)."""
        for node in nodes:
            self._decode(node)

    def _decode(self, node: Node) -> None:
        """Decode ``node``'s blob whole against its reference's values."""
        need = self.need[node]
        assert need.loc is not None
        out = self._out(node)
        value = decode_chunk(
            self.blobs[node], self._reference_of(need), need.t.codec, need.t.dtype, need.shape,
            key=pack_key(need.loc[0]), out=out,
        )  # fmt: skip
        if out is not None:
            self.into.add(node)
        if node in self.fed:  # a chain goes on from here, in place: what its first SPARSE delta checks
            if not (value.flags.c_contiguous and value.flags.writeable):
                value = value.copy()
            self.sums[node] = content_sum(value)
        self._done(node, value)

    def apply_plans(self, nodes: list[Node]) -> list[ApplyPlan]:
        """One :class:`~ulstore.codec.ApplyPlan` per dtype: ``nodes``' SPARSE blobs on their references'
        values (``nodes`` put in the plans' order)."""
        by_dtype: dict[np.dtype, list[Node]] = {}
        for node in nodes:
            by_dtype.setdefault(self.need[node].t.dtype, []).append(node)
        nodes[:] = [n for g in by_dtype.values() for n in g]
        return [
            ApplyPlan.of(
                dtype,
                [self.blobs[n] for n in g],
                [self.values[self.need[n].deps[0]].reshape(-1) for n in g],
                [self.sums[self.need[n].deps[0]] for n in g],
                shapes=[self.need[n].shape for n in g],
            )
            for dtype, g in by_dtype.items()
        ]

    def applied_wave(self, nodes: list[Node], done: list | None) -> None:
        """What :func:`~ulstore.codec.apply_sparse` did with ``nodes`` (None: nothing; then each is
        decoded whole, for the precise error, or the values)."""
        if done is None:
            for node in nodes:
                self.outs.pop(node, None)
                self._decode(node)
            return
        for node, applied in zip(nodes, done):
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


def _same(plan):
    return plan


def _nothing(*_):
    return None


class _Job:
    """A request's plans run: each batch planned, fetched, decoded wave by wave, checked and placed.

    ``batches``: what ``plan(batch)`` turns into a :class:`_Plan` (added, not run); ``place(plan)``
    puts its values where the request wants them; ``result()`` is what :meth:`run` returns.
    :meth:`run` is where the codec is entered (:func:`~ulstore.codec.decode_blobs` for whole
    decodes, :func:`~ulstore.codec.apply_sparse` for SPARSE deltas applied in place), so that a
    read reaches the kernels in few calls.  The caller's thread works too; up to
    ``reader.threads - 1`` pool threads take the other batches.  ``plan(batch)`` may return a list of
    plans (a batch walked and fetched once, then cut into a plan per decode thread: ``parts``, the
    threads the job starts however few batches it has): a thread with nothing to take while a batch is
    being planned waits for its parts.
    """

    def __init__(self, reader: TableReader, batches: list, plan, place, result=_nothing, parts: int = 1):
        self.r, self.batches, self.plan, self.place, self.result = reader, batches, plan, place, result
        #: threads to run the job on (at least): ``plan(batch)`` may return a list of plans, run in parallel
        self.parts = parts
        self._next = 0
        self._ready: list = []  # plans made and not yet taken (the rest of a list ``plan`` returned)
        self._planning = 0  # batches being planned: a thread with nothing to take waits for their plans
        self._cv = threading.Condition()
        self.stop = False
        self.on_close = None  # called by close() (a full read: the kept step's lock)

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close()
            self.on_close = None

    def _take(self) -> _Plan | None:
        """The next plan: one made already, or the next batch's (None: nothing left, or the job stopped)."""
        with self._cv:
            while not self.stop and not self._ready and self._next >= len(self.batches) and self._planning:
                self._cv.wait()  # another thread plans the last batch: its plan may come in parts
            if self.stop:
                return None
            if self._ready:
                return self._ready.pop(0)
            if self._next >= len(self.batches):
                return None
            i, self._next = self._next, self._next + 1
            self._planning += 1
        made = None
        try:
            made = self.plan(self.batches[i])
        finally:
            with self._cv:
                self._planning -= 1
                if isinstance(made, list):
                    self._ready += made[1:]
                self.stop = self.stop or made is None  # planning failed: the error is this thread's to raise
                self._cv.notify_all()
        return made[0] if isinstance(made, list) else made

    def run(self, helper: bool = False):
        """Run every batch (on this thread and up to ``threads - 1`` others); return ``result()``."""
        pool, helpers = self._helpers(helper)
        ok = False
        try:
            while (plan := self._take()) is not None:
                for wave in plan.start():
                    whole, in_place = plan.begin_wave(wave)
                    if whole:
                        blobs, refs, outs, shapes = plan.door_args(whole)
                        try:
                            sums = decode_blobs(blobs, refs, outs, shapes)
                        except UlstoreError:
                            plan.one_by_one(whole)  # the error again, naming the blob's pack
                        else:
                            plan.took(whole, outs, sums)
                    if in_place:
                        plan.applied_wave(in_place, apply_sparse(plan.apply_plans(in_place)))
                self.place(plan)
            ok = True
        finally:
            if not ok:
                with self._cv:
                    self.stop = True
                    self._cv.notify_all()
            _join(pool, helpers, ok)
        return None if helper else self.result()

    def _helpers(self, helper: bool) -> tuple:
        n = 0 if helper else min(self.r.threads, max(len(self.batches), self.parts)) - 1
        if n <= 0:
            return None, []
        pool = cf.ThreadPoolExecutor(n)
        return pool, [pool.submit(self.run, True) for _ in range(n)]


def _join(pool, helpers: list, ok: bool) -> None:
    """Wait for a job's helpers; raise the first one's error (when this thread's work went well)."""
    if pool is None:
        return
    pool.shutdown(wait=True)
    if ok:
        for f in helpers:
            f.result()


# -- requests: whole tensors, boxes, chunks into place; each cut into batches of one plan --


def read_tensors(reader: TableReader, step: int, names=None, **kw) -> dict[str, np.ndarray]:
    """Decode whole tensors of ``step`` (all by default) into fresh arrays (:func:`read_job`, run)."""
    return read_job(reader, step, names, **kw).run()


def read_job(
    reader: TableReader,
    step: int,
    names=None,
    *,
    kept: KeptStep | None = None,
    refresh_kept: bool = False,
) -> _Job:
    """The job that decodes whole tensors of ``step`` (all by default) into fresh arrays (its ``run()``
    returns them, by name).

    With ``kept`` (whose lock the caller holds), chunks whose reference
    chain reaches values the kept step holds decode against them; with
    ``refresh_kept`` the kept step becomes this step, overwritten in place.
    """
    reader.prefetch(step, None if names is None else list(names))  # the chain's table blocks: one batch
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

    def result() -> dict[str, np.ndarray]:
        if kept is not None and refresh_kept:
            kept.retain({n: {p.layout for p in tables[n].pieces} for n in names})
            kept.step, kept.origin = step, "read"
        return out

    return materialize_job(reader, targets, kept=kept, result=result)


def decode_boxes(reader: TableReader, step: int, requests: list, *, cache: bool = True) -> list[np.ndarray]:
    """The values over each box ``(name, lo, hi)`` of ``step``, fresh arrays: the chunks of all of them
    planned together, in batches (:func:`batched`: at most about ``BATCH_BYTES``, one per decode thread at
    least; one coalesced fetch each) on ``threads`` threads, each chunk decoded once per batch however many
    boxes it overlaps."""
    outs, parts = [], []
    reader.prefetch(step, sorted({name for name, _, _ in requests}))
    for name, lo, hi in requests:
        t = reader.tensor(step, name)
        out = np.empty(tuple(b - a for a, b in zip(lo, hi)), t.dtype)
        outs.append(out)
        for j, c, clo, chi in t.overlapping(lo, hi):
            size = math.prod(b - a for a, b in zip(clo, chi)) * t.dtype.itemsize
            parts.append((((step, name, j, c), out, lo, clo, chi), size))

    def plan(batch) -> _Plan:
        p = _Plan(reader, lru=True, fill_lru=cache)
        for node, *_ in batch:
            p.add(node)
        p.batch = batch
        return p

    def place(p: _Plan) -> None:
        for node, out, lo, clo, chi in p.batch:
            _paste(out, lo, p.values[node], clo, chi)

    _Job(reader, list(batched(parts, decode_workers(reader))), plan, place).run()
    return outs


def materialize(reader: TableReader, targets, *, kept: KeptStep | None = None, lru: bool = False) -> None:
    """Decode chunks into place: ``targets`` = ``(node, dest array or None, region, kept piece or None, index)``
    (:func:`materialize_job`, run)."""
    materialize_job(reader, targets, kept=kept, lru=lru).run()


def materialize_job(reader: TableReader, targets, *, kept: KeptStep | None = None, lru: bool = False, result=_nothing):
    """The job that decodes chunks into place (see :func:`materialize`).

    Work is split into batches (:func:`batched`: at most about ``BATCH_BYTES`` raw bytes, and one per
    decode thread at least; one plan, one coalesced fetch each) run on ``threads`` threads; with nothing
    at hand to stop a chain at (the column path), a batch is walked and fetched once and then cut into one
    plan per decode thread (:func:`~._column_plan.column_plan`).
    """
    targets = list(targets)
    sizes = [
        math.prod(s.stop - s.start for s in region) * (kp if dest is None else dest).dtype.itemsize
        for _, dest, region, kp, _ in targets
    ]
    workers = decode_workers(reader)

    def plan(batch) -> _Plan:
        p = _Plan(reader, kept=kept, lru=lru)
        for node, dest, region, kp, _ in batch:
            p.add(node, root=True)
            if dest is not None and kp is None and not p.fill_lru:  # decode straight into the caller's array
                view = dest[region] if region else dest
                if view.flags.c_contiguous and view.flags.writeable:
                    p.outs[node] = view
        p.batch = batch
        return p

    if (kept is None or not kept.tensors) and not lru:  # nothing at hand to stop a chain at: its columns
        # a batch per BATCH_BYTES, walked and fetched once, then cut into a plan per decode thread: the chains'
        # walk and fetch (Python, under the GIL) are not made again on each thread, as one batch per thread
        # made them; the decodes and applies still divide over the threads (issue 35)
        size = {id(t): n for t, n in zip(targets, sizes)}

        def cut(batch: list) -> list[list]:
            return list(batched(((t, size[id(t)]) for t in batch), workers))

        def plans(batch: list) -> list:
            return column_plan(reader, batch, plan, cut)

        parts = min(workers, max(1, sum(sizes) // SPLIT_BYTES))  # the most parts cut() makes of a batch
        return _Job(reader, list(batched(zip(targets, sizes))), plans, _placed, result, parts=parts)
    return _Job(reader, list(batched(zip(targets, sizes), workers)), plan, _placed, result)


def _placed(plan: _Plan | ColumnPlan) -> None:
    """A materialize batch's values where its targets want them (the caller's arrays, the kept step)."""
    if isinstance(plan, ColumnPlan):
        plan.place()
        return
    for node, dest, region, kp, i in plan.batch:
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
