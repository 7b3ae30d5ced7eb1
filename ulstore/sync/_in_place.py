"""The replica's in-place path: a version's SPARSE deltas written into the state by one compiled job.

:class:`InPlace` is half of :class:`~ulstore.sync._replica.Replica`: which
delta chunks :func:`~ulstore.codec.apply_sparse` can write where
they are (contiguous in the state, ULPack, their word sum kept), their slots
(the chunk's words in the state, made once per bindings), and the version
applied from its :class:`~ulstore.store.ChangeColumns` with no object per
chunk (the usual step: every changed chunk such a delta).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..codec import ApplyPlan, apply_sparse, is_sparse_blob, reserve_buffers, target_meta
from ..store import FeedLayout, codec_for
from ._arrays import Binding, Spec, geometry, words

if TYPE_CHECKING:
    from ._fetch import Fetched

__all__ = ["InPlace", "RESERVE_EVERY", "RESERVE_MOST"]

#: A bootstrap faults in the apply's buffers for 1/RESERVE_EVERY of the elements (RL steps change 1-6%), at most
#: RESERVE_MOST changes per dtype (768 MB in bf16): the first version applied would otherwise fault them in.
RESERVE_EVERY = 64
RESERVE_MOST = 1 << 26


class InPlace:
    """The in-place apply of :class:`~ulstore.sync._replica.Replica`."""

    # the replica's state this half reads and writes (set by Replica.__init__; see its comments)
    pool: Any
    threads: int
    version: int | None
    content: str | None
    metadata: dict
    specs: dict[str, Spec]
    _bindings: dict[str, Binding]
    _contents: dict[tuple, tuple]
    _sums: dict[tuple, int]
    _buffers: dict
    _slots: dict[tuple, tuple]
    _applied_specs: dict | None
    _layout: FeedLayout | None
    _rows: list | None
    _rows_dtypes: dict

    def invalidate(self) -> None:
        raise NotImplementedError

    def _reserve(self) -> None:
        """Fault in the in-place apply's buffers now (RESERVE_EVERY); a version that changes more grows them."""
        sizes: dict = {}
        for spec in self.specs.values():
            if codec_for(spec.dtype) == "ulpack":
                sizes[spec.dtype] = sizes.get(spec.dtype, 0) + math.prod(spec.shape)
        for dtype, n in sizes.items():
            reserve_buffers(dtype, min(n // RESERVE_EVERY, RESERVE_MOST), self._buffers.setdefault(dtype, {}))

    def _column_groups(self, f: Fetched) -> tuple[list, dict] | None:
        """The usual step planned from its change columns: ``(picked, groups)``, ``picked`` the held step's
        ``(key, slot)`` of each changed chunk and ``groups`` what :meth:`_plans` takes, when every
        changed chunk is a SPARSE delta against the step held that :meth:`_in_place` would take.  None for any
        other version: :meth:`apply` then takes the feed (whole chunks, a precise error for a bad blob)."""
        cols = f.columns
        if cols is None or cols.layout is not self._layout or f.specs is not self._applied_specs:
            return None
        if (cols.ref != self.version).any():  # intra chunks, or a delta against another step (ChainBroken)
            return None
        rows = self._layout_rows(cols.layout)
        picked = [rows[i] for i in cols.changed.tolist()]
        sums, blobs = self._sums, f.blobs
        kept = [None if r is None else sums.get(r[0]) for r in picked]
        if None in kept or not all(map(is_sparse_blob, blobs)):
            return None
        if len(self._rows_dtypes) == 1:  # (the usual model: one dtype, no regrouping)
            dtype = next(iter(self._rows_dtypes))
            return picked, {
                dtype: (range(len(picked)), [r[1][2] for r in picked], blobs, kept, [r[1][6] for r in picked])
            }
        return picked, _by_dtype(picked, blobs, kept)

    def _record_columns(self, f: Fetched, picked: list, applied: dict) -> None:
        """The usual step is written (:meth:`_column_groups`): push device copies, record the chunks held."""
        self.version = None  # the state is in flux until the bookkeeping is done
        cols = f.columns
        assert cols is not None  # (planned from the columns)
        try:
            hexes, contents, bindings, sums = cols.content.tobytes().hex(), self._contents, self._bindings, self._sums
            for k, (key, slot) in enumerate(picked):
                a = applied[k]
                b = bindings[key[0]]
                if b.device is not None:
                    b.push(slot[5], a.positions, a.words)
                sums[key] = a.content_sum
                contents[key] = (hexes[32 * k : 32 * k + 32], slot[0], slot[1])
        except BaseException:
            self.invalidate()
            raise
        info = f.info
        self.version, self.content, self.metadata = info.step, info.content, dict(info.metadata)

    def _layout_rows(self, layout: FeedLayout) -> list:
        """Per row of ``layout``, the held step's: ``(key, slot)`` of a chunk that :func:`apply_sparse` may write
        in place (held with that box, contiguous, ULPack), else None; made once per layout and bindings."""
        if self._rows is None:
            rows: list = []
            for name, piece, coord, start, stop, _ in layout.rows:
                key = (name, piece, coord)
                held = self._contents.get(key)
                slot = None
                if (
                    held is not None
                    and held[1] == start
                    and held[2] == stop
                    and codec_for(self.specs[name].dtype) == "ulpack"
                ):
                    slot = self._slots.get(key)
                    if slot is None or slot[0] != start or slot[1] != stop:
                        slot = self._slots[key] = self._slot(name, start, stop)
                rows.append((key, slot) if slot is not None and slot[2] is not None else None)
            self._rows = rows
            self._rows_dtypes = dict.fromkeys(r[1][4] for r in rows if r is not None)
        return self._rows

    def _in_place(self, items: list) -> dict:
        """The delta chunks of ``items`` (``(change, blob)``) that :func:`apply_sparse` applies (contiguous,
        SPARSE, their kept sum known), by dtype: ``{dtype: (indices, arrays, blobs, kept sums, target metas)}``,
        each array the chunk's words in the mirror."""
        # one pass, few calls per chunk: at 13M parameters this Python ran as long as a fifth of the compiled apply
        contents, sums, slots = self._contents, self._sums, self._slots
        rows = []
        for i, (c, blob) in enumerate(items):
            if c.kind != "delta":
                continue
            key = (c.tensor, c.piece, c.coord)
            held = contents.get(key)
            if held is None or held[1] != c.start or held[2] != c.stop:
                continue
            kept = sums.get(key)
            if kept is None or not is_sparse_blob(blob):
                continue
            slot = slots.get(key)
            if slot is None or slot[0] != c.start or slot[1] != c.stop:
                slot = slots[key] = self._slot(c.tensor, c.start, c.stop)
            if slot[2] is not None:
                rows.append((slot[4], i, slot[2], blob, kept, slot[6]))
        groups = {}
        for dtype in dict.fromkeys(r[0] for r in rows):  # (in chunk order: one order of writes, and of errors)
            _, *columns = zip(*(r for r in rows if r[0] == dtype))
            groups[dtype] = tuple(map(list, columns))
        return groups

    def _slot(self, tensor: str, start: tuple, stop: tuple) -> tuple:
        """What the in-place apply needs of a chunk of ``tensor``, kept while the bindings stay: ``(start, stop,
        words of the chunk in the mirror or None if not one contiguous run, box shape, dtype, flat start,
        target_meta of the box)``."""
        spec = self.specs[tensor]
        first, end, box = geometry(spec.shape, start, stop)
        mirror = self._bindings[tensor].mirror
        view = None if end is None else words(mirror[first:end])
        return start, stop, view, box, spec.dtype, first, target_meta(spec.dtype, box)

    def _prime_slots(self) -> None:
        """A step just loaded: the slots of every chunk an in-place apply may write, made now rather than by the
        first version applied (about 3 us a chunk, a tenth of a millisecond at 13M parameters)."""
        for key, (_, start, stop) in self._contents.items():
            if key not in self._slots and codec_for(self.specs[key[0]].dtype) == "ulpack":
                self._slots[key] = self._slot(key[0], start, stop)

    def _plans(self, groups: dict) -> tuple[list, list, list]:
        """What :func:`apply_sparse` takes for the delta chunks ``groups`` (from :meth:`_in_place`): one plan and one
        buffer dict per dtype, and the index in ``items`` of each blob, in the plans' order."""
        plans, stores, order = [], [], []
        for dtype, (indices, arrays, blobs, sums, metas) in groups.items():
            plans.append(ApplyPlan.of(dtype, blobs, arrays, sums, metas=metas))
            stores.append(self._buffers.setdefault(dtype, {}))
            order += indices
        return plans, stores, order

    def _apply_sparse(self, groups: dict) -> dict | None:
        """Decode, check and write the SPARSE delta chunks ``groups`` into the state, all of them or (None) none;
        their :class:`Applied` by index of ``items``.  (:meth:`Replica.apply` calls the codec itself: one hop
        fewer on the usual step.)"""
        plans, stores, order = self._plans(groups)
        out = apply_sparse(plans, pool=self.pool, parts=self.threads, buffers=stores)
        return None if out is None else dict(zip(order, out))


def _by_dtype(picked: list, blobs: list, kept: list) -> dict:
    """:meth:`InPlace._column_groups`'s groups of a model of several dtypes, in chunk order (one order of writes)."""
    groups = {}
    for dtype in dict.fromkeys(r[1][4] for r in picked):
        at = [k for k, r in enumerate(picked) if r[1][4] == dtype]
        slots = [picked[k][1] for k in at]
        groups[dtype] = (
            at,
            [s[2] for s in slots],
            [blobs[k] for k in at],
            [kept[k] for k in at],
            [s[6] for s in slots],
        )
    return groups
