"""Chunk tables: what a step stores for each tensor, as compact, self-checking binary blocks.

A tensor is a set of **pieces**: boxes of the tensor (``offset``, ``shape``),
each with its own regular chunk grid (``chunks``).  An unsharded tensor is one
piece at offset 0; a tensor saved from several ranks has one piece per shard.
Pieces tile the tensor exactly (:func:`pieces_problem`).

Per chunk of a piece, in C order of its grid, a :class:`Piece` holds columns:

- ``content``: BLAKE3-128 of the decoded chunk (16 bytes);
- ``ref``: the step whose logical values over the chunk's box are the
  reference, or -1 (intra);
- ``pack``, ``off``, ``length``: where the blob is (pack index into the step's
  pack list, byte offset, byte length);
- ``snap`` (optional, ``(n, 3)``: pack, offset, length; pack -1 = none): an
  intra blob of the same content kept alongside a delta blob.

A **table block** packs the tables of consecutive tensors (sorted by name)::

    b"ULTB"  u8 version=1  u8 flags=0  u16 0  u64 raw_len   then a Zstd frame of raw_len bytes:
      u32 n_dtypes, per dtype: u8 len + ASCII name
      u32 n_tensors, per tensor: u32 len + UTF-8 name, u8 dtype index, u8 codec (0 ulpack, 1 zstd),
          u8 ndim, u64[ndim] shape, u32 n_pieces,
          per piece: u64[ndim] offset, u64[ndim] shape, u64[ndim] chunks, u8 has_snapshots
      columns over the N chunks of all pieces, in order: content 16N bytes, ref i64[N],
          pack u32[N], gap i64[N], length u64[N]
      u64 S, then snapshot columns: chunk i64[S], pack i64[S], off i64[S], length i64[S]

All integers little-endian.  ``gap`` is a blob's offset minus the end of the
previous blob when both are in the same pack (else its offset): mostly 0, so
Zstd makes an entry cost ~20 bytes, 16 of them the content hash.  The step
document holds each block's BLAKE3-128, so a flipped byte is an error before
parsing; the parser still bounds every count by the bytes present, and the
Zstd frame may not inflate beyond its declared ``raw_len``.
"""

from __future__ import annotations

import bisect
import itertools
import math
import struct
from dataclasses import dataclass

import blake3
import numpy as np

from ..core.dtypes import numpy_dtype
from ..core.sealed import canonical_json
from ._chunkcodec import ULPACK, ZSTD, codec_for, zstd_compress, zstd_decompress
from ._layout import chunk_grid, tensor_name_problem

__all__ = [
    "Piece",
    "TensorTable",
    "TableError",
    "encode_block",
    "decode_block",
    "pieces_problem",
    "chunk_nbytes",
    "content_checksum",
    "MAX_BLOCK_RAW",
    "MAX_CHUNK_BYTES",
]

_MAGIC = b"ULTB"
_VERSION = 1
_HEAD = struct.Struct("<4sBBHQ")
_CODECS = (ULPACK, ZSTD)
#: the largest table block a reader inflates (a tensor with millions of chunks fits)
MAX_BLOCK_RAW = 1 << 30
#: Largest chunk a table may declare (and ``chunk_bytes`` may ask for): a bound
#: on what one chunk read allocates, whatever a crafted table says.
MAX_CHUNK_BYTES = 1 << 32
_MAX_NDIM = 64
_MAX_PIECES = 1 << 20
_MAX_DIM = 1 << 62
_ENTRY_BYTES = 16 + 8 + 4 + 8 + 8


class TableError(ValueError):
    """A table block or piece layout is malformed (the caller names the object)."""


