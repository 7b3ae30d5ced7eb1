"""Pure functions that turn one chunk into a blob and back, and hash chunks: no I/O, no state.

Floating-point chunks (float16, bfloat16, float32, float64, fp8) are ULPack
blobs coded against the reference chunk (or intra); every other dtype (int,
uint, bool, complex) is Zstd of the raw little-endian bytes, always intra.
These functions are module-level so that a process-based executor (dask
distributed) can pickle them.

Hashes are BLAKE3 truncated to 128 bits (:func:`digest`): content hashes of
decoded chunks, table blocks, files and the step content checksum.  A blob's
bytes are never hashed: a blob is checked by decoding it (ULPack's CRC and
target checksum, Zstd bounded to the expected size) and comparing the content
hash of what it decodes to.

Untrusted blobs are checked before anything is allocated for them
(:func:`decode_chunk`): a ULPack header must declare exactly the expected
chunk shape, a Zstd frame exactly the expected byte count, and Zstd
decompresses into a buffer of that size only.
"""

from __future__ import annotations

import blake3
import numcodecs
import numpy as np
from numcodecs import zstd as _zstd

from ... import codec as _ulpack
from ...codec import decode_into, format_of, is_sparse_blob
from ...errors import CorruptBlobError, DtypeError, IntegrityError, UlstoreError

__all__ = [
    "ULPACK",
    "ZSTD",
    "HASH_NAME",
    "codec_for",
    "check_committable",
    "digest",
    "content_digest",
    "le_bytes",
    "encode_chunk",
    "decode_chunk",
    "zstd_compress",
    "zstd_decompress",
]

ULPACK = "ulpack"
ZSTD = "zstd"
#: The one hash of format 2 (content hashes, table blocks, files, step checksums).
HASH_NAME = "blake3-128"

_ZSTD = numcodecs.Zstd(level=3)


def codec_for(dtype: np.dtype) -> str:
    """Name of the chunk codec for ``dtype``; raises DtypeError for unstorable dtypes."""
    try:
        format_of(dtype)
        return ULPACK
    except DtypeError:
        pass
    if dtype.kind in "biuc":
        return ZSTD
    raise DtypeError(f"ulstore stores floating-point, integer, boolean and complex tensors; got dtype {dtype}")


def check_committable(dtype: np.dtype) -> str:
    """:func:`codec_for` of a dtype a commit is given, refusing what no export could give back.

    complex64 is stored, read and exported (torch ``complex64``, safetensors ``C64``); wider complex
    dtypes have no safetensors code, so a step holding one could not be exported: refused with the
    exact alternative (a float view of the real and imaginary parts).  Steps stored before keep
    reading (only commits are checked).
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "c" and dtype.itemsize > 8:
        part = np.dtype(f"f{dtype.itemsize // 2}")
        raise DtypeError(
            f"{dtype.name} tensors cannot be committed: no checkpoint format ulstore exports holds them "
            f"(safetensors has complex64 only), so the step could not be exported; commit x.view(np.{part.name}) "
            f"(real and imaginary parts interleaved, bit-exact: .view(np.{dtype.name}) gives x back), "
            "or x.astype(np.complex64) if its precision is enough"
        )
    return codec_for(dtype)


def digest(data) -> bytes:
    """BLAKE3 of ``data`` (bytes-like) truncated to 16 bytes."""
    return blake3.blake3(data).digest(16)


def content_digest(chunk: np.ndarray) -> bytes:
    """Content hash of a decoded chunk: :func:`digest` of its C-order little-endian bytes."""
    return digest(le_bytes(chunk))


def le_bytes(chunk: np.ndarray) -> memoryview:
    """The chunk's values as C-order little-endian bytes (a view when it already is)."""
    a = chunk if chunk.flags.c_contiguous else np.ascontiguousarray(chunk)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers


