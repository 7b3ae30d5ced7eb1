"""The steps of one publish: snapshot the state, code the chunks that changed, upload packs, advance.

:class:`~ulstore.sync.Publisher` decides *what* a version is (delta, anchor,
reset) and in which order objects are written; these are its mechanics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from ..codec import encode
from ..core.sealed import address as blob_address
from ..errors import IntegrityError, InvalidInputError, NotFoundError
from ._arrays import chunk_hash, host_array, words
from ._documents import Entry, Layout, TensorSpec
from ._layout import DELTA, INTRA, RAW, dtype_from_name, dtype_name, layout_key, pack_key
from ._reader import ChainBroken
from ._replica import Replica

__all__ = ["PublishSteps"]

log = logging.getLogger("ulstore.sync")


class PublishSteps:
    """The chunk-level steps of :class:`~ulstore.sync.Publisher` (a mixin: the state is the publisher's)."""

    def _snapshot(self, state: Mapping, skip: set):
        """Host arrays of the tensors to examine, the new layout, and how many were skipped."""
        hosts: dict[str, np.ndarray | None] = {}
        specs = []
        old = {t.name: t for t in self._layout.tensors} if self._layout is not None else {}
        skipped = 0
        for name, value in state.items():
            if not isinstance(name, str):
                raise InvalidInputError(f"tensor names must be str, got {name!r}")
            prev = old.get(name)
            if name in skip and prev is not None and tuple(getattr(value, "shape", ())) == prev.shape:
                hosts[name] = None  # known unchanged: no device-to-host copy, no comparison
                specs.append(prev)
                skipped += 1
                continue
            arr = host_array(name, value)
            hosts[name] = arr
            specs.append(TensorSpec(name, dtype_from_name(dtype_name(arr.dtype)), tuple(arr.shape)))
        return hosts, Layout(self.chunk_elems, tuple(specs)), skipped

    def _chunks(self, layout: Layout, hosts: dict):
        for i, spec in enumerate(layout.tensors):
            if hosts[spec.name] is None:
                continue
            flat = hosts[spec.name].reshape(-1)
            for c in range(spec.n_chunks(layout.chunk_elems)):
                start, stop = spec.chunk_range(c, layout.chunk_elems)
                yield i, c, spec, flat[start:stop]

    def _code_delta(self, layout: Layout, hosts: dict) -> list:
        """``[(tensor, chunk, codec, blob, hash, start, values)]`` for every chunk that differs."""
        old = {t.name: t for t in self._layout.tensors}

        def job(item):
            i, c, spec, x = item
            same = old.get(spec.name) == spec
            if same:
                start, stop = spec.chunk_range(c, layout.chunk_elems)
                r = self._ref[spec.name][start:stop]
                if np.array_equal(words(x), words(r)):  # bits, never float ==
                    return None
            else:
                r = None
            if not spec.is_float:
                codec, blob = RAW, x.tobytes()
            elif r is not None:
                codec, blob = DELTA, encode(x, r, sparse=self.sparse)
            else:  # a new or reshaped tensor starts a new chain
                codec, blob = INTRA, encode(x)
            return i, c, codec, blob, chunk_hash(x), spec.chunk_range(c, layout.chunk_elems)[0], x

        return [r for r in self._workers.compute.map(job, self._chunks(layout, hosts)) if r is not None]

    def _code_anchor(self, layout: Layout, hosts: dict) -> list:
        def job(item):
            i, c, spec, x = item
            codec, blob = (INTRA, encode(x)) if spec.is_float else (RAW, x.tobytes())
            return i, c, codec, blob, chunk_hash(x), None, None

        return list(self._workers.compute.map(job, self._chunks(layout, hosts)))

    def _count_detector_misses(self, layout: Layout, delta: list, claimed: set) -> None:
        missed = sorted({layout.tensors[i].name for i, *_ in delta} & claimed)
        if missed:
            self.stats["detector_misses"] += len(missed)
            log.warning(
                "version anchors found %d tensor(s) the change detector reported unchanged but which "
                "changed (modified outside optimizer.step()?): %s",
                len(missed),
                missed[:5],
            )

    def _put_layout(self, layout: Layout) -> None:
        digest = layout.digest
        if digest not in self._layouts_written:
            self._bucket.put(layout_key(digest), layout.to_bytes())
            self._layouts_written.add(digest)

    def _put_packs(self, coded: list):
        """Group blobs into packs of at most ``pack_bytes``, upload them in parallel."""
        packs: list[bytearray] = []
        entries = []
        for i, c, codec, blob, h, _, _ in coded:
            if not packs or (len(packs[-1]) and len(packs[-1]) + len(blob) > self.pack_bytes):
                packs.append(bytearray())
            entries.append(Entry(i, c, codec, len(packs) - 1, len(packs[-1]), len(blob), h))
            packs[-1] += blob
        keyed = [(pack_key(blob_address(p)), bytes(p)) for p in packs]
        list(self._workers.io.map(lambda kv: self._bucket.put(*kv), keyed))
        return [(k, len(p)) for k, p in keyed], entries, sum(len(p) for p in packs)

    def _advance(self, layout: Layout, hosts: dict, delta: list | None) -> None:
        """Make the published state the reference of the next delta (copies: the caller's arrays move on)."""
        ref = {}
        old = {t.name: t for t in self._layout.tensors} if self._layout is not None else {}
        for spec in layout.tensors:
            if delta is not None and old.get(spec.name) == spec:
                ref[spec.name] = self._ref[spec.name]
            else:
                ref[spec.name] = hosts[spec.name].reshape(-1).copy()
        if delta is not None:
            for i, _c, _codec, _blob, _h, start, x in delta:
                name = layout.tensors[i].name
                if old.get(name) == layout.tensors[i]:
                    ref[name][start : start + x.size] = x
        self._ref, self._layout = ref, layout

    def _load_reference(self) -> None:
        """Resume: load the latest published state from the store, once, to code the next delta against it."""
        if self._loaded:
            return
        self._loaded = True
        if self._latest is None or not self.resume:
            return
        latest = self._latest
        try:
            chain = self._reader.chain(latest, latest.anchor)
            replica = Replica(self._reader)
            replica.load_anchor(self._reader.anchor(latest.anchor, latest.anchor_checksum), chain[0])
            for m in chain[1:]:
                if m.kind == "reset":  # cannot happen after the newest anchor, but be strict
                    raise ChainBroken(f"reset at version {m.version} after anchor {latest.anchor}")
                replica.apply(m)
        except (IntegrityError, NotFoundError, ChainBroken, InvalidInputError) as e:
            log.warning(
                "cannot resume from version %d of %s (%s); the next version will be a reset anchor",
                latest.version,
                self.url,
                e,
            )
            return
        self._layout = replica.layout
        self._ref = {t.name: replica.flat(t.name) for t in replica.layout.tensors}
        self._since_anchor = len(chain) - 1
        self._layouts_written.add(replica.layout.digest)
        log.info("resumed %s at version %d (anchor %d)", self.url, latest.version, latest.anchor)