@dataclass(eq=False)
class Piece:
    """One box of a tensor with its chunk grid and the columns of its chunks (C order)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    content: np.ndarray  # (n, 16) uint8
    ref: np.ndarray  # int64, -1 = intra
    pack: np.ndarray  # int64 index into a pack list
    off: np.ndarray  # int64
    length: np.ndarray  # int64
    snap: np.ndarray | None = None  # (n, 3) int64 (pack, off, length), pack -1 = none

    @property
    def layout(self) -> tuple:
        return self.offset, self.shape, self.chunks

    @property
    def grid(self) -> tuple[int, ...]:
        return chunk_grid(self.shape, self.chunks)

    @property
    def n(self) -> int:
        return len(self.ref)

    def index(self, coord: tuple[int, ...]) -> int:
        """Position of chunk ``coord`` in the columns (C order)."""
        return int(np.ravel_multi_index(coord, self.grid)) if coord else 0

    def coords(self) -> list[tuple[int, ...]]:
        """Chunk coordinates in C order (the order of the columns)."""
        return list(itertools.product(*map(range, self.grid)))

    def region(self, coord: tuple[int, ...]) -> tuple[slice, ...]:
        """The slice of the piece that chunk ``coord`` covers (edge chunks are short)."""
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(coord, self.chunks, self.shape))

    def region_shape(self, coord: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(min((i + 1) * c, n) - i * c for i, c, n in zip(coord, self.chunks, self.shape))

    def box(self, coord: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The chunk's box in tensor coordinates: (start, stop)."""
        lo = tuple(o + i * c for o, i, c in zip(self.offset, coord, self.chunks))
        hi = tuple(min(o + (i + 1) * c, o + n) for o, i, c, n in zip(self.offset, coord, self.chunks, self.shape))
        return lo, hi

    def snapshot(self, i: int) -> tuple[int, int, int] | None:
        if self.snap is None or self.snap[i, 0] < 0:
            return None
        p, o, n = self.snap[i]
        return int(p), int(o), int(n)

    def has_intra(self, i: int) -> bool:
        """Whether chunk ``i`` can be read without a reference (intra blob or snapshot)."""
        return bool(self.ref[i] < 0) or self.snapshot(i) is not None


@dataclass(eq=False)
class TensorTable:
    """A tensor of one step: dtype, shape, codec and its pieces (sorted by offset)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    codec: str
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def n_chunks(self) -> int:
        return sum(p.n for p in self.pieces)

    def layout(self) -> tuple:
        """What must match for chunks to be co-located: dtype, shape and every piece's box and grid."""
        return self.dtype.str, self.shape, tuple(p.layout for p in self.pieces)

    def find_piece(self, layout: tuple) -> int | None:
        for j, p in enumerate(self.pieces):
            if p.layout == layout:
                return j
        return None

    def overlapping(self, lo: tuple[int, ...], hi: tuple[int, ...]):
        """``(piece index, chunk coord, chunk lo, chunk hi)`` of every chunk that meets the box ``[lo, hi)``."""
        for j, p in enumerate(self.pieces):
            plo = [max(a, o) for a, o in zip(lo, p.offset)]
            phi = [min(b, o + s) for b, o, s in zip(hi, p.offset, p.shape)]
            if any(a >= b for a, b in zip(plo, phi)) and p.shape:
                continue
            ranges = [range((a - o) // c, (b - 1 - o) // c + 1) for a, b, o, c in zip(plo, phi, p.offset, p.chunks)]
            for coord in np.ndindex(*[len(r) for r in ranges]):
                c = tuple(r[k] for r, k in zip(ranges, coord))
                clo, chi = p.box(c)
                yield j, c, clo, chi


# -- piece layouts ----------------------------------------------------------------


def chunk_nbytes(shape, chunks, itemsize: int) -> int:
    """Bytes of the largest chunk of a piece of ``shape`` cut into ``chunks`` (a chunk never exceeds its piece)."""
    return math.prod(min(int(c), int(s)) for s, c in zip(shape, chunks)) * itemsize


def pieces_problem(shape: tuple[int, ...], layouts: list[tuple]) -> str | None:
    """Why ``layouts`` (``(offset, shape, chunks)`` each) do not tile a tensor of ``shape`` exactly, or None.

    Each piece must lie inside the tensor with chunks of at least one element
    and at most the piece's length per axis, and together they must cover every element exactly once:
    checked on the grid the pieces' boundaries cut the tensor into.
    """
    ndim = len(shape)
    if not layouts or len(layouts) > _MAX_PIECES:
        return f"{len(layouts)} pieces"
    for off, shp, ch in layouts:
        if not (len(off) == len(shp) == len(ch) == ndim):
            return "a piece has the wrong number of dimensions"
        # a chunk never exceeds its piece (writers clamp it): a crafted table cannot make a
        # reader pad a chunk of a few elements out to gigabytes
        if any(c < 1 or c > max(s, 1) or o < 0 or s < 0 or o + s > n for o, s, c, n in zip(off, shp, ch, shape)):
            return f"piece at {list(off)} of shape {list(shp)} (chunks {list(ch)}) is outside {list(shape)}"
    if len(layouts) == 1:
        off, shp, _ = layouts[0]
        ok = all(o == 0 for o in off) and tuple(shp) == tuple(shape)
        return None if ok else "a single piece must cover the whole tensor"
    if math.prod(shape) == 0:
        return "an empty tensor has one piece"
    cuts = [
        sorted({0, n, *(x[0][k] for x in layouts), *(x[0][k] + x[1][k] for x in layouts)}) for k, n in enumerate(shape)
    ]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 1 << 24:
        return f"the pieces cut the tensor into {cells} cells; too fragmented"
    count = np.zeros([len(c) - 1 for c in cuts], np.int32)
    for off, shp, _ in layouts:
        if any(s == 0 for s in shp):
            continue
        idx = tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s)) for c, o, s in zip(cuts, off, shp))
        count[idx] += 1
    if not (count == 1).all():
        return "pieces overlap or leave a gap"
    return None


