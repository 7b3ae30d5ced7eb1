"""Reading a sync bucket: the authenticated version chain, packs, decoded and checked chunks.

Read me first
-------------
- Trust flows from ``latest.json`` backwards.  :meth:`BucketReader.chain` walks
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

from dataclasses import dataclass

import numpy as np

from ..codec import decode, decode_changes
from ..core.objects import ObjectStore
from ..core.sealed import address as blob_address
from ..errors import CorruptBlobError, CorruptManifestError, IntegrityError, NotFoundError
from ._arrays import chunk_hash
from ._documents import Entry, Latest, Layout, Manifest
from ._layout import ANCHORS_DIR, DELTA, LATEST, RAW, anchor_key, layout_key, parse_version_key, version_key
from ._workers import Workers

__all__ = ["BucketReader", "ChainBroken", "Decoded", "manifest_key"]


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


class BucketReader:
    """Fetch and validate the objects of one sync bucket: pointer, manifests, layouts, packs.

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
            raise CorruptManifestError(
                "manifest is not the one its successor (or latest.json) names", step=version, key=key
            )
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
                raise CorruptBlobError(
                    "pack does not match its address (damaged or truncated)", step=manifest.version, key=key
                )
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
                raise CorruptManifestError(
                    f"chunk entry names tensor #{e.tensor} of {len(layout.tensors)}",
                    step=manifest.version,
                    key=manifest_key(manifest),
                )
            spec = layout.tensors[e.tensor]
            if (
                e.chunk >= spec.n_chunks(layout.chunk_elems)
                or (e.tensor, e.chunk) in seen
                or (e.codec == RAW) == spec.is_float
            ):
                raise CorruptManifestError(
                    f"bad chunk entry {e.row()}", step=manifest.version, tensor=spec.name, key=manifest_key(manifest)
                )
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
                            f"blob decodes to {arr.dtype}[{arr.size}], expected {spec.dtype}[{stop - start}]"
                        )
                if chunk_hash(arr) != e.hash:
                    raise CorruptBlobError("decoded chunk fails the manifest's chunk hash")
            except IntegrityError as err:
                raise type(err)(
                    f"{err.message} (chunk {e.chunk})",
                    step=manifest.version,
                    tensor=spec.name,
                    key=manifest.packs[e.pack][0],
                ) from err
            return e, arr

        chunks = list(self.workers.compute.map(run, manifest.entries))
        return Decoded(manifest, layout, chunks, sum(len(p) for p in packs))


def manifest_key(m: Manifest) -> str:
    return anchor_key(m.version) if m.kind == "anchor" else version_key(m.version)
