"""Table blocks: the tables of consecutive tensors as one compact, self-checking binary object.

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

import math
import struct
import threading
from collections import OrderedDict

import numpy as np

from ...core.dtypes import numpy_dtype
from ._chunk_tables import MAX_CHUNK_BYTES, Piece, TensorTable, _u64s, chunk_boxes, chunk_nbytes, pieces_problem
from ._chunkcodec import ULPACK, ZSTD, codec_for, zstd_compress, zstd_decompress
from ._layout import chunk_grid, tensor_name_problem

__all__ = ["TableError", "Block", "encode_block", "decode_block", "parse_block", "MAX_BLOCK_RAW"]

_MAGIC = b"ULTB"
_VERSION = 1
_HEAD = struct.Struct("<4sBBHQ")
_U32 = struct.Struct("<I")
_CODECS = (ULPACK, ZSTD)
#: the largest table block a reader inflates (a tensor with millions of chunks fits)
MAX_BLOCK_RAW = 1 << 30
_MAX_NDIM = 64
_MAX_DIM = 1 << 62
_ENTRY_BYTES = 16 + 8 + 4 + 8 + 8


class TableError(ValueError):
    """A table block or piece layout is malformed (the caller names the object)."""


def encode_block(tensors: list[TensorTable]) -> bytes:
    """The table block of ``tensors`` (sorted by name), framed and Zstd-compressed."""
    dtypes = sorted({t.dtype.name for t in tensors})
    out = bytearray(struct.pack("<I", len(dtypes)))
    for d in dtypes:
        out += bytes([len(d)]) + d.encode("ascii")
    out += struct.pack("<I", len(tensors))
    pieces: list[Piece] = []
    kinds = {(d, c): bytes([i, _CODECS.index(c)]) for i, d in enumerate(dtypes) for c in _CODECS}
    u32 = _U32.pack
    for t in tensors:  # (one concatenation per tensor: a block holds thousands)
        name = t.name.encode("utf-8")
        ps = t.pieces
        kind = kinds.get((t.dtype.name, t.codec)) or bytes([dtypes.index(t.dtype.name), _CODECS.index(t.codec)])
        head = [u32(len(name)), name, kind, bytes((len(t.shape),)), _u64s(t.shape), u32(len(ps))]
        for p in ps:
            has_snap = p.snap is not None and bool((p.snap[:, 0] >= 0).any())
            head += (_u64s((*p.offset, *p.shape, *p.chunks)), b"\x01" if has_snap else b"\x00")
            pieces.append(p)
        out += b"".join(head)
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

    def view(self, dtype: str, n: int) -> np.ndarray:
        """The next ``n`` values of ``dtype``: a read-only view of the buffer (no copy)."""
        dt = np.dtype(dtype)
        size = n * dt.itemsize
        if n < 0 or self.pos + size > len(self.buf):
            raise TableError("table block is truncated")
        out = np.frombuffer(self.buf, dt, n, self.pos)
        self.pos += size
        return out

    def array(self, dtype: str, n: int) -> np.ndarray:
        """The next ``n`` values of ``dtype``, copied out in native byte order."""
        view = self.view(dtype, n)
        return view.astype(view.dtype.newbyteorder("="))


def decode_block(data, *, n_packs: int) -> list[TensorTable]:
    """Parse and check a table block (its BLAKE3 was checked by the caller); TableError if malformed."""
    return list(parse_block(data, n_packs=n_packs).tables().values())


def parse_block(data, *, n_packs: int) -> Block:
    """:func:`decode_block` as a :class:`Block` (columns checked, tables built on first use)."""
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
    heads = _HEADS.find(raw)
    if heads is not None:  # the same tensor headers as a block parsed before: the same (checked) parse
        cur.pos = len(heads.prefix)
        if heads.total * _ENTRY_BYTES > len(raw):
            raise TableError("table block declares more chunks than it holds")
    else:
        heads = _parse_heads(cur, raw)
        _HEADS.add(raw, cur.pos, heads)
    return _columns(cur, raw, heads, n_packs)


class _Heads:
    """The checked tensor headers of a block, with what every parse of its columns needs precomputed.

    ``tensors``: ``(name, dtype, codec, shape, pieces)`` with ``pieces`` sorted by offset, each
    ``(offset, shape, chunks, has_snapshots, first, end)``: its chunks are ``[first, end)`` of the
    block's columns.  ``declared``: per chunk, whether its piece declares snapshots.
    """

    __slots__ = ("tensors", "total", "declared", "prefix", "_specs", "_feed")

    def __init__(self, tensors: list, total: int, prefix: bytes = b""):
        self.tensors, self.total = tensors, total
        self.prefix = prefix  # the block bytes these headers were parsed from (equal bytes: equal layout)
        self.declared = np.zeros(total, bool)
        for _, _, _, _, pieces in tensors:
            for _, _, _, has_snap, first, end in pieces:
                self.declared[first:end] = has_snap
        self._specs: dict | None = None
        self._feed: tuple | None = None

    # What only the layout determines, derived once per headers rather than once per step (a follower
    # reads one block per version, mostly with the headers of the last one).  Read-only, shared.

    def specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """name -> (shape, dtype) of every tensor of the block."""
        if self._specs is None:
            self._specs = {name: (shape, dtype) for name, dtype, _, shape, _ in self.tensors}
        return self._specs

    def feed(self) -> tuple:
        """Every chunk in change-feed order (name, piece by offset, C order):
        ``(column index, name, piece index, coord, start, stop, dtype)``."""
        if self._feed is None:
            out = []
            for name, dtype, _, _, pieces in self.tensors:
                for j, (off, shp, ch, _, first, _) in enumerate(pieces):
                    for k, (coord, start, stop) in enumerate(chunk_boxes(off, shp, ch)):
                        out.append((first + k, name, j, coord, start, stop, dtype))
            self._feed = tuple(out)
        return self._feed

    def owner(self, i: int) -> str:
        """The tensor whose piece holds chunk ``i`` (for error messages)."""
        return next(t[0] for t in self.tensors if any(p[4] <= i < p[5] for p in t[4]))


class _HeadsCache:
    """Parsed tensor headers of recent blocks, by the first bytes of the block they were parsed from.

    The parse of a block's header bytes is a function of those bytes alone, so a block that starts
    with the same bytes has the same, already checked, headers.  A trajectory's steps mostly share one
    layout, and a follower parses every block of a step per version: each block is found by its first
    ``_ANCHOR`` bytes (its dtype list and first tensor), one dict look-up however many blocks a step
    has (a 1T-parameter step has hundreds).  Bounded by the header bytes kept (``budget``), oldest out.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self._d: OrderedDict[bytes, _Heads] = OrderedDict()
        self._lengths: dict[int, int] = {}  # anchor length -> entries (mostly one length: _ANCHOR)
        self._used = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    def find(self, raw: bytes) -> _Heads | None:
        with self._lock:
            for n in self._lengths:
                heads = self._d.get(raw[:n])
                if heads is not None and raw.startswith(heads.prefix):
                    self._d.move_to_end(raw[:n])
                    return heads
        return None

    def add(self, raw: bytes, end: int, heads: _Heads) -> None:
        heads.prefix = bytes(raw[:end])
        anchor = heads.prefix[:_ANCHOR]
        with self._lock:
            old = self._d.pop(anchor, None)
            if old is not None:  # another block with these first bytes (its headers go on after them)
                self._forget(anchor, old)
            self._d[anchor] = heads
            self._lengths[len(anchor)] = self._lengths.get(len(anchor), 0) + 1
            self._used += _charge(heads)
            while self._used > self.budget and len(self._d) > 1:
                self._forget(*self._d.popitem(last=False))

    def _forget(self, anchor: bytes, heads: _Heads) -> None:
        self._used -= _charge(heads)
        self._lengths[len(anchor)] -= 1
        if not self._lengths[len(anchor)]:
            del self._lengths[len(anchor)]

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._lengths.clear()
            self._used = 0


