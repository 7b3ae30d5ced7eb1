"""Step documents, table blocks, files and bytes of any step, with their caches: what decoding stands on.

:class:`TableReader` reads and checks what the store keeps about a step (its
document, its table blocks, its files) and fetches blobs in coalesced range
reads; :class:`~._chunk_reader.ChunkReader` adds the decoding.

Caches (all bounded): step documents (by count); parsed table blocks; and the
decoded-chunk LRU (keyed by content hash) that decode plans read and fill.

Round trips: a step document names its ancestors' table directories (its
``chain``), so :meth:`TableReader.prefetch` fetches the table blocks of a
tensor's whole reference chain in one parallel batch, and :meth:`fetch`
reads the ranges of different packs in parallel: a read of any step takes
the same few dependent requests whatever its depth (document, blocks, blobs).

Thread rules: every public method is thread-safe.  A thread waits on another
only for a step document or table block being loaded (leaves), never inside
a reference walk, so waits cannot form a cycle.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import threading

import numpy as np

from ...core.formatting import did_you_mean
from ...core.objects import MAX_DOCUMENT_BYTES, ObjectStore
from ...errors import (
    CorruptBlobError,
    CorruptManifestError,
    IntegrityError,
    StepNotFoundError,
    TensorNotFoundError,
)
from ..format._chunk_tables import TensorTable
from ..format._chunkcodec import digest, zstd_decompress
from ..format._layout import pack_key, step_key
from ..format._packs import Location, fetch, own_blob_range
from ..format._stepdoc import ChainStep, StepDoc
from ..format._table_block import Block, TableError, parse_block
from ._lru import _LRU

__all__ = ["TableReader", "DEFAULT_CACHE_BYTES"]

DEFAULT_CACHE_BYTES = 128 << 20
_TABLE_CACHE_BYTES = 256 << 20
#: Step documents kept (oldest read first out): a follower reads one per version, for days
_MAX_DOCS = 1 << 14


def _charge(length: int) -> int:
    """What a parsed table block of ``length`` stored bytes is charged in the cache: its columns and tables
    (a chunk's entry is about 20 stored bytes), and what its headers derive for the change feed."""
    return length * 16 + 1024


class _Flight:
    """A load under way in :meth:`TableReader._once`: ``done`` is held until its value or error is set.

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
#: Requests of one fetch in flight at once (different packs; S3 serves each range read on its own connection)
_IO_THREADS = 64
#: What one prefetch may add to the table block cache (charged as :func:`_charge`): the rest of a very long chain
#: of a large model is fetched when planned, rather than evicting the blocks the same read fetched first
_PREFETCH_CHARGE = _TABLE_CACHE_BYTES // 2


class TableReader:
    """Read step documents, table blocks, files and bytes of a trajectory (the decoding: :class:`ChunkReader`).

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
        self._io_pool: cf.ThreadPoolExecutor | None = None
        # step -> (its document, the blocks whose chain :meth:`prefetch_for` fetched already)
        self._chained: dict[int, tuple[StepDoc, set[int]]] = {}

    def _pool(self) -> cf.ThreadPoolExecutor:
        """The threads that run the requests of one fetch in parallel (made on first use; fetch jobs submit
        nothing, so callers on any thread, the pool's own included, never wait on each other)."""
        pool = self._io_pool
        if pool is None:
            with self._lock:
                if self._io_pool is None:
                    self._io_pool = cf.ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="ulstore-fetch")
                pool = self._io_pool
        return pool

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

    def stored_doc(self, step: int) -> StepDoc | None:
        """The step document of ``step`` as stored now (read past the cache, which it does not change), or None.

        What a writer checks a cached document against at its commit point: the
        parent it coded against, the document it is about to rewrite.
        """
        key = step_key(step)
        data = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
        return None if data is None else StepDoc.from_bytes(data, key=key, step=step)

    def accept_doc(self, step: int, data: bytes, parent: int, parent_content: str) -> StepDoc:
        """Check a step document received out of band; cache it if it was committed on ``parent`` (whose content
        checksum is ``parent_content``).  The one cached if the same document was read already.

        Raises CorruptManifestError (nothing cached) if it fails its checks or differs from the document of
        ``step`` read already.
        """
        key = step_key(step)
        d = StepDoc.from_bytes(data, key=key, step=step)
        if d.parent != parent or d.parent_content != parent_content:
            return d  # sound, but not linked to what the caller holds: not kept

        def keep() -> StepDoc:
            with self._lock:
                held = self._docs.get(step)
            if held is None:
                self.keep_doc(d)
                return d
            return held

        # as a load of the step's document: one that is under way (another thread's read) is waited for
        held = self._once(("doc", step), keep)
        if held is not d and held.to_bytes() != data:
            raise CorruptManifestError("differs from the step document already read", step=step, key=key)
        return held

    def keep_doc(self, d: StepDoc) -> None:
        """Cache a checked step document (the oldest cached goes beyond ``_MAX_DOCS``: read again if needed)."""
        with self._lock:
            self._docs[d.step] = d
            while len(self._docs) > _MAX_DOCS:
                del self._docs[next(iter(self._docs))]

    def forget(self, steps=None) -> None:
        """Drop cached step documents and tables (all, or of ``steps``): after they were rewritten."""
        with self._lock:
            self._chained.clear()  # (the blocks dropped below may be those a prefetch fetched for another step)
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

    def stored_tables(self, step: int) -> tuple[bytes, StepDoc, dict[str, TensorTable]] | None:
        """(raw document, document, tables) of ``step`` as stored now (the cache refreshed); None if it is gone.

        For scans that run beside other writers (gc, stats): a document
        rewritten by another process between the read of the document and of
        its tables (a repack moved them) is read again.
        """
        key = step_key(step)
        for attempt in range(3):
            raw = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
            if raw is None:
                return None
            d = StepDoc.from_bytes(raw, key=key, step=step)
            self.keep_doc(d)
            try:
                return raw, d, self.tables(step)
            except (CorruptBlobError, CorruptManifestError):
                if attempt == 2 or self.io.get(key, limit=MAX_DOCUMENT_BYTES) == raw:
                    raise
                self.forget([step])
        return None

    def cached_doc(self, step: int) -> StepDoc | None:
        """The document of ``step`` this reader holds, if any (no read)."""
        with self._lock:
            return self._docs.get(step)

    def forget_docs(self, steps=None) -> None:
        """Drop cached step documents (all, or of ``steps``) and nothing else: table blocks are cached by
        their hash, so a document read anew finds its blocks again unless they changed."""
        with self._lock:
            if steps is None:
                self._docs.clear()
            else:
                for s in steps:
                    self._docs.pop(s, None)

    def settled(self, read):
        """``read()``; once more, with every step document read anew, if it met damage (a missing pack...).

        A document read a while ago may name a pack that another process has
        since repacked or collected (after a delete of an ancestor, say): the
        stored documents name where the bytes are now.  A pack still missing
        then is damage (or the step is gone: StepNotFoundError).
        """
        try:
            return read()
        except IntegrityError:  # a missing pack, a reference to a step gone: stale documents, or damage
            self.forget_docs()
            return read()

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
        return self.block_in(self.doc(step), bi)

    def block_in(self, d: StepDoc | ChainStep, bi: int) -> Block:
        """Table block ``bi`` of the directory ``d``: a step document, or an ancestor's entry of one's chain."""
        cache_key = (d.step, d.content, d.tables[bi].hash)
        hit = self._blocks.get(cache_key)
        if hit is not None:
            return hit

        def load():
            ref = d.tables[bi]
            data = self.fetch([(d.packs[ref.pack], ref.offset, ref.length)])[0]
            block = self._parse_block(d.step, d, bi, data)
            self._blocks.put(cache_key, block, _charge(ref.length))
            return block

        return self._once(("block", cache_key), load)

    @staticmethod
    def _parse_block(step: int, d: StepDoc | ChainStep, bi: int, data) -> Block:
        ref = d.tables[bi]
        key = pack_key(d.packs[ref.pack])
        # an ancestor's directory comes from a descendant's document: say so (a wrong copy is damage there)
        where = " (as a descendant's step document lists it)" if isinstance(d, ChainStep) else ""
        if digest(data).hex() != ref.hash:
            raise CorruptManifestError(f"table block at byte {ref.offset}{where} fails its hash", step=step, key=key)
        try:
            block = parse_block(data, n_packs=len(d.packs))
        except TableError as e:
            raise CorruptManifestError(
                f"table block at byte {ref.offset}{where} is malformed: {e}", step=step, key=key
            ) from e
        names = list(block.specs())
        if not names or names[0] != ref.first or names[-1] != ref.last:
            raise CorruptManifestError(
                f"table block{where} holds other tensors than its directory says", step=step, key=key
            )
        return block

    def tensor(self, step: int, name: str, *, chain: bool = False) -> TensorTable:
        """The table of tensor ``name`` at ``step``: one step document and one table block.

        ``chain``: a read of the tensor's values follows: fetch the tensor's table blocks of the step's whole
        reference chain with it, in one parallel batch (:meth:`prefetch`).
        """
        if chain:
            self.prefetch_for(step, name)
        return self.table_in(self.doc(step), name)

    def table_in(self, d: StepDoc | ChainStep, name: str) -> TensorTable:
        """The table of tensor ``name`` in the directory ``d`` (a step document or a chain entry)."""
        bi = d.table_for(name)
        t = self.block_in(d, bi).tables().get(name) if bi is not None else None
        if t is None:
            raise TensorNotFoundError("no such tensor", step=d.step, tensor=name)
        return t

    def prefetch_for(self, step: int, name: str) -> None:
        """:meth:`prefetch` of tensor ``name`` of ``step``: once per table block of a step document (a full
        read plans thousands of tensors and each asks here: a long chain's look-ups repeated per tensor would
        cost more than the decoding)."""
        self.prefetch(step, (name,))

    def prefetch(self, step: int, names=None) -> None:
        """Fetch, in one parallel batch, the table blocks of ``step`` that hold tensors ``names`` (all: None)
        and the blocks of the ancestors its document's ``chain`` lists over the same tensor range, those not
        cached yet.

        Nothing but the step document is read before: the chain names every block's place and hash.  At
        most :data:`_PREFETCH_CHARGE` of cache is filled (nearest steps first); the rest is read when needed.
        Each block of the step is done once per document (the blocks it covers may leave the cache later:
        then they are read when needed).
        """
        d = self.doc(step)
        own = range(len(d.tables)) if names is None else {bi for bi in map(d.table_for, names) if bi is not None}
        with self._lock:
            held = self._chained.get(step)
            if held is None or held[0] is not d:  # (a document read anew: its chain may differ)
                held = self._chained[step] = (d, set())
                while len(self._chained) > _MAX_DOCS:
                    del self._chained[next(iter(self._chained))]
            todo = sorted(set(own) - held[1])
        if not todo:
            return
        self._prefetch_spans(d, [(d.tables[bi].first, d.tables[bi].last) for bi in todo])
        with self._lock:
            held[1].update(todo)

    def _prefetch_spans(self, d: StepDoc, spans: list[tuple[str, str]]) -> None:
        """The blocks of ``d`` and of its chain's entries whose tensor range meets one of ``spans``, in one batch."""
        wanted: dict[tuple, tuple[StepDoc | ChainStep, int]] = {}
        charge = 0
        dirs: list[StepDoc | ChainStep] = [d, *d.chain]
        for dd in dirs:
            rows: set[int] = set()
            for first, last in spans:
                lo = bisect.bisect_left(dd.tables, first, key=lambda t: t.last)
                rows.update(range(lo, bisect.bisect_right(dd.tables, last, key=lambda t: t.first)))
            for bi in sorted(rows):
                ref = dd.tables[bi]
                key = (dd.step, dd.content, ref.hash)
                if key in wanted or self._blocks.get(key) is not None:
                    continue
                charge += _charge(ref.length)
                if charge > _PREFETCH_CHARGE and wanted:
                    break
                wanted[key] = (dd, bi)
            if charge > _PREFETCH_CHARGE:
                break
        if not wanted:
            return
        items = list(wanted.items())
        datas = self.fetch(
            [(dd.packs[dd.tables[bi].pack], dd.tables[bi].offset, dd.tables[bi].length) for _, (dd, bi) in items]
        )
        for (key, (dd, bi)), data in zip(items, datas):
            self._blocks.put(key, self._parse_block(dd.step, dd, bi, data), _charge(dd.tables[bi].length))

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
        if pool is None and not self.io.local and len({loc[0] for loc in locations}) > 1:
            pool = self._pool()  # an object store: one round trip for all the packs (local disk: no latency to hide)
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
            files = sorted(d.files)
            shown = ", ".join(files[:8]) + (", ..." if len(files) > 8 else "")
            raise TensorNotFoundError(
                f"no file named {name!r}{did_you_mean(name, files)} ({f'files: {shown}' if files else 'no files'})",
                step=step,
            )
        key = pack_key(d.packs[f.pack])
        blob = self.fetch([(d.packs[f.pack], f.offset, f.length)])[0]
        try:
            data = zstd_decompress(blob, f.size, what="file blob")
        except Exception as e:
            raise CorruptBlobError(f"file {name!r} does not decode: {e}", step=step, key=key) from e
        if digest(data).hex() != f.hash:
            raise CorruptBlobError(f"file {name!r} fails its content hash", step=step, key=key)
        return data
