"""Pure-NumPy twins of the format-version-3 table kernels: pack, read, slot tables, scale choice; and ``decode3``
(a whole payload: its checks, tables and ``rans_decode3`` in one call).

Re-exported by ``reference``; the compiled twins live in ``_one_stream.pxi``.  See
``docs/format.md`` (version 3) for the bits.
"""

from __future__ import annotations

import numpy as np

from .._rans_tables import SCALE_BITS, STATE_LOW
from ._one_stream_rans import RAW_CHUNK, _Status, rans_decode3

__all__ = ["pack_table3", "read_table3", "slot_table3", "normalize_scaled", "quantize_rows3", "decode3"]

_M = 1 << SCALE_BITS


def _gamma(value: int) -> str:
    bits = bin(value)[2:]
    return "0" * (len(bits) - 1) + bits


def _exp_golomb(value: int, g: int) -> str:
    """Exp-Golomb code of order g of value >= 0: ``gamma((value >> g) + 1)``, then g raw bits."""
    return _gamma((value >> g) + 1) + (format(value & ((1 << g) - 1), f"0{g}b") if g else "")


def pack_table3(has_band, band_count, band_lo, freqs, scales, orders, out) -> int:
    """Write a version-3 table into zeroed ``out``; returns its length in bits.

    ``gamma(count + 1)`` and, if count, ``gamma(lo + 1)`` (only when ``has_band``),
    then per row of ``freqs`` (rows x alphabet, each row summing to 2**scales[row];
    0 = the token does not occur): ``gamma(k + 1)`` with k the number of tokens
    that occur; if k >= 2, ``gamma(13 - scale)`` and ``gamma(order + 1)``; the
    tokens' gaps (``gamma(t_0 + 1)``, then ``gamma(t_j - t_(j-1))``); and for every
    token but the first the Exp-Golomb code of order ``orders[row]`` of ``f - 1``.
    The first token's frequency is what the others leave of 2**scale.
    """
    parts = []
    if has_band:
        parts.append(_gamma(band_count + 1))
        if band_count:
            parts.append(_gamma(band_lo + 1))
    for row, scale, order in zip(np.asarray(freqs).tolist(), np.asarray(scales).tolist(), np.asarray(orders).tolist()):
        present = [t for t, f in enumerate(row) if f]
        parts.append(_gamma(len(present) + 1))
        if len(present) >= 2:
            parts.append(_gamma(SCALE_BITS + 1 - scale))
            parts.append(_gamma(order + 1))
        prev = -1
        for t in present:
            parts.append(_gamma(t - prev))
            prev = t
        parts.extend(_exp_golomb(row[t] - 1, order) for t in present[1:])
    bits = "".join(parts)
    nbytes = (len(bits) + 7) // 8
    if nbytes:
        out[:nbytes] = np.frombuffer(int(bits.ljust(nbytes * 8, "0"), 2).to_bytes(nbytes, "big"), dtype=np.uint8)
    return len(bits)


def read_table3(data, has_band, n_ctx, alphabet, max_tokens, band_out, freqs_out) -> int:
    """Parse a version-3 table from the start of ``data`` into zeroed ``freqs_out``, at scale 2**12.

    Returns the bytes it occupies, or a status: -1 truncated, -2 a value out of
    range, -3 a token beyond the alphabet or more than ``max_tokens`` in a row,
    -4 frequencies that leave nothing for the first token, -5 non-zero padding.
    Writes ``band_out = [count, lo]``; the rows are ``count + 1`` (one if there is
    no band).  After a status, ``band_out`` and ``freqs_out`` hold nothing meaningful.
    """
    data = bytes(data)
    bits = "".join(f"{b:08b}" for b in data)
    end = len(bits)
    pos = 0

    def gamma(limit: int) -> int:
        nonlocal pos
        one = bits.find("1", pos)
        if (one if one >= 0 else end) - pos > 40:  # the compiled reader gives up after 40 zeros
            raise _Status(-2)
        if one < 0:
            raise _Status(-1)
        stop = 2 * one - pos + 1
        if stop > end:
            raise _Status(-1)
        value = int(bits[one:stop], 2)
        if value > limit:
            raise _Status(-2)
        pos = stop
        return value

    try:
        count, lo = 0, 0
        if has_band:
            count = gamma(n_ctx + 1) - 1
            if count:
                lo = gamma(n_ctx - count + 1) - 1
        band_out[0], band_out[1] = count, lo
        for i in range(count + 1):
            k = gamma(alphabet + 1) - 1
            if k > max_tokens:
                raise _Status(-3)
            scale, order = SCALE_BITS, 0
            if k >= 2:
                scale = SCALE_BITS + 1 - gamma(SCALE_BITS + 1)
                order = gamma(scale + 1) - 1
            tokens = []
            t = -1
            for _ in range(k):
                t += gamma(alphabet)
                if t >= alphabet:
                    raise _Status(-3)
                tokens.append(t)
            rest = 1 << scale
            for t in tokens[1:]:
                high = gamma((((1 << scale) - 2) >> order) + 1) - 1
                if pos + order > end:
                    raise _Status(-1)
                f = ((high << order) | (int(bits[pos : pos + order], 2) if order else 0)) + 1
                pos += order
                if f > (1 << scale) - 1:
                    raise _Status(-2)
                freqs_out[i, t] = f << (SCALE_BITS - scale)
                rest -= f
            if k:
                if rest < 1:
                    raise _Status(-4)
                freqs_out[i, tokens[0]] = rest << (SCALE_BITS - scale)
    except _Status as exc:
        return exc.status
    nbytes = (pos + 7) // 8
    if pos % 8 and int(bits[pos : 8 * nbytes], 2):
        return -5
    return nbytes


