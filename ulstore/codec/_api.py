"""ULPack: lossless delta coding of a floating-point tensor against a reference.

``encode(target, reference)`` returns a self-contained blob; ``decode(blob,
reference)`` returns the target exactly, bit for bit, for every bit pattern
(signed zeros, subnormals, infinities and NaN payloads included).  With no
reference the tensor is coded *intra* (anchors, first steps, new tensors).

How: the ordered-integer (ULP) residual ``zigzag(key(x) - key(r))`` of every
element is split into a token (its bit length and the two bits below the leading
one) and raw low bits.  Tokens are coded with static interleaved rANS (4 or 32
lanes) whose tables are conditioned on the reference value's exponent field,
which the decoder already holds; the raw bits go through the same rANS states.
Intra, the symbol is the exponent and the top mantissa bits, and the sign and the
other mantissa bits are raw.  See ``docs/format.md`` for the bytes.

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

import numpy as np

from ..errors import CorruptBlobError, InvalidInputError, ReferenceMismatchError
from . import _format as F
from ._apply_plan import _meta
from ._backend import kernels
from ._checksum import finish_sum
from ._checksum import fold32 as _fold32
from ._dtypes import FloatFormat, as_bits, from_bits
from ._one_stream import decode_section3, encode_delta, encode_intra, intra_choice, intra_plan
from ._rans_tables import POOL_BELOW
from ._scratch import scratch
from ._section import check_v1_intra_size, decode_section
from ._sparse import GAPS, SPARSE_ALWAYS_UP_TO, SPARSE_MAX_FRACTION, decode_sparse, encode_sparse

__all__ = ["encode", "decode", "decode_into", "HEADER_BOUND"]

#: Bytes a 1-d blob may exceed the raw tensor by (header + CRC); see :func:`header_bound`.
HEADER_BOUND = F.header_bound(1)

_MAX_ELEMENTS = F.MAX_ELEMENTS


def _prepare(target, reference):
    fmt, x = as_bits(target)
    # (a dimension can exceed the limit only when another is 0, or when the size does)
    if x.size > _MAX_ELEMENTS or (not x.size and any(d > _MAX_ELEMENTS for d in x.shape)):
        raise InvalidInputError(f"a ULPack blob holds at most {_MAX_ELEMENTS} elements; split the tensor into chunks")
    if reference is None:
        return fmt, x, None
    rfmt, r = as_bits(reference)
    if rfmt is not fmt:
        raise InvalidInputError(f"target is {fmt.name} but reference is {rfmt.name}; they must match")
    if r.shape != x.shape:
        raise InvalidInputError(f"target shape {x.shape} and reference shape {r.shape} differ")
    return fmt, x, r


def encode(target, reference=None, *, econd: bool = True, sparse: bool = False, backend: str | None = None) -> bytes:
    """Code ``target`` losslessly against ``reference`` (or against +0.0 if None).

    Parameters
    ----------
    target : array-like
        A float16, bfloat16, float32, float64, float8_e4m3fn or float8_e5m2 numpy
        array (ml_dtypes for bf16/fp8) or torch tensor, any shape, layout or byte order.
    reference : array-like, optional
        Same dtype and shape.  The decoder must supply the identical bits.
    econd : bool, default True
        Condition the models on the reference exponent; blobs record it.  ``False``
        measures what conditioning buys, and is what the store codes SPARSE deltas
        with: 2-3% larger on RL steps, but applied in place in one pass over memory.
    sparse : bool, default False
        For deltas in which at most 1/8 of the elements change, or of tensors
        of at most 4096 elements, code where the changes are instead of every
        element's residual (mode SPARSE), so that :func:`decode_changes` costs
        time in proportion to the changes, not to the tensor (and a weight-sync
        follower applies them in place).  About a third larger on RL deltas:
        positions cannot be conditioned on the reference exponent.  Ignored
        for intra blobs.
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
    mode, coded, hash_r = F.MODE_RAW, [], 0
    if not xf.size:
        hash_x = k.hash64(xf)  # empty: RAW
    elif rf is None:
        mode, coded, hash_x = _encode_intra(k, fmt, xf, econd)
    else:
        z, sym, hist, emask, hash_x, hash_r = _analyze(k, fmt, xf, rf, econd)
        changed = xf.size - int(hist[:: 1 << fmt.token_bits].sum())  # token 0 of every context
        if not changed:
            mode = F.MODE_SAME
        elif sparse and (changed * SPARSE_MAX_FRACTION <= xf.size or xf.size <= SPARSE_ALWAYS_UP_TO):
            mode, coded = F.MODE_SPARSE, encode_sparse(k, fmt, z, sym, emask, changed)
        else:
            mode, coded = F.MODE_RANS, encode_delta(k, fmt, z, sym, hist, emask)[0]
    ref_hash = _fold32(hash_r) if rf is not None else 0
    target_hash = _target_hash(k, fmt, x.shape, hash_x)
    if mode == F.MODE_SAME:  # every residual is zero: the reference (or +0.0) is the target
        return F.seal(F.pack_header(fmt, mode, flags, x.shape, ref_hash, target_hash))
    if mode == F.MODE_RAW or sum(len(part) for part in coded) >= xf.nbytes:  # tables cost more than they save
        return F.seal(F.pack_header(fmt, F.MODE_RAW, flags, x.shape, ref_hash, target_hash), xf.view(np.uint8))
    return F.seal(F.pack_header(fmt, mode, flags, x.shape, ref_hash, target_hash), *coded)


