"""Pure-NumPy twins of the format-version-3 kernels: the executable specification.

Re-exported by ``reference``; the compiled twins live in ``_one_stream.pxi``, the table
kernels' twins in ``_one_stream_tables``.  See ``docs/format.md`` (version 3) for the bytes.

Version 3 sections (modes RANS and INTRA)
-----------------------------------------
* One token per element, coded with static rANS (32-bit states in [2**15, 2**31),
  16-bit words, probability scale 2**12) on ``lanes`` interleaved states
  (4 or 32); element i uses lane ``i % lanes``.
* The raw low bits of an element go through the same state, after its token, as
  chunks of at most 15 bits (``x = x << c | bits`` when encoding, ``bits = x & (2**c
  - 1); x >>= c`` when decoding): one stream, no serial bit cursor, and every lane
  is independent of the others, which is what lets a decoder run 32 of them in
  SIMD registers.
* Decoding order: elements in groups of ``G = min(lanes, 8)``; in each group first
  every element's token (in element order), then every element's raw chunk 0,
  chunk 1, ... (``phases`` chunks in all).  Each step that leaves its state below
  2**15 shifts in the next 16-bit word.  Encoding runs the exact reverse.
* Delta (``mode`` 0): the token and tail of ``z = zigzag(key(x) - key(r))`` as in
  version 1; the table row of element i is its reference exponent's *band row*:
  ``c - lo + 1`` for ``lo <= c < lo + count``, else row 0 (the pooled row).
* Intra (``mode`` 1): the symbol is the exponent and the top mantissa bits,
  ``(x >> s) & mask``; the raw value is the sign and the ``s`` low mantissa bits,
  ``(sign << s) | (x & (2**s - 1))``.  Slot entries carry the symbol's *rank*
  among the row's symbols, and ``lut[rank]`` gives it back.
"""

from __future__ import annotations

import numpy as np

from .._rans_tables import ENC_ENTRY, SCALE_BITS, STATE_LOW
from ._hashes import hash64 as _hash64

__all__ = [
    "RAW_CHUNK",
    "intra_symbols",
    "rans_encode3",
    "rans_decode3",
]

RAW_CHUNK = 15  # raw bits per rANS step: more could leave a refilled state below 2**15
_M = 1 << SCALE_BITS


def intra_symbols(x, sym_shift, sym_mask, sym_out) -> int:
    """``sym = (x >> sym_shift) & sym_mask``: an element's exponent and top mantissa bits.

    Returns ``hash64(x)``.
    """
    sym_out[:] = (x >> x.dtype.type(sym_shift)) & x.dtype.type(sym_mask)
    return _hash64(x)


def _tail_len(t: int) -> int:
    return max((t >> 2) - 1, 0)


def _band_row(c: int, lo: int, count: int) -> int:
    return c - lo + 1 if lo <= c < lo + count else 0


def _element(mode, v, sym, p_a, p_b):
    """(raw value, raw bit count) of one element for the encoder."""
    if mode == 0:  # delta: v is the residual z, sym = context << token_bits | token
        nb = _tail_len(sym & ((1 << p_a) - 1))
        return v & ((1 << nb) - 1), nb
    s, width = p_a, p_b  # intra: v is the value, sym its symbol
    return ((v >> (width - 1)) << s) | (v & ((1 << s) - 1)), s + 1


