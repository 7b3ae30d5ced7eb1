"""Reading a sync store: the authenticated version chain, packs, and a replica kept in step.

Read me first
-------------
- Trust flows from ``latest.json`` backwards.  :meth:`StoreReader.chain` walks
  parent links from the latest version and checks every manifest's checksum
  against its successor's ``parent_checksum`` (and the newest one against the
  pointer), so a replica never applies a manifest that is not part of the
  chain the publisher committed.
- A version is applied in two phases: every chunk is fetched, decoded and
  checked first (pack address, ULPack CRC + reference + target checksums,
  and for whole chunks the manifest's chunk hash); only then is anything
  written.  A failure leaves the state exactly at the previous version.
- Deltas are applied by position: :func:`ulstore.decode_changes` yields the
  changed elements only, and the replica keeps each chunk's
  :func:`ulstore.content_sum`, so a SPARSE blob checks its reference in O(1)
  and its result in O(changes).  Delta chunks are therefore verified by
  ULPack's two 32-bit checksums rather than the manifest's CRC-32, which
  would mean reading the whole chunk.  Whether the kept sums stand in for
  hashing the reference chunk is the ``trust_state`` choice: trusted, writes
  to the state by anyone else go unnoticed until the next anchor.
- :class:`Replica` holds no policy: it raises.  :class:`~ulstore.sync.Follower`
  decides what to do (re-bootstrap, wait, report).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass

import numpy as np

from ..codec import Changes, content_sum, decode, decode_changes
from ..core.sealed import address as blob_address
from ..errors import CorruptBlobError, CorruptManifestError, IntegrityError, InvalidInputError, NotFoundError
from ._arrays import Binding, allocate, bind, chunk_hash
from ..core.objects import ObjectStore
from ._layout import (
    ANCHORS_DIR,
    DELTA,
    INTRA,
    LATEST,
    RAW,
    Entry,
    Latest,
    Layout,
    Manifest,
    anchor_key,
    layout_key,
    parse_version_key,
    version_key,
)

__all__ = ["Workers", "StoreReader", "Replica", "ChainBroken", "Decoded", "default_threads"]


class ChainBroken(Exception):
    """Internal: the chain from ``latest`` does not pass through the version we hold.

    ``far`` is True when the version may well be on the chain but further back
    than the caller wants to replay.
    """

    def __init__(self, message: str, far: bool = False):
        super().__init__(message)
        self.far = far


@dataclass
class Decoded:
    """A version's chunks, decoded and verified, ready to be written."""

    manifest: Manifest
    layout: Layout
    chunks: list  # [(Entry, whole flat chunk, or the Changes of a DELTA entry)]
    nbytes: int  # pack bytes downloaded


class Workers:
    """The thread pools of a publisher or follower.

    Three pools so that no task ever waits on a task queued behind it in its
    own pool: ``compute`` codes chunks (the ULPack kernels release the GIL),
    ``io`` runs single GETs/PUTs, ``prefetch`` runs whole-version downloads
    (which fan out their GETs to ``io``).
    """

    def __init__(self, threads: int | None, name: str):
        n = default_threads(threads)
        self.compute = cf.ThreadPoolExecutor(n, thread_name_prefix=f"{name}-compute")
        self.io = cf.ThreadPoolExecutor(max(8, 2 * n), thread_name_prefix=f"{name}-io")
        self.prefetch = cf.ThreadPoolExecutor(2, thread_name_prefix=f"{name}-prefetch")

    def close(self) -> None:
        for pool in (self.prefetch, self.io, self.compute):
            pool.shutdown(wait=True, cancel_futures=True)



