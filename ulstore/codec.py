"""ULPack: lossless delta coding of a floating-point tensor against a reference.

``encode(target, reference)`` returns a self-contained blob; ``decode(blob,
reference)`` returns the target exactly, bit for bit, for every bit pattern
(signed zeros, subnormals, infinities and NaN payloads included).  With no
reference the tensor is coded against all +0.0 ("intra" mode, used for anchors).

How: the ordered-integer (ULP) residual ``zigzag(key(x) - key(r))`` of every
element is split into a token (its bit length and the two bits below the leading
one) and raw low bits.  Tokens are coded with static 4-lane interleaved rANS whose
tables are conditioned on the reference value's exponent field, which the decoder
already holds.  See ``docs/format.md`` for the bytes.

Thread safety: every function here is a pure function of its arguments; the
compiled kernels release the GIL, so threads encode or decode in parallel.

Examples
--------
>>> import numpy as np, ulstore
>>> base = np.linspace(-1, 1, 1000, dtype=np.float32)
>>> step = base + np.float32(1e-6)
>>> blob = ulstore.encode(step, base)
>>> len(blob) < step.nbytes // 2
True
>>> bool((ulstore.decode(blob, base).view(np.uint32) == step.view(np.uint32)).all())
True
"""
from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Iterable, Sequence

import numcodecs
import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ensure_ndarray_like, ndarray_copy

from . import _format as F
from ._backend import kernels
from ._dtypes import FloatFormat, as_bits, format_of, from_bits
from ._scratch import scratch
from ._tables import (
    ENC_ENTRY,
    POOL_BELOW,
    SCALE_BITS,
    STATE_LOW,
    sum_rows,
    table_rows,
)
from .errors import CorruptBlobError, InvalidInputError, ReferenceMismatchError

__all__ = [
    "ULPack",
    "encode",
    "decode",
    "encode_many",
    "decode_many",
    "inspect_blob",
    "model_entropy_bits",
    "HEADER_BOUND",
]

#: Bytes a 1-d blob may exceed the raw tensor by (header + CRC); see :func:`header_bound`.
HEADER_BOUND = F.header_bound(1)

# Status codes the kernels return, and what they mean for the user.
STATUS = {
    -1: "the rANS word stream ends early",
    -2: "the raw-tail bitstream does not match the decoded lengths",
    -3: "the rANS lanes do not end in their initial state",
    -5: "the rANS word stream has words left over",
}

TABLE_STATUS = {
    -1: "it is truncated",
    -2: "a value is out of range",
    -3: "it names a token beyond the alphabet",
    -4: "a row has no tokens",
    -5: "it has trailing bytes",
}

_MAX_ELEMENTS = F.MAX_ELEMENTS


def _prepare(target, reference):
    fmt, x = as_bits(target)
    if x.size > _MAX_ELEMENTS or any(d > _MAX_ELEMENTS for d in x.shape):
        raise InvalidInputError(f"a ULPack blob holds at most {_MAX_ELEMENTS} elements; split the tensor into chunks")
    if reference is None:
        return fmt, x, None
    rfmt, r = as_bits(reference)
    if rfmt is not fmt:
        raise InvalidInputError(f"target is {fmt.name} but reference is {rfmt.name}; they must match")
    if r.shape != x.shape:
        raise InvalidInputError(f"target shape {x.shape} and reference shape {r.shape} differ")
    return fmt, x, r


def encode(target, reference=None, *, econd: bool = True, backend: str | None = None) -> bytes:
    """Code ``target`` losslessly against ``reference`` (or against +0.0 if None).

    Parameters
    ----------
    target : array-like
        A float16, bfloat16, float32, float64, float8_e4m3fn or float8_e5m2 numpy
        array (ml_dtypes for bf16/fp8) or torch tensor, any shape, layout or byte order.
    reference : array-like, optional
        Same dtype and shape.  The decoder must supply the identical bits.
    econd : bool, default True
        Condition the models on the reference exponent.  ``False`` is the ablation
        that measures what conditioning buys; blobs record it.
    backend : {"cython", "numpy"}, optional
        Kernel implementation; defaults to the active one.  Blobs are identical.

    Returns
    -------
    bytes
        The blob: never larger than ``target.nbytes + header_bound(target.ndim)``.

    Raises
    ------
    DtypeError
        ``target`` is not one of the supported floating-point dtypes.
    InvalidInputError
        dtype or shape of ``reference`` differ from ``target``'s.
    """
    fmt, x, r = _prepare(target, reference)
    k = kernels(backend)
    xf = x.reshape(-1)
    rf = None if r is None else r.reshape(-1)
    flags = (F.FLAG_DELTA if rf is not None else 0) | (0 if econd else F.FLAG_NO_ECOND)
    if xf.size:
        z, sym, hist, emask, hash_x, hash_r = _analyze(k, fmt, xf, rf, econd)
        coded = _encode_rans(k, fmt, z, sym, hist, emask)
    else:
        hash_x, hash_r, coded = k.hash64(xf), k.hash64(xf), []
    header = dict(
        fmt=fmt,
        flags=flags,
        shape=x.shape,
        ref_hash=_fold32(hash_r) if rf is not None else 0,
        target_hash=_target_hash(k, fmt, x.shape, hash_x),
    )
    if coded is None:  # every residual is zero: the reference (or +0.0) is the target
        return F.seal(F.Header(mode=F.MODE_SAME, **header).pack())
    if sum(len(part) for part in coded) >= xf.nbytes:  # tables would cost more than they save
        return F.seal(F.Header(mode=F.MODE_RAW, **header).pack(), xf.view(np.uint8))
    return F.seal(F.Header(mode=F.MODE_RANS, **header).pack(), *coded)