def slot_table3(freqs, rank_mode, slots_out, lut_out) -> None:
    """One entry per (row, slot): ``token << 24 | (f - 1) << 12 | (slot - start)``.

    ``rank_mode``: the token field is the token's rank in its row (intra, one row)
    and ``lut_out[rank]`` the token.  A row where nothing occurs decodes token 0 at
    frequency 2**12 (no element of a valid blob is in it).
    """
    out: list[int] = []
    for row in np.asarray(freqs).tolist():
        present = [t for t, f in enumerate(row) if f]
        if not present:
            out.extend(((_M - 1) << 12) | j for j in range(_M))
            continue
        for rank, t in enumerate(present):
            f = row[t]
            if rank_mode:
                lut_out[rank] = t
            code = rank if rank_mode else t
            out.extend((code << 24) | ((f - 1) << 12) | j for j in range(f))
    slots_out[: len(out)] = np.array(out, dtype=np.uint32)


# -- choosing table scales --------------------------------------------------------------


def _bitlen(v) -> np.ndarray:
    return np.frexp(np.asarray(v, dtype=np.float64))[1].astype(np.int64)  # exact below 2**53


def _gamma_bits(v) -> np.ndarray:
    return 2 * _bitlen(v) - 1


def normalize_scaled(counts: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Scale row i of ``counts`` to sum exactly 2**scales[i], every seen symbol >= 1.

    ``_rans_tables.normalize`` with a scale per row: ``floor(c * 2**S / N)``, raised to 1 for
    seen symbols; the remainder goes to (or comes from) the row's most frequent
    symbols.  Integers only, and the same code for every backend.  Rows without
    counts stay 0.
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = np.left_shift(1, np.asarray(scales, dtype=np.int64))[:, None]
    n = counts.sum(axis=1, keepdims=True)
    freqs = (counts * total) // np.maximum(n, 1)
    freqs[(counts > 0) & (freqs == 0)] = 1
    diff = total[:, 0] - freqs.sum(axis=1)
    rows = np.arange(len(freqs))
    top = np.argmax(counts, axis=1)  # first maximum: deterministic tie-break
    grow = (diff > 0) & (n[:, 0] > 0)
    freqs[rows[grow], top[grow]] += diff[grow]
    for i in np.flatnonzero((diff < 0) & (n[:, 0] > 0)):  # rare: many raised symbols in one row
        deficit = -int(diff[i])
        while deficit:
            j = int(np.argmax(freqs[i]))
            take = min(deficit, int(freqs[i, j]) - 1)
            freqs[i, j] -= take
            deficit -= take
    freqs[n[:, 0] == 0] = 0
    return freqs


_GB = np.concatenate([[0], 2 * np.frexp(np.arange(1, 1 << 15, dtype=np.float64))[1].astype(np.int64) - 1])
#: _EGB[g, v]: bits of the Exp-Golomb code of order g of v (0 <= v < 2**12).
_EGB = np.stack([_GB[(np.arange(_M) >> g) + 1] + g for g in range(SCALE_BITS + 1)])


def _row_table_bits(freqs: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bits ``pack_table3`` spends on each row of ``freqs`` (at the rows' own scales), with the
    Exp-Golomb order that minimises them; returns (bits, orders)."""
    rows = len(freqs)
    row, tok = np.nonzero(freqs)  # row-major: tokens ascending within each row
    k = np.bincount(row, minlength=rows)
    first = np.ones(len(row), dtype=bool)
    first[1:] = row[1:] != row[:-1]
    prev = np.where(first, -1, np.concatenate([[0], tok[:-1]]))
    bits = _GB[k + 1] + np.where(k >= 2, _GB[SCALE_BITS + 1 - scales], 0)
    bits += np.bincount(row, weights=_GB[tok - prev], minlength=rows).astype(np.int64)
    coded = ~first  # the first token's frequency is implied
    v = freqs[row[coded], tok[coded]].astype(np.int64) - 1
    per_order = np.stack(
        [np.bincount(row[coded], weights=_EGB[g, v], minlength=rows) for g in range(SCALE_BITS + 1)]
    ).astype(np.int64)
    per_order += _GB[np.arange(SCALE_BITS + 1) + 1][:, None]
    per_order[np.arange(SCALE_BITS + 1)[:, None] > scales[None, :]] = 1 << 40  # order <= scale
    orders = np.argmin(per_order, axis=0)  # first minimum: the smallest order
    bits += np.where(k >= 2, per_order[orders, np.arange(rows)], 0)
    return bits, orders


def quantize_rows3(counts, cost_table, freqs_out, f12_out, scales_out, orders_out) -> int:
    """Per row of ``counts``: the frequencies at the scale 2**S (S <= 12) that minimise the
    estimated table bits plus data bits (``cost_table[f]``: Q16 bits of a symbol of
    frequency f out of 2**12), among S = bitlen(n) - 1 and its neighbours (clipped to
    [ceil(log2 k), 12] for k symbols; ties keep the first, finer one), and the
    Exp-Golomb order of its table code (the smallest of the cheapest).

    Writes the frequencies at that scale and at 2**12, the scales and the orders;
    returns the total estimated cost (Q16 bits).
    """
    counts = np.asarray(counts, dtype=np.int64)
    n = counts.sum(axis=1)
    k = (counts > 0).sum(axis=1)
    lowest = np.where(k >= 2, _bitlen(np.maximum(k - 1, 1)), 0)  # 2**S >= k
    middle = np.clip(_bitlen(np.maximum(n, 1)) - 1, lowest, SCALE_BITS)
    cost_table = np.asarray(cost_table, dtype=np.int64)
    best: list = []
    for d in (1, 0, -1):
        scales = np.clip(middle + d, lowest, SCALE_BITS)
        freqs = normalize_scaled(counts, scales)
        f12 = freqs << (SCALE_BITS - scales)[:, None]
        tbits, orders = _row_table_bits(freqs, scales)
        cost = (counts * cost_table[f12]).sum(axis=1) + (tbits << 16)
        if not best:
            best = [freqs, scales, f12, cost, orders]
            continue
        better = cost < best[3]  # a repeated scale costs the same: never better
        best = [
            np.where(better[:, None], freqs, best[0]),
            np.where(better, scales, best[1]),
            np.where(better[:, None], f12, best[2]),
            np.where(better, cost, best[3]),
            np.where(better, orders, best[4]),
        ]
    freqs_out[:] = best[0]
    f12_out[:] = best[2]
    scales_out[:] = best[1]
    orders_out[:] = best[4]
    return int(best[3].sum())


#: decode3's statuses besides the table's (minus 100), the stream's and -8 (twin: _one_stream.pxi's SEC3_*)
SEC3_PARAMS, SEC3_STATES, SEC3_ODD, SEC3_EMPTY, SEC3_CAPACITY, SEC3_CONSTANT = -20, -21, -22, -23, -24, 1
_STEPS_PER_WORD = 46000  # (_one_stream._STEPS_PER_WORD)


def _sec3_table(p: bytes, intra, mant_bits, exp_bits, alphabet, emask):
    """The params byte and table of payload ``p``: (0, (lanes, k, frequencies, count, lo, bytes used)) or (status, None)."""
    if len(p) < 1:
        return -101, None
    params = p[0]
    kk = (params >> 2) & 3
    if params >> 4 or (params & 3) >= 2 or (kk and not intra) or kk > min(3, mant_bits):
        return SEC3_PARAMS, None
    if intra:
        alpha, has_band, n_ctx, max_tokens = 1 << (exp_bits + kk), False, 1, 256
    else:
        alpha, has_band, n_ctx, max_tokens = alphabet, emask > 0, emask + 1, alphabet
    freqs = np.zeros((n_ctx + 1 if has_band else 1, alpha), dtype=np.uint32)
    band = np.zeros(2, dtype=np.int64)
    used = read_table3(np.frombuffer(p[1:], dtype=np.uint8), int(has_band), n_ctx, alpha, max_tokens, band, freqs)
    if used < 0:
        return used - 100, None
    count, lo = int(band[0]), int(band[1])
    return 0, (4 if params & 3 == 0 else 32, kk, freqs[: count + 1], count, lo, 1 + used)


def _sec3_capacity(freqs, intra, has_ref, mant_bits, kk, lanes, n_words, n) -> int:
    """``_one_stream._check_capacity`` as a status (SEC3_CONSTANT: a constant tensor against +0.0)."""
    if intra:
        return SEC3_CAPACITY if n * (mant_bits - kk + 1) > 31 * lanes + 16 * n_words else 0
    if not has_ref:
        t0 = int(np.flatnonzero(freqs[0])[0])
        if freqs[0, t0] == _M and t0 < 8:
            return SEC3_CONSTANT
        if n > _STEPS_PER_WORD * (lanes + n_words):
            return SEC3_CAPACITY
    return 0


def _sec3_parse(p: bytes, intra, has_ref, width, mant_bits, exp_bits, token_bits, alphabet, emask, n):
    """The checks and arguments of ``_one_stream.section3_args`` on payload ``p``: (0, arguments) or (status, None)."""
    status, table = _sec3_table(p, intra, mant_bits, exp_bits, alphabet, emask)
    if status:
        return status, None
    lanes, kk, freqs, count, lo, pos = table
    if len(p) - pos < 4 * lanes:
        return SEC3_STATES, None
    states = np.frombuffer(p[pos : pos + 4 * lanes], dtype="<u4").astype(np.uint32)
    if int(states.min()) < STATE_LOW or int(states.max()) >= 1 << 31:
        return SEC3_STATES, None
    pos += 4 * lanes
    if (len(p) - pos) % 2:
        return SEC3_ODD, None
    words = np.frombuffer(p[pos:], dtype=np.uint8)
    if not np.count_nonzero(freqs):
        return SEC3_EMPTY, None
    status = _sec3_capacity(freqs, intra, has_ref, mant_bits, kk, lanes, len(words) // 2, n)
    if status:
        return status, None
    if intra:
        mode, p_a, p_b, p_c, phases = 1, mant_bits - kk, width, 0, -(-(mant_bits - kk + 1) // RAW_CHUNK)
    else:
        mode, p_a, p_b, p_c, phases = (0 if has_ref else 2), token_bits, lo, count, -(-(width - 3) // RAW_CHUNK)
    return 0, (freqs, mode, p_a, p_b, p_c, lanes, phases, words, states)


def decode3(blob, start, end, out, ref, intra, width, mant_bits, exp_bits, token_bits, alphabet, emask, n):
    """A version-3 RANS or INTRA payload ``blob[start:end]`` decoded in one call: ``_one_stream.section3_args``'
    checks, the tables and :func:`rans_decode3`.

    ``out``: the ``n`` words to write, or None for a new array (made once the payload is known to hold
    ``n`` elements); ``ref``: the reference words of a delta, or None.  Returns ``(status, out,
    hash64(values), hash64(ref) or 0)``: status 0, or any other value when the payload is damaged,
    inconsistent or a constant tensor against +0.0 (``SEC3_CONSTANT``; then ``out`` is None or partly
    written, and the caller's step-by-step path says what is wrong, or decodes the constant).
    """
    status, args = _sec3_parse(
        bytes(memoryview(blob).cast("B")[start:end]),
        intra,
        ref is not None,
        width,
        mant_bits,
        exp_bits,
        token_bits,
        alphabet,
        emask,
        n,
    )
    if status:
        return status, None, 0, 0
    freqs, mode, p_a, p_b, p_c, lanes, phases, words, states = args
    slots = np.zeros(len(freqs) << SCALE_BITS, dtype=np.uint32)
    lut = np.zeros(256, dtype=np.uint32)
    slot_table3(freqs, int(intra), slots, lut)
    if out is None:
        out = np.empty(n, dtype=f"<u{width // 8}")
    hashes = np.zeros(2, dtype=np.uint64)
    status = rans_decode3(
        ref if ref is not None else out,
        mode,
        p_a,
        p_b,
        p_c,
        mant_bits,
        emask,
        slots,
        lut,
        lanes,
        phases,
        words,
        states,
        out,
        hashes,
    )
    return status, out, int(hashes[0]), int(hashes[1])