def _encode_intra(k, fmt: FloatFormat, xf: np.ndarray, econd: bool):
    """(mode, payload parts, hash64(x)) of an intra blob: INTRA, or RANS against +0.0 when that
    is smaller (many zeros) or INTRA cannot code it (more than 256 symbols), or SAME (all +0.0)."""
    mode, plan, hash_x = _intra_mode(k, fmt, xf, econd)
    if mode == F.MODE_INTRA:
        sym, choice = plan
        return mode, encode_intra(k, fmt, xf, sym, choice), hash_x
    return mode, plan, hash_x


def _intra_mode(k, fmt: FloatFormat, xf: np.ndarray, econd: bool):
    """The intra model ``encode`` uses: (MODE_SAME, [], h), (MODE_RANS, payload parts, h) or
    (MODE_INTRA, (symbols, intra_choice), h), with h = hash64(x)."""
    sym, hist, hash_x = intra_plan(k, fmt, xf)
    n = xf.size
    if hist[0] == n and not xf.any():
        return F.MODE_SAME, [], hash_x
    choice = intra_choice(k, fmt, hist, n)
    # INTRA spends sign and low mantissa bits on every element, zeros too: where
    # zeros (symbol 0) are common, see whether the residual coder does better
    if choice is None or int(hist[0]) * 8 >= n:
        z, rsym, rhist, emask, _, _ = _analyze(k, fmt, xf, None, econd)
        parts, bits = encode_delta(k, fmt, z, rsym, rhist, emask)
        if choice is None or bits < choice[0]:
            return F.MODE_RANS, parts, hash_x
    return F.MODE_INTRA, (sym, choice), hash_x


def _hash32(k, words: np.ndarray) -> int:
    """32-bit checksum of an array's bytes.

    A blob carries one for its reference and one for its target: a wrong reference
    must get past both to yield values, a 2**-64 event.
    """
    return _fold32(k.hash64(words))


def _target_hash(k, fmt: FloatFormat, shape: tuple, values_hash: int) -> int:
    """Checksum of the values (their ``hash64``), bound to the dtype and shape they are read as."""
    key = (fmt.code, shape)
    meta_hash = _META_HASHES.get(key)
    if meta_hash is None:
        meta = bytearray((fmt.code,))
        for d in shape:
            F.write_varint(meta, d)
        meta_hash = k.hash64(meta)  # (every backend gives the same value)
        if len(_META_HASHES) >= 4096:  # a model has a few hundred shapes; a stream of odd ones must not grow this
            _META_HASHES.clear()
        _META_HASHES[key] = meta_hash
    return _fold32(values_hash ^ meta_hash)


#: hash64 of (dtype code, shape varints) by (code, shape): the target hash's salt.
_META_HASHES: dict[tuple[int, tuple], int] = {}


#: Elements from which ``_analyze`` counts symbols in four interleaved histogram copies.
_HIST_COPIES_FROM = 1 << 16


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
    # four interleaved histogram copies avoid store-to-load stalls, where they fit in cache;
    # a small tensor has too few elements for that to repay clearing and folding three more
    copies = F.LANES if fmt.symbol.itemsize == 2 and xf.size >= _HIST_COPIES_FROM else 1
    size = (emask + 1) << fmt.token_bits
    lanes = scratch("histogram", copies * size, np.uint32).reshape(copies, size)
    k.histogram(sym, lanes)
    return z, sym, lanes[0], emask, hash_x, hash_r  # counts per symbol: context << token_bits | token


