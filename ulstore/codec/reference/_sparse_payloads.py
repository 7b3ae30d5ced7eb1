"""Pure-NumPy twins of the SPARSE kernels: split, gap gather, word-sum update, scatter, decode (both versions).

Part of the NumPy backend (re-exported by ``reference``); the compiled twins are in
``_kernels.pyx``.
"""

from __future__ import annotations

import numpy as np

from .. import _rans_tables
from .._elias_fano import ef_encode, ef_positions
from .._format import LANES
from .._rans_tables import SCALE_BITS
from ._hashes import _GOLDEN, _M64
from ._hashes import mix_words as _mix
from ._residual_sections import _bitlen, normalize_rows, rans_decode, read_table, reconstruct, slot_table, unpack_tails

__all__ = [
    "sparse_split",
    "gap_gather",
    "sum_update",
    "scatter",
    "sparse_decode",
    "ef_encode",
    "ef_positions",
    "sparse_decode_ef",
]


def sparse_split(z, sym, gaps_out, gsym_out, z_out, sym_out) -> int:
    """The changed elements of residuals ``z``: gaps between their positions and the gaps' tokens,
    their residuals and symbols.  The outputs must hold exactly the non-zero count: returns it,
    or -1 if they do not."""
    pos = np.flatnonzero(z)
    if len(pos) != len(gaps_out):
        return -1
    gaps = (np.diff(pos, prepend=-1) - 1).astype(np.uint32)
    nb = np.maximum(_bitlen(gaps, 32) - 3, 0)
    gaps_out[:] = gaps
    gsym_out[:] = (gaps >> nb.astype(np.uint32)) + 4 * nb
    z_out[:] = z[pos]
    sym_out[:] = sym[pos]
    return len(pos)


def gap_gather(gaps, r, pos_out, r_out) -> int:
    """Positions ``p_k = p_(k-1) + gaps_k + 1`` (``p_(-1) = -1``) and the reference words there.

    Returns 0, or -6 when a position lies past the end of ``r``.
    """
    pos = np.cumsum(np.asarray(gaps, dtype=np.int64) + 1) - 1
    if len(pos) and pos[-1] >= len(r):
        return -6
    pos_out[:] = pos
    r_out[:] = r[pos]
    return 0


