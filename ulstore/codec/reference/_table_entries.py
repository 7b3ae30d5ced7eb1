"""Index entry columns: the NumPy twin of kernel ``table_entries`` (the store's table blocks).

A table block stores, after the 16-byte content hash of each of its ``total``
chunks, four little-endian columns: the reference step (int64), the pack index
(uint32), the gap before the blob (int64) and the blob's length (uint64).  The
blob offsets are the gaps undone: ``off[i] = gap[i]`` where a run of one pack
starts, ``off[i - 1] + length[i - 1] + gap[i]`` within it (int64 sums that
wrap, as NumPy's do: a crafted table is caught by the range checks).
"""

from __future__ import annotations

import numpy as np

__all__ = ["table_entries"]


def table_entries(raw, pos: int, total: int, n_packs: int, max_dim: int, out) -> int:
    """Read the columns at byte ``pos`` of ``raw`` into ``out`` (int64, shape (4, total): reference, pack, offset,
    length); 0, or 1 (an entry names a reference below -1, a pack >= ``n_packs`` or a length >= ``max_dim``),
    2 (an offset is negative or its blob ends at or past ``max_dim``), 3 (``raw`` is too short).  The caller
    checked nothing: on a status ``out`` holds anything."""
    if total < 0 or pos < 0 or pos + total * 28 > len(raw):
        return 3
    ref = np.frombuffer(raw, "<i8", total, pos)
    pack = np.frombuffer(raw, "<u4", total, pos + 8 * total).astype(np.int64)
    gap = np.frombuffer(raw, "<i8", total, pos + 12 * total)
    length = np.frombuffer(raw, "<u8", total, pos + 20 * total)
    if total and (ref.min() < -1 or pack.max() >= n_packs or length.max() >= max_dim):
        return 1
    length = length.astype(np.int64)
    offs = _offsets(pack, gap.astype(np.int64), length)
    if total and (offs.min() < 0 or (offs + length).max() >= max_dim):
        return 2
    out[0], out[1], out[2], out[3] = ref, pack, offs, length
    return 0


def _offsets(pack: np.ndarray, gap: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Invert the gap coding (module docstring), in whole-array steps.

    Within a run of one pack, ``off[i]`` is the sum of the run's gaps up to ``i`` and of its
    lengths before ``i``: ``x[i] - x'[first]`` with ``x`` = gaps through ``i`` plus lengths before
    ``i`` and ``x'[first] = x[first] - gap[first]``.  One run (one pack throughout): its
    ``x'[first]`` is 0, so ``off`` is ``x``.
    """
    if not len(pack):
        return gap.copy()
    start = np.empty(len(pack), bool)
    start[0] = True
    np.not_equal(pack[1:], pack[:-1], out=start[1:])
    x = (gap + length).cumsum() - length
    (first,) = start.nonzero()
    if len(first) == 1:
        return x
    return x - (x - gap)[first][start.cumsum() - 1]