def decode(blob, reference=None, *, shape=None, backend: str | None = None) -> np.ndarray:
    """Decode a ULPack blob, bit-exact.

    Parameters
    ----------
    blob : bytes-like
        A blob from :func:`encode`.
    reference : array-like, optional
        The reference the blob was coded against (None for intra blobs).
    shape : tuple of int, optional
        The shape the caller expects.  A blob that declares another one is refused
        before anything of its size is allocated: pass it whenever you know it
        (a store knows its chunks' shapes), so that a damaged or forged intra
        blob cannot make the decoder allocate more than the tensor you expect.
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
        The blob is truncated, altered or inconsistent (CRC, tables, streams,
        checksum, or a size its payload cannot hold), or declares a shape other
        than ``shape``.
    UnsupportedVersionError
        The blob was written by a newer format version.
    ReferenceMismatchError
        ``reference`` is not the one the blob was coded against (or is missing).
    """
    return _decode(blob, reference, backend, None, shape)


def decode_into(blob, reference, out: np.ndarray, *, shape=None, backend: str | None = None) -> np.ndarray:
    """:func:`decode` into ``out`` (C-contiguous, the blob's dtype and element count); returns ``out``.

    ``shape`` as for :func:`decode` (the blob must declare it).  What ``out``
    holds when this raises is unspecified.  ``out`` must not overlap ``reference``:
    a decode that fails with the two overlapping says so (InvalidInputError), rather
    than blaming the blob or the reference it overwrote.
    """
    try:
        return _decode(blob, reference, backend, out, shape)
    except (CorruptBlobError, ReferenceMismatchError) as e:
        # checked after a failure only: a bounds test costs nothing on the success path, which is every call
        if reference is not None and np.may_share_memory(out, reference):
            raise InvalidInputError(
                "out overlaps reference: decode_into reads the reference while it writes out, so they must be "
                "separate arrays (the reference's values may have been overwritten)"
            ) from e
        raise


