"""Decoding chunks of any step: step documents, table blocks, reference chains, caches.

A chunk's blob is decoded against its reference: the values of the step its
entry names over the same box (the co-located chunk when that step has the
same piece layout, else a box assembled from that step's chunks), which are
decoded the same way, down to an intra blob or a snapshot.

:class:`ChunkReader` never recurses: a request is planned first, then
fetched and decoded (``_decode_plan.py``: the reference walk, with cycle
detection and hard bounds, and the decoding deps-first, each intermediate
chunk once).  Every decoded chunk is checked against its content hash.

Caches (all bounded): step documents (by count); parsed table blocks; decoded chunks in
an LRU keyed by content hash (the zarr view's lazy slices); and the
trajectory's kept step (``_kept.py``), which full reads use and refresh.

Thread rules: every public method is thread-safe.  A thread waits on another
only for a step document or table block being loaded (leaves), never inside
a reference walk, so waits cannot form a cycle.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import math
import threading

import numpy as np

from ..core.objects import MAX_DOCUMENT_BYTES, ObjectStore
from ..errors import CorruptBlobError, CorruptManifestError, StepNotFoundError, TensorNotFoundError
from ._chunkcodec import digest, zstd_decompress
from ._decode_plan import Node, _paste, _Plan
from ._kept import KeptStep
from ._layout import pack_key, step_key
from ._lru import _LRU
from ._packs import Location, fetch, own_blob_range
from ._stepdoc import StepDoc
from ._table_block import Block, TableError, parse_block
from ._tables import TensorTable

__all__ = ["ChunkReader", "DEFAULT_CACHE_BYTES", "Node"]

DEFAULT_CACHE_BYTES = 128 << 20
_TABLE_CACHE_BYTES = 256 << 20
_BATCH_BYTES = 32 << 20  # raw bytes of one unit of work of a full read
#: Step documents kept (oldest read first out): a follower reads one per version, for days
_MAX_DOCS = 1 << 14


def _charge(length: int) -> int:
    """What a parsed table block of ``length`` stored bytes is charged in the cache: its columns and tables
    (a chunk's entry is about 20 stored bytes), and what its headers derive for the change feed."""
    return length * 16 + 1024


class _Flight:
    """A load under way in :meth:`ChunkReader._once`: ``done`` is held until its value or error is set.

    (A follower loads a step document and a table block per version: a cf.Future with its Condition
    cost several times this lock, most of it with the caches as cold as after an apply.)
    """

    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()
        self.value = None
        self.error: BaseException | None = None

    def result(self):
        with self.done:  # taken once the owner released it: value or error is set
            pass
        if self.error is not None:
            raise self.error
        return self.value


#: Packs whose bytes read ahead a reader keeps until they are fetched.
_MAX_AHEAD_PACKS = 2


class ChunkReader:
    """Read step documents, tables and decoded chunks of a trajectory.

    Parameters
    ----------
    io : ObjectStore
    cache_bytes : int
        Budget of the decoded-chunk LRU (lazy slices); 0 disables it.
    threads : int
        Threads of full reads.
    """

    def __init__(self, io: ObjectStore, cache_bytes: int = DEFAULT_CACHE_BYTES, threads: int = 4):
        self.io = io
        self.cache_bytes = int(cache_bytes)
        self.threads = max(1, int(threads))
        self._lock = threading.Lock()
        self._docs: dict[int, StepDoc] = {}
        self._blocks = _LRU(_TABLE_CACHE_BYTES)
        self._chunks = _LRU(self.cache_bytes)
        self._inflight: dict = {}
        # steps' own blobs, read with their table blocks for a caller that fetches them next (blocks(own_blobs=)):
        # pack id -> view of its first bytes, dropped by the first fetch that reads from it (a follower that
        # catches up reads a step ahead while it applies one: two at most, the older dropped beyond that)
        self._ahead: dict[str, memoryview] = {}

    def __getstate__(self) -> dict:
        # where to read and how, not the caches (locks, decoded chunks): a process that
        # unpickles a reader (a dask worker) starts with empty caches of the same budgets
        return {"io": self.io, "cache_bytes": self.cache_bytes, "threads": self.threads}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["io"], state["cache_bytes"], state["threads"])  # type: ignore[misc]

    # -- single flight ------------------------------------------------------------

    def _once(self, key, compute):
        """Run ``compute()`` once for concurrent callers asking for ``key`` (leaves only: no nested waits)."""
        with self._lock:
            flight = self._inflight.get(key)
            owner = flight is None
            if owner:
                flight = self._inflight[key] = _Flight()
        if not owner:
            return flight.result()
        try:
            value = flight.value = compute()
            return value
        except BaseException as e:
            flight.error = e
            raise
        finally:
            with self._lock:
                del self._inflight[key]
            flight.done.release()

    # -- step documents and tables --------------------------------------------------

    def doc(self, step: int) -> StepDoc:
        """The step document of ``step`` (StepNotFoundError, CorruptManifestError)."""
        d = self._docs.get(step)
        if d is not None:
            return d

        def load():
            d = self._docs.get(step)
            if d is not None:
                return d
            key = step_key(step)
            data = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
            if data is None:
                raise StepNotFoundError("no such step", step=step, key=key)
            d = StepDoc.from_bytes(data, key=key, step=step)
            self.keep_doc(d)
            return d

        return self._once(("doc", step), load)

    def keep_doc(self, d: StepDoc) -> None:
        """Cache a checked step document (the oldest cached goes beyond ``_MAX_DOCS``: read again if needed)."""
        with self._lock:
            self._docs[d.step] = d
            while len(self._docs) > _MAX_DOCS:
                del self._docs[next(iter(self._docs))]

    def forget(self, steps=None) -> None:
        """Drop cached step documents and tables (all, or of ``steps``): after they were rewritten."""
        if steps is None:
            with self._lock:
                self._docs.clear()
            self._blocks.clear()
            return
        steps = set(steps)
        with self._lock:
            for s in steps:
                self._docs.pop(s, None)
        self._blocks.drop(lambda key: key[0] not in steps)  # keyed (step, content, block hash)

    def clear_cache(self) -> None:
        """Drop every decoded chunk (documents and tables stay)."""
        self._chunks.clear()

    def remember(self, doc: StepDoc, tables: list[TensorTable]) -> None:
        """Cache a step document and its tables that this process just wrote."""
        self.keep_doc(doc)
        names = [t.name for t in tables]
        for ref in doc.tables:
            lo = bisect.bisect_left(names, ref.first)
            hi = bisect.bisect_right(names, ref.last)
            self._blocks.put((doc.step, doc.content, ref.hash), Block.from_tables(tables[lo:hi]), _charge(ref.length))

    def _block(self, step: int, bi: int) -> Block:
        d = self.doc(step)
        cache_key = (step, d.content, d.tables[bi].hash)
        hit = self._blocks.get(cache_key)
        if hit is not None:
            return hit

        def load():
            ref = d.tables[bi]
            data = self.fetch([(d.packs[ref.pack], ref.offset, ref.length)])[0]
            block = self._parse_block(step, d, bi, data)
            self._blocks.put(cache_key, block, _charge(ref.length))
            return block

        return self._once(("block", cache_key), load)

    @staticmethod
    def _parse_block(step: int, d: StepDoc, bi: int, data) -> Block:
        ref = d.tables[bi]
        key = pack_key(d.packs[ref.pack])
        if digest(data).hex() != ref.hash:
            raise CorruptManifestError(f"table block at byte {ref.offset} fails its hash", step=step, key=key)
        try:
            block = parse_block(data, n_packs=len(d.packs))
        except TableError as e:
            raise CorruptManifestError(f"table block at byte {ref.offset} is malformed: {e}", step=step, key=key) from e
        names = list(block.specs())
        if not names or names[0] != ref.first or names[-1] != ref.last:
            raise CorruptManifestError("table block holds other tensors than its directory says", step=step, key=key)
        return block

    def tensor(self, step: int, name: str) -> TensorTable:
        """The table of tensor ``name`` at ``step``: one step document and one table block."""
        bi = self.doc(step).table_for(name)
        t = self._block(step, bi).tables().get(name) if bi is not None else None
        if t is None:
            raise TensorNotFoundError("no such tensor", step=step, tensor=name)
        return t

    def blocks(self, step: int, *, own_blobs: bool = False) -> list[Block]:
        """The table blocks of ``step``, in name order (the missing ones fetched together).

        ``own_blobs``: when every byte the step's commit wrote before its table
        blocks is a blob of one of its changes (no snapshot, no file: see
        :func:`~ulstore.store._packs.own_blob_range`), read those bytes in the
        same request as the blocks and keep them for the next :meth:`fetch`.
        For a caller that fetches the blobs of the step's changes next (a
        weight-sync follower): one request per step fewer, the same bytes.
        """
        d = self.doc(step)
        # one cache look-up per block (a follower asks for a step's blocks three times per version)
        got = [self._blocks.get((step, d.content, ref.hash)) for ref in d.tables]
        missing = [bi for bi, block in enumerate(got) if block is None]
        head = own_blob_range(d) if own_blobs and missing else None
        if len(missing) > 1 or head is not None:  # one coalesced fetch instead of one GET per block
            locations = [(d.packs[d.tables[bi].pack], d.tables[bi].offset, d.tables[bi].length) for bi in missing]
            datas = self.fetch(locations + ([head] if head is not None else []))
            if head is not None:
                with self._lock:
                    self._ahead[head[0]] = datas[-1]
                    while len(self._ahead) > _MAX_AHEAD_PACKS:
                        del self._ahead[next(iter(self._ahead))]
            for bi, data in zip(missing, datas):
                block = self._parse_block(step, d, bi, data)  # (returned from the cache below, as before)
                self._blocks.put((step, d.content, d.tables[bi].hash), block, _charge(d.tables[bi].length))
        return [block if block is not None else self._block(step, bi) for bi, block in enumerate(got)]

    def tables(self, step: int) -> dict[str, TensorTable]:
        """Every tensor table of ``step``, in name order (blocks fetched together)."""
        out: dict[str, TensorTable] = {}
        for block in self.blocks(step):
            out.update(block.tables())
        return out

    def specs(self, step: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """name -> (shape, dtype) of every tensor of ``step``, in name order (a new dict)."""
        out: dict = {}
        for block in self.blocks(step):
            out.update(block.specs())
        return out

    # -- bytes ------------------------------------------------------------------------

    def fetch(self, locations: list[Location], pool: cf.Executor | None = None) -> list[memoryview]:
        """Bytes at (pack, offset, length) locations, with coalesced range reads (and from the bytes
        :meth:`blocks` read ahead, if any: this call drops them)."""
        if not self._ahead:
            return fetch(self.io, locations, pool=pool)
        with self._lock:
            heads = {p: self._ahead.pop(p) for p in {loc[0] for loc in locations} if p in self._ahead}
        out: list = [None] * len(locations)
        rest = []
        for i, (p, off, n) in enumerate(locations):
            head = heads.get(p)
            if head is not None and off + n <= len(head):  # (locations are non-negative: checked with the tables)
                out[i] = head[off : off + n]
            else:
                rest.append(i)
        if rest:
            for i, view in zip(rest, fetch(self.io, [locations[i] for i in rest], pool=pool)):
                out[i] = view
        return out

    def file(self, step: int, name: str) -> bytes:
        """The content of file ``name`` of ``step``, checked against its hash."""
        d = self.doc(step)
        f = d.files.get(name)
        if f is None:
            raise TensorNotFoundError(f"no file named {name!r}", step=step)
        key = pack_key(d.packs[f.pack])
        blob = self.fetch([(d.packs[f.pack], f.offset, f.length)])[0]
        try:
            data = zstd_decompress(blob, f.size, what="file blob")
        except Exception as e:
            raise CorruptBlobError(f"file {name!r} does not decode: {e}", step=step, key=key) from e
        if digest(data).hex() != f.hash:
            raise CorruptBlobError(f"file {name!r} fails its content hash", step=step, key=key)
        return data

    # -- chunks -----------------------------------------------------------------------

    def chunk(self, step: int, name: str, coord: tuple[int, ...], piece: int = 0, *, cache: bool = True) -> np.ndarray:
        """Decoded chunk ``coord`` of piece ``piece`` of ``name`` at ``step``: exact, shared (do not modify).

        ``cache=False`` reads the decoded-chunk cache but adds nothing to it
        (a commit without the kept parent: memory stays a few chunks).

        Raises
        ------
        CorruptBlobError
            A blob of the reference chain is missing, altered, or decodes to a
            chunk that fails its content hash; ``key`` names its pack.
        CorruptManifestError
            Tables are inconsistent (a reference cycle, a missing reference).
        """
        t = self.tensor(step, name)
        if not 0 <= piece < len(t.pieces):
            raise IndexError(f"piece {piece} of {name!r} does not exist")
        p = t.pieces[piece]
        coord = tuple(coord)
        if len(coord) != len(p.shape) or any(not 0 <= i < g for i, g in zip(coord, p.grid)):
            raise IndexError(f"chunk {coord} is outside the chunk grid {p.grid} of {name!r}")
        node = (step, name, piece, coord)
        plan = _Plan(self, lru=True, fill_lru=cache)
        plan.add(node)
        plan.run()
        return plan.values[node]

    def box(self, step: int, name: str, lo: tuple[int, ...], hi: tuple[int, ...], *, cache: bool = True) -> np.ndarray:
        """The values of ``name`` at ``step`` over the box ``[lo, hi)`` (assembled from its chunks)."""
        t = self.tensor(step, name)
        parts = list(t.overlapping(lo, hi))
        if len(parts) == 1 and parts[0][2] == tuple(lo) and parts[0][3] == tuple(hi):
            return self.chunk(step, name, parts[0][1], parts[0][0], cache=cache)
        return self.boxes(step, [(name, lo, hi)], cache=cache)[0]

    def boxes(self, step: int, requests: list, *, cache: bool = True) -> list[np.ndarray]:
        """The values over each box ``(name, lo, hi)`` of ``step``, fresh arrays: the chunks of all of them
        planned together, in batches of about ``_BATCH_BYTES`` (one coalesced fetch each) on ``threads``
        threads, each chunk decoded once per batch however many boxes it overlaps."""
        outs, parts = [], []
        for name, lo, hi in requests:
            t = self.tensor(step, name)
            out = np.empty(tuple(b - a for a, b in zip(lo, hi)), t.dtype)
            outs.append(out)
            for j, c, clo, chi in t.overlapping(lo, hi):
                size = math.prod(b - a for a, b in zip(clo, chi)) * t.dtype.itemsize
                parts.append((((step, name, j, c), out, lo, clo, chi), size))

        def run(batch):
            plan = _Plan(self, lru=True, fill_lru=cache)
            for node, *_ in batch:
                plan.add(node)
            plan.run()
            for node, out, lo, clo, chi in batch:
                _paste(out, lo, plan.values[node], clo, chi)

        self._run(run, _batched(parts))
        return outs

    def read(
        self,
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
        tables = self.tables(step)
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
        self.materialize(targets, kept=kept)
        if kept is not None and refresh_kept:
            kept.retain({n: {p.layout for p in tables[n].pieces} for n in names})
            kept.step, kept.origin = step, "read"
        return out

    def materialize(self, targets, *, kept: KeptStep | None = None, lru: bool = False) -> None:
        """Decode chunks into place: ``targets`` = ``(node, dest array or None, region, kept piece or None, index)``.

        Work is split into batches of about ``_BATCH_BYTES`` raw bytes (one
        plan, one coalesced fetch each) run on ``threads`` threads.
        """
        batches = _batched(
            (tgt, math.prod(s.stop - s.start for s in tgt[2]) * (tgt[3] if tgt[1] is None else tgt[1]).dtype.itemsize)
            for tgt in targets
        )

        def run(batch):
            plan = _Plan(self, kept=kept, lru=lru)
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

        self._run(run, batches)

    def _run(self, run, batches: list) -> None:
        """``run(batch)`` for every batch, on up to ``threads`` threads."""
        if self.threads == 1 or len(batches) <= 1:
            for b in batches:
                run(b)
        else:
            with cf.ThreadPoolExecutor(min(self.threads, len(batches))) as pool:
                for f in [pool.submit(run, b) for b in batches]:
                    f.result()


def _batched(items) -> list[list]:
    """``(item, raw bytes)`` pairs cut into lists of about ``_BATCH_BYTES`` (one plan and coalesced fetch each)."""
    batches: list[list] = []
    cur: list = []
    size = 0
    for item, n in items:
        cur.append(item)
        size += n
        if size >= _BATCH_BYTES:
            batches.append(cur)
            cur, size = [], 0
    if cur:
        batches.append(cur)
    return batches
