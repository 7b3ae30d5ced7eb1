"""Decoding chunks of any step: chunks, boxes and whole tensors, through decode plans.

A chunk's blob is decoded against its reference: the values of the step its
entry names over the same box (the co-located chunk when that step has the
same piece layout, else a box assembled from that step's chunks), which are
decoded the same way, down to an intra blob or a snapshot.

:class:`ChunkReader` never recurses: a request is planned first, then
fetched and decoded (``_decode_plan.py``: the reference walk, with cycle
detection and hard bounds, and the decoding deps-first, each intermediate
chunk once).  Every decoded chunk is checked against its content hash.  A
request is cut into batches of about ``BATCH_BYTES`` raw bytes, each one plan
(one coalesced fetch of its blobs) run on the reader's threads.  What the plans
stand on (documents, tables, bytes, caches) is :class:`~._table_reader.TableReader`;
the trajectory's kept step (``_kept.py``) is what full reads use and refresh.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections.abc import Iterable, Iterator

import numpy as np

from ...errors import TensorNotFoundError
from ._decode_plan import Node, _paste, _Plan
from ._kept import KeptStep
from ._table_reader import DEFAULT_CACHE_BYTES, TableReader

__all__ = ["ChunkReader", "DEFAULT_CACHE_BYTES", "Node", "BATCH_BYTES", "batched"]

BATCH_BYTES = 32 << 20  # raw bytes of one unit of work of a read


def batched(items: Iterable[tuple]) -> Iterator[list]:
    """``(item, raw bytes)`` pairs cut into lists of about ``BATCH_BYTES`` (one plan and coalesced fetch each)."""
    cur: list = []
    size = 0
    for item, n in items:
        cur.append(item)
        size += n
        if size >= BATCH_BYTES:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


class ChunkReader(TableReader):
    """Read step documents, tables and decoded chunks of a trajectory.

    Parameters
    ----------
    io : ObjectStore
    cache_bytes : int
        Budget of the decoded-chunk LRU (lazy slices); 0 disables it.
    threads : int
        Threads of full reads.
    """

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

        self._run(run, list(batched(parts)))
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
        batches = list(
            batched(
                (
                    tgt,
                    math.prod(s.stop - s.start for s in tgt[2]) * (tgt[3] if tgt[1] is None else tgt[1]).dtype.itemsize,
                )
                for tgt in targets
            )
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