def _hash32(k, words: np.ndarray) -> int:
    """32-bit checksum of an array's bytes.

    A blob carries one for its reference and one for its target: a wrong reference
    must get past both to yield values, a 2**-64 event.
    """
    return _fold32(k.hash64(words))


def _fold32(h: int) -> int:
    return (h ^ (h >> 32)) & 0xFFFFFFFF


def _target_hash(k, fmt: FloatFormat, shape: tuple, values_hash: int) -> int:
    """Checksum of the values (their ``hash64``), bound to the dtype and shape they are read as."""
    meta = bytearray((fmt.code,))
    for d in shape:
        F.write_varint(meta, d)
    return _fold32(values_hash ^ k.hash64(meta))


def _econd_mask(fmt: FloatFormat, has_ref: bool, econd: bool) -> int:
    return fmt.n_contexts - 1 if (has_ref and econd) else 0


def _analyze(k, fmt: FloatFormat, xf, rf, econd):
    """Encode pass 1: residuals, symbols, the per-context token histogram and both hashes."""
    emask = _econd_mask(fmt, rf is not None, econd)
    if rf is None:
        rf = np.zeros_like(xf)  # intra: the reference is +0.0 everywhere
    z = scratch("residuals", xf.size, xf.dtype)
    sym = scratch("symbols", xf.size, fmt.symbol)
    hash_x, hash_r = k.residuals(xf, rf, fmt.mant_bits, emask, fmt.token_bits, z, sym)
    # four interleaved histogram copies avoid store-to-load stalls, where they fit in cache
    copies = F.LANES if fmt.symbol.itemsize == 2 else 1
    size = (emask + 1) << fmt.token_bits
    lanes = scratch("histogram", copies * size, np.uint32).reshape(copies, size)
    k.histogram(sym, lanes)
    return z, sym, lanes[0], emask, hash_x, hash_r  # counts per symbol: context << token_bits | token


