"""The piece writer: encodes pieces of tensors of one step into its own pack stream.

One code path for every writer: :meth:`Trajectory.commit` runs one piece
writer over the whole state; a torch DCP rank runs one over its shards; the
finalizer (``_finalize.py``) then writes tables, the step document and the ref.

Per chunk, in a bounded window (``2 * threads`` jobs in flight, each a batch of
chunks of up to ``BATCH_BYTES``), on worker threads: hash the chunk (BLAKE3-128,
once); if it equals the parent's co-located chunk, reuse the parent's entry (no
blob); otherwise find the reference (the kept parent's region, or the parent's
values decoded through the reader), look the blob up in this commit's dedup
index, encode, and copy the new values into the kept parent in place.  The main
thread takes results in plan order and appends blobs to the pack stream, so a
pack's layout is deterministic.

Dedup: a blob is identified by (content, reference content or none, codec,
dtype, chunk shape): an in-commit index over the parent's intra entries and
this commit's own blobs finds a tied weight or a re-coded frozen chunk, which
is then written once.  No blob bytes are hashed for it.  A chunk sees the
parent's intra entries of the pieces written up to its own (plan order), never
those of a piece written after it, whatever the worker's timing: what one
thread stores, several store byte for byte.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
import threading
from collections import deque

import numpy as np

from ...errors import DtypeError, InvalidInputError
from ..format._chunk_tables import MAX_CHUNK_BYTES, Piece, TensorTable, chunk_nbytes
from ..format._chunkcodec import ULPACK, check_committable, content_digest, encode_chunk
from ..format._layout import choose_chunks, chunk_grid
from ..format._packs import Location, PackStream
from ..format._read_cost import INTRA, blob_cost, cost_of
from ..format._refs import RefState
from ..format._stepdoc import StepDoc
from ..read._chunk_reader import ChunkReader
from ..read._kept import KeptStep
from ._piece_columns import PieceRecord, _PieceState

__all__ = ["PieceRecord", "PieceWriter"]


_PLACED = object()

#: Raw bytes of chunks handed to a worker as one job (at most ``chunk_bytes``).  A MoE step has ~10,000 tensors of ~0.1 MB:
#: one pool hand-off (future, queue, wake-up) per chunk cost as much as encoding it; batching never
#: changes a blob or a table (results are placed in plan order).
BATCH_BYTES = 4 << 20


class _Job:
    """A batch of chunks handed to the pool as one task: ``(piece, index, coord)`` each, and its future."""

    __slots__ = ("chunks", "future")

    def __init__(self, chunks: list):
        self.chunks = chunks
        self.future: cf.Future | None = None


class PieceWriter:
    """Encode pieces of tensors of ``step`` against ``parent`` into this writer's packs.

    Create with :meth:`Trajectory.piece_writer`.  Call :meth:`write` for each
    piece (arrays must stay unchanged until :meth:`flush`), then :meth:`close`
    (or hand the writer to :meth:`Trajectory.finalize`, which appends the
    step's tables to the same pack).  Not thread-safe: one thread drives a
    writer; it encodes on its own pool.
    """

    def __init__(
        self,
        *,
        step: int,
        parent: int | None,
        parent_content: str | None,
        anchor: bool,
        strict: bool,
        snapshot: bool,
        reader: ChunkReader,
        stream: PackStream,
        kept: KeptStep | None,
        chunk_bytes: int,
        threads: int,
        executor: cf.Executor | None = None,
        sparse: bool = False,
        why: dict | None = None,
    ):
        self.step, self.parent, self.parent_content = step, parent, parent_content
        self.sparse = sparse
        self.why = why  # why the step is an anchor (the step document's anchoring reason), None for a delta
        self.anchor, self.strict, self.snapshot = anchor, strict, snapshot
        self.reader, self.stream, self.kept = reader, stream, kept
        self.chunk_bytes = chunk_bytes
        self.threads = max(1, threads)
        self.executor = executor
        self._pool = cf.ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._window: deque = deque()  # (chunks, future of their results), in plan order
        self._batch: list = []  # chunks not yet handed to the pool
        self._batch_bytes = 0
        self._records: list[PieceRecord] = []
        self._written: set[tuple] = set()
        # dedup key -> the job that encodes its blob (``_Job``; the writer itself when one thread encodes
        # inline), then _PLACED once the blob is in the pack.  No lock: a claim is one ``dict.setdefault``
        # (atomic for these keys: bytes, str, tuples), and a chunk that loses a claim is placed from its
        # owner's results (the main thread waits for that job, already running, when it gets there)
        self._claims: dict = {}
        self._parent_doc: StepDoc | None = None  # the parent's step document, read at the first piece
        self._parent_tables: dict[str, TensorTable] = {}  # the parent's tables of the blocks looked up so far
        self._parent_blocks: set[int] = set()
        self._placed: dict = {}
        self._costs: dict = {}  # dedup key -> the modelled read cost of its blob (set by the worker that encoded it)
        # dedup key of an intra blob -> (position in ``_intra_todo`` of the first parent piece that holds it,
        # Location), from the parent's entries
        self._intra: dict = {}
        # the parent pieces written so far, indexed into ``_intra`` when an intra chunk first looks there (a
        # delta commit of colocated chunks never does): appended by the main thread, indexed under the lock
        self._intra_todo: list[_PieceState] = []
        self._intra_done = 0
        self._intra_lock = threading.Lock()
        # the float tensors written that the parent holds under the same name with another dtype or shape (so
        # their chunks are intra-coded, not deltas): name -> ((parent shape, dtype), (shape, dtype)), in their records
        self._retyped: dict[str, tuple] = {}
        self._failed = False
        self.closed = False
        #: the branch as read when :meth:`Trajectory.piece_writer` made this writer: a
        #: finalize given this writer moves it by compare-and-swap from there
        self.ref: RefState | None = None

    # -- input ----------------------------------------------------------------------

    def write(self, name: str, array, *, offset=None, shape=None, chunks=None) -> None:
        """Encode one piece of tensor ``name``: ``array`` placed at ``offset`` of a tensor of ``shape``.

        Defaults: the whole tensor (offset 0, shape ``array.shape``).  ``chunks``
        fixes the piece's chunk grid (default: the parent's for the same piece,
        else chosen from ``chunk_bytes``).
        """
        self._check_open()
        dtype, codec = _committable(array, name)
        pshape, shape, offset = _placement(name, array.shape, shape, offset)
        pt = self._parent_table(name)
        parent = pt if self._deltas_against(name, pt, dtype, shape, codec) else None
        if chunks is None:  # (the parent's piece's, checked when its table was read, or chosen: valid)
            chunks = self._default_chunks(parent, offset, pshape, dtype)
        else:
            chunks = _piece_chunks(name, chunks, pshape, dtype)
        layout = (offset, pshape, chunks)
        placed = (name, offset)
        if placed in self._written:
            raise InvalidInputError(f"piece at {list(offset)} was written twice", tensor=name)
        self._written.add(placed)
        pj, pp, mode = self._against(parent, layout, codec)
        grid = chunk_grid(pshape, chunks)
        n = math.prod(grid)
        kp = self.kept.ensure(name, dtype, shape, layout, n) if self.kept is not None else None
        parent_packs = self._parent_doc.packs if self._parent_doc is not None else ()
        st = _PieceState(name, array, dtype, shape, codec, layout, grid, n, parent, pp, parent_packs, mode, kp)
        if pp is not None:
            self._intra_todo.append(st)
        # the parent pieces this piece's chunks may dedup against: those written up to it.  A worker may run a
        # chunk after the main thread wrote later pieces; seeing their entries would make the stored bytes
        # depend on thread timing (one thread never sees them)
        st.seen = len(self._intra_todo)
        if mode == "colocated" and kp is not None:
            self._load_parent(st, pj)
        if n == 1:  # most tensors of a many-tensor model
            self._submit(st, 0, (0,) * len(grid))
        elif n == 0:
            self._finish_piece(st)
        else:  # (C order, as the columns)
            for i, coord in enumerate(itertools.product(*map(range, grid))):
                self._submit(st, i, coord)

    def _deltas_against(self, name: str, pt: TensorTable | None, dtype: np.dtype, shape: tuple, codec: str) -> bool:
        """Whether the parent's table ``pt`` has the piece's dtype and shape, so its chunks can be references.
        A float tensor that cannot be (the parent holds it in another dtype or shape, or not at all) is refused
        by a strict commit, and noted in its records (``retyped``) when the parent holds it (the commit warns of it)."""
        same = pt is not None and pt.dtype == dtype and pt.shape == shape
        if codec == ULPACK and not same:
            if self.strict:
                self._refuse_intra(name, pt, dtype, shape)
            if pt is not None:
                self._retyped[name] = ((tuple(pt.shape), pt.dtype), (shape, dtype))
        return same

    def _refuse_intra(self, name: str, pt: TensorTable | None, dtype: np.dtype, shape: tuple) -> None:
        """A strict (anchor=False) commit refuses a tensor that would need an intra-coded chunk."""
        why = "is new" if pt is None else f"changed from {pt.dtype}{list(pt.shape)} to {dtype}{list(shape)}"
        raise InvalidInputError(
            f"tensor {why}, which needs an intra-coded chunk, but anchor=False forbids it; "
            "commit with anchor=None or anchor=True",
            step=self.step,
            tensor=name,
        )

    def _default_chunks(self, pt: TensorTable | None, offset: tuple, pshape: tuple, dtype: np.dtype) -> tuple:
        """The chunks of the parent's piece at the same place (``pt``: the parent's table, same dtype and
        shape), else chosen from ``chunk_bytes``."""
        if pt is not None:
            for p in pt.pieces:
                if p.offset == offset and p.shape == pshape:
                    return p.chunks
        return choose_chunks(pshape, dtype.itemsize, self.chunk_bytes)

    def _against(self, pt: TensorTable | None, layout: tuple, codec: str) -> tuple[int | None, Piece | None, str]:
        """(index, piece) of the parent's piece of the same layout (``pt``: the parent's table, same dtype and
        shape) and what the piece's chunks are coded against: ``intra`` alone, ``colocated`` the parent's
        chunk at the same place, ``box`` the parent's values over the chunk's box (other pieces)."""
        pj = pt.find_piece(layout) if pt is not None else None
        pp = pt.pieces[pj] if pt is not None and pj is not None else None
        if codec != ULPACK or self.anchor or pt is None:
            return pj, pp, "intra"
        return pj, pp, "colocated" if pp is not None else "box"

    def _parent_table(self, name: str) -> TensorTable | None:
        """The parent's table of tensor ``name`` (None: the parent has no such tensor).  Each table block of the
        parent is looked up once and its tables kept by name (one lookup per tensor, not the reader's cache
        path: ~10,000 of them on a MoE step)."""
        if self.parent is None:
            return None
        t = self._parent_tables.get(name)
        if t is not None:
            return t
        if self._parent_doc is None:  # one document for every piece: the tables and the pack list agree
            self._parent_doc = self.reader.doc(self.parent)
        bi = self._parent_doc.table_for(name)
        if bi is None or bi in self._parent_blocks:
            return None
        self._parent_blocks.add(bi)
        self._parent_tables.update(self.reader.block_in(self._parent_doc, bi).tables())
        return self._parent_tables.get(name)

    def _index_intra(self, st: _PieceState) -> None:
        """Add the parent piece's intra entries (intra blobs and snapshots) to the dedup index."""
        pp = st.pp
        assert pp is not None
        has = pp.ref < 0
        if pp.snap is not None:
            has |= pp.snap[:, 0] >= 0
        at = np.flatnonzero(has)  # none when the parent is a delta without snapshots: nothing to look at
        if not len(at):
            return
        coords = pp.coords() if pp.n > 1 else [(0,) * len(pp.grid)]
        at_piece = self._intra_done  # (pieces are indexed in plan order: the first holder of a key stays)
        for i in at.tolist():
            intra = st.parent_snap(i) or st.parent_loc(i)
            key = (pp.content[i].tobytes(), None, st.codec, st.dtype.str, pp.region_shape(coords[i]))
            self._intra.setdefault(key, (at_piece, intra))

    def _intra_entry(self, key, seen: int) -> Location | None:
        """The parent's intra entry (blob or snapshot) for dedup key ``key`` among the first ``seen`` parent
        pieces written (a chunk's :attr:`_PieceState.seen`), whatever was written since."""
        if self._intra_done < seen:
            with self._intra_lock:
                todo = self._intra_todo
                while self._intra_done < len(todo):
                    self._index_intra(todo[self._intra_done])
                    self._intra_done += 1
        hit = self._intra.get(key)
        # the earliest holder is kept, so one past ``seen`` means no piece up to ``seen`` holds it
        return hit[1] if hit is not None and hit[0] < seen else None

    def _load_parent(self, st: _PieceState, pj) -> None:
        """Make the kept piece hold the parent's values where it does not yet (decodes each chain once)."""
        kp, pp = st.kp, st.pp
        assert kp is not None and pp is not None and self.parent is not None
        if kp.content.tobytes() == pp.content.tobytes():  # the usual case: the kept step is the parent
            return
        stale = np.flatnonzero((kp.content != pp.content).any(axis=1))
        if not len(stale):
            return
        coords = [tuple(int(x) for x in np.unravel_index(i, pp.grid)) if pp.grid else () for i in stale]
        targets = [((self.parent, st.name, pj, c), None, pp.region(c), kp, int(i)) for i, c in zip(stale, coords)]
        self.reader.settled(lambda: self.reader.materialize(targets, kept=self.kept))

    # -- the window -------------------------------------------------------------------

    def _submit(self, st: _PieceState, i: int, coord) -> None:
        if self._pool is None:
            self._place(st, i, self._job(st, i, coord, self))
            return
        # a job holds at most one chunk's worth of bytes (``chunk_bytes``, at most BATCH_BYTES), or one
        # larger chunk: the window's memory bound (its copies of memory-mapped chunks, its blobs) stays
        # what it was with one chunk per job
        if self._batch and self._batch_bytes + st.chunk_nbytes > min(BATCH_BYTES, self.chunk_bytes):
            self._send()
        self._batch.append((st, i, coord))
        self._batch_bytes += st.chunk_nbytes

    def _send(self) -> None:
        """Hand the chunks gathered so far to the pool as one job; keep at most ``2 * threads`` jobs in flight."""
        if not self._batch:
            return
        job = _Job(self._batch)
        self._batch, self._batch_bytes = [], 0
        job.future = self._pool.submit(self._jobs, job)  # type: ignore[union-attr]
        self._window.append(job)
        while len(self._window) >= 2 * self.threads:
            self._take()

    def _jobs(self, job: _Job) -> list:
        """Worker: the chunks of one batch, in order (one hand-off for many small chunks)."""
        run = self._job
        return [run(st, i, coord, job) for st, i, coord in job.chunks]

    def _take(self) -> None:
        job = self._window.popleft()
        place = self._place
        assert job.future is not None
        for (st, i, _), result in zip(job.chunks, job.future.result()):
            place(st, i, result)

    def _encode(self, chunk, ref, codec) -> bytes:
        if self.executor is None:
            return encode_chunk(chunk, ref, codec, self.sparse)
        return self.executor.submit(encode_chunk, chunk, ref, codec, self.sparse).result()

    def _job(self, st: _PieceState, i: int, coord, owner):
        """Worker: hash, reuse or encode one chunk; returns what the main thread places.

        ``owner``: the job this chunk is part of (the writer itself when chunks are done inline), which a
        blob's claim names."""
        region, chunk = _chunk_of(st, coord)
        shape = chunk.shape
        content = content_digest(chunk)
        pp, kp = st.pp, st.kp
        if pp is not None and pp.content[i].tobytes() == content:
            if not (self.anchor or self.snapshot) or pp.has_intra(i):
                if kp is not None:
                    kp.put(i, chunk, content)
                # an anchor's read cost is its own: an intra entry it reuses is decoded by its reads too
                return ("reuse", content, blob_cost(int(pp.length[i]), chunk.nbytes, INTRA) if self.anchor else 0)
        ref, ref_content = self._reference(st, i, coord, region)
        key = (content, ref_content, st.codec, st.dtype.str, shape)
        blob = self._blob(key, chunk, ref, st.codec, owner, st.seen)
        snap = None
        if self.snapshot and ref is not None:
            snap = self._blob((content, None, st.codec, st.dtype.str, shape), chunk, None, st.codec, owner, st.seen)
        if kp is not None:
            kp.put(i, chunk, content)
        return ("blob", content, key, blob, ref is not None, snap, self._cost(key, blob, chunk.nbytes))

    def _reference(self, st: _PieceState, i: int, coord, region) -> tuple[np.ndarray | None, bytes | None]:
        """Worker: the values chunk ``i`` is coded against and their content hash ((None, None): intra)."""
        if st.mode == "colocated":
            pp, kp = st.pp, st.kp
            assert pp is not None
            ref_content = pp.content[i].tobytes()
            ref = kp.get(i, ref_content) if kp is not None else None
            if ref is None:
                pj = st.pt.find_piece(st.layout)  # type: ignore[union-attr]
                ref = self.reader.chunk(self.parent, st.name, coord, pj, cache=False)  # type: ignore[arg-type]
            return ref, ref_content
        if st.mode == "box":
            lo = tuple(o + r.start for o, r in zip(st.offset, region))
            hi = tuple(o + r.stop for o, r in zip(st.offset, region))
            ref = self.reader.box(self.parent, st.name, lo, hi, cache=False)  # type: ignore[arg-type]
            return ref, content_digest(ref)
        return None, None

    def _blob(self, key, chunk, ref, codec, owner, seen: int):
        """The blob for ``key``: a known location, bytes this thread encoded, or None (another chunk's claim:
        an earlier chunk of this job, or another job's, whose results hold the bytes).  ``seen``: the parent
        pieces the chunk may dedup against (:meth:`_intra_entry`)."""
        if key[1] is None:
            loc = self._intra_entry(key, seen)
            if loc is not None:
                return loc
        claims = self._claims
        if claims.get(key) is not None or claims.setdefault(key, owner) is not owner:
            return None
        blob = self._encode(chunk, ref, codec)
        self._costs[key] = cost_of(blob, chunk.nbytes, ref is not None)
        return blob

    def _cost(self, key, blob, nbytes: int) -> int | None:
        """The modelled read cost (``_read_cost.py``) of the blob of ``key``: bytes this thread encoded, or an intra
        entry found in the parent (a location); None for a blob another chunk claimed (the main thread prices it
        when it places it: its encoder has set its cost by then)."""
        if isinstance(blob, tuple):
            return blob_cost(blob[2], nbytes, INTRA)
        return None if blob is None else self._costs[key]

    def _locate(self, key, got) -> Location:
        """Main thread: the location of the blob ``got`` stands for (appending it the first time)."""
        if isinstance(got, tuple):
            return got
        loc = self._placed.get(key)
        if loc is not None:
            return loc
        if got is None:
            got = self._claimed(key)
        loc = self.stream.append(got)
        self._placed[key] = loc
        self._claims[key] = _PLACED  # the bytes are in the pack: drop them
        return loc

    def _claimed(self, key) -> bytes:
        """The blob of ``key`` from the results of the job that claimed it (a later one in the window: waited for)."""
        owner = self._claims[key]
        assert isinstance(owner, _Job) and owner.future is not None
        for result in owner.future.result():
            if result[0] == "blob":
                if result[2] == key and isinstance(result[3], bytes):
                    return result[3]
                snap = result[5]
                if isinstance(snap, bytes) and key[1] is None and result[2][0] == key[0] and result[2][2:] == key[2:]:
                    return snap  # the snapshot (intra) blob of a delta-coded chunk
        raise AssertionError("a claimed blob is missing from its job's results")

    def _place(self, st: _PieceState, i: int, result) -> None:
        kind, content, cost = result[0], result[1], result[-1]
        st.content[i] = np.frombuffer(content, np.uint8)
        if kind == "reuse":
            assert st.pp is not None
            st.ref[i] = st.pp.ref[i]
            st.locs[i] = st.parent_loc(i)
            st.snaps[i] = st.parent_snap(i)
        else:
            _, _, key, blob, delta, snap, _ = result
            st.locs[i] = self._locate(key, blob)
            if cost is None:  # a blob another chunk encoded (placed now, so its cost is known)
                cost = self._costs[key]
            if delta:
                st.ref[i] = self.parent
            if snap is not None or (self.snapshot and delta):
                st.snaps[i] = self._locate((content, None, *key[2:]), snap)
        st.cost += cost
        st.left -= 1
        if st.left == 0:
            self._finish_piece(st)

    def _finish_piece(self, st: _PieceState) -> None:
        locs, snaps = st.locs, st.snaps
        snap = None
        if st.n == 1 and snaps[0] is None:  # most pieces of a many-tensor model: one blob, no snapshot
            pid, o, length = locs[0]
            packs: tuple = (pid,)
            cols = np.array((0, o, length), np.int64)
            pack, off, length = cols[0:1], cols[1:2], cols[2:3]
        else:
            ids: dict[str, int] = {}
            for loc in locs:
                ids.setdefault(loc[0], len(ids))
            if any(s is not None for s in snaps):
                for s in snaps:
                    if s is not None:
                        ids.setdefault(s[0], len(ids))
                snap = np.array([(ids[s[0]], s[1], s[2]) if s is not None else (-1, -1, -1) for s in snaps], np.int64)
            packs = tuple(ids)
            pack = np.array([ids[loc[0]] for loc in locs], np.int64)
            off = np.array([loc[1] for loc in locs], np.int64)
            length = np.array([loc[2] for loc in locs], np.int64)
        self._records.append(
            PieceRecord(
                self.step,
                self.parent,
                self.parent_content,
                self.anchor,
                st.name,
                st.dtype.name,
                st.shape,
                st.codec,
                st.offset,
                st.pshape,
                st.chunks,
                packs,
                st.content,
                st.ref,
                pack,
                off,
                length,
                snap,
                cost=st.cost,
                why=self.why,
                retyped=self._retyped.get(st.name),
            )
        )
        st.arr = None  # the caller's array is no longer needed

    # -- ending -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed or self._failed:
            raise InvalidInputError("this piece writer is closed (or failed); start a new one")

    def flush(self) -> list[PieceRecord]:
        """Wait for every chunk; returns the records of every piece written so far."""
        try:
            self._send()
            while self._window:
                self._take()
        except BaseException:
            self.abort()
            raise
        return list(self._records)

    def close(self) -> list[PieceRecord]:
        """Flush, close the pack stream; returns the records (hand them to :meth:`Trajectory.finalize`)."""
        records = self.flush()
        if not self.closed:
            self.stream.close()
            self._shutdown()
        return records

    def abort(self) -> None:
        """Give up: the open pack is discarded, closed packs stay as orphans for ``gc``."""
        self._failed = True
        for job in self._window:
            if job.future is not None:
                job.future.cancel()
        self._window.clear()
        self._batch.clear()
        self.stream.abort()
        self._shutdown()

    def _shutdown(self) -> None:
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> PieceWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()