# -- encoding ----------------------------------------------------------------------


def _u64s(values) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def encode_block(tensors: list[TensorTable]) -> bytes:
    """The table block of ``tensors`` (sorted by name), framed and Zstd-compressed."""
    dtypes = sorted({t.dtype.name for t in tensors})
    out = bytearray(struct.pack("<I", len(dtypes)))
    for d in dtypes:
        out += bytes([len(d)]) + d.encode("ascii")
    out += struct.pack("<I", len(tensors))
    pieces: list[Piece] = []
    for t in tensors:
        name = t.name.encode("utf-8")
        out += struct.pack("<I", len(name)) + name
        out += bytes([dtypes.index(t.dtype.name), _CODECS.index(t.codec), len(t.shape)])
        out += _u64s(t.shape) + struct.pack("<I", len(t.pieces))
        for p in t.pieces:
            has_snap = p.snap is not None and bool((p.snap[:, 0] >= 0).any())
            out += _u64s(p.offset) + _u64s(p.shape) + _u64s(p.chunks) + bytes([has_snap])
            pieces.append(p)
    cat = (lambda f, dt: np.concatenate([f(p) for p in pieces]).astype(dt)) if pieces else None
    if cat is None or not sum(p.n for p in pieces):
        out += struct.pack("<Q", 0)
    else:
        content = np.concatenate([p.content for p in pieces]).astype(np.uint8)
        ref, pack = cat(lambda p: p.ref, "<i8"), cat(lambda p: p.pack, "<i8")
        off, length = cat(lambda p: p.off, "<i8"), cat(lambda p: p.length, "<i8")
        same = np.r_[False, pack[1:] == pack[:-1]]
        prev_end = np.r_[0, off[:-1] + length[:-1]]
        gap = off - np.where(same, prev_end, 0)
        out += content.tobytes() + ref.tobytes() + pack.astype("<u4").tobytes() + gap.tobytes()
        out += length.astype("<u8").tobytes()
        snaps, base = [], 0
        for p in pieces:
            if p.snap is not None:
                at = np.flatnonzero(p.snap[:, 0] >= 0)
                snaps.append(np.column_stack([at + base, p.snap[at]]).astype("<i8"))
            base += p.n
        s = np.concatenate(snaps) if snaps else np.zeros((0, 4), "<i8")
        out += struct.pack("<Q", len(s)) + b"".join(np.ascontiguousarray(s[:, k]).tobytes() for k in range(4))
    body = zstd_compress(bytes(out))
    return _HEAD.pack(_MAGIC, _VERSION, 0, 0, len(out)) + body


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise TableError("table block is truncated")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))

    def array(self, dtype: str, n: int) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(n * dt.itemsize), dtype=dt).astype(dt.newbyteorder("="))