def _encode_rans(k, fmt: FloatFormat, z, sym, counts, emask) -> list | None:
    """The rANS payload as a list of bytes-like parts, or None if every residual is zero."""
    n = z.size
    zeros = int(counts[:: 1 << fmt.token_bits].sum())  # token 0 of every context
    if zeros == n:
        return None
    scale_bits = SCALE_BITS
    rows = np.empty(emask + 1, dtype=np.int64)
    q = np.empty((emask + 2, fmt.alphabet), dtype=np.int64)
    q = q[: k.table_model(counts, fmt.token_bits, fmt.alphabet, POOL_BELOW, scale_bits, rows, q)]
    freqs = np.empty(q.shape, dtype=np.uint32)
    k.normalize_rows(q, scale_bits, freqs)
    table = scratch("encoder table", (emask + 1) * ENC_ENTRY.itemsize << fmt.token_bits, np.uint8)
    k.encoder_table(rows, freqs, scale_bits, fmt.token_bits, table)
    words = scratch("words", n + 1, np.uint16)  # one spare slot: see kernels.enc_put
    states = np.empty(F.LANES, dtype=np.uint32)
    n_words = k.rans_encode(sym, table, words, states, zeros * 16 > 15 * n)
    tail = scratch("tail", n * (fmt.width - 3) // 8 + 16, np.uint8)
    tail_bits = k.pack_tails(sym, z, fmt.token_bits, tail)
    # the payload's parts, views of the scratch buffers included (seal copies them once)
    head = bytearray((scale_bits,))
    table_bytes = np.zeros(len(q) * (2 + 5 * fmt.alphabet), dtype=np.uint8)
    n_bytes = (k.pack_table(np.ascontiguousarray(q, dtype=np.int64), table_bytes) + 7) // 8
    F.write_varint(head, n_bytes)
    head += table_bytes[:n_bytes].tobytes()
    head += states.astype("<u4").tobytes()
    F.write_varint(head, n_words)
    middle = bytearray()
    F.write_varint(middle, tail_bits)
    # the kernels work in the machine's byte order, which ulstore requires to be little-endian
    return [head, words[n + 1 - n_words :].view(np.uint8), middle, tail[: (tail_bits + 7) // 8]]


def decode(blob, reference=None, *, backend: str | None = None) -> np.ndarray:
    """Decode a ULPack blob, bit-exact.

    Parameters
    ----------
    blob : bytes-like
        A blob from :func:`encode`.
    reference : array-like, optional
        The reference the blob was coded against (None for intra blobs).
    backend : {"cython", "numpy"}, optional
        Kernel implementation; defaults to the active one.

    Returns
    -------
    numpy.ndarray
        A new C-contiguous array of the original dtype (ml_dtypes for bf16/fp8)
        and shape, in native (little-endian) byte order.

    Raises
    ------
    CorruptBlobError
        The blob is truncated, altered or inconsistent (CRC, tables, streams, checksum).
    UnsupportedVersionError
        The blob was written by a newer format version.
    ReferenceMismatchError
        ``reference`` is not the one the blob was coded against (or is missing).
    """
    header, rd = F.open_blob(blob)
    fmt = header.fmt
    rf = None
    if header.is_delta:
        if reference is None:
            raise ReferenceMismatchError("this ULPack blob is a delta: pass the reference it was coded against")
        rfmt, r = as_bits(reference)
        if rfmt is not fmt or r.shape != header.shape:
            raise ReferenceMismatchError(
                f"reference is {rfmt.name}{list(r.shape)} but the blob was coded against {fmt.name}{list(header.shape)}"
            )
        rf = r.reshape(-1)
    elif reference is not None:
        raise ReferenceMismatchError("this ULPack blob is intra-coded (no reference); do not pass one")
    k = kernels(backend)
    n = header.size
    if header.mode == F.MODE_RANS:
        # one pass over the reference yields its checksum and the context sizes
        emask = _econd_mask(fmt, rf is not None, not header.flags & F.FLAG_NO_ECOND)
        ref = rf if rf is not None else np.zeros(n, dtype=fmt.word)
        n_c = np.zeros((8, emask + 1), dtype=np.uint32)
        ref_hash = _fold32(k.context_histogram(ref, fmt.mant_bits, emask, n_c))
    else:
        ref_hash = _hash32(k, rf) if rf is not None else 0
    if rf is not None and ref_hash != header.ref_hash:
        raise ReferenceMismatchError("reference does not match the one this ULPack blob was coded against")
    if header.mode == F.MODE_RANS:
        out, values_hash = _decode_rans(k, fmt, rd, ref, emask, n_c.sum(axis=0, dtype=np.int64))
    else:
        if header.mode == F.MODE_RAW:
            out = np.frombuffer(rd.take(n * fmt.width // 8, "raw values"), dtype=fmt.word).copy()
        else:
            out = rf.copy() if rf is not None else np.zeros(n, dtype=fmt.word)
        values_hash = k.hash64(out)
    if rd.pos != rd.end:
        raise CorruptBlobError(f"ULPack blob has {rd.end - rd.pos} unexpected trailing bytes")
    if _target_hash(k, fmt, header.shape, values_hash) != header.target_hash:
        raise CorruptBlobError("ULPack blob decodes to values that fail the target checksum")
    return from_bits(fmt, out).reshape(header.shape)


def _decode_rans(k, fmt, rd, rf, emask, n_c) -> tuple[np.ndarray, int]:
    """Decode the rANS payload against reference words ``rf`` whose contexts hold ``n_c`` elements.

    Returns the values and their ``hash64``.
    """
    n = len(rf)
    scale_bits = rd.u8("scale bits")
    if scale_bits != SCALE_BITS:
        raise CorruptBlobError(f"ULPack blob declares a {scale_bits}-bit scale; format version 1 uses {SCALE_BITS}")
    # the table rows and their sizes come from the reference, not the blob
    rows = table_rows(n_c)
    data = np.frombuffer(rd.take(rd.varint("table size", limit=1 << 24), "table"), dtype=np.uint8)
    row_n = sum_rows(n_c, n_c)
    q = np.zeros((len(row_n), fmt.alphabet), dtype=np.int64)
    status = k.read_table(data, row_n, scale_bits, q)
    if status:
        raise CorruptBlobError(f"ULPack blob table is corrupt: {TABLE_STATUS.get(status, f'status {status}')}")
    freqs = np.empty(q.shape, dtype=np.uint32)
    k.normalize_rows(q, scale_bits, freqs)
    states = np.frombuffer(rd.take(4 * F.LANES, "lane states"), dtype="<u4").astype(np.uint32)
    if ((states < STATE_LOW) | (states >= 1 << 31)).any():
        raise CorruptBlobError("ULPack blob has an rANS lane state out of range")
    n_words = rd.varint("word count", limit=n)
    words = np.frombuffer(rd.take(2 * n_words, "rANS words"), dtype=np.uint8)
    tail_bits = rd.varint("tail bit count", limit=n * (fmt.width - 3))
    tail = np.frombuffer(rd.take((tail_bits + 7) // 8, "raw tail"), dtype=np.uint8)
    if tail_bits % 8 and tail[-1] >> (tail_bits % 8):
        raise CorruptBlobError("ULPack blob has non-zero padding bits after its raw tail")
    # first slot entry of each context's row; contexts absent from the reference are never read
    ctx_rows = (np.maximum(rows, 0) << scale_bits).astype(np.int32)
    slots = scratch("slots", len(freqs) << scale_bits, np.uint32)
    k.slot_table(freqs, slots)
    tokens = scratch("tokens", n, np.uint8)
    status = k.rans_decode(rf, fmt.mant_bits, emask, ctx_rows, slots, words, states, tokens)
    out = np.empty(n, dtype=fmt.word)  # first holds the residuals, then the values
    if not status:
        status = k.unpack_tails(tokens, tail, tail_bits, out)
    if status:
        raise CorruptBlobError(f"ULPack blob is corrupt: {STATUS.get(status, f'status {status}')}")
    return out, k.reconstruct(rf, out)


# -- batches --------------------------------------------------------------------


def _batches(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Group indices, largest first, into batches of at most ``budget`` bytes (one item may exceed it)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + sizes[i] > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += sizes[i]
    if current:
        batches.append(current)
    return batches


def _run_batched(fn, items: list, sizes: list[int], threads: int | None, budget: int) -> list:
    """``[fn(item) for item in items]``, in parallel batches.

    A batch holds at most ``budget`` bytes, and at most a sixteenth of one thread's
    share of the work so that every thread stays busy to the end.  Batches are
    submitted largest first.  Each result depends only on its item, so neither
    batching nor scheduling can change it.
    """
    threads = (os.cpu_count() or 1) if threads is None else max(1, int(threads))
    if threads == 1 or len(items) <= 1:
        return [fn(item) for item in items]
    results: list = [None] * len(items)

    def run(batch):
        for i in batch:
            results[i] = fn(items[i])

    per_task = max(1, min(budget, sum(sizes) // (16 * threads)))
    with cf.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(run, b) for b in _batches(sizes, per_task)]:
            f.result()
    return results


def _nbytes(array) -> int:
    if hasattr(array, "nbytes"):
        return int(array.nbytes)
    if hasattr(array, "element_size"):  # torch
        return int(array.numel() * array.element_size())
    return int(np.asarray(array).nbytes)


def encode_many(
    pairs: Iterable, *, threads: int | None = None, budget: int = 64 << 20, econd: bool = True, backend: str | None = None
) -> list[bytes]:
    """Encode many tensors in parallel; returns exactly what :func:`encode` returns for each.

    Parameters
    ----------
    pairs : iterable
        ``(target, reference)`` tuples, or bare targets (intra).
    threads : int, optional
        Worker threads (default: all cores).  The kernels release the GIL.
    budget : int
        Bytes of raw input grouped into one task, so many small tensors share one
        call.  Batching never changes a blob.
    """
    items = [p if isinstance(p, tuple) else (p, None) for p in pairs]
    sizes = [_nbytes(t) for t, _ in items]
    return _run_batched(lambda p: encode(p[0], p[1], econd=econd, backend=backend), items, sizes, threads, budget)


def decode_many(pairs: Iterable, *, threads: int | None = None, budget: int = 64 << 20, backend: str | None = None) -> list[np.ndarray]:
    """Decode many ``(blob, reference)`` pairs (or bare intra blobs) in parallel."""
    items = [p if isinstance(p, tuple) else (p, None) for p in pairs]
    sizes = [len(b) for b, _ in items]
    return _run_batched(lambda p: decode(p[0], p[1], backend=backend), items, sizes, threads, budget)


# -- analysis -------------------------------------------------------------------


def inspect_blob(blob) -> dict:
    """Header fields of a blob (after its integrity checks), for tools and debugging."""
    header, _ = F.open_blob(blob)
    mode = {F.MODE_RAW: "raw", F.MODE_SAME: "same", F.MODE_RANS: "rans"}[header.mode]
    return {
        "version": F.VERSION,
        "dtype": header.fmt.name,
        "shape": header.shape,
        "mode": mode,
        "delta": header.is_delta,
        "econd": not header.flags & F.FLAG_NO_ECOND,
        "nbytes": len(memoryview(blob)),
    }


def model_entropy_bits(target, reference=None, *, econd: bool = True) -> float:
    """Ideal size in bits of ``target`` under ULPack's own model (no tables, no coder loss).

    ``sum over table rows and tokens of -count * log2(count / row total)`` plus the
    raw tail bits: what a perfect entropy coder with free tables would reach.  Rows
    are the reference-exponent contexts, with contexts of fewer than 256 elements
    pooled into one row, exactly as the coder models them.
    """
    fmt, x, r = _prepare(target, reference)
    xf = x.reshape(-1)
    if xf.size == 0:
        return 0.0
    rf = None if r is None else r.reshape(-1)
    counts, emask = _analyze(kernels(), fmt, xf, rf, econd)[2:4]
    hist = counts.reshape(emask + 1, -1)[:, : fmt.alphabet].astype(np.int64)
    tokens = np.arange(fmt.alphabet)
    tail_bits = int((hist.sum(axis=0) * np.maximum((tokens >> 2) - 1, 0)).sum())
    h = sum_rows(hist, hist.sum(axis=1)).astype(np.float64)  # the model's own rows
    totals = h.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = -np.where(h > 0, h * np.log2(h / totals), 0.0).sum()
    return float(bits) + tail_bits


# -- numcodecs ------------------------------------------------------------------


class ULPack(Codec):
    """numcodecs codec for ULPack (``{"id": "ulpack"}``).

    A pure codec: no I/O.  ``encode``/``decode`` take an optional ``reference=``
    array; without one they code intra (against +0.0).  Decoding returns the
    original dtype and shape; with ``out=`` the values are copied into it.

    Parameters
    ----------
    econd : bool, default True
        Condition the models on the reference exponent (False: ablation).
    dtype : str, optional
        How to read buffers that carry no float dtype (bytes, uint8 arrays...):
        e.g. ``"bfloat16"``.  Arrays of a float dtype are always read as such.

    Notes
    -----
    numcodecs codecs round-trip a buffer's bytes in memory order.  A Fortran-ordered
    array is therefore coded as its C-ordered transpose (same bytes, reversed
    shape), so ``decode(encode(a))`` has ``a``'s memory bytes.

    Examples
    --------
    >>> import numcodecs, numpy as np
    >>> codec = numcodecs.get_codec({"id": "ulpack"})
    >>> codec
    ULPack(econd=True)
    >>> x = np.arange(6, dtype=np.float16).reshape(2, 3)
    >>> codec.decode(codec.encode(x)).tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """

    codec_id = "ulpack"

    def __init__(self, econd: bool = True, dtype: str | None = None):
        self.econd = bool(econd)
        self.dtype = None if dtype is None else format_of(dtype).name

    def _as_array(self, buf):
        arr = buf if isinstance(buf, np.ndarray) else ensure_ndarray_like(buf)
        if arr.dtype.kind in "biuV" and self.dtype is not None:
            arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).view(format_of(self.dtype).dtype)
        if arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous:
            arr = arr.T  # memory order, see Notes
        return arr

    def encode(self, buf, reference=None):
        ref = None if reference is None else self._as_array(reference)
        return encode(self._as_array(buf), ref, econd=self.econd)

    def decode(self, buf, out=None, reference=None):
        ref = None if reference is None else self._as_array(reference)
        arr = decode(ensure_contiguous_ndarray(buf), ref)
        if out is None:
            return arr
        return ndarray_copy(arr, out)

    def get_config(self) -> dict:
        config = {"id": self.codec_id, "econd": self.econd}
        if self.dtype is not None:  # omitted when unset, so plain configs stay {"id", "econd"}
            config["dtype"] = self.dtype
        return config

    def __repr__(self) -> str:
        dtype = "" if self.dtype is None else f", dtype={self.dtype!r}"
        return f"ULPack(econd={self.econd!r}{dtype})"


numcodecs.register_codec(ULPack)
