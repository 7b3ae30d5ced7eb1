"""The ULPack blob byte layout (versions 1 to 3): header, tables, sections, trailer.

See ``docs/format.md`` for the field-by-field description.  This module only packs
and parses bytes; it never codes values.  Everything read from a blob is untrusted:
every parse failure raises :class:`~ulstore.errors.CorruptBlobError`.
"""

from __future__ import annotations

import platform
import zlib
from typing import NamedTuple

from ..errors import CorruptBlobError, UnsupportedVersionError
from ._dtypes import FloatFormat, format_by_code


def _blob_crc32():
    """zlib.crc32, or the kernels' (the same function, several times faster: PCLMULQDQ folding, _crc32.h)
    on x86-64, where they are built; elsewhere theirs is a plain byte loop."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        try:
            from ._kernels import crc32

            return crc32
        except ImportError:  # never built
            pass
    return zlib.crc32


_crc32 = _blob_crc32()

__all__ = [
    "MAGIC",
    "VERSION",
    "MODE_RAW",
    "MODE_SAME",
    "MODE_RANS",
    "MODE_SPARSE",
    "MODE_INTRA",
    "FLAG_DELTA",
    "FLAG_NO_ECOND",
    "LANES",
    "MAX_ELEMENTS",
    "Header",
    "pack_header",
    "Reader",
    "write_varint",
    "seal",
    "open_blob",
    "header_bound",
]

MAGIC = b"ULPK"
VERSION = 4  # the newest version this module reads and writes
MODE_RAW, MODE_SAME, MODE_RANS, MODE_SPARSE, MODE_INTRA = 0, 1, 2, 3, 4
# The modes each version may hold.  Version 2 added MODE_SPARSE and nothing else;
# version 3 has a shorter header and new RANS and INTRA payloads (one-stream
# sections, see _one_stream); version 4 is SPARSE with Elias-Fano positions instead
# of the gap section (_elias_fano), the weight-sync follower's hot path, and
# version 2's header.  Writers use one version per mode (_WRITE_VERSION).  Readers
# accept every (version, mode) pair below and refuse the rest.
_VERSION_MODES = {
    1: (MODE_RAW, MODE_SAME, MODE_RANS),
    2: (MODE_SPARSE,),
    3: (MODE_RAW, MODE_SAME, MODE_RANS, MODE_INTRA),
    4: (MODE_SPARSE,),
}
_WRITE_VERSION = {MODE_RAW: 3, MODE_SAME: 3, MODE_RANS: 3, MODE_SPARSE: 4, MODE_INTRA: 3}
_COMPACT_HEADER = (3,)  # versions whose header packs dtype, mode and flags in one byte (no ref hash if intra)
FLAG_DELTA = 1  # coded against a caller-held reference (else: intra, against +0.0)
FLAG_NO_ECOND = 2  # the models ignore the reference exponent (the store's SPARSE deltas: one-pass in-place apply)
_KNOWN_FLAGS = FLAG_DELTA | FLAG_NO_ECOND
LANES = 4  # interleaved rANS states; element i uses lane i % 4
MAX_ELEMENTS = (1 << 32) - 1  # per blob: the kernels count symbols in 32-bit histograms
CRC_BYTES = 4


def header_bound(ndim: int) -> int:
    """Largest header + trailer, in bytes, for a tensor of ``ndim`` dimensions.

    A blob is never larger than the raw tensor plus this many bytes.
    """
    return 9 + 10 * ndim + 8 + CRC_BYTES


def write_varint(out: bytearray, value: int) -> None:
    """Append ``value`` (>= 0) as an unsigned LEB128 varint."""
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


class Reader:
    """A bounds-checked cursor over blob bytes; overruns raise CorruptBlobError."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview, pos: int = 0, end: int | None = None):
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def need(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.end:
            raise CorruptBlobError(f"ULPack blob is truncated: {what} runs past the end")
        self.pos = start + n
        return start

    def u8(self, what: str) -> int:
        return self.buf[self.need(1, what)]

    def u32(self, what: str) -> int:
        p = self.need(4, what)
        return int.from_bytes(self.buf[p : p + 4], "little")

    def varint(self, what: str, limit: int = 1 << 63) -> int:
        value = shift = 0
        while True:
            byte = self.u8(what)
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 63:
                raise CorruptBlobError(f"ULPack blob has an overlong varint in {what}")
        if value > limit:
            raise CorruptBlobError(f"ULPack blob has an out-of-range {what} ({value} > {limit})")
        return value

    def take(self, n: int, what: str) -> memoryview:
        p = self.need(n, what)
        return self.buf[p : p + n]


class Header(NamedTuple):
    """The fixed part of every blob (a named tuple: made once per blob decoded, cheaply)."""

    fmt: FloatFormat
    mode: int
    flags: int
    shape: tuple[int, ...]
    ref_hash: int
    target_hash: int
    version: int = 0  # 0: the version this module writes for ``mode``

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_delta(self) -> bool:
        return bool(self.flags & FLAG_DELTA)

    def pack(self) -> bytearray:
        return pack_header(self.fmt, self.mode, self.flags, self.shape, self.ref_hash, self.target_hash, self.version)


def pack_header(
    fmt: FloatFormat, mode: int, flags: int, shape: tuple[int, ...], ref_hash: int, target_hash: int, version: int = 0
) -> bytearray:
    """``Header(...).pack()`` without building the Header (the encoder writes one per blob)."""
    version = version or _WRITE_VERSION[mode]
    out = bytearray(MAGIC)
    if version not in _COMPACT_HEADER:
        out += bytes((version, fmt.code, mode, flags, len(shape)))
    else:  # dtype, mode and flags in one byte; no reference hash without a reference
        out += bytes((version, fmt.code | mode << 3 | flags << 6, len(shape)))
    for d in shape:
        write_varint(out, d)
    if version not in _COMPACT_HEADER or flags & FLAG_DELTA:
        out += ref_hash.to_bytes(4, "little")
    out += target_hash.to_bytes(4, "little")
    return out


def seal(*parts) -> bytes:
    """Join the blob's parts (bytes-like) and append the CRC-32 of them all: one copy."""
    crc = 0
    for part in parts:
        crc = _crc32(part, crc)
    return b"".join((*parts, crc.to_bytes(4, "little")))


def open_blob(blob) -> tuple[Header, Reader]:
    """Check magic, version and CRC; parse the header; return it and a reader at the payload."""
    buf = _blob_bytes(blob)
    version = buf[4]
    body_end = len(buf) - CRC_BYTES
    stored = int.from_bytes(buf[body_end:], "little")
    if _crc32(buf[:body_end]) != stored:
        raise CorruptBlobError("ULPack blob fails its CRC-32 check (truncated or corrupted)")
    if version == 3:
        opened = _open_compact(buf, body_end)
        if opened is not None:
            return opened
    return _open_general(buf, version, body_end)


def _open_general(buf: memoryview, version: int, body_end: int) -> tuple[Header, Reader]:
    """The header of a blob whose CRC is checked, field by field, every one checked."""
    r = Reader(buf, 5, body_end)
    fmt, mode, flags = _kind(r, version)
    ndim = r.u8("ndim")
    shape = tuple(r.varint("shape", limit=MAX_ELEMENTS) for _ in range(ndim))
    n = 1
    for d in shape:
        n *= d
    if n > MAX_ELEMENTS:
        raise CorruptBlobError(f"ULPack blob declares an implausible shape {shape}")
    ref_hash = r.u32("reference hash") if version not in _COMPACT_HEADER or flags & FLAG_DELTA else 0
    header = Header(fmt, mode, flags, shape, ref_hash, r.u32("target hash"), version)
    return header, r


def _open_compact(buf: memoryview, body_end: int) -> tuple[Header, Reader] | None:
    """:func:`open_blob`'s parse of a well-formed version-3 header, in a few steps (a blob of a few thousand
    elements spent as long in the general parse as in its decode); None for anything else (the general
    parse then says what is wrong)."""
    kind, ndim = buf[5], buf[6]
    code, mode, flags = kind & 7, (kind >> 3) & 7, kind >> 6
    fmt = format_by_code(code)
    if fmt is None or mode not in _VERSION_MODES[3] or (mode == MODE_INTRA and flags & FLAG_DELTA):
        return None  # (flags holds two bits: both known)
    pos, n, dims = 7, 1, []
    for _ in range(ndim):
        value = shift = 0
        while shift <= 28 and pos < body_end:  # at most 5 bytes: MAX_ELEMENTS < 2**35
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        else:
            return None
        if value > MAX_ELEMENTS:
            return None
        dims.append(value)
        n *= value
    delta = flags & FLAG_DELTA
    end = pos + (8 if delta else 4)
    if n > MAX_ELEMENTS or end > body_end:
        return None
    ref_hash = int.from_bytes(buf[pos : pos + 4], "little") if delta else 0
    header = Header(fmt, mode, flags, tuple(dims), ref_hash, int.from_bytes(buf[end - 4 : end], "little"), 3)
    return header, Reader(buf, end, body_end)


def _blob_bytes(blob) -> memoryview:
    """``blob``'s bytes, once magic, version and length are those of a blob this module reads."""
    try:
        buf = memoryview(blob).cast("B")
    except TypeError as exc:
        raise CorruptBlobError(f"a ULPack blob must be a bytes-like object, got {type(blob).__name__}") from exc
    if len(buf) < 5 or bytes(buf[:4]) != MAGIC:
        if len(buf) < 5 and MAGIC.startswith(bytes(buf[:4])):
            raise CorruptBlobError(f"ULPack blob is truncated: {len(buf)} bytes is shorter than any header")
        raise CorruptBlobError("not a ULPack blob (bad magic bytes)")
    version = buf[4]
    if not 1 <= version <= VERSION:
        raise UnsupportedVersionError(
            f"ULPack blob has format version {version}; this ulstore reads versions 1 to {VERSION}"
        )
    shortest = 9 + 8 + CRC_BYTES if version not in _COMPACT_HEADER else 7 + 4 + CRC_BYTES
    if len(buf) < shortest:
        raise CorruptBlobError(f"ULPack blob is truncated: {len(buf)} bytes is shorter than any header")
    return buf


def _kind(r: Reader, version: int) -> tuple[FloatFormat, int, int]:
    """The dtype, mode and flags fields, checked against each other and the version."""
    if version not in _COMPACT_HEADER:
        code, mode, flags = r.u8("dtype"), r.u8("mode"), r.u8("flags")
    else:
        kind = r.u8("dtype and mode")
        code, mode, flags = kind & 7, (kind >> 3) & 7, kind >> 6
    fmt = format_by_code(code)
    if fmt is None:
        raise CorruptBlobError(f"ULPack blob names an unknown dtype code {code}")
    if mode not in _VERSION_MODES[version]:
        raise CorruptBlobError(f"ULPack blob names an unknown mode {mode} for format version {version}")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptBlobError(f"ULPack blob sets unknown flag bits {flags:#x}")
    if mode == MODE_SPARSE and not flags & FLAG_DELTA:
        raise CorruptBlobError("ULPack blob is sparse but not a delta")
    if mode == MODE_INTRA and flags & FLAG_DELTA:
        raise CorruptBlobError("ULPack blob is intra-coded but marked as a delta")
    return fmt, mode, flags