def decode_block(data, *, n_packs: int) -> list[TensorTable]:
    """Parse and check a table block (its BLAKE3 was checked by the caller); TableError if malformed."""
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise TableError("table block is truncated")
    magic, version, flags, _, raw_len = _HEAD.unpack_from(data)
    if magic != _MAGIC or version != _VERSION or flags:
        raise TableError(f"not a table block of version {_VERSION}")
    if raw_len > MAX_BLOCK_RAW:
        raise TableError(f"table block declares {raw_len} bytes")
    try:
        raw = zstd_decompress(data[_HEAD.size :], raw_len, what="table block")
    except ValueError as e:
        raise TableError(str(e)) from None
    cur = _Cursor(raw)
    (n_dtypes,) = cur.unpack("<I")
    dtypes = []
    for _ in range(min(n_dtypes, 256)):
        (k,) = cur.unpack("<B")
        try:
            dtypes.append(numpy_dtype(cur.take(k).decode("ascii")))
        except (ValueError, TypeError, UnicodeDecodeError):
            raise TableError("table block names an unknown dtype") from None
    if n_dtypes > 256:
        raise TableError("table block has too many dtypes")
    (n_tensors,) = cur.unpack("<I")
    if n_tensors > len(raw):
        raise TableError("table block declares more tensors than it holds")
    heads: list[tuple[str, np.dtype, str, tuple, list]] = []
    total = 0
    for _ in range(n_tensors):
        (k,) = cur.unpack("<I")
        try:
            name = cur.take(k).decode("utf-8")
        except UnicodeDecodeError:
            raise TableError("a tensor name is not UTF-8") from None
        why = tensor_name_problem(name)
        if why is not None:
            raise TableError(why)
        di, ci, ndim = cur.unpack("<BBB")
        if di >= len(dtypes) or ci >= len(_CODECS) or ndim > _MAX_NDIM:
            raise TableError(f"tensor {name!r} has a bad dtype, codec or rank")
        dtype, codec = dtypes[di], _CODECS[ci]
        try:
            ok = codec_for(dtype) == codec
        except ValueError:
            ok = False
        if not ok:
            raise TableError(f"tensor {name!r} is {dtype} but says codec {codec!r}")
        shape = cur.unpack(f"<{ndim}Q")
        (n_pieces,) = cur.unpack("<I")
        if n_pieces > len(raw) or any(d > _MAX_DIM for d in shape):
            raise TableError(f"tensor {name!r} has an implausible shape or piece count")
        layouts = []
        for _ in range(n_pieces):
            off, shp, ch = cur.unpack(f"<{ndim}Q"), cur.unpack(f"<{ndim}Q"), cur.unpack(f"<{ndim}Q")
            (has_snap,) = cur.unpack("<B")
            if any(c < 1 or c > _MAX_DIM for c in ch):
                raise TableError(f"tensor {name!r} has a chunk shape {list(ch)}")
            if chunk_nbytes(shp, ch, dtype.itemsize) > MAX_CHUNK_BYTES:
                raise TableError(f"tensor {name!r} has chunks {list(ch)} of more than {MAX_CHUNK_BYTES} bytes")
            layouts.append((off, shp, ch, bool(has_snap)))
        why = pieces_problem(shape, [x[:3] for x in layouts])
        if why is not None:
            raise TableError(f"tensor {name!r}: {why}")
        for _, shp, ch, _ in layouts:
            total += math.prod(chunk_grid(shp, ch))
            if total * _ENTRY_BYTES > len(raw):
                raise TableError("table block declares more chunks than it holds")
        if heads and name <= heads[-1][0]:
            raise TableError("tensors of a table block are not sorted by name")
        heads.append((name, dtype, codec, tuple(shape), layouts))
    content = np.frombuffer(cur.take(16 * total), np.uint8).reshape(total, 16)
    ref = cur.array("<i8", total)
    pack = cur.array("<u4", total).astype(np.int64)
    gap = cur.array("<i8", total)
    length = cur.array("<u8", total)
    (n_snap,) = cur.unpack("<Q")
    if n_snap > total:
        raise TableError("table block declares more snapshots than chunks")
    snap_cols = [cur.array("<i8", n_snap) for _ in range(4)]
    if cur.pos != len(raw):
        raise TableError("table block has trailing bytes")
    if total and (ref.min() < -1 or pack.max() >= n_packs or length.max() >= _MAX_DIM):
        raise TableError("an entry names a bad reference, pack or length")
    length = length.astype(np.int64)
    offs = _offsets(pack, gap, length)
    if total and (offs.min() < 0 or (offs + length).max() >= _MAX_DIM):
        raise TableError("an entry has a bad offset")
    snap_all = None
    if n_snap:
        at, sp, so, sl = snap_cols
        if at.min() < 0 or at.max() >= total or (np.diff(at) <= 0).any():
            raise TableError("snapshot entries are out of order")
        if sp.min() < 0 or sp.max() >= n_packs or so.min() < 0 or sl.min() < 0 or (so + sl).max() >= _MAX_DIM:
            raise TableError("a snapshot names a bad pack, offset or length")
        snap_all = np.full((total, 3), -1, np.int64)
        snap_all[at] = np.column_stack([sp, so, sl])
    out, base = [], 0
    for name, dtype, codec, shape, layouts in heads:
        pieces = []
        for off_, shp, ch, has_snap in layouts:
            n = math.prod(chunk_grid(shp, ch))
            sl_ = slice(base, base + n)
            snap = snap_all[sl_] if has_snap and snap_all is not None else None
            if not has_snap and snap_all is not None and (snap_all[sl_, 0] >= 0).any():
                raise TableError(f"tensor {name!r} has snapshots in a piece that declares none")
            pieces.append(Piece(off_, shp, ch, content[sl_], ref[sl_], pack[sl_], offs[sl_], length[sl_], snap))
            base += n
        pieces.sort(key=lambda p: p.offset)
        out.append(TensorTable(name, dtype, shape, codec, tuple(pieces)))
    return out


