"""Format-version-3 payloads of modes RANS and INTRA: one rANS stream per blob.

Both payloads are one *section*::

    params (1 byte) | table (bit string, zero-padded to a byte) | lane states (4 x lanes) | words (to the end)

``params``: bits 0-1 the lane count (0: 4 lanes, 1: 32 lanes), bits 2-3 the
mantissa bits of an INTRA symbol (0 for RANS), other bits 0.  The word count is
what is left of the payload, so a section has no length fields at all.

- RANS (delta, or intra against +0.0): each element's residual token and tail, as
  in version 1, but the tail goes through the rANS state after its token (see
  ``_one_stream_rans``), and the table rows are *bands* of reference exponents: the
  contexts ``lo .. lo + count - 1`` have a row each, every other context shares
  row 0.  The decoder maps a context to its row with two comparisons, so it
  needs no pass over the reference before decoding.
- INTRA (no reference): each element's symbol is its exponent and top ``k``
  mantissa bits (P(e) P(m_top | e) by the chain rule), in one row; the sign and
  the other mantissa bits are raw.  ``k`` (0..3) is chosen per blob.

Choices the encoder makes (deterministically, from integer counts and estimates of
the coded size, so every backend and machine picks the same): the band (``choose_band``), each row's
scale and Exp-Golomb order (``quantize_rows``), the lane count (32 when the
payload is large enough that 28 more lane states cost under 0.05%), ``k``, and
INTRA against RANS for intra blobs.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import CorruptBlobError
from . import _format as F
from ._dtypes import FloatFormat
from ._rans_tables import ENC_ENTRY, POOL_BELOW, SCALE_BITS, STATE_LOW
from ._scratch import scratch

__all__ = [
    "encode_delta",
    "encode_intra",
    "decode_section3",
    "section3_args",
    "section3_parts",
    "status_error",
    "intra_plan",
    "intra_choice",
    "quantize_rows",
    "band_of",
    "choose_band",
    "RAW_CHUNK",
    "LANE_COUNTS",
    "COST",
]

RAW_CHUNK = 15
LANE_COUNTS = (4, 32)  # by params bits 0-1
#: Estimated payload bits from which a section uses 32 lanes (the vector decoder's
#: layout): below it, 28 more lane states (112 bytes) would cost more than ~0.05%.
WIDE_BITS = 1 << 21
#: INTRA symbols per blob at most: a slot entry holds a symbol's rank in 8 bits.
MAX_SYMBOLS = 256
_M = 1 << SCALE_BITS
# rANS on one lane can decode at most this many tokens per 16 bits it reads (each
# step with f < 2**12 shrinks the state by at least 1/2**12; see decode_section3).
_STEPS_PER_WORD = 46000
_STATES_FORMAT = {lanes: f"<{lanes}I" for lanes in LANE_COUNTS}

STATUS3 = {
    -1: "the rANS word stream ends early",
    -3: "the rANS lanes do not end in their initial state",
    -5: "the rANS word stream has words left over",
    -8: "out of memory",
    -9: "the kernel was called with inconsistent arguments",
}
TABLE3_STATUS = {
    -1: "it is truncated",
    -2: "a value is out of range",
    -3: "it names a token beyond the alphabet, or too many",
    -4: "a row's frequencies leave nothing for its first token",
    -5: "it has non-zero padding bits",
}


# -- integer size estimates -------------------------------------------------------


def _ilog2_q16(v: int) -> int:
    """floor(65536 * log2(v)) for an integer v >= 1, in integer arithmetic only."""
    e = v.bit_length() - 1
    y = (v << 32) >> e  # v / 2**e in [1, 2), Q32
    frac = 0
    for bit in range(15, -1, -1):
        y = (y * y) >> 32
        if y >= 2 << 32:
            y >>= 1
            frac |= 1 << bit
    return (e << 16) | frac


#: COST[f]: bits (Q16) to code a symbol of frequency f out of 2**12.  Integers, so
#: size-based choices cannot differ between machines.
COST = np.array([0] + [(SCALE_BITS << 16) - _ilog2_q16(f) for f in range(1, _M + 1)], dtype=np.int64)


def quantize_rows(k, counts: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray, int]:
    """Each row's frequencies at the scale 2**S (S <= 12) that minimises its estimated
    table plus data bits, among the three around ``bitlen(n) - 1`` (kernel
    ``quantize_rows3``; see its twin in ``_one_stream_tables``).

    Returns (frequencies at the rows' scales, (scales, Exp-Golomb orders of their
    table codes), the same frequencies at scale 2**12, estimated bits of the rows
    and the data).  A coarser scale costs fewer table bits and a little coding
    precision: a row of 300 elements sends counts near its own, a row of millions
    the full 12 bits.
    """
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    rows, alphabet = counts.shape
    freqs = np.zeros((rows, alphabet), dtype=np.uint32)
    f12 = np.zeros((rows, alphabet), dtype=np.uint32)
    scales = np.zeros(rows, dtype=np.int64)
    orders = np.zeros(rows, dtype=np.int64)
    total = k.quantize_rows3(counts, COST, freqs, f12, scales, orders)
    return freqs, (scales, orders), f12, int(total) >> 16


def _lanes_code(bits: int) -> int:
    return 1 if bits >= WIDE_BITS else 0


def _enc_table(k, ctx_rows: np.ndarray, freqs: np.ndarray, token_bits: int) -> np.ndarray:
    """EncEntry per symbol ``context << token_bits | token``; ``ctx_rows[c]`` is context c's row of
    ``freqs`` (-1: no element has it, its entries are never read)."""
    table = scratch("encoder table 3", len(ctx_rows) * ENC_ENTRY.itemsize << token_bits, np.uint8)
    k.encoder_table(
        np.ascontiguousarray(ctx_rows, dtype=np.int64),
        np.ascontiguousarray(freqs, dtype=np.uint32),
        SCALE_BITS,
        token_bits,
        table,
    )
    return table


def _pack(k, has_band: bool, count: int, lo: int, freqs: np.ndarray, coding) -> bytes:
    """The table bytes; ``coding`` = (scales, Exp-Golomb orders) per row, from ``quantize_rows``."""
    scales, orders = coding
    out = np.zeros(4 + len(freqs) * (6 + 5 * freqs.shape[1]), dtype=np.uint8)
    bits = k.pack_table3(
        int(has_band),
        count,
        lo,
        np.ascontiguousarray(freqs, dtype=np.uint32),
        np.ascontiguousarray(scales, dtype=np.int64),
        np.ascontiguousarray(orders, dtype=np.int64),
        out,
    )
    return out[: (bits + 7) // 8].tobytes()


def _section(
    k, params: int, table: bytes, v, sym, mode: int, p_a: int, p_b: int, enc, lanes: int, phases: int, mostly_zero: bool
) -> list:
    n = len(v)
    words = scratch("words 3", n * (1 + phases) + 8, np.uint16)
    states = np.empty(lanes, dtype=np.uint32)
    n_words = k.rans_encode3(v, sym, mode, p_a, p_b, enc, lanes, phases, words, states, mostly_zero)
    # the kernels work in the machine's byte order, which ulstore requires to be little-endian
    return [bytes((params,)), table, states.astype("<u4").tobytes(), words[len(words) - n_words :].view(np.uint8)]


# -- RANS: residual tokens --------------------------------------------------------


def band_of(n_c: np.ndarray) -> tuple[int, int]:
    """(count, lo): the contexts from the first to the last with >= POOL_BELOW elements: the rows of
    ``model_entropy_bits``' model (the benchmarks' ideal); the encoder's band is ``choose_band``'s."""
    big = np.flatnonzero(n_c >= POOL_BELOW)
    if not len(big):
        return 0, 0
    return int(big[-1] - big[0] + 1), int(big[0])


#: Changed elements (non-zero tokens) from which a context of a sparse delta is given a row in
#: the band, whatever its element count.  The pooled row of a sparse delta is dominated by
#: unchanged elements, so a context where many elements change (small weights, low exponents, in
#: an RL step) pays for its row's table bits (20-40) within a few dozen changes.
CHANGED_ROW = 32


def choose_band(k, h: np.ndarray, n_c: np.ndarray, totals: np.ndarray, sparse: bool):
    """The RANS band the encoder writes, with its rows' ``quantize_rows`` result:
    ``((count, lo), quantize_rows(rows))``.

    ``band_of``'s band (contexts of >= ``POOL_BELOW`` elements), except in a sparse delta
    (``sparse``: mostly unchanged elements), where contexts with >= ``CHANGED_ROW`` changed
    elements count too, if that is estimated smaller (integers: every backend and machine
    picks the same).  Any band decodes; on rl-bf16 of benchmarks/codec.py this one is 0.11%
    smaller.  ``h``: token counts per context, ``n_c`` and ``totals`` its row and column sums.
    """
    band = band_of(n_c)
    quantized = quantize_rows(k, _band_rows(h, totals, *band))
    if sparse:
        own = np.flatnonzero((n_c >= POOL_BELOW) | (n_c - h[:, 0] >= CHANGED_ROW))
        wide = (int(own[-1] - own[0] + 1), int(own[0])) if len(own) else (0, 0)
        if wide != band:
            other = quantize_rows(k, _band_rows(h, totals, *wide))
            if other[3] + _band_bits(*wide) < quantized[3] + _band_bits(*band):
                band, quantized = wide, other
    return band, quantized


def _band_bits(count: int, lo: int) -> int:
    """Table bits of a band's (count, lo) codes."""
    return 2 * (count + 1).bit_length() - 1 + (2 * (lo + 1).bit_length() - 1 if count else 0)