def encode_chunk(chunk: np.ndarray, reference: np.ndarray | None, codec: str, sparse: bool = False) -> bytes:
    """Encode one chunk (against ``reference``, or intra) into its blob.

    ``sparse``: a ULPack delta in which few elements change is coded by position
    (SPARSE mode), so :func:`ulstore.decode_changes` applies it in O(changes), and
    without exponent contexts: 2.7% larger on the benchmark's RL steps (more where
    the changed elements' exponents say more about their residuals), but a
    follower's in-place apply then reads and writes each changed word in one pass
    over memory instead of two, 16-19% faster (``_apply.pxi``, ``fused_put``).  A
    delta that changes too much for SPARSE mode keeps its contexts: it is coded
    again with them (nothing applies dense deltas in place).
    """
    if codec == ULPACK:
        if sparse and reference is not None:
            blob = _ulpack.encode(chunk, reference, sparse=True, econd=False)
            if is_sparse_blob(blob):
                return blob
        return _ulpack.encode(chunk, reference)
    return zstd_compress(le_bytes(chunk))


def zstd_compress(data) -> bytes:
    """Zstd (level 3) of ``data``; the frame records its content size."""
    return bytes(_ZSTD.encode(data))


def zstd_decompress(frame, size: int, *, what: str = "zstd frame") -> bytes:
    """Decompress a Zstd frame that must hold exactly ``size`` bytes, never inflating beyond that.

    Raises
    ------
    ValueError
        The frame does not declare exactly ``size`` bytes, or does not decode.
    """
    declared = _frame_content_size(memoryview(frame).cast("B"))
    if declared != size:
        raise ValueError(f"{what} declares {declared} bytes, expected {size}")
    if not size:
        return b""
    try:
        # numcodecs allocates the declared content size, checked above: no frame inflates beyond ``size``
        # (and no output buffer to fill and copy out: half the time of a follower's table block, cold)
        data = _zstd.decompress(frame)
    except Exception as e:  # numcodecs raises RuntimeError on damaged frames
        raise ValueError(f"{what} does not decompress: {e}") from None
    if len(data) != size:
        raise ValueError(f"{what} decompresses to {len(data)} bytes, expected {size}")
    return bytes(data)


def _frame_content_size(buf: memoryview) -> int | None:
    """Frame_Content_Size of a Zstd frame header (RFC 8878, 3.1.1.1), or None if absent or unreadable."""
    if len(buf) < 6 or bytes(buf[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    fhd = buf[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if width == 0 or len(buf) < pos + width:
        return None
    value = int.from_bytes(buf[pos : pos + width], "little")
    return value + 256 if width == 2 else value


def decode_chunk(
    blob,
    reference: np.ndarray | None,
    codec: str,
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    key: str,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode one chunk to an array of ``dtype`` and ``shape`` (unpadded).

    Declared sizes are checked against ``shape`` before decoding.  Any failure
    of the blob itself becomes a :class:`CorruptBlobError` naming ``key``.
    ``out`` (optional): a C-contiguous array of ``dtype`` and ``shape`` to
    decode into (returned); what it holds after a failure is unspecified.
    """
    shape = tuple(shape)
    n = 1
    for d in shape:
        n *= d
    try:
        if codec == ULPACK:
            # the codec refuses a blob declaring another shape before it allocates anything
            if out is None:
                value = _ulpack.decode(blob, reference, shape=shape)
            else:
                value = decode_into(blob, reference, out, shape=shape)
        elif codec == ZSTD:
            raw = zstd_decompress(blob, n * dtype.itemsize, what="zstd chunk")
            value = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
            if out is not None:
                out[...] = value.reshape(out.shape)
                value = out
        else:
            raise CorruptBlobError(f"unknown chunk codec {codec!r}", key=key)
    except UlstoreError as e:
        # a ULPack error on stored bytes is always an integrity failure; keep its class
        # (CorruptBlobError, ReferenceMismatchError) and name the blob
        cls = type(e) if isinstance(e, IntegrityError) else CorruptBlobError
        raise cls(f"chunk blob does not decode: {e.message}", key=key) from e
    except Exception as e:  # zstd or numpy choking on damaged bytes
        raise CorruptBlobError(f"chunk blob does not decode: {e}", key=key) from e
    if value.dtype != dtype or value.size != n:
        raise CorruptBlobError(
            f"chunk blob decodes to {value.dtype}{list(value.shape)}, expected {dtype}{list(shape)}", key=key
        )
    return value.reshape(shape)
