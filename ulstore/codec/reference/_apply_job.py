"""NumPy twin of ``_apply.pxi``: SPARSE blobs applied in place, many per call.

Same arguments (an :class:`~ulstore.codec._apply_plan.ApplyPlan` and the job's options),
results and statuses as the compiled ``sparse_apply`` and ``SparseApply``; see their
docstrings there.  Imported into ``reference`` (the numpy backend).
"""

from __future__ import annotations

import threading
import zlib

import numpy as np

from .._checksum import finish_sum, fold32
from .._elias_fano import sizes as ef_sizes
from .._format import LANES
from .._rans_tables import SCALE_BITS, STATE_LOW
from ._hashes import hash64
from ._sparse_payloads import sparse_decode, sparse_decode_ef

__all__ = ["sparse_apply", "SparseApply"]

APPLY_HEADER, APPLY_REFERENCE, APPLY_FIELDS, APPLY_TARGET, APPLY_CRC = -20, -21, -22, -23, -24


class _Bad(Exception):
    def __init__(self, status: int):
        self.status = status


def _varint(b, pos: int, end: int, limit: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise _Bad(APPLY_FIELDS)
        byte = b[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift > 63:
            raise _Bad(APPLY_FIELDS)
    if value > limit or value >= 1 << 64:
        raise _Bad(APPLY_FIELDS)
    return value, pos


def _section(b, pos: int, end: int, m: int, width: int) -> tuple[tuple, int]:
    if pos >= end or b[pos] != SCALE_BITS:
        raise _Bad(APPLY_FIELDS)
    size, pos = _varint(b, pos + 1, end, 1 << 24)
    if size > end - pos:
        raise _Bad(APPLY_FIELDS)
    table = np.frombuffer(b[pos : pos + size], dtype=np.uint8)
    pos += size
    if end - pos < 4 * LANES:
        raise _Bad(APPLY_FIELDS)
    states = np.frombuffer(b[pos : pos + 4 * LANES], dtype="<u4")
    if not all(STATE_LOW <= int(x) < 1 << 31 for x in states):
        raise _Bad(APPLY_FIELDS)
    pos += 4 * LANES
    n_words, pos = _varint(b, pos, end, m)
    if 2 * n_words > end - pos:
        raise _Bad(APPLY_FIELDS)
    words = np.frombuffer(b[pos : pos + 2 * n_words], dtype=np.uint8)
    pos += 2 * n_words
    tail_bits, pos = _varint(b, pos, end, m * (width - 3))
    tail_len = (tail_bits + 7) // 8
    if tail_len > end - pos:
        raise _Bad(APPLY_FIELDS)
    tail = np.frombuffer(b[pos : pos + tail_len], dtype=np.uint8)
    pos += tail_len
    if tail_bits % 8 and tail[-1] >> (tail_bits % 8):
        raise _Bad(APPLY_FIELDS)
    return (table, states.copy(), words, tail, tail_bits), pos


def _parse(b, meta, code: int, n: int, emask: int, width: int) -> tuple:
    end = len(b) - 4
    if (
        end < 9
        or len(meta) < 1
        or bytes(b[:4]) != b"ULPK"
        or b[4] not in (2, 4)
        or b[5] != code
        or b[5] != meta[0]
        or b[6] != 3
        or b[7] & ~3
        or not b[7] & 1
    ):
        raise _Bad(APPLY_HEADER)
    ndim = sum(not x & 0x80 for x in meta[1:])
    pos = 9
    if b[8] != ndim or end - pos < len(meta) - 1 or bytes(b[pos : pos + len(meta) - 1]) != bytes(meta[1:]):
        raise _Bad(APPLY_HEADER)
    pos += len(meta) - 1
    if end - pos < 8:
        raise _Bad(APPLY_FIELDS)
    ref_hash = int.from_bytes(b[pos : pos + 4], "little")
    target_hash = int.from_bytes(b[pos + 4 : pos + 8], "little")
    pos += 8
    emask = 0 if b[7] & 2 else emask
    m, pos = _varint(b, pos, end, n)
    if m == 0:
        raise _Bad(APPLY_FIELDS)
    if b[4] == 4:  # Elias-Fano positions, their lengths fixed by n and m (_elias_fano.sizes)
        lo_len, hi_len = ef_sizes(n, m)
        if lo_len + hi_len > end - pos:
            raise _Bad(APPLY_FIELDS)
        lo, pos = np.frombuffer(b[pos : pos + lo_len], dtype=np.uint8), pos + lo_len
        hi, pos = np.frombuffer(b[pos : pos + hi_len], dtype=np.uint8), pos + hi_len
        g = (lo, hi)
    else:
        g, pos = _section(b, pos, end, m, 32)
    t, pos = _section(b, pos, end, m, width)
    if pos != end:
        raise _Bad(APPLY_FIELDS)
    return m, ref_hash, target_hash, emask, g, t


def _refuse_overlaps(dsts) -> None:
    """All or nothing needs each blob's words to itself (the undo restores blob by blob): ValueError if two of the
    (C-contiguous) arrays share memory."""
    arrays = [np.asarray(d) for d in dsts if memoryview(d).c_contiguous]
    spans = sorted((a.__array_interface__["data"][0], a.nbytes) for a in arrays if a.nbytes)
    for (a, na), (b, _) in zip(spans, spans[1:]):
        if a + na > b:
            raise ValueError("sparse_apply: two arrays overlap in memory (each blob needs an array of its own)")


def sparse_apply(plan, write, buffers=None, crc=False):
    """Decode SPARSE ``plan.blobs`` against ``plan.arrays`` and, ``write``, apply them; see ``_apply.pxi``."""
    c = len(plan.blobs)
    views = _word_views(plan, write)
    if write:
        _refuse_overlaps(views)
    parsed, parse_status, upto = _parse_all(plan, views)
    starts = np.zeros(c + 1, dtype=np.int64)
    starts[1 : upto + 1] = np.cumsum([p[0] for p in parsed])
    starts[upto + 1 :] = starts[upto]
    pos, new, old = _outputs(buffers, int(starts[-1]), np.dtype(f"<u{plan.width // 8}"))
    sums = np.zeros(c, dtype=np.uint64)
    failed, status = -1, 0
    for i in range(upto):
        s, e = int(starts[i]), int(starts[i + 1])
        status = _decode_one(plan, i, views[i], parsed[i], pos[s:e], new[s:e], old[s:e], sums, crc)
        if status:
            failed = i
            break
        if write:
            views[i][pos[s:e]] = new[s:e]
    if not status and parse_status:
        status, failed = parse_status, upto
    if status and write:  # all or nothing: put back what the blobs before the failed one wrote
        for j in range(failed - 1, -1, -1):
            s, e = int(starts[j]), int(starts[j + 1])
            views[j][pos[s:e]] = old[s:e]
    return status, failed, pos, new, old, starts.tolist(), sums.tolist()


def _word_views(plan, write) -> list[np.ndarray]:
    """Each array's words in memory order, whatever its shape (the compiled job's flat buffers), the plan checked."""
    c, width = len(plan.blobs), plan.width
    wb = width // 8
    if (
        len(plan.arrays) != c
        or len(plan.metas) != c
        or len(plan.sums) != c
        or wb not in (1, 2, 4, 8)
        or width != 8 * wb
        or not 0 < plan.g_alphabet <= 256
        or not 0 < plan.t_alphabet <= 256
    ):
        raise ValueError("sparse_apply needs one array, word sum and shape per blob, and a word width of 8-64 bits")
    word = np.dtype(f"<u{wb}")
    views = []
    for blob, meta, dst in zip(plan.blobs, plan.metas, plan.arrays):
        memoryview(blob), memoryview(meta)
        if not memoryview(dst).c_contiguous or write and memoryview(dst).readonly:
            raise BufferError("sparse_apply reads its arrays as flat words and writes them: pass C-contiguous ones")
        if memoryview(dst).nbytes % wb:
            raise ValueError("sparse_apply: an array is not a whole number of words")
        views.append(
            np.frombuffer(dst, dtype=np.uint8).view(word)
            if not write
            else np.asarray(dst).reshape(-1).view(np.uint8).view(word)
        )
    return views


def _parse_all(plan, views) -> tuple[list, int, int]:
    """Every blob's header and fields until the first bad one: ``(parsed, its status or 0, its index or c)``."""
    parsed: list = []
    for i, blob in enumerate(plan.blobs):
        try:
            parsed.append(
                _parse(
                    memoryview(blob).cast("B"), bytes(plan.metas[i]), plan.code, len(views[i]), plan.emask, plan.width
                )
            )
        except _Bad as bad:
            return parsed, bad.status, i
    return parsed, 0, len(plan.blobs)


def _outputs(buffers, total: int, word: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, new and old words for ``total`` changes: the caller's ``buffers`` when they fit, else new."""
    if (
        buffers is not None
        and buffers[0].dtype == np.int64
        and buffers[1].dtype == word
        and buffers[2].dtype == word
        and min(len(b) for b in buffers) >= max(total, 1)
    ):
        pos, new, old = (b[:total] for b in buffers)
        return pos, new, old
    return np.empty(total, np.int64), np.empty(total, word), np.empty(total, word)


def _decode_one(plan, i, r, parsed, pos, new, old, sums, crc):
    """Blob ``i`` decoded against its words ``r`` into its slices of the outputs and checked (CRC-32 if ``crc``,
    reference, target); its target word sum into ``sums[i]``.  Returns 0 or the status of what failed."""
    _, ref_hash, target_hash, em, g, t = parsed
    b = memoryview(plan.blobs[i]).cast("B")
    ref_sum = int(plan.sums[i])
    if crc and zlib.crc32(b[:-4]) != int.from_bytes(b[-4:], "little"):
        return APPLY_CRC
    if fold32(finish_sum(ref_sum, r.nbytes)) != ref_hash:
        return APPLY_REFERENCE
    delta = np.zeros(1, dtype=np.uint64)
    mant_bits, pool_below, t_alphabet = plan.mant_bits, plan.pool_below, plan.t_alphabet
    if len(g) == 2:  # version 4: Elias-Fano positions
        status = sparse_decode_ef(r, mant_bits, em, pool_below, *g, *t, t_alphabet, pos, new, delta)
    else:
        status = sparse_decode(r, mant_bits, em, pool_below, *g, plan.g_alphabet, *t, t_alphabet, pos, new, delta)
    if status:
        return status
    old[...] = r[pos]
    acc = (ref_sum + int(delta[0])) & 0xFFFFFFFFFFFFFFFF
    if fold32(finish_sum(acc, r.nbytes) ^ hash64(bytes(plan.metas[i]))) != target_hash:
        return APPLY_TARGET
    sums[i] = acc
    return 0


class SparseApply:
    """The compiled ``SparseApply``'s interface: the first :meth:`work` call applies every blob (blob order)."""

    def __init__(self, plan, write, buffers=None, order=None, crc=False):
        c = len(plan.blobs)
        if order is not None and sorted(int(i) for i in order) != list(range(c)):
            raise ValueError("SparseApply: order must be a permutation of the blobs")
        if write:
            _refuse_overlaps(plan.arrays)
        self._args = (plan, write, buffers, crc)
        self._lock = threading.Lock()
        self._state = threading.Condition()  # guards _done and _active
        self._result = None
        self._done = False  # no work() enters
        self._finished = False
        self._active = 0

    def work(self):
        with self._state:
            if self._done:  # a worker that starts late: nothing is left to take
                return
            self._active += 1
        try:
            with self._lock:
                if self._result is None:
                    self._result = sparse_apply(*self._args)
        finally:
            with self._state:
                self._active -= 1
                self._state.notify_all()

    def join(self, seconds=2e-4):
        with self._state:
            self._done = True  # no worker enters from here on (finish() still runs once)
            return self._state.wait_for(lambda: not self._active, seconds)

    def finish(self):
        with self._state:
            if self._finished:
                raise RuntimeError("SparseApply: finish() called twice")
            if self._active:
                raise RuntimeError("SparseApply: finish() while work() is running (call join() first)")
            self._done = self._finished = True
        plan = self._args[0]
        if self._result is None and not plan.blobs:
            self._result = sparse_apply(*self._args)
        if self._result is None:  # never worked: nothing was written
            word = np.dtype(f"<u{plan.width // 8}")
            empty = np.empty(0, np.int64), np.empty(0, word), np.empty(0, word)
            return -8, 0, *empty, [0] * (len(plan.blobs) + 1), [0] * len(plan.blobs)
        return self._result