def _charge(heads: _Heads) -> int:
    """What a parse of headers holds: its bytes, its Python objects (about 200 bytes a tensor) and a flag a chunk."""
    return len(heads.prefix) + 200 * len(heads.tensors) + heads.total


_ANCHOR = 256  # first bytes of a block that key its headers (a block with fewer header bytes: all of them)
_HEADS = _HeadsCache(64 << 20)


def _parse_heads(cur: _Cursor, raw: bytes) -> _Heads:
    """The dtype list and tensor headers at the start of a block, checked."""
    dtypes = _parse_dtypes(cur)
    (n_tensors,) = cur.unpack("<I")
    if n_tensors > len(raw):
        raise TableError("table block declares more tensors than it holds")
    heads: list[tuple[str, np.dtype, str, tuple, tuple]] = []
    total = 0
    for _ in range(n_tensors):
        head, total = _parse_tensor(cur, raw, dtypes, total)
        if heads and head[0] <= heads[-1][0]:
            raise TableError("tensors of a table block are not sorted by name")
        heads.append(head)
    return _Heads(heads, total)


def _parse_dtypes(cur: _Cursor) -> list[np.dtype]:
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
    return dtypes


def _parse_tensor(cur: _Cursor, raw: bytes, dtypes: list[np.dtype], total: int) -> tuple[tuple, int]:
    """One tensor's header ``(name, dtype, codec, shape, pieces)``, checked, and the chunks counted so far
    with its own (``total``: before it); a piece is ``(offset, shape, chunks, has_snap, first, end)``."""
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
    layouts = [_parse_piece(cur, name, ndim, dtype) for _ in range(n_pieces)]
    why = pieces_problem(shape, [x[:3] for x in layouts])
    if why is not None:
        raise TableError(f"tensor {name!r}: {why}")
    pieces = []
    for off, shp, ch, has_snap in layouts:  # columns are in the block's piece order
        first = total
        total += math.prod(chunk_grid(shp, ch))
        if total * _ENTRY_BYTES > len(raw):
            raise TableError("table block declares more chunks than it holds")
        pieces.append((off, shp, ch, has_snap, first, total))
    pieces.sort(key=lambda p: p[0])  # a table's pieces are sorted by offset
    return (name, dtype, codec, tuple(shape), tuple(pieces)), total


