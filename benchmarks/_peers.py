"""Peer codecs the benchmarks compare ULPack against, behind one small interface.

Every peer is a class with

    name                                   label used in tables
    threads                                worker threads it was built with (1 = single)
    encode(child, parent, dtype) -> bytes  code ``child`` given ``parent``
    decode(blob, parent, dtype) -> bytes   the exact bytes of ``child``

``child`` and ``parent`` are bytes-like (``bytes``, ``memoryview``, C-contiguous
numpy arrays) holding the raw little-endian values of one tensor; ``dtype`` is
the checkpoint dtype name ("bfloat16", "float16", "float32").  Both peers are
delta codecs built the usual way: XOR the raw bytes of the child with those of
the parent (identical values give zero bytes), then compress that.

Instances are not thread-safe (zstd contexts and ZipNN objects carry state);
use one instance per thread.  :func:`available_peers` lists the peers whose
packages are installed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ZstdByteGroupedXor", "ZipNNXor", "available_peers", "ITEMSIZE"]

#: Bytes per element of each supported dtype.
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def _u8(buf) -> np.ndarray:
    """A read-only uint8 view of a bytes-like object (no copy)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def xor_bytes(a, b) -> np.ndarray:
    """Byte-wise XOR of two equally long bytes-like objects, as a new uint8 array."""
    a, b = _u8(a), _u8(b)
    if a.size != b.size:
        raise ValueError(f"child has {a.size} bytes but parent has {b.size}")
    return np.bitwise_xor(a, b)


class ZstdByteGroupedXor:
    """zstd on the byte-grouped XOR delta.

    The XOR of child and parent bytes is split into byte planes (byte 0 of every
    element, then byte 1, ...), the planes are concatenated and compressed with
    zstd at ``level`` (19 by default).  Decoding decompresses, interleaves the
    planes back and XORs with the parent.

    ``threads > 1`` uses zstd's own multi-threading (``ZstdCompressor(threads=)``),
    which splits one input into jobs of several MiB; a tensor smaller than one
    job is still compressed by a single thread.  Decompression is single-threaded
    in zstd.
    """

    def __init__(self, level: int = 19, threads: int = 1):
        import zstandard

        self.level = level
        self.threads = max(1, int(threads))
        self.name = f"zstd-{level} BG-XOR"
        # threads=0 would mean "no worker threads" in zstd; 1 worker would add a
        # thread hand-off for nothing, so single-threaded uses 0
        self._c = zstandard.ZstdCompressor(level=level, threads=self.threads if self.threads > 1 else 0)
        self._d = zstandard.ZstdDecompressor()

    def encode(self, child, parent, dtype: str) -> bytes:
        width = ITEMSIZE[dtype]
        delta = xor_bytes(child, parent).reshape(-1, width)
        planes = np.ascontiguousarray(delta.T)  # (width, n): plane k = byte k of every element
        return self._c.compress(planes)

    def decode(self, blob, parent, dtype: str) -> bytes:
        width = ITEMSIZE[dtype]
        p = _u8(parent)
        planes = np.frombuffer(self._d.decompress(blob, max_output_size=p.size), dtype=np.uint8)
        if planes.size != p.size:
            raise ValueError(f"zstd blob holds {planes.size} bytes, parent has {p.size}")
        delta = planes.reshape(width, -1).T  # back to (n, width), element-major
        return np.bitwise_xor(delta, p.reshape(-1, width)).tobytes()


class ZipNNXor:
    """ZipNN (Huffman with its byte grouping and, for bf16/fp32, sign-bit reordering) on the XOR delta.

    Uses ``zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype)``, the mode for
    raw bytes of one float dtype.  ZipNN's own ``delta_compressed_type="byte"``
    does the same XOR internally; doing it here keeps the two peers' delta
    identical.  ZipNN reorders bits *in place* in the buffer it compresses, so it
    gets a private copy (the fresh XOR array), never caller data.
    ``threads`` is ZipNN's ``threads=`` option (it splits a buffer into
    256 KiB chunks and compresses or decompresses them in parallel).
    """

    def __init__(self, threads: int = 1):
        import zipnn

        self._zipnn = zipnn
        self.threads = max(1, int(threads))
        self.name = "ZipNN XOR"
        self._by_dtype = {}

    def _codec(self, dtype: str):
        codec = self._by_dtype.get(dtype)
        if codec is None:
            codec = self._zipnn.ZipNN(
                method="HUFFMAN", input_format="byte", bytearray_dtype=dtype, threads=self.threads
            )
            self._by_dtype[dtype] = codec
        return codec

    def encode(self, child, parent, dtype: str) -> bytes:
        delta = xor_bytes(child, parent)  # fresh buffer: ZipNN may scramble it
        return bytes(self._codec(dtype).compress(memoryview(delta)))

    def decode(self, blob, parent, dtype: str) -> bytes:
        # (decompression leaves its input alone; only compression scrambles it)
        delta = self._codec(dtype).decompress(bytes(blob))
        return xor_bytes(delta, parent).tobytes()


def available_peers(threads: int = 1) -> list:
    """Instances of every peer whose package imports, built with ``threads`` workers."""
    peers = []
    for make in (lambda: ZstdByteGroupedXor(19, threads), lambda: ZipNNXor(threads)):
        try:
            peers.append(make())
        except ImportError:
            pass
    return peers
