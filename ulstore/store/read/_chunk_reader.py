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

import numpy as np

from ._decode_plan import Node, _Plan, decode_boxes, materialize, read_tensors
from ._kept import KeptStep
from ._table_reader import DEFAULT_CACHE_BYTES, TableReader

__all__ = ["ChunkReader", "DEFAULT_CACHE_BYTES", "Node"]


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
        t = self.tensor(step, name, chain=True)
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
        t = self.tensor(step, name, chain=True)
        parts = list(t.overlapping(lo, hi))
        if len(parts) == 1 and parts[0][2] == tuple(lo) and parts[0][3] == tuple(hi):
            return self.chunk(step, name, parts[0][1], parts[0][0], cache=cache)
        return self.boxes(step, [(name, lo, hi)], cache=cache)[0]

    def boxes(self, step: int, requests: list, *, cache: bool = True) -> list[np.ndarray]:
        """The values over each box ``(name, lo, hi)`` of ``step``, fresh arrays (:func:`decode_boxes`)."""
        return decode_boxes(self, step, requests, cache=cache)

    def read(self, step: int, names=None, *, kept: KeptStep | None = None, refresh_kept: bool = False):
        """Decode whole tensors of ``step`` (all by default) into fresh arrays (:func:`read_tensors`)."""
        return read_tensors(self, step, names, kept=kept, refresh_kept=refresh_kept)

    def materialize(self, targets, *, kept: KeptStep | None = None, lru: bool = False) -> None:
        """Decode chunks into place (:func:`materialize`)."""
        materialize(self, targets, kept=kept, lru=lru)
