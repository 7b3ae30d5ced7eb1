"""Pure-NumPy ULPack kernels: the executable specification.

Every function here has a compiled twin in ``codec_ext/kernels.pyx`` with the same
signature and byte-identical results; tests hold the two to that.  The element-wise
stages are vectorised; the rANS loops are inherently serial and run in plain Python
(slow, but short and obviously right).

Conventions shared with the compiled kernels
--------------------------------------------
* ``x``, ``r``: target and reference as unsigned w-bit words; ``has_ref`` false means
  intra (reference all +0.0; ``r`` is then a placeholder and never read).
* token ``t`` of residual ``z``: ``nb = max(bitlen(z) - 3, 0)``, ``t = (z >> nb) + 4 nb``;
  ``tail = z & (2**nb - 1)`` is stored raw.  ``t`` determines (b, q1, q2) and vice versa.
* context of element i: ``(r_i >> mant_bits) & emask`` (emask 0 drops conditioning).
* rANS: 4 lanes, element i on lane ``i % 4``; states in [2**15, 2**31); 16-bit words.
"""
from __future__ import annotations

import numpy as np

from ._format import LANES
from ._tables import STATE_LOW

__all__ = ["hash64", "analyze", "rans_encode", "decode", "BACKEND"]

BACKEND = "numpy"

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, a bijection on 64-bit words."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash64(data) -> int:
    """64-bit checksum of a byte buffer: sum of mix(word_j + (j+1)*golden), then mixed with the length.

    Words are the little-endian u64s of the bytes zero-padded to a multiple of 8.  A
    sum of bijections of position-salted words: any single changed word changes it,
    and it vectorises (no serial chain), which keeps it cheap next to the coder.
    """
    b = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    nbytes = len(b)
    pad = (-nbytes) % 8
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    words = b.view("<u8").astype(np.uint64)
    with np.errstate(over="ignore"):
        salt = (np.arange(1, len(words) + 1, dtype=np.uint64)) * _GOLDEN
        acc = int(_mix(words + salt).sum(dtype=np.uint64))
        final = _mix(np.array([(acc + nbytes * 0xD6E8FEB86659FD93) & _M64], dtype=np.uint64))
    return int(final[0])


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


def _residual(x: np.ndarray, r, width: int) -> np.ndarray:
    """zigzag(key(x) - key(r)) in w-bit arithmetic."""
    kr = _key(r, width) if r is not None else x.dtype.type(1 << (width - 1))  # key(+0.0)
    d = _key(x, width) - kr  # wraps mod 2**w
    sign = (d >> x.dtype.type(width - 1)) * x.dtype.type((1 << width) - 1)  # all ones if negative
    return (d << x.dtype.type(1)) ^ sign


def _contexts(r, n: int, mant_bits: int, emask: int) -> np.ndarray:
    if r is None or emask == 0:
        return np.zeros(n, dtype=np.int64)
    return ((r >> r.dtype.type(mant_bits)) & r.dtype.type(emask)).astype(np.int64)


def analyze(x, r, has_ref, mant_bits, emask, tokens_out, hist_out, tail_out) -> int:
    """Pass 1 of encoding: tokens, per-context token histogram, packed raw tails.

    Writes ``tokens_out[:n]``, adds counts into ``hist_out`` (contexts x alphabet,
    zeroed by the caller) and writes the LSB-first tail bitstream into ``tail_out``.
    Returns the number of tail bits.
    """
    width = x.dtype.itemsize * 8
    r = r if has_ref else None
    with np.errstate(over="ignore"):
        z = _residual(x, r, width)
    nb = np.maximum(_bitlen(z, width) - 3, 0)
    nbu = nb.astype(z.dtype)
    tokens = (z >> nbu).astype(np.int64) + 4 * nb
    tokens_out[: len(x)] = tokens
    alphabet = hist_out.shape[1]
    ctx = _contexts(r, len(x), mant_bits, emask)
    hist_out += np.bincount(ctx * alphabet + tokens, minlength=hist_out.size).reshape(hist_out.shape).astype(hist_out.dtype)
    tails = (z & ((z.dtype.type(1) << nbu) - z.dtype.type(1))).astype(np.uint64)
    total = int(nb.sum())
    if total:
        owner = np.repeat(np.arange(len(x)), nb)
        first = np.cumsum(nb) - nb
        k = (np.arange(total) - np.repeat(first, nb)).astype(np.uint64)
        bits = ((tails[owner] >> k) & np.uint64(1)).astype(np.uint8)
        packed = np.packbits(bits, bitorder="little")
        tail_out[: len(packed)] = packed
    return total


