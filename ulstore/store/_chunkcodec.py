"""Pure functions that turn one chunk into a blob and back: no I/O, no state.

Floating-point chunks (float16, bfloat16, float32, float64, fp8) are ULPack
blobs coded against the co-located chunk of the reference step (or intra);
every other dtype (int, uint, bool, complex) is Zstd of the raw little-endian
bytes, always intra.  These functions are module-level so that a process-based
executor (dask distributed) can pickle them.
"""

from __future__ import annotations

import numcodecs
import numpy as np

from .. import codec as _ulpack
from ..codec._dtypes import format_of
from ..core.sealed import address, digest128
from ..errors import CorruptBlobError, DtypeError, IntegrityError, UlstoreError

__all__ = [
    "ULPACK",
    "ZSTD",
    "codec_for",
    "blob_digest",
    "content_digest",
    "encode_chunk",
    "decode_chunk",
]

ULPACK = "ulpack"
ZSTD = "zstd"

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


def blob_digest(blob) -> str:
    """The blob's address: blake2b-256 of its bytes, hex."""
    return address(blob)


def content_digest(chunk: np.ndarray) -> str:
    """Checksum of a decoded chunk: blake2b-128 of its C-order little-endian bytes, hex.

    128 bits is for integrity, not addressing: it detects a wrong or damaged
    chunk, it never names one.
    """
    return digest128(_le_bytes(chunk))


def _le_bytes(chunk: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(chunk)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers


def encode_chunk(chunk: np.ndarray, reference: np.ndarray | None, codec: str) -> tuple[bytes, str]:
    """Encode one chunk; returns ``(blob, blob_digest)``.

    Hashing here (in the worker) keeps the writer's thread free for I/O.
    """
    if codec == ULPACK:
        blob = _ulpack.encode(chunk, reference)
    else:
        blob = bytes(_ZSTD.encode(_le_bytes(chunk)))
    return blob, blob_digest(blob)


def decode_chunk(
    blob, reference: np.ndarray | None, codec: str, dtype: np.dtype, shape: tuple[int, ...], *, key: str
) -> np.ndarray:
    """Decode one chunk to an array of ``dtype`` and ``shape`` (unpadded).

    Any failure of the blob itself becomes a :class:`CorruptBlobError` naming ``key``.
    """
    try:
        if codec == ULPACK:
            out = _ulpack.decode(blob, reference)
        elif codec == ZSTD:
            raw = _ZSTD.decode(blob)
            out = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
        else:
            raise CorruptBlobError(f"unknown chunk codec {codec!r}", key=key)
    except UlstoreError as e:
        # a ULPack error on stored bytes is always an integrity failure; keep its class
        # (CorruptBlobError, ReferenceMismatchError) and name the blob
        cls = type(e) if isinstance(e, IntegrityError) else CorruptBlobError
        raise cls(f"chunk blob does not decode: {e.message}", key=key) from e
    except Exception as e:  # zstd or numpy choking on damaged bytes
        raise CorruptBlobError(f"chunk blob does not decode: {e}", key=key) from e
    if out.dtype != dtype or out.size != int(np.prod(shape)):
        raise CorruptBlobError(
            f"chunk blob decodes to {out.dtype}{list(out.shape)}, expected {dtype}{list(shape)}", key=key
        )
    return out.reshape(shape)
