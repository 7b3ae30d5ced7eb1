"""Decoding chunks of any step: manifests, reference chains, caches.

A chunk's blob is decoded against its reference chunk (the co-located chunk of
the step its manifest entry names), which is itself decoded the same way,
down to an intra blob.  :class:`ChunkReader` does that walk, checks every blob
against its address and every decoded chunk against its content hash, and
keeps

- manifests (immutable once written) in a dict,
- decoded chunks in an LRU under a byte budget, keyed by content hash, so a
  chunk shared by many steps (unchanged weights) is decoded once,
- one in-flight computation per key: concurrent readers of the same manifest
  or chunk wait for the first instead of fetching again.

Thread rules: every public method is thread-safe.  A thread that computes a
chunk recurses into its reference in the same thread; a thread only ever
waits on a computation that another thread is actively running, keyed by
manifest entry (never by content, which can repeat along a chain), and waits
go strictly down the (acyclic) ancestry, so waiting cannot deadlock.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections import OrderedDict

import numpy as np

from ..core.objects import ObjectStore
from ..errors import CorruptBlobError, CorruptManifestError, StepNotFoundError, TensorNotFoundError
from ._chunkcodec import blob_digest, content_digest, decode_chunk
from ._layout import blob_key, step_key
from ._manifest import Entry, Manifest, TensorManifest

__all__ = ["ChunkReader", "DEFAULT_CACHE_BYTES"]

DEFAULT_CACHE_BYTES = 256 << 20
_MAX_CHAIN = 1 << 16  # longer reference chains can only come from damaged manifests


class ChunkReader:
    """Read manifests and decoded chunks of a trajectory.

    Parameters
    ----------
    io : ObjectStore
    cache_bytes : int
        Budget of the decoded-chunk LRU cache.
    """

    def __init__(self, io: ObjectStore, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.io = io
        self.cache_bytes = int(cache_bytes)
        self._lock = threading.Lock()
        self._manifests: dict[int, Manifest] = {}
        self._chunks: OrderedDict = OrderedDict()  # (content, dtype, shape) -> ndarray, never modified
        self._cached = 0
        self._inflight: dict = {}

    # -- single-flight helper ---------------------------------------------------

    def _once(self, key, compute):
        """Run ``compute()`` once for concurrent callers asking for ``key``."""
        with self._lock:
            fut = self._inflight.get(key)
            owner = fut is None
            if owner:
                fut = self._inflight[key] = cf.Future()
        if not owner:
            return fut.result()
        try:
            value = compute()
        except BaseException as e:
            fut.set_exception(e)
            raise
        else:
            fut.set_result(value)
            return value
        finally:
            with self._lock:
                del self._inflight[key]

    # -- manifests --------------------------------------------------------------

    def manifest(self, step: int) -> Manifest:
        """The manifest of ``step``.

        Raises
        ------
        StepNotFoundError
        CorruptManifestError
        """
        m = self._manifests.get(step)
        if m is not None:
            return m

        def load():
            m = self._manifests.get(step)
            if m is not None:
                return m
            key = step_key(step)
            data = self.io.get(key)
            if data is None:
                raise StepNotFoundError("no such step", step=step, key=key)
            m = Manifest.from_bytes(data, key=key, step=step)
            self._manifests[step] = m
            return m

        return self._once(("manifest", step), load)

    def forget(self, steps=None) -> None:
        """Drop cached manifests (all, or of ``steps``): after a delete rewrote them."""
        with self._lock:
            if steps is None:
                self._manifests.clear()
            else:
                for s in steps:
                    self._manifests.pop(s, None)

    def tensor(self, step: int, name: str) -> TensorManifest:
        m = self.manifest(step)
        try:
            return m.tensors[name]
        except KeyError:
            raise TensorNotFoundError("no such tensor", step=step, tensor=name) from None

    # -- decoded chunks ---------------------------------------------------------

    def chunk(self, step: int, name: str, coord: tuple[int, ...]) -> np.ndarray:
        """Decoded chunk ``coord`` of tensor ``name`` at ``step``: unpadded, exact, shared (do not modify).

        Raises
        ------
        CorruptBlobError
            The blob (or one in its reference chain) is missing, altered, or
            decodes to a chunk that fails its content hash; ``key`` names the blob.
        CorruptManifestError
            A manifest's chunk table is inconsistent with its reference's.
        """
        return self._chunk(step, name, tuple(coord), 0)

    def _chunk(self, step, name, coord, depth):
        if depth > _MAX_CHAIN:
            raise CorruptManifestError("reference chain does not end (cycle?)", step=step, tensor=name)
        t = self.tensor(step, name)
        if len(coord) != len(t.shape) or any(not 0 <= i < g for i, g in zip(coord, t.grid)):
            raise IndexError(f"chunk {coord} is outside the chunk grid {t.grid} of {name!r}")
        e = t.entry(coord)
        shape = t.region_shape(coord)
        ckey = (e.content, t.dtype.str, shape)
        with self._lock:
            hit = self._chunks.get(ckey)
            if hit is not None:
                self._chunks.move_to_end(ckey)
                return hit
        # Single-flight by *entry*, not by content: equal contents can recur along a
        # chain (weights that flip back), and waiting on one's own content key would
        # deadlock.  An entry only ever waits on entries of strict ancestors of its
        # reference step, so waits cannot form a cycle.
        flight = ("chunk", name, coord, e.blob, e.ref)
        return self._once(flight, lambda: self._decode(step, name, t, e, coord, shape, ckey, depth))

    def _decode(self, step, name, t: TensorManifest, e: Entry, coord, shape, ckey, depth):
        with self._lock:
            hit = self._chunks.get(ckey)
            if hit is not None:
                return hit
        ref = None
        if e.ref is not None:
            if e.ref == step:
                raise CorruptManifestError("chunk is coded against itself", step=step, tensor=name)
            rt = self.tensor(e.ref, name)
            if rt.dtype != t.dtype or rt.shape != t.shape or rt.chunks != t.chunks:
                raise CorruptManifestError(
                    f"reference step {e.ref} holds {name!r} as {rt.dtype}{list(rt.shape)}, "
                    f"not {t.dtype}{list(t.shape)}",
                    step=step,
                    tensor=name,
                )
            ref = self._chunk(e.ref, name, coord, depth + 1)
        key = blob_key(e.blob)
        blob = self.io.get(key)
        if blob is None:
            raise CorruptBlobError("blob is missing", step=step, tensor=name, key=key)
        if blob_digest(blob) != e.blob:
            raise CorruptBlobError("blob bytes do not match their address", step=step, tensor=name, key=key)
        arr = decode_chunk(blob, ref, t.codec, t.dtype, shape, key=key)
        if content_digest(arr) != e.content:
            raise CorruptBlobError("decoded chunk fails its content hash", step=step, tensor=name, key=key)
        # Cached chunks are shared (they serve as references for later decodes) and
        # must never be modified; they are not flagged read-only only because the
        # compiled kernels take writable memoryviews of the reference.
        self.remember(ckey, arr)
        return arr

    def remember(self, ckey, arr: np.ndarray) -> None:
        """Put a decoded (or just committed) chunk in the LRU cache."""
        n = arr.nbytes
        if n > self.cache_bytes:
            return
        with self._lock:
            if ckey in self._chunks:
                self._chunks.move_to_end(ckey)
                return
            self._chunks[ckey] = arr
            self._cached += n
            while self._cached > self.cache_bytes:
                _, old = self._chunks.popitem(last=False)
                self._cached -= old.nbytes

    def clear_cache(self) -> None:
        """Drop every decoded chunk (manifests stay)."""
        with self._lock:
            self._chunks.clear()
            self._cached = 0

    # -- whole tensors ----------------------------------------------------------

    def read(self, step: int, names=None, *, threads: int | None = None) -> dict[str, np.ndarray]:
        """Decode whole tensors of ``step`` (all by default) into fresh arrays."""
        m = self.manifest(step)
        names = list(m.tensors) if names is None else list(names)
        out = {}
        jobs = []
        for name in names:
            t = self.tensor(step, name)
            out[name] = np.empty(t.shape, dtype=t.dtype)
            jobs += [(name, c) for c in t.coords()]

        def fill(job):
            name, coord = job
            t = m.tensors[name]
            out[name][t.region(coord)] = self.chunk(step, name, coord)

        threads = threads or min(32, os.cpu_count() or 1)
        if threads == 1 or len(jobs) <= 1:
            for j in jobs:
                fill(j)
        else:
            with cf.ThreadPoolExecutor(threads) as pool:
                list(pool.map(fill, jobs))
        return out