def _parse_piece(cur: _Cursor, name: str, ndim: int, dtype: np.dtype) -> tuple:
    """``(offset, shape, chunks, has_snap)`` of a piece, its chunk shape checked."""
    off, shp, ch = cur.unpack(f"<{ndim}Q"), cur.unpack(f"<{ndim}Q"), cur.unpack(f"<{ndim}Q")
    (has_snap,) = cur.unpack("<B")
    if any(c < 1 or c > _MAX_DIM for c in ch):
        raise TableError(f"tensor {name!r} has a chunk shape {list(ch)}")
    if chunk_nbytes(shp, ch, dtype.itemsize) > MAX_CHUNK_BYTES:
        raise TableError(f"tensor {name!r} has chunks {list(ch)} of more than {MAX_CHUNK_BYTES} bytes")
    return off, shp, ch, bool(has_snap)


def _columns(cur: _Cursor, raw: bytes, heads: _Heads, n_packs: int) -> Block:
    """The chunk columns after the headers, checked."""
    total = heads.total
    # one copy of each column kept (views of the inflated bytes for the rest): a follower parses a block per version
    content = cur.view("u1", 16 * total).reshape(total, 16)
    entries_at = cur.pos
    cur.take((_ENTRY_BYTES - 16) * total)  # reference, pack, gap, length: read below, in one pass
    (n_snap,) = cur.unpack("<Q")
    if n_snap > total:
        raise TableError("table block declares more snapshots than chunks")
    snap_cols = [cur.array("<i8", n_snap) for _ in range(4)] if n_snap else []  # mostly none: no empty arrays
    if cur.pos != len(raw):
        raise TableError("table block has trailing bytes")
    ref, pack, offs, length = _entries(raw, entries_at, total, n_packs)
    snap_all = None
    if n_snap:
        at, sp, so, sl = snap_cols
        if at.min() < 0 or at.max() >= total or (np.diff(at) <= 0).any():
            raise TableError("snapshot entries are out of order")
        if sp.min() < 0 or sp.max() >= n_packs or so.min() < 0 or sl.min() < 0 or (so + sl).max() >= _MAX_DIM:
            raise TableError("a snapshot names a bad pack, offset or length")
        undeclared = at[~heads.declared[at]]
        if len(undeclared):
            name = heads.owner(int(undeclared[0]))
            raise TableError(f"tensor {name!r} has snapshots in a piece that declares none")
        snap_all = np.full((total, 3), -1, np.int64)
        snap_all[at] = np.column_stack([sp, so, sl])
    return Block(heads, content, ref, pack, offs, length, snap_all)


