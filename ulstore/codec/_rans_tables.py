"""Static rANS tables: normalising counts, and the per-symbol encode/decode entries.

Shared by both kernel backends, so tables (and thus blobs) cannot differ between
them.  Integer arithmetic only: a float rounding difference between machines must
never change a blob's bytes.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "normalize",
    "quantized_counts",
    "SCALE_BITS",
    "POOL_BELOW",
    "table_rows",
    "sum_rows",
    "encoder_table",
    "decoder_table",
    "ENC_ENTRY",
    "STATE_LOW",
    "STATE_BITS",
]

STATE_LOW = 1 << 15  # L: every lane state lives in [L, 2**31)
STATE_BITS = 31  # the reciprocal division below is exact only for states < 2**31
# Probability resolution of every version-1 blob.  12 bits: a context's decode table
# (one uint32 per slot packing token, f - 1 and slot - start) is 16 KiB, and a fixed
# scale lets the compiled decoder shift by constants.  The blob still records it.
SCALE_BITS = 12


def normalize(counts: np.ndarray, scale_bits: int) -> np.ndarray:
    """Scale each row of ``counts`` to sum exactly 2**scale_bits, keeping every seen symbol >= 1.

    Rows: contexts; columns: tokens.  Each frequency is ``floor(c * M / N)``, raised
    to 1 for seen symbols; the remainder goes to (or, when rare symbols were raised,
    comes from) the row's most frequent symbol, where it costs the least.
    """
    total = 1 << scale_bits
    counts = counts.astype(np.uint64)
    n = counts.sum(axis=1, keepdims=True)
    freqs = (counts * np.uint64(total)) // np.maximum(n, 1)
    freqs[(counts > 0) & (freqs == 0)] = 1
    freqs = freqs.astype(np.int64)
    diff = total - freqs.sum(axis=1)
    rows = np.arange(len(freqs))
    top = np.argmax(counts, axis=1)  # first maximum: deterministic tie-break
    grow = diff > 0
    freqs[rows[grow], top[grow]] += diff[grow]
    for i in np.flatnonzero(diff < 0):  # rare: many raised symbols in one row
        deficit = -int(diff[i])
        while deficit:
            j = int(np.argmax(freqs[i]))
            take = min(deficit, int(freqs[i, j]) - 1)
            freqs[i, j] -= take
            deficit -= take
    return freqs.astype(np.uint32)


def quantized_counts(counts: np.ndarray, n_rows: np.ndarray, scale_bits: int) -> np.ndarray:
    """Per-row counts coarsened to what the table transmits (docs/format.md, Tables).

    ``q = max(1, count >> shift)`` with ``shift = max(0, bitlen(n_r) - S)`` for every
    token but 0, whose count is implied: ``max(1, (n_r >> shift) - sum q)``.
    """
    counts = counts.astype(np.int64)
    n_rows = np.asarray(n_rows, dtype=np.int64)
    bitlen = np.frexp(n_rows.astype(np.float64))[1]  # exact: counts are far below 2**53
    shift = np.maximum(0, bitlen - scale_bits).astype(np.int64)[:, None]
    q = np.where(counts > 0, np.maximum(1, counts >> shift), 0)
    rest = q[:, 1:].sum(axis=1)
    q[:, 0] = np.where(counts[:, 0] > 0, np.maximum(1, (n_rows >> shift[:, 0]) - rest), 0)
    return q


def _starts(freqs: np.ndarray) -> np.ndarray:
    return (np.cumsum(freqs, axis=1, dtype=np.int64) - freqs).astype(np.uint32)


POOL_BELOW = 256  # contexts with fewer reference elements than this share one table row


def table_rows(n_c: np.ndarray) -> np.ndarray:
    """The frequency-table row of every context, from its element count ``n_c``.

    Contexts with at least ``POOL_BELOW`` elements get their own row, in ascending
    context order; all smaller ones share one pooled row after them: a row of
    their own would cost more table bits than its sharper statistics save.  -1
    marks contexts with no elements.  Encoder and decoder both derive this from
    the reference, so it costs nothing to transmit.
    """
    n_c = np.asarray(n_c)
    rows = np.full(len(n_c), -1, dtype=np.int64)
    big = n_c >= POOL_BELOW
    small = (n_c > 0) & ~big
    rows[big] = np.arange(int(big.sum()))
    rows[small] = int(big.sum())
    return rows


def sum_rows(values: np.ndarray, n_c: np.ndarray) -> np.ndarray:
    """Add per-context ``values`` (1-d or 2-d) into the table rows ``table_rows(n_c)`` defines."""
    big = n_c >= POOL_BELOW
    small = (n_c > 0) & ~big
    n_big = int(big.sum())
    out = np.zeros((n_big + bool(small.any()),) + values.shape[1:], dtype=np.int64)
    out[:n_big] = values[big]
    if small.any():
        out[n_big] = values[small].sum(axis=0)
    return out


# = EncEntry of _constants.pxi, as are the constants above (tests hold every backend to them)
ENC_ENTRY = np.dtype([("rcp", "<u8"), ("xmax", "<u4"), ("start", "<u2"), ("shift", "<u2")])


def encoder_table(rows: np.ndarray, freqs: np.ndarray, scale_bits: int, token_bits: int) -> np.ndarray:
    """One ``ENC_ENTRY`` per symbol value ``context << token_bits | token``.

    ``rows[c]`` is context c's row of ``freqs`` (see :func:`table_rows`).

    With ``s = ceil(log2 f)`` and ``rcp = ceil(2**(31+s) / f)``, ``(x * rcp) >> (31+s)``
    equals ``x // f`` for every ``x < 2**31`` (the error ``rcp*f - 2**(31+s) < f <= 2**s``
    never reaches the next multiple).  The encode step is then
    ``x + start + (x // f) * (M - f)``, i.e. ``((x // f) << S) + x % f + start``.
    Renormalise (emit 16 bits) first when ``x >= xmax = f * 2**(31 - S)``.
    """
    n_rows, alphabet = freqs.shape
    entries = np.zeros((n_rows, alphabet), dtype=ENC_ENTRY)
    f = freqs.astype(np.uint64)
    safe = np.maximum(f, 1)
    s = np.zeros_like(safe)
    for k in range(1, scale_bits + 1):  # ceil(log2 f) for f in [1, 2**S]
        s += (safe > (np.uint64(1) << np.uint64(k - 1))).astype(np.uint64)
    shift = np.uint64(STATE_BITS) + s
    entries["rcp"] = ((np.uint64(1) << shift) + safe - np.uint64(1)) // safe
    entries["shift"] = shift
    entries["start"] = _starts(freqs)
    entries["xmax"] = f << np.uint64(STATE_BITS - scale_bits)
    table = np.zeros((len(rows), 1 << token_bits), dtype=ENC_ENTRY)
    occupied = rows >= 0
    table[occupied, :alphabet] = entries[rows[occupied]]
    return table.reshape(-1)


def decoder_table(freqs: np.ndarray, scale_bits: int) -> np.ndarray:
    """One uint32 per (row, slot): ``token << 24 | (f - 1) << 12 | (slot - start)``.

    A single lookup gives everything a decode step needs:
    ``x' = f * (x >> S) + (slot - start)``.  Requires S <= 12.
    """
    total = 1 << scale_bits
    n_rows, alphabet = freqs.shape
    f = freqs.astype(np.int64)
    tokens = np.arange(alphabet, dtype=np.int64)
    # entry = base + slot with base = t << 24 | (f - 1) << 12 minus the token's start
    # (slot - start < f <= 2**12 never carries into f's field)
    base = (tokens << 24) + ((f - 1) << 12) - _starts(freqs).astype(np.int64)
    slots = np.tile(np.arange(total, dtype=np.int64), n_rows)
    return (np.repeat(base.reshape(-1), f.reshape(-1)) + slots).astype(np.uint32)
