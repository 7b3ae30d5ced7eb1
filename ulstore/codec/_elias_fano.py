"""Elias-Fano positions: where a SPARSE blob of format version 4 changes its tensor.

The ``m`` changed positions ``p_0 < p_1 < ... < p_(m-1)`` of a tensor of ``n``
elements are split at ``L = bitlen(n // m) - 1`` bits (derived, never stored)::

    low  | ceil(m L / 8) bytes: p_k mod 2^L in bits [k L, (k + 1) L), LSB-first
    high | ceil(H / 8) bytes, H = m + ((n - 1) >> L) + 1: bit (p_k >> L) + k set,
         | every other bit 0 (LSB-first)

Every padding bit is 0, so a set of positions has exactly one coding.  It costs
at most ``L + 3`` bits per position, about 0.6 bit above the entropy of a
uniformly random set (version 2's entropy-coded gap section comes closer): 5%
more bytes for a SPARSE blob of an RL step.  What it buys is the decoder: each
position is the next set bit of ``high`` (a count of trailing zeros) plus ``L``
bits of ``low``, with no table and no serial state; the in-place apply runs 12%
fewer instructions per version than with the gap section (docs/format.md).

This module writes and (as the NumPy twin of the compiled kernel) reads them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["low_bits", "sizes", "encode_positions", "ef_encode", "ef_positions"]


def low_bits(n: int, m: int) -> int:
    """L: the low bits kept per position, for ``m`` positions (1 <= m <= n) below ``n``."""
    return (n // m).bit_length() - 1


def sizes(n: int, m: int) -> tuple[int, int]:
    """Bytes of the low and the high part."""
    L = low_bits(n, m)
    return (m * L + 7) // 8, (m + ((n - 1) >> L) + 1 + 7) // 8


def encode_positions(pos: np.ndarray, n: int) -> bytes:
    """The low and high parts of ascending positions ``pos`` (1 <= len <= n, all below ``n``), joined."""
    pos = np.asarray(pos, dtype=np.int64)
    m = len(pos)
    L = low_bits(n, m)
    lo_len, hi_len = sizes(n, m)
    low = np.zeros(lo_len * 8, dtype=np.uint8)
    if L:
        low[: m * L] = ((pos[:, None] >> np.arange(L, dtype=np.int64)) & 1).reshape(-1)
    high = np.zeros(hi_len * 8, dtype=np.uint8)
    high[(pos >> L) + np.arange(m, dtype=np.int64)] = 1
    return np.packbits(low, bitorder="little").tobytes() + np.packbits(high, bitorder="little").tobytes()


def ef_encode(pos, n: int, out: np.ndarray) -> int:
    """:func:`encode_positions` into ``out`` (exactly :func:`sizes` bytes): the NumPy twin of the kernel.

    Returns 0, or -9 when a length is wrong or the positions do not ascend below ``n``.
    """
    pos = np.asarray(pos, dtype=np.int64)
    m = len(pos)
    if not 1 <= m <= n or n >= 1 << 58 or len(out) != sum(sizes(n, m)):
        return -9
    if (m > 1 and (np.diff(pos) <= 0).any()) or pos[0] < 0 or pos[-1] >= n:
        return -9
    out[:] = np.frombuffer(encode_positions(pos, n), dtype=np.uint8)
    return 0


def ef_positions(lo, hi, n: int, pos_out: np.ndarray) -> int:
    """Decode ``len(pos_out)`` positions below ``n`` from the low and high parts (the NumPy twin of the kernel).

    Returns 0; -6 when a position lies at or past ``n``; -9 when the parts are
    not :func:`sizes` long or ``n`` is 2**58 or more (bad arguments: no array is
    that long, and past it the kernel's 64-bit reads and shifts would overflow);
    -10 when they are not the coding of ascending positions (a wrong number of
    set bits, a low padding bit set, two equal positions), checked in that order.
    """
    m = len(pos_out)
    if not 1 <= m <= n or n >= 1 << 58:
        return -9
    L = low_bits(n, m)
    lo = np.frombuffer(lo, dtype=np.uint8)
    hi = np.frombuffer(hi, dtype=np.uint8)
    if (len(lo), len(hi)) != sizes(n, m):
        return -9
    ones = np.flatnonzero(np.unpackbits(hi, bitorder="little"))
    low = np.unpackbits(lo, bitorder="little")
    if len(ones) != m or low[m * L :].any():
        return -10
    pos = (ones - np.arange(m, dtype=np.int64)) << L
    if L:
        pos |= (low[: m * L].reshape(m, L).astype(np.int64) << np.arange(L, dtype=np.int64)).sum(axis=1)
    if m > 1 and (np.diff(pos) <= 0).any():
        return -10
    if pos[-1] >= n:
        return -6
    pos_out[:] = pos
    return 0
