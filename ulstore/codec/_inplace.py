"""A version's SPARSE delta blobs applied in place, in one compiled call per thread.

This is the weight-sync follower's hot path (:class:`ulstore.sync.Follower`):
each blob is decoded against the array it was coded against (the replica's own
memory), checked (reference through its word sum, target checksum) and written
there, all blobs of a call in one GIL release (kernel ``sparse_apply``, see
``_apply.pxi``).  All or nothing: if any blob fails, every array is left as it
was, and the caller decodes the blobs again with :func:`decode_changes` for
the precise error.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np

from . import _format as F
from ._backend import kernels
from ._dtypes import format_of
from ._sparse import GAPS
from ._tables import POOL_BELOW

__all__ = ["Applied", "is_sparse_blob", "apply_sparse"]


@dataclass(frozen=True)
class Applied:
    """One blob applied in place: its changed positions (int64, in the array), new and old words, target word sum."""

    positions: np.ndarray
    words: np.ndarray
    old: np.ndarray
    content_sum: int


def is_sparse_blob(blob) -> bool:
    """Whether ``blob`` is a format-2 SPARSE blob (what :func:`apply_sparse` applies); nothing is checked."""
    mv = memoryview(blob)
    return len(mv) > 9 and mv[4] == 2 and mv[6] == F.MODE_SPARSE and mv[:4] == F.MAGIC


_metas: dict[tuple, bytes] = {}


def _meta(code: int, shape: tuple) -> bytes:
    """The dtype-and-shape bytes a blob's target checksum binds (``_api._target_hash``)."""
    key = (code, shape)
    out = _metas.get(key)
    if out is None:
        buf = bytearray((code,))
        for d in shape:
            F.write_varint(buf, d)
        out = _metas[key] = bytes(buf)
        if len(_metas) > 4096:
            _metas.clear()
    return out


def _crc_ok(blob) -> bool:
    mv = memoryview(blob).cast("B")
    return F._crc32(mv[:-4]) == int.from_bytes(mv[-4:], "little")  # the kernels' CRC-32: GIL released, PCLMULQDQ


RUNS_PER_THREAD = 4  # runs a version is cut into per decode thread (see apply_sparse)


def _nearest(ends: list[int], share: float) -> int:
    """How many blobs (``ends``: their cumulative sizes) come closest to ``share`` bytes."""
    k = bisect.bisect_left(ends, share)  # ends[k - 1] < share <= ends[k]
    if k > 0 and (k == len(ends) or share - ends[k - 1] <= ends[k] - share):
        return k
    return k + 1


def apply_sparse(dtype, blobs: list, arrays: list, sums: list, shapes: list, *, pool=None, parts: int = 1,
                 buffers: dict | None = None, backend: str | None = None) -> list[Applied] | None:
    """Apply SPARSE ``blobs[i]`` to ``arrays[i]`` in place; all or nothing.

    ``arrays[i]``: the 1-d, C-contiguous, writeable array of ``dtype`` the blob
    was coded against (seen as the blob's ``shapes[i]``), whose
    :func:`content_sum` is ``sums[i]``.  ``parts`` threads decode them: this
    one and ``parts - 1`` of ``pool``'s (the kernel releases the GIL), each
    taking the next of ``RUNS_PER_THREAD * parts`` runs of about equal bytes.

    ``buffers``: a dict this function keeps output arrays in between calls
    (per run and word size), so that a version does not fault in fresh pages;
    the :class:`Applied` results are views of them, valid until the next call
    with the same dict.

    Returns one :class:`Applied` per blob, or None when any blob fails (or is
    not a SPARSE blob of that dtype and shape): then no array changed.
    """
    fmt = format_of(np.dtype(dtype))
    k = kernels(backend)
    word = fmt.word
    views = [a.view(word) for a in arrays]
    metas = [_meta(fmt.code, tuple(s)) for s in shapes]
    ref_sums = np.array(sums, dtype=np.uint64)
    n = len(blobs)
    threads = max(1, min(parts, n))
    # contiguous runs of about equal bytes (a blob's decode time follows its size), each ending at the blob
    # boundary nearest its share; more runs than threads, each taken by whichever thread is free next, so
    # that a run decoding slower (colder memory, a core shared with another process) leaves no thread idle
    count = 1 if threads == 1 else min(n, threads * RUNS_PER_THREAD)
    ends = list(itertools.accumulate(map(len, blobs)))  # (lists and bisect: a few dozen blobs, no NumPy calls)
    bounds = [0, *(_nearest(ends, ends[-1] * j / count) for j in range(1, count)), n]
    runs = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    if not runs:
        return []

    def run(j):
        try:
            return attempt(j)
        except Exception as e:  # noqa: BLE001  (re-raised below, once the other runs are undone)
            return e

    def attempt(j):
        a, b = runs[j]
        if not all(_crc_ok(x) for x in blobs[a:b]):
            return None
        key = (j, word.itemsize)
        bufs = None if buffers is None else buffers.get(key)
        out = k.sparse_apply(blobs[a:b], views[a:b], ref_sums[a:b], metas[a:b], fmt.code, fmt.width, fmt.mant_bits,
                             fmt.n_contexts - 1, POOL_BELOW, GAPS.alphabet, fmt.alphabet, True, bufs)
        if buffers is not None and (bufs is None or len(out[2]) > len(bufs[0])):  # keep the larger (with headroom)
            total = len(out[2]) + len(out[2]) // 4
            buffers[key] = (np.empty(total, np.int64), np.empty(total, word), np.empty(total, word))
        return out if out[0] == 0 else None

    results: list = [None] * len(runs)
    taken = itertools.count()  # next() on it is atomic: each run is taken once

    def work():
        while (j := next(taken)) < len(runs):
            results[j] = run(j)

    # this thread works too (it would otherwise only wait): one pool wake-up fewer per version
    helpers = [pool.submit(work) for _ in range(threads - 1)] if pool is not None else []
    try:
        work()
    finally:
        for f in helpers:
            f.result()
    if any(r is None or isinstance(r, Exception) for r in results):
        for (a, _), r in zip(runs, results):  # undo the runs that were written
            if isinstance(r, tuple):
                _, _, pos, _, old, starts, _ = r
                for i in range(len(starts) - 1):
                    k.scatter(views[a + i], pos[starts[i] : starts[i + 1]], old[starts[i] : starts[i + 1]])
        for r in results:
            if isinstance(r, Exception):
                raise r
        return None
    applied = []
    for r in results:
        _, _, pos, new, old, starts, target = r
        bounds = starts.tolist()
        for i, t in enumerate(target[: len(bounds) - 1].tolist()):
            s, e = bounds[i], bounds[i + 1]
            # a frozen dataclass's __init__ sets each field through object.__setattr__; filling
            # __dict__ at once is the same object for half the cost (one per changed chunk)
            one = _new(Applied)
            _set(one, "__dict__", {"positions": pos[s:e], "words": new[s:e], "old": old[s:e], "content_sum": t})
            applied.append(one)
    return applied


_new = object.__new__
_set = object.__setattr__
