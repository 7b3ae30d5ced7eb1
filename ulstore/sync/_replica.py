"""A replica: a state dict held equal to one published version, updated in place.

Reading and checking the bucket's objects is :class:`~._reader.BucketReader`'s
job; this module writes what it decoded, only once all of a version checked.
:class:`Replica` holds no policy: it raises.  :class:`~ulstore.sync.Follower`
decides what to do (re-bootstrap, wait, report).
"""

from __future__ import annotations

import numpy as np

from ..codec import Changes, content_sum
from ..errors import CorruptManifestError, InvalidInputError
from ._arrays import Binding, allocate, bind
from ._documents import Entry, Layout, Manifest
from ._layout import INTRA, RAW, anchor_key
from ._reader import BucketReader, ChainBroken, Decoded, manifest_key

__all__ = ["Replica"]


class Replica:
    """A state dict held equal to one published version.

    Parameters
    ----------
    reader : BucketReader
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

    def __init__(self, reader: BucketReader, state=None, *, trust_state: bool = False):
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
                raise CorruptManifestError(
                    f"delta chunk for a tensor the parent version does not hold as {spec.dtype}{list(spec.shape)}",
                    tensor=spec.name,
                )
            start, stop = spec.chunk_range(e.chunk, layout.chunk_elems)
            return b.mirror[start:stop], self._sums.get((spec.name, e.chunk)) if self.trust_state else None

        return ref

    # -- loading ----------------------------------------------------------------------

    def load_anchor(self, anchor: Manifest, version: Manifest) -> int:
        """Replace the whole state with anchor ``anchor`` (of version manifest ``version``).

        Returns the number of pack bytes downloaded.
        """
        if anchor.version_checksum != version.checksum:
            raise CorruptManifestError(
                "anchor does not belong to this version's manifest", step=anchor.version, key=anchor_key(anchor.version)
            )
        layout = self.reader.layout(anchor.layout)
        if version.layout != anchor.layout:
            raise CorruptManifestError(
                "anchor and version manifest name different layouts",
                step=anchor.version,
                key=anchor_key(anchor.version),
            )
        covered = {(e.tensor, e.chunk) for e in anchor.entries}
        expected = {(i, c) for i, t in enumerate(layout.tensors) for c in range(t.n_chunks(layout.chunk_elems))}
        if covered != expected:
            raise CorruptManifestError(
                "anchor does not cover every chunk of the state", step=anchor.version, key=anchor_key(anchor.version)
            )
        decoded = self.reader.decode(anchor, layout, self.reader.fetch_packs(anchor), None)
        self._rebind(layout)
        self._write(decoded, version)
        return decoded.nbytes

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
                raise CorruptManifestError(
                    "new or reshaped tensor is not sent whole",
                    step=decoded.manifest.version,
                    tensor=spec.name,
                    key=manifest_key(decoded.manifest),
                )

    def _rebind(self, layout: Layout) -> None:
        """Point bindings at ``layout``'s tensors (allocating or checking the caller's)."""
        names = [t.name for t in layout.tensors]
        if not self.owned:
            missing = [n for n in names if n not in self.state]
            extra = [n for n in self.state if n not in layout.index]
            if missing or extra:
                raise InvalidInputError(
                    f"the state dict does not match the published tensors: missing {missing[:5]}"
                    f"{'...' if len(missing) > 5 else ''}, not published {extra[:5]}{'...' if len(extra) > 5 else ''}"
                )
        bindings = {}
        for spec in layout.tensors:
            old = (
                self.layout.tensors[self.layout.index[spec.name]]
                if self.layout is not None and spec.name in self.layout.index
                else None
            )
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
        self._sums = {
            key: v
            for key, v in self._sums.items()
            if same_chunks and key[0] in bindings and bindings[key[0]] is self._bindings.get(key[0])
        }
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

        return [
            f"{spec.name}[{c}]" for (spec, c), bad in zip(jobs, self.reader.workers.compute.map(differs, jobs)) if bad
        ]

    def invalidate(self) -> None:
        self.version = self.checksum = None
        self._sums.clear()