def sum_update(r, pos, values) -> int:
    """How ``hash_sum64(r)`` changes when ``r[pos] = values`` (pos ascending), mod 2**64.

    Visits only the 8-byte words that hold a changed element.
    """
    pos = np.asarray(pos)
    if len(values) != len(pos) or (len(pos) and (pos[0] < 0 or pos[-1] >= len(r) or (np.diff(pos) <= 0).any())):
        raise ValueError("sum_update needs ascending positions inside r, one value each")
    if not len(pos):
        return 0
    per = 8 // r.itemsize
    word = pos // per
    starts = np.diff(word, prepend=-1) != 0
    touched = word[starts]
    idx = touched[:, None] * per + np.arange(per)
    old = np.zeros(idx.shape, dtype=r.dtype)  # the last word is zero-padded, as in hash64
    inside = idx < len(r)
    old[inside] = r[idx[inside]]
    new = old.copy()
    new[np.cumsum(starts) - 1, pos % per] = values
    with np.errstate(over="ignore"):
        salt = (touched.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        gained = int(_mix(new.view(np.uint64).reshape(-1) + salt).sum(dtype=np.uint64))
        lost = int(_mix(old.view(np.uint64).reshape(-1) + salt).sum(dtype=np.uint64))
    return (gained - lost) & _M64


def scatter(dst, pos, values) -> int:
    """``dst[pos] = values``; returns 0, or -1 without writing anything unless the positions
    strictly ascend inside ``dst`` and match ``values`` one to one."""
    pos = np.asarray(pos)
    if len(values) != len(pos) or (len(pos) and (pos[0] < 0 or pos[-1] >= len(dst) or (np.diff(pos) <= 0).any())):
        return -1
    dst[pos] = values
    return 0


def _section_tokens(r, mant_bits, emask, n_c, table, states, words, alphabet, tokens_out) -> int:
    """Tables for rows of ``n_c`` (per context), then the tokens of one section: 0 or a status (tables: -100 + s)."""
    rows = _rans_tables.table_rows(n_c)
    row_n = _rans_tables.sum_rows(n_c, n_c)
    q = np.zeros((len(row_n), alphabet), dtype=np.int64)
    status = read_table(table, row_n, SCALE_BITS, q)
    if status:
        return status - 100
    freqs = np.empty(q.shape, dtype=np.uint32)
    normalize_rows(q, SCALE_BITS, freqs)
    slots = np.empty(len(freqs) << SCALE_BITS, dtype=np.uint32)
    slot_table(freqs, slots)
    ctx_rows = (np.maximum(rows, 0) << SCALE_BITS).astype(np.int32)
    return rans_decode(r, mant_bits, emask, ctx_rows, slots, words, states, tokens_out)


def sparse_decode(
    r,
    mant_bits,
    emask,
    pool_below,
    g_table,
    g_states,
    g_words,
    g_tail,
    g_tail_bits,
    g_alphabet,
    t_table,
    t_states,
    t_words,
    t_tail,
    t_tail_bits,
    t_alphabet,
    pos_out,
    values_out,
    sum_out,
) -> int:
    """Decode a SPARSE payload's gap and residual sections (the compiled twin does it in one call).

    Writes the m = len(pos_out) changed positions, their new words, and in
    ``sum_out[0]`` what :func:`sum_update` returns for them.  Returns 0,
    a stream status (-1, -2, -3, -5 as the section kernels, -6 a position past the
    end, -7 a zero residual, -9 bad arguments), or a table status minus 100.
    """
    assert pool_below == _rans_tables.POOL_BELOW
    m = len(pos_out)
    if (
        m == 0
        or m > len(r)
        or g_alphabet > 256
        or t_alphabet > 256
        or emask > 0xFFFF
        or len(values_out) != m
        or len(sum_out) < 1
        or len(g_states) != LANES
        or len(t_states) != LANES
    ):
        return -9
    tokens = np.empty(m, dtype=np.uint8)
    status = _section_tokens(r[:m], 0, 0, np.array([m]), g_table, g_states, g_words, g_alphabet, tokens)
    gaps = np.empty(m, dtype=np.uint32)
    if not status:
        status = unpack_tails(tokens, g_tail, g_tail_bits, gaps)
    if not status:
        status = gap_gather(gaps, r, pos_out, np.empty(m, dtype=r.dtype))
    if not status:
        status = _sparse_rest(
            r,
            mant_bits,
            emask,
            t_table,
            t_states,
            t_words,
            t_tail,
            t_tail_bits,
            t_alphabet,
            pos_out,
            values_out,
            sum_out,
            tokens,
        )
    return status


def sparse_decode_ef(
    r,
    mant_bits,
    emask,
    pool_below,
    lo,
    hi,
    t_table,
    t_states,
    t_words,
    t_tail,
    t_tail_bits,
    t_alphabet,
    pos_out,
    values_out,
    sum_out,
) -> int:
    """:func:`sparse_decode` of a version-4 SPARSE payload: Elias-Fano positions (:func:`ef_positions`'s
    statuses), then the residual section as in version 2."""
    assert pool_below == _rans_tables.POOL_BELOW
    m = len(pos_out)
    if (
        m == 0
        or m > len(r)
        or t_alphabet > 256
        or emask > 0xFFFF
        or len(values_out) != m
        or len(sum_out) < 1
        or len(t_states) != LANES
    ):
        return -9
    status = ef_positions(lo, hi, len(r), pos_out)
    if not status:
        status = _sparse_rest(
            r,
            mant_bits,
            emask,
            t_table,
            t_states,
            t_words,
            t_tail,
            t_tail_bits,
            t_alphabet,
            pos_out,
            values_out,
            sum_out,
            np.empty(m, dtype=np.uint8),
        )
    return status


def _sparse_rest(
    r, mant_bits, emask, t_table, t_states, t_words, t_tail, t_tail_bits, t_alphabet, pos, values_out, sum_out, tokens
) -> int:
    """A SPARSE payload's residual section, its positions decoded: the new words and the word-sum change."""
    rs = r[pos]
    n_c = np.bincount(((rs >> r.dtype.type(mant_bits)) & r.dtype.type(emask)).astype(np.int64), minlength=emask + 1)
    status = _section_tokens(rs, mant_bits, emask, n_c, t_table, t_states, t_words, t_alphabet, tokens)
    if not status:
        status = unpack_tails(tokens, t_tail, t_tail_bits, values_out)
    if not status and not values_out.all():
        status = -7
    if not status:
        reconstruct(rs, values_out)
        sum_out[0] = sum_update(r, pos, values_out)
    return status