def rans_encode3(v, sym, mode, p_a, p_b, table, lanes, phases, words_out, states_out, mostly_zero=False) -> int:
    """Encode every element (token, then raw chunks) in the reverse of decoding order.

    ``table``: one ``ENC_ENTRY`` per symbol value (delta: ``context << token_bits |
    token``, mode 0, ``p_a`` = token_bits; intra: the exponent and top mantissa bits,
    mode 1, ``p_a = s``, ``p_b`` the bit width).  Words fill ``words_out`` from its
    end (it needs ``len(v) * (1 + phases) + 8`` slots); returns their count.
    ``mostly_zero`` is the compiled twin's speed hint.
    """
    entries = np.frombuffer(table, dtype=ENC_ENTRY)
    freq = (entries["xmax"].astype(np.int64) >> (31 - SCALE_BITS)).tolist()
    start, xmax = entries["start"].tolist(), entries["xmax"].tolist()
    values, syms = np.asarray(v).tolist(), np.asarray(sym).tolist()
    n = len(values)
    group = min(lanes, 8)
    state = [STATE_LOW] * lanes
    out = []
    for lo in range(((n - 1) // group) * group if n else -1, -1, -group):
        hi = min(n, lo + group)
        elems = [_element(mode, values[i], syms[i], p_a, p_b) for i in range(lo, hi)]
        for p in range(phases - 1, -1, -1):
            for i in range(hi - 1, lo - 1, -1):
                raw, nb = elems[i - lo]
                c = min(max(nb - RAW_CHUNK * p, 0), RAW_CHUNK)
                if c:
                    x = state[i % lanes]
                    if x >= 1 << (31 - c):
                        out.append(x & 0xFFFF)
                        x >>= 16
                    state[i % lanes] = (x << c) | ((raw >> (RAW_CHUNK * p)) & ((1 << c) - 1))
        for i in range(hi - 1, lo - 1, -1):
            e = syms[i]
            x = state[i % lanes]
            if x >= xmax[e]:
                out.append(x & 0xFFFF)
                x >>= 16
            f = freq[e]
            state[i % lanes] = (x // f) * _M + x % f + start[e]
    count = len(out)
    words_out[len(words_out) - count :] = np.array(out[::-1], dtype=np.uint16)
    states_out[:] = state
    return count


def rans_decode3(
    r, mode, p_a, p_b, p_c, mant_bits, emask, slots, lut, lanes, phases, words, states, out, hashes_out
) -> int:
    """Decode every element into ``out`` (values); returns 0 or a negative status.

    ``slots[row * 2**12 + slot]`` is ``token << 24 | (f - 1) << 12 | (slot - start)``.
    Delta: ``r`` is the reference (contexts, and the values are ``r`` plus the
    residual); ``p_b, p_c`` the band.  Intra: ``r`` is not read; tokens are ranks,
    ``lut[rank]`` the symbol, ``p_a = s``, ``p_b`` the bit width.  Writes
    ``hashes_out = [hash64(out), hash64(r) or 0]``.  Statuses: -1 the words end
    early, -3 a lane does not end at 2**15, -5 words are left over.
    """
    n = len(out)
    mask = _M - 1
    width = out.dtype.itemsize * 8
    wmask = (1 << width) - 1
    h = 1 << (width - 1)
    word_list = np.frombuffer(words, dtype="<u2").tolist()
    table = np.asarray(slots).tolist()
    lut_list = np.asarray(lut).tolist()
    state = [int(s) for s in states]
    refs: list = np.asarray(r).tolist() if mode == 0 else []
    pos = 0
    result = [0] * n
    group = min(lanes, 8)

    def refill(x):
        nonlocal pos
        if x < STATE_LOW:
            if pos >= len(word_list):
                raise _Status(-1)
            x = (x << 16) | word_list[pos]
            pos += 1
        return x

    try:
        for lo in range(0, n, group):
            hi = min(n, lo + group)
            tokens, raws = [], []
            for i in range(lo, hi):
                row = _band_row((refs[i] >> mant_bits) & emask, p_b, p_c) if mode == 0 else 0
                x = state[i % lanes]
                e = table[(row << SCALE_BITS) + (x & mask)]
                x = (((e >> 12) & 0xFFF) + 1) * (x >> SCALE_BITS) + (e & 0xFFF)
                state[i % lanes] = refill(x)
                tokens.append(e >> 24)
                raws.append(0)
            for p in range(phases):
                for i in range(lo, hi):
                    t = tokens[i - lo]
                    nb = _tail_len(t) if mode != 1 else p_a + 1
                    c = min(max(nb - RAW_CHUNK * p, 0), RAW_CHUNK)
                    x = state[i % lanes]
                    raws[i - lo] |= (x & ((1 << c) - 1)) << (RAW_CHUNK * p)
                    state[i % lanes] = refill(x >> c)
            for i in range(lo, hi):
                t, raw = tokens[i - lo], raws[i - lo]
                if mode != 1:
                    nb = _tail_len(t)
                    z = ((t - 4 * nb) << nb) | raw
                    ref = refs[i] if mode == 0 else 0
                    kr = (ref ^ wmask) if ref & h else (ref | h)
                    k = (kr + ((z >> 1) ^ (-(z & 1)))) & wmask
                    result[i] = (k & ~h & wmask) if k & h else (~k & wmask)
                else:
                    s = p_a
                    result[i] = ((raw >> s) << (width - 1)) | (lut_list[t] << s) | (raw & ((1 << s) - 1))
    except _Status as exc:
        return exc.status
    if pos != len(word_list):
        return -5
    if any(x != STATE_LOW for x in state):
        return -3
    out[:] = np.array(result, dtype=out.dtype)
    hashes_out[0] = _hash64(out)
    hashes_out[1] = _hash64(r) if mode == 0 else 0
    return 0


class _Status(Exception):
    def __init__(self, status: int):
        self.status = status