def _offsets(pack: np.ndarray, gap: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Invert the gap coding: ``off[i] = gap[i] + (off[i-1] + length[i-1] if pack[i] == pack[i-1] else 0)``."""
    if not len(pack):
        return gap.copy()
    start = np.r_[True, pack[1:] != pack[:-1]]
    with np.errstate(over="ignore"):
        cg = np.cumsum(gap)
        cl = np.r_[0, np.cumsum(length)[:-1]]  # lengths of the blobs before i
        run = np.cumsum(start) - 1
        first = np.flatnonzero(start)
        base_g = np.r_[0, cg][first][run]  # cumulative gap before the run
        base_l = cl[first][run]
        return cg - base_g + cl - base_l


# -- the logical checksum -----------------------------------------------------------


def content_checksum(tensors, files: dict[str, str], metadata: dict) -> str:
    """BLAKE3-128 (hex) of a step's logical content: independent of where blobs live.

    Covers, in this order: every tensor (sorted by name) with its dtype,
    shape and pieces (offset, shape, chunks, every chunk's content hash),
    every file (sorted by name) with its content hash, and the metadata's
    canonical JSON.  Repacking or re-encoding a step never changes it.
    """
    h = blake3.blake3(b"ulstore step content v2\x00")
    ts = sorted(tensors, key=lambda t: t.name)
    h.update(struct.pack("<Q", len(ts)))
    for t in ts:
        name = t.name.encode("utf-8")
        h.update(struct.pack("<Q", len(name)) + name + t.dtype.name.encode() + b"\x00")
        h.update(struct.pack("<QQ", len(t.shape), len(t.pieces)) + _u64s(t.shape))
        for p in t.pieces:
            h.update(_u64s(p.offset) + _u64s(p.shape) + _u64s(p.chunks))
            h.update(np.ascontiguousarray(p.content, np.uint8).tobytes())
    h.update(struct.pack("<Q", len(files)))
    for name in sorted(files):
        raw = name.encode("utf-8")
        h.update(struct.pack("<Q", len(raw)) + raw + bytes.fromhex(files[name]))
    h.update(canonical_json(metadata))
    return h.hexdigest(16)
