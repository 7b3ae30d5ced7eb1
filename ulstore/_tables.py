"""Static rANS tables: normalising counts, and the per-symbol encode/decode entries.

Shared by both kernel backends, so tables (and thus blobs) cannot differ between
them.  Integer arithmetic only: a float rounding difference between machines must
never change a blob's bytes.
"""
from __future__ import annotations

import numpy as np

__all__ = ["normalize", "SCALE_BITS", "encoder_table", "decoder_table", "ENC_ENTRY", "STATE_LOW", "STATE_BITS"]

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


def _starts(freqs: np.ndarray) -> np.ndarray:
    return (np.cumsum(freqs, axis=1, dtype=np.int64) - freqs).astype(np.uint32)


ENC_ENTRY = np.dtype([("rcp", "<u8"), ("xmax", "<u4"), ("start", "<u2"), ("shift", "<u2")])  # = kernels.EncEntry


def encoder_table(ctx_ids: np.ndarray, freqs: np.ndarray, scale_bits: int, token_bits: int, n_contexts: int) -> np.ndarray:
    """One ``ENC_ENTRY`` per symbol value ``context << token_bits | token``.

    With ``s = ceil(log2 f)`` and ``rcp = ceil(2**(31+s) / f)``, ``(x * rcp) >> (31+s)``
    equals ``x // f`` for every ``x < 2**31`` (the error ``rcp*f - 2**(31+s) < f <= 2**s``
    never reaches the next multiple).  The encode step is then
    ``x + start + (x // f) * (M - f)``, i.e. ``((x // f) << S) + x % f + start``.
    Renormalise (emit 16 bits) first when ``x >= xmax = f * 2**(31 - S)``.
    """
    n_ctx, alphabet = freqs.shape
    table = np.zeros(n_contexts << token_bits, dtype=ENC_ENTRY)
    rows = table.reshape(n_contexts, 1 << token_bits)[ctx_ids, :alphabet]
    f = freqs.astype(np.uint64)
    safe = np.maximum(f, 1)
    s = np.zeros_like(safe)
    for k in range(1, scale_bits + 1):  # ceil(log2 f) for f in [1, 2**S]
        s += (safe > (np.uint64(1) << np.uint64(k - 1))).astype(np.uint64)
    shift = np.uint64(STATE_BITS) + s
    rows["rcp"] = ((np.uint64(1) << shift) + safe - np.uint64(1)) // safe
    rows["shift"] = shift
    rows["start"] = _starts(freqs)
    rows["xmax"] = f << np.uint64(STATE_BITS - scale_bits)
    table.reshape(n_contexts, 1 << token_bits)[ctx_ids, :alphabet] = rows
    return table


def decoder_table(freqs: np.ndarray, scale_bits: int) -> np.ndarray:
    """One uint32 per (context, slot): ``token << 24 | (f - 1) << 12 | (slot - start)``.

    A single lookup gives everything a decode step needs:
    ``x' = f * (x >> S) + (slot - start)``.  Requires S <= 12.
    """
    total = 1 << scale_bits
    n_ctx, alphabet = freqs.shape
    tokens = np.arange(alphabet, dtype=np.uint32)
    starts = _starts(freqs)
    out = np.empty((n_ctx, total), dtype=np.uint32)
    slot = np.arange(total, dtype=np.uint32)
    for i in range(n_ctx):
        t = np.repeat(tokens, freqs[i])
        out[i] = (t << 24) | ((freqs[i][t] - 1) << 12) | (slot - starts[i][t])
    return out.reshape(-1)