def _decode(blob, reference, backend, dest, shape) -> np.ndarray:
    header, rd, rf = _open(blob, reference, shape)
    fmt = header.fmt
    k = kernels(backend)
    words = _dest_words(fmt, header.size, dest)
    if header.mode == F.MODE_SPARSE:
        assert rf is not None  # open_blob refuses SPARSE blobs that are not deltas
        ref_sum = k.hash_sum64(rf)
        out = _filled(rf, words)
        if not _sparse_in_place(k, blob, header, out, ref_sum):  # (all or nothing: out still holds rf)
            pos, values, _ = _sparse_changes(k, header, rd, rf, ref_sum)  # names what is wrong
            out[pos] = values
        return _shaped(fmt, out, header.shape, dest)

    def verify(values_hash: int) -> None:
        if _target_hash(k, fmt, header.shape, values_hash) != header.target_hash:
            raise CorruptBlobError("ULPack blob decodes to values that fail the target checksum")

    emask = _econd_mask(fmt, rf is not None, not header.flags & F.FLAG_NO_ECOND)
    if header.version >= 3 and header.mode in (F.MODE_RANS, F.MODE_INTRA):
        out = _decode_one_stream(k, header, rd, rf, emask, verify, words)
    elif header.mode == F.MODE_SAME and rf is None:  # all +0.0: check before allocating (the size is all there is)
        _check_end(rd)
        verify(k.hash_fill(0, header.size, fmt.width // 8))
        if words is not None:
            words[...] = 0
            return dest
        return from_bits(fmt, np.zeros(header.size, dtype=fmt.word)).reshape(header.shape)
    else:
        out = _decode_version1(k, header, rd, rf, emask, verify, words)
    if out is words and dest is not None:  # decoded in place, into dest's words (np.shares_memory: a microsecond)
        return dest
    return _shaped(fmt, out, header.shape, dest)


def _dest_words(fmt: FloatFormat, n: int, dest: np.ndarray | None) -> np.ndarray | None:
    """The words of the caller's ``out`` array (checked: writable, C-contiguous, the blob's dtype and size)."""
    if dest is None:
        return None
    if dest.dtype != fmt.dtype or dest.size != n or not dest.flags.c_contiguous or not dest.flags.writeable:
        raise InvalidInputError(
            f"out must be a writable C-contiguous {fmt.name} array of {n} elements, got {dest.dtype}{list(dest.shape)}"
        )
    return dest.reshape(-1).view(fmt.word)


def _filled(src: np.ndarray, words: np.ndarray | None) -> np.ndarray:
    """``src`` copied into ``words``, or into a new array."""
    if words is None:
        return src.copy()
    words[...] = src
    return words


def _decode_one_stream(k, header: F.Header, rd: F.Reader, rf, emask: int, verify, words) -> np.ndarray:
    """The values of a version-3 RANS or INTRA payload, checked (reference, then target).

    One kernel call (``decode3``: the payload's checks, tables and decode) does it when all is well; on any
    status it reports, the step-by-step path below runs, which names what is wrong (or decodes the one
    case ``decode3`` leaves to it, a constant tensor against +0.0).
    """
    decode3 = getattr(k, "decode3", None)  # (a kernel build older than its sources lacks it: the path below decodes)
    if decode3 is None:
        return _decode_one_stream_steps(k, header, rd, rf, emask, verify, words)
    status, out, values_hash, ref_hash = decode3(*decode3_args(header, rd, rf, words, emask))
    if not status and (rf is None or _fold32(ref_hash) == header.ref_hash):
        rd.pos = rd.end
        verify(values_hash)
        return out
    return _decode_one_stream_steps(k, header, rd, rf, emask, verify, words)


def decode3_args(header: F.Header, rd: F.Reader, rf, words, emask: int) -> tuple:
    """The arguments of the kernels' ``decode3`` for the version-3 RANS or INTRA payload at ``rd`` of ``header``:
    ``rf`` the reference words of a delta (None: intra), ``words`` those to decode into (None: a new array)."""
    fmt = header.fmt
    intra = header.mode == F.MODE_INTRA
    return (rd.buf, rd.pos, rd.end, words, rf, intra, fmt.width, fmt.mant_bits, fmt.exp_bits, fmt.token_bits,
            fmt.alphabet, emask, header.size)  # fmt: skip


def _decode_one_stream_steps(k, header: F.Header, rd: F.Reader, rf, emask: int, verify, words) -> np.ndarray:
    """:func:`_decode_one_stream` step by step (section3_args' checks in Python, then ``rans_decode3``): the
    path that names what is wrong with a damaged payload."""
    try:
        out, values_hash, ref_hash = decode_section3(k, header.fmt, header, rd, rf, emask, verify, words)
        _check_end(rd)
    except CorruptBlobError:
        _check_reference(k, header, rf)  # a wrong reference is the likelier cause: say so
        raise
    if rf is not None and _fold32(ref_hash) != header.ref_hash:
        raise ReferenceMismatchError("reference does not match the one this ULPack blob was coded against")
    verify(values_hash)
    return out


def _decode_version1(k, header: F.Header, rd: F.Reader, rf, emask: int, verify, words) -> np.ndarray:
    """The values of a version-1 RANS payload, of a RAW one, or of a SAME delta; checked (reference, then target)."""
    fmt, n = header.fmt, header.size
    if header.mode == F.MODE_RANS:
        if rf is None:
            check_v1_intra_size(k, fmt, header, rd, verify)
        # one pass over the reference yields its checksum and the context sizes
        ref = rf if rf is not None else np.zeros(n, dtype=fmt.word)
        n_c = np.zeros((8, emask + 1), dtype=np.uint32)
        ref_hash = _fold32(k.context_histogram(ref, fmt.mant_bits, emask, n_c))
    else:
        ref_full = k.hash64(rf) if rf is not None else 0
        ref_hash = _fold32(ref_full)
    if rf is not None and ref_hash != header.ref_hash:
        raise ReferenceMismatchError("reference does not match the one this ULPack blob was coded against")
    if header.mode == F.MODE_RANS:
        out = decode_section(k, fmt, rd, ref, emask, n_c.sum(axis=0, dtype=np.int64), words)  # residuals
        values_hash = k.reconstruct(ref, out)  # now the values
    elif header.mode == F.MODE_RAW:
        out = _filled(np.frombuffer(rd.take(n * fmt.width // 8, "raw values"), dtype=fmt.word), words)
        values_hash = k.hash64(out)
    else:  # SAME: the target is the reference
        out = _filled(rf, words)
        values_hash = ref_full
    _check_end(rd)
    verify(values_hash)
    return out


def _shaped(fmt: FloatFormat, words: np.ndarray, shape: tuple, dest: np.ndarray | None) -> np.ndarray:
    """The decoded words as the caller's array: a new one, or ``dest`` (filled unless decoded in place)."""
    if dest is None:
        return from_bits(fmt, words).reshape(shape)
    flat = dest.reshape(-1).view(fmt.word)
    if not np.shares_memory(flat, words):  # (a path that decoded into a buffer of its own)
        flat[...] = words
    return dest


def _check_reference(k, header: F.Header, rf) -> None:
    if rf is not None and _hash32(k, rf) != header.ref_hash:
        raise ReferenceMismatchError("reference does not match the one this ULPack blob was coded against")


def _open(blob, reference, shape=None) -> tuple[F.Header, F.Reader, np.ndarray | None]:
    """Parse and check a blob; check ``reference`` (and ``shape``) fit it; return its flat words (None: intra)."""
    header, rd = F.open_blob(blob)
    fmt = header.fmt
    if shape is not None:
        expected = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        if expected != header.shape:
            raise CorruptBlobError(f"ULPack blob declares shape {list(header.shape)}, expected {list(expected)}")
    if not header.is_delta:
        if reference is not None:
            raise ReferenceMismatchError("this ULPack blob is intra-coded (no reference); do not pass one")
        return header, rd, None
    if reference is None:
        raise ReferenceMismatchError("this ULPack blob is a delta: pass the reference it was coded against")
    rfmt, r = as_bits(reference)
    if rfmt is not fmt or r.shape != header.shape:
        raise ReferenceMismatchError(
            f"reference is {rfmt.name}{list(r.shape)} but the blob was coded against {fmt.name}{list(header.shape)}"
        )
    return header, rd, r.reshape(-1)


def _check_end(rd: F.Reader) -> None:
    if rd.pos != rd.end:
        raise CorruptBlobError(f"ULPack blob has {rd.end - rd.pos} unexpected trailing bytes")


class _OneSparseBlob:
    """The fields of an :class:`~._apply_plan.ApplyPlan` for one blob, made in a few steps (the kernel reads
    them by name)."""

    __slots__ = (
        "blobs",
        "arrays",
        "sums",
        "metas",
        "code",
        "width",
        "mant_bits",
        "emask",
        "g_alphabet",
        "t_alphabet",
        "pool_below",
    )

    def __init__(self, blob, words: np.ndarray, ref_sum: int, header: F.Header) -> None:
        fmt = header.fmt
        self.blobs, self.arrays, self.sums, self.metas = [blob], [words], [ref_sum], [_meta(fmt.code, header.shape)]
        self.code, self.width, self.mant_bits, self.emask = fmt.code, fmt.width, fmt.mant_bits, fmt.n_contexts - 1
        self.g_alphabet, self.t_alphabet, self.pool_below = GAPS.alphabet, fmt.alphabet, POOL_BELOW


def _sparse_in_place(k, blob, header: F.Header, words: np.ndarray, ref_sum: int) -> bool:
    """Apply SPARSE ``blob`` onto ``words`` (its reference's, word sum ``ref_sum``) in the kernel's in-place
    job: one compiled call for its parse, decode and checks (the decode of :func:`_sparse_changes`, then a
    scatter, took ~35 us of Python and NumPy for a blob of a few dozen changes).  False, ``words`` as they
    were, if anything failed (its CRC was checked when it was opened)."""
    job = k.SparseApply(_OneSparseBlob(blob, words, ref_sum, header), True, None, None, False)
    job.work()
    return job.finish()[0] == 0


def _sparse_changes(k, header: F.Header, rd: F.Reader, rf: np.ndarray, ref_sum: int):
    """Decode a SPARSE payload, checking the reference by its word sum ``ref_sum``.

    Returns (positions, new words, the target's word sum); O(changes) given ``ref_sum``.
    """
    fmt, nbytes = header.fmt, rf.nbytes
    if _fold32(finish_sum(ref_sum, nbytes)) != header.ref_hash:
        raise ReferenceMismatchError("reference does not match the one this ULPack blob was coded against")
    emask = _econd_mask(fmt, True, not header.flags & F.FLAG_NO_ECOND)
    pos, values, delta = decode_sparse(k, fmt, rd, rf, emask, header.version)
    _check_end(rd)
    target_sum = (ref_sum + delta) & 0xFFFFFFFFFFFFFFFF
    if _target_hash(k, fmt, header.shape, finish_sum(target_sum, nbytes)) != header.target_hash:
        raise CorruptBlobError("ULPack blob decodes to values that fail the target checksum")
    return pos, values, target_sum