def _band_rows(h: np.ndarray, totals: np.ndarray, count: int, lo: int) -> np.ndarray:
    """RANS rows of band (count, lo): row 0 pools every context outside it."""
    rows = np.empty((count + 1, h.shape[1]), dtype=np.int64)
    rows[1:] = h[lo : lo + count]
    rows[0] = totals - rows[1:].sum(axis=0) if count else totals
    return rows


def delta_phases(fmt: FloatFormat) -> int:
    return -(-(fmt.width - 3) // RAW_CHUNK)  # tails are at most w - 3 bits


_TAIL_BITS: dict[int, np.ndarray] = {}


def _tail_bits(alphabet: int) -> np.ndarray:
    """Raw tail bits of each token (``max(0, token // 4 - 1)``), by alphabet size."""
    w = _TAIL_BITS.get(alphabet)
    if w is None:
        w = _TAIL_BITS[alphabet] = np.maximum((np.arange(alphabet) >> 2) - 1, 0)
    return w


def encode_delta(k, fmt: FloatFormat, z: np.ndarray, sym: np.ndarray, hist: np.ndarray, emask: int) -> tuple[list, int]:
    """The RANS payload of residuals ``z`` with symbols ``sym`` (``context << token_bits | token``)
    and their histogram ``hist``.  Returns (parts, estimated bits)."""
    tb, alphabet = fmt.token_bits, fmt.alphabet
    # a view, not a copy: einsum sums its rows and columns exactly (in uint32, which
    # cannot overflow: every sum is at most the element count, < 2**32) and, on small
    # tables, several times faster than ndarray.sum along the short axis
    h = hist.reshape(emask + 1, 1 << tb)[:, :alphabet]
    has_band = emask > 0
    n_c = np.einsum("ij->i", h)
    totals = np.einsum("ij->j", h).astype(np.int64)  # every row's counts together: rows.sum(axis=0)
    zeros = int(totals[0])
    mostly_zero = zeros * 16 > 15 * len(z)
    if has_band:
        (count, lo), (freqs_s, scales, freqs, bits) = choose_band(k, h, n_c, totals, mostly_zero)
    else:
        count, lo = 0, 0
        freqs_s, scales, freqs, bits = quantize_rows(k, totals[None, :])
    table = _pack(k, has_band, count, lo, freqs_s, scales)
    bits += int(_tail_bits(alphabet) @ totals)
    lanes_code = _lanes_code(bits)
    ctx_rows = np.where(n_c > 0, 0, -1)
    if count:
        ctx_rows[lo : lo + count] = np.where(n_c[lo : lo + count] > 0, np.arange(1, count + 1), -1)
    parts = _section(
        k,
        lanes_code,
        table,
        z,
        sym,
        0,
        tb,
        0,
        _enc_table(k, ctx_rows, freqs, tb),
        LANE_COUNTS[lanes_code],
        delta_phases(fmt),
        mostly_zero,
    )
    return parts, bits


# -- INTRA: exponent and top mantissa bits ------------------------------------------


def _symbol_bits(fmt: FloatFormat) -> tuple[int, int]:
    """(k_max, bits of a symbol with k_max mantissa bits)."""
    k_max = min(3, fmt.mant_bits)
    return k_max, fmt.exp_bits + k_max


def intra_plan(k, fmt: FloatFormat, x: np.ndarray):
    """Analyse ``x`` for INTRA coding: (symbols with k_max mantissa bits, their histogram, hash64(x))."""
    k_max, bits = _symbol_bits(fmt)
    sym = scratch("intra symbols", x.size, np.uint16)
    hash_x = k.intra_symbols(x, fmt.mant_bits - k_max, (1 << bits) - 1, sym)
    hist = np.zeros((1, 1 << bits), dtype=np.uint32)
    k.histogram(sym, hist)
    return sym, hist[0], hash_x


def intra_choice(k, fmt: FloatFormat, hist: np.ndarray, n: int):
    """Best (estimated bits, mantissa bits k, frequencies) of an INTRA payload, or None if no
    k keeps the symbols within MAX_SYMBOLS."""
    k_max, _ = _symbol_bits(fmt)
    best = None
    for kk in range(k_max + 1):
        counts = hist.reshape(-1, 1 << (k_max - kk)).sum(axis=1, dtype=np.int64)[None, :]
        if np.count_nonzero(counts) > MAX_SYMBOLS:
            continue
        freqs_s, scales, freqs, bits = quantize_rows(k, counts)
        bits += n * (fmt.mant_bits - kk + 1)
        if best is None or bits < best[0]:
            best = (bits, kk, freqs_s, scales, freqs)
    return best


def intra_phases(fmt: FloatFormat, kk: int) -> int:
    return -(-(fmt.mant_bits - kk + 1) // RAW_CHUNK)


def encode_intra(k, fmt: FloatFormat, x: np.ndarray, sym: np.ndarray, choice) -> list:
    """The INTRA payload of words ``x`` given ``intra_plan``'s symbols and ``intra_choice``'s choice.
    Overwrites ``sym``."""
    bits, kk, freqs_s, scales, freqs = choice
    k_max, _ = _symbol_bits(fmt)
    if kk != k_max:
        np.right_shift(sym, k_max - kk, out=sym)
    lanes_code = _lanes_code(bits)
    params = lanes_code | kk << 2
    sym_bits = fmt.exp_bits + kk
    return _section(
        k,
        params,
        _pack(k, False, 0, 0, freqs_s, scales),
        x,
        sym,
        1,
        fmt.mant_bits - kk,
        fmt.width,
        _enc_table(k, np.zeros(1, dtype=np.int64), freqs, sym_bits),
        LANE_COUNTS[lanes_code],
        intra_phases(fmt, kk),
        False,
    )


# -- decoding ---------------------------------------------------------------------------


def status_error(status: int) -> CorruptBlobError:
    return CorruptBlobError(f"ULPack blob is corrupt: {STATUS3.get(status, f'status {status}')}")


def decode_section3(
    k,
    fmt: FloatFormat,
    header: F.Header,
    rd: F.Reader,
    r: np.ndarray | None,
    emask: int,
    verify_constant=None,
    out: np.ndarray | None = None,
):
    """Decode a version-3 RANS or INTRA payload into a new array of words (or into ``out``,
    the caller's C-contiguous words of the declared size, apart from ``r``).

    ``r``: the reference words of a delta (None: intra).  Returns ``(values,
    hash64(values), hash64(r) or None)``.  Raises CorruptBlobError on any damage;
    a delta's caller checks its reference before reporting that, so that a wrong
    reference is reported as such.  The declared size is checked against what the
    payload can hold before anything of that size is allocated;
    ``verify_constant(hash64)`` checks the values of a constant intra tensor
    (the one case with no such bound) from their hash alone.
    """
    args = section3_args(k, fmt, header, rd, r, emask, verify_constant, out)
    status = k.rans_decode3(*args)
    if status:
        raise status_error(status)
    out, hashes = args[-2], args[-1]
    return out, int(hashes[0]), (int(hashes[1]) if r is not None else None)


def section3_args(
    k,
    fmt: FloatFormat,
    header: F.Header,
    rd: F.Reader,
    r: np.ndarray | None,
    emask: int,
    verify_constant=None,
    out: np.ndarray | None = None,
) -> tuple:
    """The arguments of kernel ``rans_decode3`` for a version-3 payload (:func:`decode_section3`'s checks
    made): its last two are the output words and ``hashes`` (``hash64`` of the values, then of ``r``)."""
    n = header.size
    intra = header.mode == F.MODE_INTRA
    lanes, kk = _read_params(fmt, rd, intra)
    freqs, count, lo = _read_table(k, fmt, rd, intra, kk, emask)
    states, words = _read_states_and_words(rd, lanes)
    if not np.count_nonzero(freqs):
        raise CorruptBlobError("ULPack blob table has no token at all")
    constant = _check_capacity(fmt, n, intra, r is None, kk, freqs, lanes, len(words) // 2)
    if constant is not None and verify_constant is not None:
        # z = t0 against +0.0 (key 2**(w-1)): the value is unkey(2**(w-1) + unzigzag(t0))
        w = fmt.width
        key = ((1 << (w - 1)) + ((constant >> 1) ^ -(constant & 1))) & ((1 << w) - 1)
        value = key & ~(1 << (w - 1)) if key >> (w - 1) else ~key & ((1 << w) - 1)
        verify_constant(k.hash_fill(value, n, w // 8))
    rows = len(freqs)
    slots = scratch("slots 3", rows * _M, np.uint32)
    lut = np.zeros(MAX_SYMBOLS, dtype=np.uint32)
    k.slot_table3(freqs, int(intra), slots, lut)
    if intra:
        mode, p_a, p_b, p_c, phases = 1, fmt.mant_bits - kk, fmt.width, 0, intra_phases(fmt, kk)
    else:
        mode, p_a, p_b, p_c, phases = (0 if r is not None else 2), fmt.token_bits, lo, count, delta_phases(fmt)
    if out is None:
        out = np.empty(n, dtype=fmt.word)
    hashes = np.zeros(2, dtype=np.uint64)
    ref = r if r is not None else out
    return ref, mode, p_a, p_b, p_c, fmt.mant_bits, emask, slots, lut, lanes, phases, words, states, out, hashes


def section3_parts(k, fmt: FloatFormat, header: F.Header, rd: F.Reader, emask: int) -> dict:
    """Bytes per field of a version-3 RANS or INTRA payload (``rd`` at its start; read to its end):
    ``params``, ``table``, ``lane states`` and ``words`` (the rANS words: coded symbols and raw bits)."""
    intra = header.mode == F.MODE_INTRA
    lanes, kk = _read_params(fmt, rd, intra)
    start = rd.pos
    _read_table(k, fmt, rd, intra, kk, emask)
    parts = {"params": 1, "table": rd.pos - start, "lane states": 4 * lanes}
    rd.take(4 * lanes, "lane states")
    parts["words"] = rd.end - rd.pos
    rd.take(rd.end - rd.pos, "rANS words")
    return parts


def _read_params(fmt: FloatFormat, rd: F.Reader, intra: bool) -> tuple[int, int]:
    """The section's lane count and ``k`` (the mantissa bits of an INTRA symbol), checked."""
    params = rd.u8("section parameters")
    lanes_code, kk = params & 3, (params >> 2) & 3
    if params >> 4 or lanes_code >= len(LANE_COUNTS) or (kk and not intra) or kk > min(3, fmt.mant_bits):
        raise CorruptBlobError(f"ULPack blob has invalid section parameters {params:#x}")
    return LANE_COUNTS[lanes_code], kk


def _read_table(k, fmt: FloatFormat, rd: F.Reader, intra: bool, kk: int, emask: int) -> tuple[np.ndarray, int, int]:
    """The table's rows (frequencies, one row per band context plus the shared row 0) and its band (count, lo)."""
    if intra:
        alphabet, has_band, n_ctx, max_tokens = 1 << (fmt.exp_bits + kk), False, 1, MAX_SYMBOLS
    else:
        alphabet, has_band, n_ctx, max_tokens = fmt.alphabet, emask > 0, emask + 1, fmt.alphabet
    freqs = np.zeros((n_ctx + 1 if has_band else 1, alphabet), dtype=np.uint32)
    band = np.zeros(2, dtype=np.int64)
    used = k.read_table3(rd.buf[rd.pos : rd.end], int(has_band), n_ctx, alphabet, max_tokens, band, freqs)
    if used < 0:
        raise CorruptBlobError(f"ULPack blob table is corrupt: {TABLE3_STATUS.get(used, f'status {used}')}")
    rd.take(used, "table")
    count, lo = int(band[0]), int(band[1])
    return freqs[: count + 1], count, lo


def _read_states_and_words(rd: F.Reader, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """The final lane states (checked to lie in [2**15, 2**31)) and the rANS words' bytes (the rest)."""
    state_bytes = rd.take(4 * lanes, "lane states")
    lane_states = struct.unpack(_STATES_FORMAT[lanes], state_bytes)  # (cheaper than numpy for 4 or 32 values)
    if min(lane_states) < STATE_LOW or max(lane_states) >= 1 << 31:
        raise CorruptBlobError("ULPack blob has an rANS lane state out of range")
    states = np.frombuffer(state_bytes, dtype="<u4").copy()  # aligned: the kernels read them as uint32_t
    n_bytes = rd.end - rd.pos
    if n_bytes % 2:
        raise CorruptBlobError("ULPack blob has an odd number of bytes of rANS words")
    return states, np.frombuffer(rd.take(n_bytes, "rANS words"), dtype=np.uint8)


def _check_capacity(
    fmt: FloatFormat, n: int, intra: bool, no_reference: bool, kk: int, freqs: np.ndarray, lanes: int, n_words: int
) -> int | None:
    """Refuse a declared size ``n`` the payload cannot hold, before n elements are allocated; returns the token
    of a constant tensor coded against +0.0 (the one case with no such bound), else None.

    Each lane starts with 31 bits of state and gains 16 per word; every raw bit costs one,
    and a token step with f < 2**12 shrinks a state by at least a factor 1 - 2**-12
    (so a lane decodes at most _STEPS_PER_WORD tokens per word it reads).
    """
    capacity_bits = 31 * lanes + 16 * n_words
    if intra:
        raw_bits = fmt.mant_bits - kk + 1
        if n * raw_bits > capacity_bits:
            raise CorruptBlobError(
                f"ULPack blob declares {n} elements but its payload holds at most {capacity_bits // raw_bits}"
            )
    elif no_reference:  # against +0.0, one row
        t0 = int(np.flatnonzero(freqs[0])[0])
        if freqs[0, t0] == _M and t0 < 8:  # one token and no tail: every element is the same value
            return t0
        if n > _STEPS_PER_WORD * (lanes + n_words):
            raise CorruptBlobError(f"ULPack blob declares {n} elements, more than its payload can code")
    return None
