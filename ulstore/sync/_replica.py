"""A replica: a state dict held equal to one step of a trajectory, updated in place from the change feed.

:class:`Replica` holds no policy: it raises.  :class:`~ulstore.sync.Follower`
decides what to do (re-bootstrap, wait, report).  Every version is applied all
or nothing: (1) fetch and decode every changed chunk that is not a contiguous
SPARSE delta, checking each one (ULPack checksums; whole chunks also against
the store's BLAKE3 content hash); (2) apply the SPARSE deltas in place with
:func:`~ulstore.codec.apply_sparse` (each chunk written once it
verifies, every write undone if any chunk fails); (3) write the rest.
"""

from __future__ import annotations

import math

import numpy as np

from ..codec import Applied, Changes, apply_sparse, content_sum, decode_changes
from ..errors import CorruptBlobError, CorruptManifestError, IntegrityError, InvalidInputError, UlstoreError
from ..store import codec_for, content_digest, decode_chunk
from ._arrays import Binding, Spec, allocate, bind, geometry
from ._fetch import Fetched
from ._in_place import InPlace

__all__ = ["Replica", "ChainBroken"]

Key = tuple  # (tensor name, piece index, chunk coordinate)


class ChainBroken(UlstoreError):
    """The step to apply does not follow the step held (or is too far ahead: ``far``)."""

    def __init__(self, message: str, *, far: bool = False):
        super().__init__(message)
        self.far = far