def _chunk_of(st: _PieceState, coord) -> tuple[tuple[slice, ...], np.ndarray]:
    """The region of chunk ``coord`` of a piece and its values, C-contiguous in the chunk's shape (a private
    copy of a memory-mapped file's: it could change under us between the hash and the encode)."""
    if st.n == 1:  # a piece of one chunk (most tensors of a many-tensor model): no region to cut
        region = st.whole
        chunk = st.arr
    else:
        region = st.region(coord)
        chunk = st.arr[region] if region else st.arr
    if isinstance(chunk, np.memmap):
        chunk = np.array(chunk, copy=True, order="C")
    elif not chunk.flags.c_contiguous:
        chunk = np.ascontiguousarray(chunk)
    shape = tuple(s.stop - s.start for s in region)
    return region, chunk if chunk.shape == shape else chunk.reshape(shape)


#: dtype -> the codec its chunks take, for the dtypes seen committable (one check per dtype, not per tensor)
_CODEC_OF: dict[np.dtype, str] = {}


def _committable(array, name: str) -> tuple[np.dtype, str]:
    """The dtype of ``array`` and the codec its chunks take (DtypeError naming the tensor if none)."""
    dtype = array.dtype
    codec = _CODEC_OF.get(dtype)
    if codec is not None:
        return dtype, codec
    try:
        codec = check_committable(dtype)
    except DtypeError as e:
        raise DtypeError(e.message, tensor=name) from None
    _CODEC_OF[dtype] = codec
    return dtype, codec