def rans_encode(tokens, r, has_ref, mant_bits, emask, ctx_map, rcp, shift, start, cmpl, xmax, alphabet, words_out, states_out) -> int:
    """Pass 2: rANS-encode ``tokens`` in reverse; words fill ``words_out`` from its end.

    The table arrays are indexed by ``ctx_map[context] * alphabet + token``.
    Returns the number of 16-bit words written (they are ``words_out[-count:]``).
    """
    n = len(tokens)
    r = r if has_ref else None
    ctx = ctx_map[_contexts(r, n, mant_bits, emask)].astype(np.int64) * alphabet + np.asarray(tokens[:n], dtype=np.int64)
    rcp, shift = rcp.tolist(), shift.tolist()
    start, cmpl, xmax = start.tolist(), cmpl.tolist(), xmax.tolist()
    state = [STATE_LOW] * LANES
    out = []
    for i in range(n - 1, -1, -1):
        e = int(ctx[i])
        lane = i & 3
        x = state[lane]
        if x >= xmax[e]:
            out.append(x & 0xFFFF)
            x >>= 16
        q = (x * rcp[e]) >> shift[e]
        state[lane] = x + start[e] + q * cmpl[e]
    count = len(out)
    # the decoder reads words in the reverse order of their emission
    words_out[len(words_out) - count :] = np.array(out[::-1], dtype=np.uint16)
    states_out[:] = state
    return count


def decode(words, states, tail, tail_bits, r, has_ref, mant_bits, emask, ctx_map, slot2sym, fs, scale_bits, alphabet, out) -> int:
    """Decode tokens, read tails and rebuild the target words into ``out``.

    ``words`` holds the little-endian 16-bit word stream as bytes, ``tail`` the tail
    bytes.  Returns 0, or a negative status (``ulstore.codec.STATUS`` names them).
    """
    n = len(out)
    width = out.dtype.itemsize * 8
    total = 1 << scale_bits
    mask = total - 1
    r = r if has_ref else None
    ctx = _contexts(r, n, mant_bits, emask)
    dense = ctx_map[ctx] if n else np.zeros(0, np.int64)
    if n and dense.min() < 0:
        return -4
    words = np.frombuffer(words, dtype="<u2").tolist()
    s2s, fsl = slot2sym.tolist(), fs.tolist()
    state = [int(s) for s in states]
    pos = 0
    tokens = np.empty(n, dtype=np.int64)
    for i in range(n):
        lane = i & 3
        x = state[lane]
        c = int(dense[i])
        slot = x & mask
        t = s2s[c * total + slot]
        e = fsl[c * alphabet + t]
        x = (e >> 16) * (x >> scale_bits) + slot - (e & 0xFFFF)
        if x < STATE_LOW:
            if pos >= len(words):
                return -1
            x = (x << 16) | words[pos]
            pos += 1
        state[lane] = x
        tokens[i] = t
    if pos != len(words):
        return -5
    if any(s != STATE_LOW for s in state):
        return -3
    nb = np.maximum((tokens >> 2) - 1, 0)
    if int(nb.sum()) != tail_bits:
        return -2
    bits = np.unpackbits(np.frombuffer(tail, dtype=np.uint8), bitorder="little")[:tail_bits].astype(np.uint64)
    if len(bits) < tail_bits:
        return -2
    first = np.cumsum(nb) - nb
    k = (np.arange(tail_bits) - np.repeat(first, nb)).astype(np.uint64)
    owner = np.repeat(np.arange(n), nb)
    tails = np.zeros(n, dtype=np.uint64)
    np.add.at(tails, owner, bits << k)
    wt = out.dtype.type
    z = (((tokens - 4 * nb).astype(np.uint64) << nb.astype(np.uint64)) | tails).astype(out.dtype)
    with np.errstate(over="ignore"):
        delta = (z >> wt(1)) ^ (wt(0) - (z & wt(1)))  # unzigzag
        kr = _key(r, width) if r is not None else wt(1 << (width - 1))
        out[:] = _unkey(kr + delta, width)
    return 0