class WorkerOwner:
    """Context-manager plumbing of an object that owns a :class:`Workers`."""

    _workers: Workers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Stop the worker threads (the store itself needs no closing)."""
        self._workers.close()

class StoreReader:
    """Fetch and validate the objects of one sync store.

    Parameters
    ----------
    bucket : ObjectStore
    workers : Workers
    """

    def __init__(self, bucket: ObjectStore, workers: Workers):
        self.bucket = bucket
        self.workers = workers
        self._layouts: dict[str, Layout] = {}

    # -- documents ------------------------------------------------------------------

    def latest(self) -> Latest | None:
        raw = self.bucket.get(LATEST)
        return None if raw is None else Latest.from_bytes(raw, LATEST)

    def manifest(self, version: int, checksum: str | None = None) -> Manifest:
        key = version_key(version)
        raw = self.bucket.get(key)
        if raw is None:
            raise NotFoundError("version manifest is missing", step=version, key=key)
        m = Manifest.from_bytes(raw, key, version=version)
        if checksum is not None and m.checksum != checksum:
            raise CorruptManifestError("manifest is not the one its successor (or latest.json) names", step=version, key=key)
        return m

    def anchor(self, version: int, checksum: str | None = None) -> Manifest:
        key = anchor_key(version)
        raw = self.bucket.get(key)
        if raw is None:
            raise NotFoundError("anchor manifest is missing", step=version, key=key)
        m = Manifest.from_bytes(raw, key, version=version, kind="anchor")
        if checksum is not None and m.checksum != checksum:
            raise CorruptManifestError("anchor is not the one latest.json names", step=version, key=key)
        return m

    def anchors(self) -> list[int]:
        """Versions with an anchor manifest, ascending (one LIST)."""
        found = (parse_version_key(k, ANCHORS_DIR) for k in self.bucket.list(ANCHORS_DIR))
        return sorted(v for v in found if v is not None)

    def layout(self, digest: str) -> Layout:
        if digest not in self._layouts:
            key = layout_key(digest)
            raw = self.bucket.get(key)
            if raw is None:
                raise NotFoundError("layout is missing", key=key)
            self._layouts[digest] = Layout.from_bytes(raw, key)
        return self._layouts[digest]

    def chain(self, latest: Latest, stop_at: int, limit: int | None = None) -> list[Manifest]:
        """Manifests ``[stop_at, ..., latest.version]`` along parent links, oldest first.

        Each one is checked against its successor's ``parent_checksum``.

        Raises
        ------
        ChainBroken
            The walk passes below ``stop_at`` without meeting it, or needs more
            than ``limit`` manifests.
        NotFoundError, CorruptManifestError
            A manifest on the way is missing or damaged.
        """
        out = []
        version, checksum = latest.version, latest.checksum
        while True:
            if limit is not None and len(out) > limit:
                raise ChainBroken(f"more than {limit} versions between {stop_at} and {latest.version}", far=True)
            m = self.manifest(version, checksum)
            out.append(m)
            if version == stop_at:
                return out[::-1]
            if m.parent is None or m.parent < stop_at:
                raise ChainBroken(f"version {stop_at} is not an ancestor of version {latest.version}")
            version, checksum = m.parent, m.parent_checksum

    # -- packs and chunks -----------------------------------------------------------

    def fetch_packs(self, manifest: Manifest) -> list[bytes]:
        """Download a manifest's packs in parallel and check each against its address and size."""
        def get(pack):
            key, size = pack
            raw = self.bucket.get(key)
            if raw is None:
                raise NotFoundError("pack is missing", step=manifest.version, key=key)
            if len(raw) != size or blob_address(raw) != key.rsplit("/", 1)[-1].split(".")[0]:
                raise CorruptBlobError("pack does not match its address (damaged or truncated)",
                                       step=manifest.version, key=key)
            return raw

        return list(self.workers.io.map(get, manifest.packs))

    def decode(self, manifest: Manifest, layout: Layout, packs: list[bytes], reference) -> Decoded:
        """Decode and verify every chunk of ``manifest``.

        ``reference(entry)`` returns the flat chunk the publisher coded a DELTA
        entry against (the replica's current bits) and its ``content_sum``
        (None: unknown).
        """
        seen = set()
        for e in manifest.entries:
            if e.tensor >= len(layout.tensors):
                raise CorruptManifestError(f"chunk entry names tensor #{e.tensor} of {len(layout.tensors)}",
                                           step=manifest.version, key=_mkey(manifest))
            spec = layout.tensors[e.tensor]
            if e.chunk >= spec.n_chunks(layout.chunk_elems) or (e.tensor, e.chunk) in seen or \
                    (e.codec == RAW) == spec.is_float:
                raise CorruptManifestError(f"bad chunk entry {e.row()}", step=manifest.version,
                                           tensor=spec.name, key=_mkey(manifest))
            seen.add((e.tensor, e.chunk))

        def run(e: Entry):
            spec = layout.tensors[e.tensor]
            start, stop = spec.chunk_range(e.chunk, layout.chunk_elems)
            blob = memoryview(packs[e.pack])[e.offset : e.offset + e.length]
            try:
                if e.codec == DELTA:
                    ref, ref_sum = reference(e)
                    changes = decode_changes(blob, ref, reference_sum=ref_sum)
                    if changes.values.dtype != spec.dtype:
                        raise CorruptBlobError(f"blob decodes to {changes.values.dtype}, expected {spec.dtype}")
                    return e, changes
                if e.codec == RAW:
                    want = (stop - start) * spec.dtype.itemsize
                    if e.length != want:
                        raise CorruptBlobError(f"raw chunk has {e.length} bytes, expected {want}")
                    arr = np.frombuffer(blob, dtype=spec.dtype).copy()
                else:
                    arr = decode(blob).reshape(-1)
                    if arr.dtype != spec.dtype or arr.size != stop - start:
                        raise CorruptBlobError(
                            f"blob decodes to {arr.dtype}[{arr.size}], expected {spec.dtype}[{stop - start}]")
                if chunk_hash(arr) != e.hash:
                    raise CorruptBlobError("decoded chunk fails the manifest's chunk hash")
            except IntegrityError as err:
                raise type(err)(f"{err.message} (chunk {e.chunk})", step=manifest.version, tensor=spec.name,
                                key=manifest.packs[e.pack][0]) from err
            return e, arr

        chunks = list(self.workers.compute.map(run, manifest.entries))
        return Decoded(manifest, layout, chunks, sum(len(p) for p in packs))


