"""The ULPack blob byte layout (version 1): header, tables, sections, trailer.

See ``docs/format.md`` for the field-by-field description.  This module only packs
and parses bytes; it never codes values.  Everything read from a blob is untrusted:
every parse failure raises :class:`~ulstore.errors.CorruptBlobError`.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ._dtypes import FloatFormat, format_by_code
from .errors import CorruptBlobError, UnsupportedVersionError

__all__ = [
    "MAGIC",
    "VERSION",
    "MODE_RAW",
    "MODE_SAME",
    "MODE_RANS",
    "FLAG_DELTA",
    "FLAG_NO_ECOND",
    "LANES",
    "MAX_ELEMENTS",
    "Header",
    "Reader",
    "write_varint",
    "pack_tables",
    "seal",
    "open_blob",
    "header_bound",
]

MAGIC = b"ULPK"
VERSION = 1
MODE_RAW, MODE_SAME, MODE_RANS = 0, 1, 2
FLAG_DELTA = 1  # coded against a caller-held reference (else: intra, against +0.0)
FLAG_NO_ECOND = 2  # ablation: the models ignore the reference exponent
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

    def u64(self, what: str) -> int:
        p = self.need(8, what)
        return int.from_bytes(self.buf[p : p + 8], "little")

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


@dataclass(frozen=True)
class Header:
    """The fixed part of every blob."""

    fmt: FloatFormat
    mode: int
    flags: int
    shape: tuple[int, ...]
    ref_hash: int
    target_hash: int

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
        out = bytearray(MAGIC)
        out += bytes((VERSION, self.fmt.code, self.mode, self.flags, len(self.shape)))
        for d in self.shape:
            write_varint(out, d)
        out += self.ref_hash.to_bytes(4, "little") + self.target_hash.to_bytes(4, "little")
        return out


def seal(body: bytearray) -> bytes:
    """Append the CRC-32 of everything before it and return the finished blob."""
    body += zlib.crc32(body).to_bytes(4, "little")
    return bytes(body)


def open_blob(blob) -> tuple[Header, Reader]:
    """Check magic, version and CRC; parse the header; return it and a reader at the payload."""
    try:
        buf = memoryview(blob).cast("B")
    except TypeError as exc:
        raise CorruptBlobError(f"a ULPack blob must be a bytes-like object, got {type(blob).__name__}") from exc
    if len(buf) < 9 + 8 + CRC_BYTES:
        raise CorruptBlobError(f"ULPack blob is truncated: {len(buf)} bytes is shorter than any header")
    if bytes(buf[:4]) != MAGIC:
        raise CorruptBlobError("not a ULPack blob (bad magic bytes)")
    if buf[4] != VERSION:
        raise UnsupportedVersionError(
            f"ULPack blob has format version {buf[4]}; this ulstore reads version {VERSION}"
        )
    body_end = len(buf) - CRC_BYTES
    stored = int.from_bytes(buf[body_end:], "little")
    if zlib.crc32(buf[:body_end]) != stored:
        raise CorruptBlobError("ULPack blob fails its CRC-32 check (truncated or corrupted)")
    r = Reader(buf, 5, body_end)
    fmt = format_by_code(r.u8("dtype"))
    if fmt is None:
        raise CorruptBlobError(f"ULPack blob names an unknown dtype code {buf[5]}")
    mode = r.u8("mode")
    if mode not in (MODE_RAW, MODE_SAME, MODE_RANS):
        raise CorruptBlobError(f"ULPack blob names an unknown mode {mode}")
    flags = r.u8("flags")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptBlobError(f"ULPack blob sets unknown flag bits {flags:#x}")
    ndim = r.u8("ndim")
    shape = tuple(r.varint("shape", limit=MAX_ELEMENTS) for _ in range(ndim))
    n = 1
    for d in shape:
        n *= d
    if n > MAX_ELEMENTS:
        raise CorruptBlobError(f"ULPack blob declares an implausible shape {shape}")
    header = Header(fmt, mode, flags, shape, r.u32("reference hash"), r.u32("target hash"))
    return header, r


# -- frequency tables ---------------------------------------------------------------
# The decoder already knows which contexts occur and how many elements each holds
# (it has the reference), so the table sends, per occupied context in ascending id
# order, only what it cannot know: which tokens occur and their counts, coarsened
# to the coder's precision.  Elias-gamma codes keep the small numbers small: in the
# sparse (RL) regime most contexts cost a couple of bits.
#
#   bit        token 0 occurs
#   gamma(k+1) number of other tokens that occur
#   gamma(g+1) each such token as a gap from the previous (first: from token 0)
#   gamma(q)   each such token's quantised count q = max(1, count >> shift) >= 1,
#              shift = max(0, bitlen(n_c) - S) for the context's element count n_c
# Token 0's quantised count is implied: max(1, (n_c >> shift) - sum q).


def quantized_counts(counts: np.ndarray, n_c: np.ndarray, scale_bits: int) -> np.ndarray:
    """Per-context counts coarsened to what the table transmits (see the block comment above)."""
    counts = counts.astype(np.int64)
    n_c = np.asarray(n_c, dtype=np.int64)
    shift = np.maximum(0, _bitlen(n_c) - scale_bits)[:, None]
    q = np.where(counts > 0, np.maximum(1, counts >> shift), 0)
    rest = q[:, 1:].sum(axis=1)
    q[:, 0] = np.where(counts[:, 0] > 0, np.maximum(1, (n_c >> shift[:, 0]) - rest), 0)
    return q


def _bitlen(v: np.ndarray) -> np.ndarray:
    out = np.zeros(v.shape, dtype=np.int64)
    v = v.copy()
    while (v > 0).any():
        out += v > 0
        v >>= 1
    return out


def _gamma(value: int) -> str:
    """Elias gamma code of value >= 1, MSB first."""
    bits = bin(value)[2:]
    return "0" * (len(bits) - 1) + bits


# Every value a table codes is <= 2**12 (counts are quantised to the scale, gaps and
# token counts are below the alphabet size), so the codes are precomputed.
_GAMMA = [""] + [_gamma(v) for v in range(1, 4097)]


def pack_tables(out: bytearray, q: np.ndarray) -> None:
    """Append the bit-packed table of quantised counts ``q`` (table rows x tokens)."""
    parts = []
    for row in q.tolist():
        others = [t for t, count in enumerate(row) if count and t]
        parts.append("1" if row[0] else "0")
        parts.append(_GAMMA[len(others) + 1])
        prev = 0
        for t in others:
            parts.append(_GAMMA[t - prev])
            prev = t
        parts.extend(_GAMMA[row[t]] for t in others)
    bits = "".join(parts)
    nbytes = (len(bits) + 7) // 8
    write_varint(out, nbytes)
    if nbytes:
        out += int(bits.ljust(nbytes * 8, "0"), 2).to_bytes(nbytes, "big")


def read_tables(r: Reader, alphabet: int, n_rows: np.ndarray, scale_bits: int) -> np.ndarray:
    """Parse the table for rows holding ``n_rows`` elements each; returns quantised counts.

    The bit string is parsed as text: ``str.find`` scans each gamma code's zeros in C.
    """
    data = bytes(r.take(r.varint("table size", limit=1 << 24), "tables"))
    bits = bin(int.from_bytes(data, "big") | (1 << (8 * len(data))))[3:] if data else ""
    end = len(bits)
    pos = 0

    def gamma(limit: int) -> int:
        nonlocal pos
        one = bits.find("1", pos)
        stop = 2 * one - pos + 1
        if one < 0 or stop > end:
            raise CorruptBlobError("ULPack blob table is truncated")
        value = int(bits[one:stop], 2)
        if value > limit:
            raise CorruptBlobError(f"ULPack blob table value {value} is out of range")
        pos = stop
        return value

    q = np.zeros((len(n_rows), alphabet), dtype=np.int64)
    for i, n in enumerate(n_rows.tolist()):
        top = (n >> max(0, n.bit_length() - scale_bits)) or 1
        if pos >= end:
            raise CorruptBlobError("ULPack blob table is truncated")
        has_zero = bits[pos] == "1"
        pos += 1
        k = gamma(alphabet) - 1
        others = []
        t = 0
        for _ in range(k):
            t += gamma(alphabet)
            if t >= alphabet:
                raise CorruptBlobError(f"ULPack blob table names token {t} beyond the alphabet")
            others.append(t)
        counts = [gamma(top) for _ in others]
        q[i, others] = counts
        if has_zero:
            q[i, 0] = max(1, top - sum(counts))
        elif k == 0:
            raise CorruptBlobError("ULPack blob table has a row with no tokens")
    if end - pos >= 8:
        raise CorruptBlobError("ULPack blob table has trailing bytes")
    return q