def _placement(name: str, piece_shape, shape, offset) -> tuple[tuple, tuple, tuple]:
    """(piece shape, tensor shape, offset) of a piece, checked to lie inside its tensor (defaults: the whole)."""
    if shape is None and offset is None:  # the whole tensor (a commit's pieces): nothing to check
        pshape = tuple(map(int, piece_shape))
        return pshape, pshape, (0,) * len(pshape)
    pshape = tuple(int(n) for n in piece_shape)
    shape = pshape if shape is None else tuple(int(n) for n in shape)
    offset = (0,) * len(shape) if offset is None else tuple(int(o) for o in offset)
    if len(offset) != len(shape) or len(pshape) != len(shape):
        raise InvalidInputError(f"piece of rank {len(pshape)} at {offset} of a tensor of shape {shape}", tensor=name)
    if any(o < 0 or o + s > n for o, s, n in zip(offset, pshape, shape)):
        raise InvalidInputError(f"piece {pshape} at {list(offset)} lies outside {list(shape)}", tensor=name)
    return pshape, shape, offset


def _piece_chunks(name: str, chunks, pshape: tuple, dtype: np.dtype) -> tuple[int, ...]:
    """The chunk shape of a piece, checked; a chunk longer than its piece is cut to the piece's length
    (it holds the same elements)."""
    chunks = tuple(int(c) for c in chunks)
    if len(chunks) != len(pshape) or any(c < 1 for c in chunks):
        raise InvalidInputError(f"chunk shape {list(chunks)} does not fit a piece of rank {len(pshape)}", tensor=name)
    chunks = tuple(min(c, max(s, 1)) for c, s in zip(chunks, pshape))
    if chunk_nbytes(pshape, chunks, dtype.itemsize) > MAX_CHUNK_BYTES:
        raise InvalidInputError(f"chunks {list(chunks)} exceed {MAX_CHUNK_BYTES} bytes", tensor=name)
    return chunks