def _mkey(m: Manifest) -> str:
    return anchor_key(m.version) if m.kind == "anchor" else version_key(m.version)


class Replica:
    """A state dict held equal to one published version.

    Parameters
    ----------
    reader : StoreReader
    state : dict, optional
        The caller's tensors (numpy arrays or torch tensors, CPU or device),
        written in place.  Their names, shapes and dtypes must match the
        published ones.  None: the replica allocates numpy arrays.
    trust_state : bool
        Check delta references by the sums kept since each chunk was last
        written (O(1)) instead of hashing the chunk.  The sums are kept either
        way (:meth:`verify`).

    Attributes
    ----------
    version : int or None
        The version the state holds (None: not loaded, or left invalid).
    checksum : str or None
        That version's manifest checksum (the next version's ``parent_checksum``).
    """

    def __init__(self, reader: StoreReader, state=None, *, trust_state: bool = False):
        self.reader = reader
        self.trust_state = bool(trust_state)
        self.owned = state is None
        self.state = {} if state is None else state
        self.version: int | None = None
        self.checksum: str | None = None
        self.layout: Layout | None = None
        self.metadata: dict = {}
        self._bindings: dict[str, Binding] = {}
        self._sums: dict[tuple[str, int], int] = {}  # (tensor, chunk) -> content_sum of the held bits

    # -- what the publisher codes against ---------------------------------------------

    def flat(self, name: str) -> np.ndarray:
        """The host bits of tensor ``name`` (flat)."""
        return self._bindings[name].mirror

    def _reference(self, layout: Layout):
        def ref(e: Entry):
            spec = layout.tensors[e.tensor]
            b = self._bindings.get(spec.name)
            cur = self.layout.tensors[self.layout.index[spec.name]] if b is not None else None
            if cur != spec:
                raise CorruptManifestError("delta chunk for a tensor the parent version does not hold as "
                                           f"{spec.dtype}{list(spec.shape)}", tensor=spec.name)
            start, stop = spec.chunk_range(e.chunk, layout.chunk_elems)
            return b.mirror[start:stop], self._sums.get((spec.name, e.chunk)) if self.trust_state else None
        return ref

    # -- loading ----------------------------------------------------------------------

    def load_anchor(self, anchor: Manifest, version: Manifest) -> int:
        """Replace the whole state with anchor ``anchor`` (of version manifest ``version``).

        Returns the number of pack bytes downloaded.
        """
        if anchor.version_checksum != version.checksum:
            raise CorruptManifestError("anchor does not belong to this version's manifest",
                                       step=anchor.version, key=anchor_key(anchor.version))
        layout = self.reader.layout(anchor.layout)
        if version.layout != anchor.layout:
            raise CorruptManifestError("anchor and version manifest name different layouts",
                                       step=anchor.version, key=anchor_key(anchor.version))
        covered = {(e.tensor, e.chunk) for e in anchor.entries}
        expected = {(i, c) for i, t in enumerate(layout.tensors) for c in range(t.n_chunks(layout.chunk_elems))}
        if covered != expected:
            raise CorruptManifestError("anchor does not cover every chunk of the state",
                                       step=anchor.version, key=anchor_key(anchor.version))
        decoded = self.reader.decode(anchor, layout, self.reader.fetch_packs(anchor), None)
        self._rebind(layout)
        self._write(decoded, version)
        return decoded.nbytes

    def fetch(self, manifest: Manifest) -> tuple[Manifest, list[bytes]]:
        """Download (and check) a delta's packs; nothing is decoded or written."""
        return manifest, self.reader.fetch_packs(manifest)

    def apply(self, manifest: Manifest, packs: list[bytes] | None = None) -> int:
        """Apply delta ``manifest``, the child of the version held; returns pack bytes downloaded."""
        if manifest.kind != "delta":
            raise InvalidInputError(f"version {manifest.version} is a {manifest.kind}, not a delta")
        if self.version is None or manifest.parent != self.version or manifest.parent_checksum != self.checksum:
            raise ChainBroken(f"version {manifest.version} does not follow version {self.version}")
        layout = self.reader.layout(manifest.layout)
        if packs is None:
            packs = self.reader.fetch_packs(manifest)
        decoded = self.reader.decode(manifest, layout, packs, self._reference(layout))
        if layout != self.layout:
            self._check_new_tensors(decoded)
            self._rebind(layout)
        self._write(decoded, manifest)
        return decoded.nbytes

    def _check_new_tensors(self, decoded: Decoded) -> None:
        """Tensors new in this layout (or reshaped) must arrive whole, intra-coded."""
        layout = decoded.layout
        have = {(e.tensor, e.chunk) for e, _ in decoded.chunks if e.codec in (INTRA, RAW)}
        for i, spec in enumerate(layout.tensors):
            old = self.layout.tensors[self.layout.index[spec.name]] if spec.name in self.layout.index else None
            if old != spec and any((i, c) not in have for c in range(spec.n_chunks(layout.chunk_elems))):
                raise CorruptManifestError("new or reshaped tensor is not sent whole", step=decoded.manifest.version,
                                           tensor=spec.name, key=_mkey(decoded.manifest))

    def _rebind(self, layout: Layout) -> None:
        """Point bindings at ``layout``'s tensors (allocating or checking the caller's)."""
        names = [t.name for t in layout.tensors]
        if not self.owned:
            missing = [n for n in names if n not in self.state]
            extra = [n for n in self.state if n not in layout.index]
            if missing or extra:
                raise InvalidInputError(
                    f"the state dict does not match the published tensors: missing {missing[:5]}"
                    f"{'...' if len(missing) > 5 else ''}, not published {extra[:5]}{'...' if len(extra) > 5 else ''}")
        bindings = {}
        for spec in layout.tensors:
            old = self.layout.tensors[self.layout.index[spec.name]] \
                if self.layout is not None and spec.name in self.layout.index else None
            if old == spec and spec.name in self._bindings:
                bindings[spec.name] = self._bindings[spec.name]
            elif self.owned:
                self.state[spec.name], bindings[spec.name] = allocate(spec)
            else:
                bindings[spec.name] = bind(spec, self.state[spec.name])
        if self.owned:
            for name in [n for n in self.state if n not in layout.index]:
                del self.state[name]
        same_chunks = self.layout is not None and self.layout.chunk_elems == layout.chunk_elems
        self._sums = {key: v for key, v in self._sums.items()
                      if same_chunks and key[0] in bindings and bindings[key[0]] is self._bindings.get(key[0])}
        self._bindings = bindings
        self.layout = layout

    def _write(self, decoded: Decoded, version: Manifest) -> None:
        """Phase 2: every chunk verified; write them all, then record the version."""
        self.version = None  # the state is in flux until every chunk is written
        try:
            for e, item in decoded.chunks:
                spec = decoded.layout.tensors[e.tensor]
                start, stop = spec.chunk_range(e.chunk, decoded.layout.chunk_elems)
                if isinstance(item, Changes):
                    self._bindings[spec.name].apply(start, stop, item)
                    self._sums[spec.name, e.chunk] = item.content_sum
                else:
                    self._bindings[spec.name].write(start, item)
                    if spec.is_float:  # trusted: the next delta checks its reference by this sum; and verify()
                        self._sums[spec.name, e.chunk] = content_sum(item)
        except BaseException:
            self.invalidate()  # part of a version is written: only a bootstrap makes the state whole again
            raise
        self.version, self.checksum, self.metadata = version.version, version.checksum, dict(version.metadata)

    def verify(self) -> list[str]:
        """The float chunks whose host bits differ from what was last written: ``["name[chunk]", ...]``."""
        layout = self.layout
        jobs = [(spec, c) for spec in layout.tensors if spec.is_float for c in range(spec.n_chunks(layout.chunk_elems))]

        def differs(job) -> bool:
            spec, c = job
            start, stop = spec.chunk_range(c, layout.chunk_elems)
            return content_sum(self._bindings[spec.name].mirror[start:stop]) != self._sums.get((spec.name, c))

        return [f"{spec.name}[{c}]" for (spec, c), bad in zip(jobs, self.reader.workers.compute.map(differs, jobs)) if bad]

    def invalidate(self) -> None:
        self.version = self.checksum = None
        self._sums.clear()


def default_threads(threads: int | None) -> int:
    return max(1, int(threads)) if threads else max(2, os.cpu_count() or 1)
