"""Analysis of blobs and of the model: :func:`inspect_blob`, :func:`model_entropy_bits`."""

from __future__ import annotations

import numpy as np

from . import _format as F
from ._api import _analyze, _econd_mask, _intra_mode, _prepare
from ._backend import kernels
from ._elias_fano import sizes as ef_sizes
from ._one_stream import band_of, intra_plan, section3_parts
from ._section import read_fields
from ._sparse import GAPS

__all__ = ["inspect_blob", "model_entropy_bits"]


def inspect_blob(blob) -> dict:
    """Header fields of a blob (after its integrity checks), for tools and debugging.

    ``parts`` maps each part of the blob to its bytes (they sum to ``nbytes``):
    ``header`` and ``crc`` always, the payload as one ``payload`` entry, except in
    a SPARSE blob, where it is split into ``count`` (the varint m), the changed
    positions (``positions low`` and ``positions high`` in version 4, the ``gaps``
    section in version 2) and the residual section's ``residual table``,
    ``residual states`` (lane states), ``residual words`` (rANS words),
    ``residual tail`` (raw bits) and ``residual fields`` (scale byte and length
    varints): what tells where a SPARSE blob's bytes go.  A version-3 RANS or
    INTRA payload is split into ``params`` (its one byte), ``table``,
    ``lane states`` and ``words`` (the rANS words: coded symbols and raw bits
    together): what its tables and fixed fields cost beside the coded data.
    """
    header, rd = F.open_blob(blob)
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
        "parts": _parts(header, rd),
    }


def _parts(header: F.Header, rd: F.Reader) -> dict:
    """Bytes per part of a blob whose payload ``rd`` is at (see :func:`inspect_blob`)."""
    parts = {"header": rd.pos}
    if header.mode == F.MODE_SPARSE:
        start = rd.pos
        m = rd.varint("changed element count", limit=header.size)
        parts["count"] = rd.pos - start
        if header.version == 4:
            parts["positions low"], parts["positions high"] = ef_sizes(header.size, m)
            rd.take(sum(ef_sizes(header.size, m)), "positions")
        else:
            start = rd.pos
            read_fields(rd, m, GAPS)
            parts["gaps"] = rd.pos - start
        start = rd.pos
        f = read_fields(rd, m, header.fmt)
        named = {"table": f.table.nbytes, "states": f.states.nbytes, "words": f.words.nbytes, "tail": f.tail.nbytes}
        parts.update({f"residual {k}": v for k, v in named.items()})
        parts["residual fields"] = rd.pos - start - sum(named.values())
    elif header.version == 3 and header.mode in (F.MODE_RANS, F.MODE_INTRA):
        econd = not header.flags & F.FLAG_NO_ECOND
        parts.update(section3_parts(kernels(), header.fmt, header, rd, _econd_mask(header.fmt, header.is_delta, econd)))
    if rd.end > rd.pos:
        parts["payload"] = rd.end - rd.pos
    parts["crc"] = F.CRC_BYTES
    return parts


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