class Replica(InPlace):
    """A state dict held equal to one step.

    Parameters
    ----------
    state : dict, optional
        The caller's tensors (numpy arrays or torch tensors, CPU or device),
        written in place; names, shapes and dtypes must match the published
        ones.  None: the replica allocates numpy arrays.
    pool : concurrent.futures.Executor
        Where chunks are decoded (the ULPack kernels release the GIL).
    names : frozenset, optional
        The tensors to hold (a replica of part of a model); None: all.

    Attributes
    ----------
    version : int or None
        The step the state holds (None: not loaded, or left invalid).
    content : str or None
        That step's content checksum (the next step's ``parent_content``).
    """

    def __init__(self, state=None, *, pool=None, threads: int = 1, names: frozenset | None = None) -> None:
        self.names = names  # the tensors this replica holds (None: all)
        self.owned = state is None
        self.state = {} if state is None else state
        self.pool = pool
        self.threads = threads  # compiled calls that apply a version's SPARSE deltas side by side
        self.version: int | None = None
        self.content: str | None = None
        self.metadata: dict = {}
        self.specs: dict[str, Spec] = {}
        self._bindings: dict[str, Binding] = {}
        self._contents: dict[Key, tuple] = {}  # (BLAKE3 hex, start, stop) of each chunk held, from the tables
        self._sums: dict[Key, int] = {}  # content_sum of each float chunk held (O(1) reference checks)
        self._buffers: dict = {}  # apply_sparse's outputs, reused from version to version
        self._slots: dict[Key, tuple] = {}  # Replica._slot of each chunk applied in place (until the next rebind)
        self._sizes: dict[Key, int] | None = None  # chunk_bytes(), while the chunks held keep their boxes
        self._applied_specs: dict | None = None  # the Fetched.specs the step held was written with
        self._layout = None  # the FeedLayout of the step held (applied from change columns, or loaded whole)
        self._rows: list | None = None  # Replica._layout_rows, while the layout and bindings stay
        self._rows_dtypes: dict = {}  # the dtypes of _rows' chunks, in order

    def flat(self, name: str) -> np.ndarray:
        """The host bits of tensor ``name`` (flat)."""
        return self._bindings[name].mirror

    def _map(self, fn, items):
        return list(self.pool.map(fn, items)) if self.pool is not None and len(items) > 1 else [fn(x) for x in items]

    # -- phase 1 + 2 --------------------------------------------------------------------

    def load(self, f: Fetched) -> int:
        """Replace the whole state with a self-contained step (anchor or snapshot); returns bytes fetched."""
        decoded = self._map(lambda cb: self._whole(f, *cb), list(zip(f.changes, f.blobs)))
        self._rebind(f.specs, fresh=True)
        self._write(f, decoded, fresh=True)
        self._reserve()
        self._prime_slots()
        if self._layout is not None:  # the next version's columns carry this layout: its rows made now
            self._layout_rows(self._layout)
        return f.nbytes

    def apply(self, f: Fetched) -> int:
        """Apply step ``f.info.step``, a child of the step held; returns bytes fetched."""
        info = f.info
        if self.version is None or info.parent != self.version or info.parent_content != self.content:
            raise ChainBroken(f"step {info.step} does not follow step {self.version}")
        # the usual step (every changed chunk a SPARSE delta against the step held, in its layout): planned from
        # the change columns, written by one compiled job, with no object per chunk
        planned = self._column_groups(f) if f.columns is not None else None
        if planned is None:
            return self._apply_feed(f)
        plans, stores, order = self._plans(planned[1])
        out = apply_sparse(plans, pool=self.pool, parts=self.threads, buffers=stores)
        if out is None:
            return self._apply_feed(f)
        self._record_columns(f, planned[0], dict(zip(order, out)))
        return f.nbytes

    def _apply_feed(self, f: Fetched) -> int:
        """:meth:`apply` from the change feed: any mix of chunks (whole, deltas; tensors added or reshaped)."""
        changed = [c for c in f.changes if c.kind != "unchanged"]
        same = f.specs is self._applied_specs
        respecced = self._check_deltas(f, changed)
        respec = not same and (bool(respecced) or f.specs.keys() != self.specs.keys())
        items = list(zip(changed, f.blobs))
        groups = {} if respec else self._in_place(items)
        fast = [i for group in groups.values() for i in group[0]]
        decoded: list = [None] * len(items)
        skip = set(fast)
        rest = [i for i in range(len(items)) if i not in skip]
        run = self._decoder(f)
        for i, item in zip(rest, self._map(run, [items[i] for i in rest])):  # verified, nothing written yet
            decoded[i] = item
        if fast:
            applied = self._apply_sparse(groups)
            if applied is None:  # nothing was written: decode them one by one, for the precise error
                applied = dict(zip(fast, self._map(run, [items[i] for i in fast])))
            for i, item in applied.items():
                decoded[i] = item
        try:
            if respec:
                self._rebind(f.specs, fresh=False)
        except BaseException:
            if fast:  # in-place deltas are written: the state is not the version held any more
                self.invalidate()
            raise
        self._write(f, decoded, fresh=False)
        return f.nbytes

    def _check_deltas(self, f: Fetched, changed: list) -> set:
        """The tensors whose name, shape or dtype the held step does not have (only whole chunks may write them;
        none if ``f.specs`` is the very dict the held step was applied with); raises if a delta writes one, or
        is coded against another step."""
        same = f.specs is self._applied_specs
        respecced = set() if same else {n for n, spec in f.specs.items() if self.specs.get(n) != spec}
        for c in changed:
            if c.kind != "delta":
                continue
            if c.ref != self.version:
                raise ChainBroken(f"chunk {c.coord} of {c.tensor!r} is coded against step {c.ref}, not {self.version}")
            if c.tensor in respecced or c.tensor not in f.specs:
                raise CorruptManifestError("a delta of a tensor the held step does not hold", tensor=c.tensor)
        if respecced:
            for c in f.changes:
                if c.kind in ("unchanged", "delta") and c.tensor in respecced:
                    raise CorruptManifestError("a new or reshaped tensor is not sent whole", tensor=c.tensor)
        return respecced

    def _decoder(self, f: Fetched):
        """Decode and check one ``(change, blob)`` of ``f`` (nothing written): Changes of a delta, else the chunk."""

        def run(cb):
            c, blob = cb
            return self._delta(f, c, blob) if c.kind == "delta" else self._whole(f, c, blob)

        return run

    def _kept_sum(self, c) -> int | None:
        """The word sum kept for the held values of chunk ``c``'s box (None: none kept, or the key held another
        box: the tensor was chunked differently in the held step)."""
        key = (c.tensor, c.piece, c.coord)
        held = self._contents.get(key)
        if held is None or held[1] != c.start or held[2] != c.stop:
            return None
        return self._sums.get(key)

    def _whole(self, f: Fetched, c, blob) -> np.ndarray:
        box = tuple(b - a for a, b in zip(c.start, c.stop))
        loc = c.snapshot if f.snapshot and c.snapshot is not None else c.blob
        arr = decode_chunk(blob, None, codec_for(c.dtype), c.dtype, box, key=f"packs/{loc[0]}.pack")
        if content_digest(arr).hex() != c.content:
            raise CorruptBlobError(
                f"chunk {c.coord} decodes to values that fail its content hash",
                step=f.info.step,
                tensor=c.tensor,
                key=f"packs/{loc[0]}.pack",
            )
        return arr

    def _delta(self, f: Fetched, c, blob) -> Changes:
        spec = self.specs[c.tensor]
        first, stop, box = geometry(spec.shape, c.start, c.stop)
        mirror = self._bindings[c.tensor].mirror
        if stop is not None:
            ref = mirror[first:stop].reshape(box)
        else:
            ref = np.ascontiguousarray(mirror.reshape(spec.shape)[tuple(slice(a, b) for a, b in zip(c.start, c.stop))])
        try:
            changes = decode_changes(blob, ref, reference_sum=self._kept_sum(c))
        except IntegrityError as e:
            raise type(e)(
                f"{e.message} (chunk {c.coord})",
                step=f.info.step,
                tensor=c.tensor,
                key=f"packs/{c.blob[0]}.pack",
            ) from e
        if changes.values.dtype != spec.dtype:
            raise CorruptBlobError(f"blob decodes to {changes.values.dtype}, expected {spec.dtype}", tensor=c.tensor)
        return changes

    def _rebind(self, specs: dict[str, Spec], *, fresh: bool) -> None:
        """Point bindings at ``specs`` (allocating or checking the caller's tensors)."""
        if not self.owned:
            self._check_names(specs)
        bindings: dict[str, Binding] = {}
        fresh_specs = []
        for name, spec in specs.items():
            kept = self._bindings.get(name)
            if self.specs.get(name) == spec and kept is not None and kept.current(self.state.get(name)):
                bindings[name] = kept
            elif self.owned:
                bindings[name] = None  # type: ignore[assignment]  # (in the specs' order) allocated below, together
                fresh_specs.append(spec)
            else:
                bindings[name] = bind(spec, self.state[name])
        for name, (arr, binding) in allocate(fresh_specs).items():
            self.state[name], bindings[name] = arr, binding
        if self.owned:
            for name in [n for n in self.state if n not in specs]:
                del self.state[name]
        keep = {n for n in specs if bindings[n] is self._bindings.get(n)} if not fresh else set()
        self._contents = {k: v for k, v in self._contents.items() if k[0] in keep}
        self._sums = {k: v for k, v in self._sums.items() if k[0] in keep}
        self._bindings, self.specs = bindings, dict(specs)
        self._slots, self._sizes = {}, None
        self._layout, self._rows = None, None

    def _check_names(self, specs: dict[str, Spec]) -> None:
        """The caller's state dict holds exactly the published tensors (InvalidInputError names the others)."""
        missing = [n for n in specs if n not in self.state]
        extra = [n for n in self.state if n not in specs]
        if missing or extra:
            raise InvalidInputError(
                f"the state dict does not match the published tensors: missing {_few(missing)}, "
                f"not published {_few(extra)}"
            )

    def _write(self, f: Fetched, decoded: list, *, fresh: bool) -> None:
        """Every chunk verified (SPARSE deltas already in the mirror): write the rest, then record the step held."""
        self.version = None  # the state is in flux until every chunk is written
        changed = f.changes if f.snapshot else [c for c in f.changes if c.kind != "unchanged"]
        try:
            for c, item in zip(changed, decoded):
                self._write_chunk(c, item)
            # exactly the step's chunks: a tensor chunked differently leaves none of its old chunks behind
            contents = {(c.tensor, c.piece, c.coord): (c.content, c.start, c.stop) for c in f.changes}
            held, none = self._contents, (None, None, None)
            if len(contents) != len(held) or any(held.get(k, none)[1:] != v[1:] for k, v in contents.items()):
                self._sizes = None  # other chunks, or other boxes: chunk_bytes() makes them again
            self._contents = contents
            self._sums = {k: v for k, v in self._sums.items() if k in self._contents}
        except BaseException:
            self.invalidate()  # part of a version is written: only a bootstrap makes the state whole again
            raise
        info = f.info
        self.version, self.content, self.metadata = info.step, info.content, dict(info.metadata)
        self._applied_specs = f.specs  # self.specs is equal to it (a copy)
        self._layout, self._rows = (f.columns.layout if f.columns is not None else f.layout), None

    def _write_chunk(self, c, item) -> None:
        """Write one verified chunk ``c`` (Applied: already in the mirror; Changes; or the whole chunk)."""
        spec = self.specs[c.tensor]
        b = self._bindings[c.tensor]
        key = (c.tensor, c.piece, c.coord)
        if isinstance(item, Applied):  # already in the mirror (apply_sparse)
            if b.device is not None:
                b.push(self._slots[key][5], item.positions, item.words)
            self._sums[key] = item.content_sum
            return
        first, stop, _ = geometry(spec.shape, c.start, c.stop)
        region = None if stop is not None else tuple(slice(a, z) for a, z in zip(c.start, c.stop))
        if isinstance(item, Changes):
            if stop is not None:  # a contiguous run
                b.apply(first, stop, item)
            elif region is not None:
                tmp = np.ascontiguousarray(b.mirror.reshape(spec.shape)[region])
                item.apply_to(tmp)
                b.write_box(spec.shape, region, tmp)
            self._sums[key] = item.content_sum
            return
        if region is None:
            b.write(first, item.reshape(-1))
        else:
            b.write_box(spec.shape, region, item)
        if codec_for(spec.dtype) == "ulpack":
            self._sums[key] = content_sum(item)
        else:
            self._sums.pop(key, None)

    # -- checking -----------------------------------------------------------------------

    def replaced(self) -> list[str]:
        """Tensors whose entry in the state dict is no longer the object (torch: the storage) the replica writes."""
        state = self.state  # (Binding.current inlined for numpy: checked before every version)
        return [
            n
            for n, b in self._bindings.items()
            if b.source is not None and (state.get(n) is not b.source or b.ptr is not None and not b.current(b.source))
        ]

    def chunk_bytes(self) -> dict[Key, int]:
        """Bytes of each chunk held, in a stable order (name, piece, coordinate); kept while the chunks held
        keep their boxes (the default mode's scan asks once a version)."""
        if self._sizes is None:
            out = {}
            for key in sorted(self._contents, key=lambda k: (k[0], k[1], k[2])):
                _, start, stop = self._contents[key]
                out[key] = math.prod(b - a for a, b in zip(start, stop)) * self.specs[key[0]].dtype.itemsize
            self._sizes = out
        return dict(self._sizes)

    def verify(self, keys=None, *, sums: bool = False) -> list[str]:
        """The chunks (all, or ``keys``) whose bits differ from the store's content hash: ``["name[coord]", ...]``.

        ``sums``: compare a chunk's word sum (:func:`content_sum`, about 3x cheaper than BLAKE3) with the
        sum the replica keeps for it instead, where it keeps one.  That sum was computed from values
        verified against the store (the content hash when the chunk was loaded whole, ULPack's target
        checksum at every delta), so any write to the state since is found just the same.
        """
        keys = list(self._contents) if keys is None else list(keys)

        def differs(key) -> bool:
            content, start, stop = self._contents[key]
            spec = self.specs[key[0]]
            first, end, box = geometry(spec.shape, start, stop)
            mirror = self._bindings[key[0]].mirror
            if end is not None:
                region = mirror[first:end]
            else:
                region = np.ascontiguousarray(
                    mirror.reshape(spec.shape)[tuple(slice(a, b) for a, b in zip(start, stop))]
                )
            kept = self._sums.get(key) if sums else None
            if kept is not None:
                return content_sum(region.view(spec.dtype)) != kept
            return content_digest(region).hex() != content

        # word sums run at memory speed: on this thread (the GIL is released), leaving the other core to
        # whatever overlaps the scan (the next version's download); content hashes in the pool
        flags = [differs(k) for k in keys] if sums else self._map(differs, keys)
        return [f"{k[0]}{list(k[2])}" for k, bad in zip(keys, flags) if bad]

    def invalidate(self) -> None:
        self.version = self.content = None
        self._applied_specs = None
        self._layout, self._rows = None, None
        self._sums.clear()
        self._contents.clear()
        self._sizes = None


def _few(names: list) -> str:
    """At most five of ``names``, for an error message."""
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"
