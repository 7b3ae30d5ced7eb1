"""Analysis of blobs and of the model: :func:`inspect_blob`, :func:`model_entropy_bits`."""

from __future__ import annotations

import numpy as np

from . import _format as F
from ._api import _analyze, _intra_mode, _prepare
from ._backend import kernels
from ._one_stream import band_of, intra_plan

__all__ = ["inspect_blob", "model_entropy_bits"]


def inspect_blob(blob) -> dict:
    """Header fields of a blob (after its integrity checks), for tools and debugging."""
    header, _ = F.open_blob(blob)
    mode = {
        F.MODE_RAW: "raw",
        F.MODE_SAME: "same",
        F.MODE_RANS: "rans",
        F.MODE_SPARSE: "sparse",
        F.MODE_INTRA: "intra",
    }[header.mode]
    return {
        "version": memoryview(blob).cast("B")[4],
        "dtype": header.fmt.name,
        "shape": header.shape,
        "mode": mode,
        "delta": header.is_delta,
        "econd": not header.flags & F.FLAG_NO_ECOND,
        "nbytes": len(memoryview(blob)),
    }


def model_entropy_bits(target, reference=None, *, econd: bool = True) -> float:
    """Ideal size in bits of ``target`` under ULPack's own model (no tables, no coder loss).

    ``sum over table rows and symbols of -count * log2(count / row total)`` plus the
    raw bits: what a perfect entropy coder with free tables would reach, for the
    model :func:`encode` uses.  Deltas: residual tokens in rows of reference
    exponents (the contexts from the first to the last holding 256 elements or
    more have a row each, the others share one), plus their raw tails.  Intra:
    the INTRA symbols (exponent and top mantissa bits) plus the sign and low
    mantissa bits, or, where ``encode`` picks it, the residual model against +0.0.
    """
    fmt, x, r = _prepare(target, reference)
    xf = x.reshape(-1)
    if xf.size == 0:
        return 0.0
    k = kernels()
    rf = None if r is None else r.reshape(-1)
    if rf is None:
        mode, plan, _ = _intra_mode(k, fmt, xf, econd)
        if mode == F.MODE_SAME:
            return 0.0
        if mode == F.MODE_INTRA:
            _, (_, kk, _, _, _) = plan
            k_max = min(3, fmt.mant_bits)
            hist = intra_plan(k, fmt, xf)[1]
            counts = hist.reshape(-1, 1 << (k_max - kk)).sum(axis=1, dtype=np.int64)[None, :]
            return _entropy_bits(counts) + xf.size * (fmt.mant_bits - kk + 1)
    counts, emask = _analyze(k, fmt, xf, rf, econd)[2:4]
    hist = counts.reshape(emask + 1, -1)[:, : fmt.alphabet].astype(np.int64)
    tokens = np.arange(fmt.alphabet)
    tail_bits = int((hist.sum(axis=0) * np.maximum((tokens >> 2) - 1, 0)).sum())
    count, lo = band_of(hist.sum(axis=1)) if emask else (0, 0)
    rows = np.zeros((count + 1, fmt.alphabet), dtype=np.int64)  # the model's own rows
    rows[1:] = hist[lo : lo + count]
    rows[0] = hist.sum(axis=0) - rows[1:].sum(axis=0)
    return _entropy_bits(rows) + tail_bits


def _entropy_bits(rows: np.ndarray) -> float:
    """``sum -count * log2(count / row total)`` over the rows of a count matrix."""
    h = rows.astype(np.float64)
    totals = h.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(-np.where(h > 0, h * np.log2(h / totals), 0.0).sum())