def _entries(raw, pos: int, total: int, n_packs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The entry columns at byte ``pos`` of ``raw`` (the layout above): reference, pack, offset, length (int64).

    ``gap`` is undone run by run: ``off[i] = gap[i]`` where a run of one pack starts, else
    ``off[i - 1] + length[i - 1] + gap[i]``, i.e. within a run the sum of its gaps through ``i``
    and of its lengths before ``i`` (int64 sums wrap: a crafted table is caught by the range checks).
    TableError names what is wrong; the caller checked that the bytes are there.
    """
    ref = np.frombuffer(raw, "<i8", total, pos)
    pack = np.frombuffer(raw, "<u4", total, pos + 8 * total)
    gap = np.frombuffer(raw, "<i8", total, pos + 12 * total)
    length = np.frombuffer(raw, "<u8", total, pos + 20 * total)
    if total and (ref.min() < -1 or pack.max() >= n_packs or length.max() >= _MAX_DIM):
        raise TableError("an entry names a bad reference, pack or length")
    ref, pack, length = ref.astype(np.int64), pack.astype(np.int64), length.astype(np.int64)
    through = np.cumsum(gap + length) - length  # gaps through i, lengths before i, from the block's start
    if total:
        cuts = np.flatnonzero(pack[1:] != pack[:-1])
        if len(cuts):  # each run from its own start: what the runs before it summed taken off
            starts = np.concatenate(([0], cuts + 1))
            before = (through - gap)[starts]
            through -= np.repeat(before, np.diff(np.append(starts, total)))
        if through.min() < 0 or (through + length).max() >= _MAX_DIM:
            raise TableError("an entry has a bad offset")
    return ref, pack, through, length


_TABLES_LOCK = threading.Lock()


class Block:
    """A parsed, checked table block: its headers and the columns of all its chunks (block order).

    The :class:`TensorTable` objects (one per tensor, each piece a slice of the columns) are built on
    first use: a weight-sync follower's change feed reads the columns whole (``_changes.py``).
    ``heads`` is None for a block built from tables (:meth:`from_tables`).
    """

    __slots__ = ("heads", "content", "ref", "pack", "off", "length", "snap", "_tables", "_refs")

    def __init__(self, heads: _Heads | None, content, ref, pack, off, length, snap) -> None:
        self.heads = heads
        self.content, self.ref, self.pack, self.off, self.length, self.snap = content, ref, pack, off, length, snap
        self._tables: dict[str, TensorTable] | None = None
        self._refs: frozenset[int] | None = None

    def refs(self) -> frozenset[int]:
        """The steps the block's chunk entries are coded against (a delete asks it of every step), made once."""
        if self._refs is None:
            columns = [self.ref] if self.ref is not None else [p.ref for t in self.tables().values() for p in t.pieces]
            self._refs = frozenset(np.unique(np.concatenate([c[c >= 0] for c in columns] or [[]])).astype(int).tolist())
        return self._refs

    @classmethod
    def from_tables(cls, tables: list[TensorTable]) -> Block:
        """A block of tables already in memory (a writer's own): no columns of its own."""
        out = cls(None, None, None, None, None, None, None)
        out._tables = {t.name: t for t in tables}
        return out

    def specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """name -> (shape, dtype) of each tensor (shared: read-only)."""
        if self.heads is not None:
            return self.heads.specs()
        return {k: (t.shape, t.dtype) for k, t in self.tables().items()}

    def tables(self) -> dict[str, TensorTable]:
        """name -> table of each tensor of the block, in name order (shared: read-only)."""
        if self._tables is None:
            with _TABLES_LOCK:  # built once: every caller gets the same TensorTable objects
                if self._tables is None:
                    self._tables = self._build()
        return self._tables

    def _build(self) -> dict[str, TensorTable]:
        """The tables, each piece's columns slices of the block's."""
        assert self.heads is not None
        content, ref, pack, offs, length, snap_all = (
            self.content,
            self.ref,
            self.pack,
            self.off,
            self.length,
            self.snap,
        )
        out = {}
        for name, dtype, codec, shape, layouts in self.heads.tensors:
            pieces = tuple(
                Piece(
                    off,
                    shp,
                    ch,
                    content[a:b],
                    ref[a:b],
                    pack[a:b],
                    offs[a:b],
                    length[a:b],
                    snap_all[a:b] if has_snap and snap_all is not None else None,
                )
                for off, shp, ch, has_snap, a, b in layouts
            )
            out[name] = TensorTable(name, dtype, shape, codec, pieces)
        return out
