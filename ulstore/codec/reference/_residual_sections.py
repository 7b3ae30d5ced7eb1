"""Pure-NumPy twins of the format-version-1 kernels: residuals, rANS, raw tails, tables.

Part of the NumPy backend (re-exported by ``reference``, whose docstring states the
conventions); the compiled twins are in ``_kernels.pyx``.  The residual helpers
(``_key``, ``_bitlen``, ...) are shared with the SPARSE twins.
"""

from __future__ import annotations

import numpy as np

from .. import _rans_tables
from .._format import LANES
from .._rans_tables import ENC_ENTRY, SCALE_BITS, STATE_LOW, decoder_table
from ._hashes import hash64

__all__ = [
    "residuals",
    "histogram",
    "context_histogram",
    "pack_tails",
    "rans_encode",
    "rans_decode",
    "slot_table",
    "unpack_tails",
    "reconstruct",
    "pack_table",
    "read_table",
    "normalize_rows",
    "encoder_table",
    "table_model",
]


# -- residuals -------------------------------------------------------------------


def _key(u: np.ndarray, width: int) -> np.ndarray:
    """Order-preserving map of float bit patterns to unsigned ints (sign-magnitude -> offset)."""
    h = u.dtype.type(1 << (width - 1))
    return np.where(u & h, ~u, u | h)


def _unkey(k: np.ndarray, width: int) -> np.ndarray:
    h = k.dtype.type(1 << (width - 1))
    return np.where(k & h, k & ~h, ~k)


def _bitlen(z: np.ndarray, width: int) -> np.ndarray:
    """Number of significant bits of each unsigned word (0 for 0)."""
    b = np.zeros(z.shape, dtype=np.int64)
    v = z.copy()
    s = width // 2
    while s:
        hi = (v >> z.dtype.type(s)) != 0
        b += s * hi
        v = np.where(hi, v >> z.dtype.type(s), v)
        s //= 2
    return b + (v != 0)


def _tail_len(tokens: np.ndarray) -> np.ndarray:
    return np.maximum((tokens.astype(np.int64) >> 2) - 1, 0)


def residuals(x, r, mant_bits, emask, token_bits, z_out, sym_out) -> tuple[int, int]:
    """z = zigzag(key(x) - key(r)) and sym = (r's exponent & emask) << token_bits | token(z).

    Returns ``(hash64(x), hash64(r))`` (the compiled twin hashes in the same pass).
    """
    width = x.dtype.itemsize * 8
    w = x.dtype.type
    with np.errstate(over="ignore"):
        d = _key(x, width) - _key(r, width)  # wraps mod 2**w
        z = (d << w(1)) ^ ((d >> w(width - 1)) * w((1 << width) - 1))
    nb = np.maximum(_bitlen(z, width) - 3, 0)
    tokens = (z >> nb.astype(z.dtype)).astype(np.int64) + 4 * nb
    ctx = ((r >> w(mant_bits)) & w(emask)).astype(np.int64)
    z_out[:] = z
    sym_out[:] = (ctx << token_bits) | tokens
    return hash64(x), hash64(r)


def histogram(sym, hist_out) -> None:
    """Symbol counts, returned in row 0 of ``hist_out`` (whose contents on entry do not matter)."""
    hist_out[:] = 0
    hist_out[0] = np.bincount(np.asarray(sym, dtype=np.int64), minlength=hist_out.shape[1])


def context_histogram(r, mant_bits, emask, hist_out) -> int:
    """Count reference elements per context ``(r >> mant_bits) & emask``; element i in row i % 8.

    Returns ``hash64`` of ``r``'s bytes (the compiled twin computes both in one pass).
    """
    copies, size = hist_out.shape
    ctx = ((r >> r.dtype.type(mant_bits)) & r.dtype.type(emask)).astype(np.int64)
    row = np.arange(len(r)) % copies
    hist_out += np.bincount(row * size + ctx, minlength=hist_out.size).reshape(hist_out.shape).astype(hist_out.dtype)
    return hash64(r)


def pack_tails(sym, z, token_bits, tail_out) -> int:
    """Write every residual's raw low bits, LSB-first, into ``tail_out``; returns the bit count."""
    nb = _tail_len(np.asarray(sym) & ((1 << token_bits) - 1))
    total = int(nb.sum())
    if total:
        tails = (z & ((z.dtype.type(1) << nb.astype(z.dtype)) - z.dtype.type(1))).astype(np.uint64)
        owner = np.repeat(np.arange(len(z)), nb)
        k = (np.arange(total) - np.repeat(np.cumsum(nb) - nb, nb)).astype(np.uint64)
        packed = np.packbits(((tails[owner] >> k) & np.uint64(1)).astype(np.uint8), bitorder="little")
        tail_out[: len(packed)] = packed
    return total


# -- rANS -------------------------------------------------------------------------


def rans_encode(sym, table, words_out, states_out, mostly_zero=False) -> int:
    """Encode symbols in reverse; words fill ``words_out`` from its end; returns their count.

    ``table`` is the encoder table (``_rans_tables.ENC_ENTRY`` records) as bytes, one per
    symbol value.  Plain integer division here; the compiled twin uses the exact
    reciprocal the table carries.  ``mostly_zero`` is the compiled twin's speed hint.
    """
    entries = np.frombuffer(table, dtype=ENC_ENTRY)
    total = 1 << SCALE_BITS
    freq = (entries["xmax"].astype(np.int64) >> (31 - SCALE_BITS)).tolist()
    start, xmax = entries["start"].tolist(), entries["xmax"].tolist()
    state = [STATE_LOW] * LANES
    out = []
    syms = np.asarray(sym).tolist()
    for i in range(len(syms) - 1, -1, -1):
        e = syms[i]
        lane = i & 3
        x = state[lane]
        if x >= xmax[e]:
            out.append(x & 0xFFFF)
            x >>= 16
        f = freq[e]
        state[lane] = (x // f) * total + x % f + start[e]
    count = len(out)
    # the decoder reads words in the reverse order of their emission
    words_out[len(words_out) - count :] = np.array(out[::-1], dtype=np.uint16)
    states_out[:] = state
    return count


def rans_decode(r, mant_bits, emask, ctx_rows, slots, words, states, tokens_out) -> int:
    """Decode one token per element into ``tokens_out``; returns 0 or a negative status.

    ``ctx_rows[(r >> mant_bits) & emask]`` is the context's first entry in ``slots``,
    which holds ``token << 24 | (f - 1) << 12 | (slot - start)`` per (context, slot);
    ``words`` is the little-endian 16-bit word stream as bytes.
    """
    n = len(tokens_out)
    mask = (1 << SCALE_BITS) - 1
    rows = ctx_rows[((r >> r.dtype.type(mant_bits)) & r.dtype.type(emask)).astype(np.int64)].tolist()
    words = np.frombuffer(words, dtype="<u2").tolist()
    table = slots.tolist()
    state = [int(s) for s in states]
    pos = 0
    tokens = [0] * n
    for i in range(n):
        lane = i & 3
        x = state[lane]
        e = table[rows[i] + (x & mask)]
        x = (((e >> 12) & 0xFFF) + 1) * (x >> SCALE_BITS) + (e & 0xFFF)
        if x < STATE_LOW:
            if pos >= len(words):
                return -1
            x = (x << 16) | words[pos]
            pos += 1
        state[lane] = x
        tokens[i] = e >> 24
    tokens_out[:] = tokens
    if pos != len(words):
        return -5
    if any(s != STATE_LOW for s in state):
        return -3
    return 0


def slot_table(freqs, out) -> None:
    """Fill one entry per (row, slot): ``token << 24 | (f - 1) << 12 | (slot - start)``."""
    out[:] = decoder_table(freqs, SCALE_BITS)


def unpack_tails(tokens, tail, tail_bits, z_out) -> int:
    """Rebuild residuals from tokens and raw tail bits; returns 0, or -2 if the bit count disagrees."""
    nb = _tail_len(np.asarray(tokens))
    if int(nb.sum()) != tail_bits or len(tail) * 8 < tail_bits:
        return -2
    bits = np.unpackbits(np.frombuffer(tail, dtype=np.uint8), bitorder="little")[:tail_bits].astype(np.uint64)
    k = (np.arange(tail_bits) - np.repeat(np.cumsum(nb) - nb, nb)).astype(np.uint64)
    tails = np.zeros(len(z_out), dtype=np.uint64)
    np.add.at(tails, np.repeat(np.arange(len(z_out)), nb), bits << k)
    base = (np.asarray(tokens, dtype=np.int64) - 4 * nb).astype(np.uint64) << nb.astype(np.uint64)
    z_out[:] = (base | tails).astype(z_out.dtype)
    return 0


def reconstruct(r, values) -> int:
    """In place: residuals in, values out: unkey(key(r) + unzigzag(z)) in w-bit arithmetic.

    Returns ``hash64`` of the values.
    """
    width = values.dtype.itemsize * 8
    w = values.dtype.type
    with np.errstate(over="ignore"):
        delta = (values >> w(1)) ^ (w(0) - (values & w(1)))
        values[:] = _unkey(_key(r, width) + delta, width)
    return hash64(values)


# -- frequency tables (bit-level, MSB-first; see docs/format.md) --------------------


def _gamma(value: int) -> str:
    """Elias gamma code of value >= 1, MSB first."""
    bits = bin(value)[2:]
    return "0" * (len(bits) - 1) + bits


def pack_table(q, out) -> int:
    """Write the table of quantised counts ``q`` (rows x tokens) into zeroed ``out``; returns bits."""
    parts = []
    for row in q.tolist():
        others = [t for t, count in enumerate(row) if count and t]
        parts.append("1" if row[0] else "0")
        parts.append(_gamma(len(others) + 1))
        prev = 0
        for t in others:
            parts.append(_gamma(t - prev))
            prev = t
        parts.extend(_gamma(row[t]) for t in others)
    bits = "".join(parts)
    nbytes = (len(bits) + 7) // 8
    if nbytes:
        out[:nbytes] = np.frombuffer(int(bits.ljust(nbytes * 8, "0"), 2).to_bytes(nbytes, "big"), dtype=np.uint8)
    return len(bits)


class _TableError(Exception):
    def __init__(self, status: int):
        self.status = status


def read_table(data, n_rows, scale_bits, q_out) -> int:
    """Parse a table for rows of ``n_rows`` elements into zeroed ``q_out``; returns 0 or a status:
    -1 truncated, -2 value out of range, -3 token beyond the alphabet, -4 row without tokens,
    -5 trailing bytes."""
    data = bytes(data)
    bits = bin(int.from_bytes(data, "big") | (1 << (8 * len(data))))[3:] if data else ""
    end = len(bits)
    alphabet = q_out.shape[1]
    pos = 0

    def gamma(limit: int) -> int:
        nonlocal pos
        one = bits.find("1", pos)
        if one < 0:
            raise _TableError(-1)
        if one - pos > 40:
            raise _TableError(-2)
        stop = 2 * one - pos + 1
        if stop > end:
            raise _TableError(-1)
        value = int(bits[one:stop], 2)
        if value > limit:
            raise _TableError(-2)
        pos = stop
        return value

    try:
        for i, n in enumerate(np.asarray(n_rows).tolist()):
            top = (n >> max(0, n.bit_length() - scale_bits)) or 1
            if pos >= end:
                raise _TableError(-1)
            has_zero = bits[pos] == "1"
            pos += 1
            k = gamma(alphabet) - 1
            tokens = []
            t = 0
            for _ in range(k):
                t += gamma(alphabet)
                if t >= alphabet:
                    raise _TableError(-3)
                tokens.append(t)
            counts = [gamma(top) for _ in tokens]
            q_out[i, tokens] = counts
            if has_zero:
                q_out[i, 0] = max(1, top - sum(counts))
            elif k == 0:
                raise _TableError(-4)
    except _TableError as exc:
        return exc.status
    return -5 if end - pos >= 8 else 0


# -- table construction -------------------------------------------------------------


def normalize_rows(q, scale_bits, freqs_out) -> None:
    """Scale each row of counts to sum 2**scale_bits exactly (``_rans_tables.normalize``)."""
    freqs_out[:] = _rans_tables.normalize(q, scale_bits)


def encoder_table(rows, freqs, scale_bits, token_bits, out) -> None:
    """Write one ENC_ENTRY per symbol of every context with a row (``_rans_tables.encoder_table``)."""
    table = _rans_tables.encoder_table(rows, freqs, scale_bits, token_bits)
    entries = out.view(ENC_ENTRY)
    occupied = np.repeat(rows >= 0, 1 << token_bits)
    entries[occupied] = table[occupied]


def table_model(counts, token_bits, alphabet, pool_below, scale_bits, rows_out, q_out) -> int:
    """From symbol counts to table rows and quantised counts (``_rans_tables`` functions)."""
    hist = np.asarray(counts, dtype=np.int64).reshape(len(rows_out), -1)[:, :alphabet]
    n_c = hist.sum(axis=1)
    rows_out[:] = _rans_tables.table_rows(n_c)
    assert _rans_tables.POOL_BELOW == pool_below
    row_hist = _rans_tables.sum_rows(hist, n_c)
    q_out[:] = 0
    q_out[: len(row_hist)] = _rans_tables.quantized_counts(row_hist, row_hist.sum(axis=1), scale_bits)
    return len(row_hist)
