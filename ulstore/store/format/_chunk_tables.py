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

The binary form of tables (a **table block**, what a step's document points
at) is ``_table_block.py``; :func:`content_checksum` here is the step's
logical checksum, which no storage detail enters.
"""

from __future__ import annotations

import bisect
import itertools
import math
import struct
import threading
from dataclasses import dataclass

import blake3
import numpy as np

from ...core.sealed import canonical_json
from ._layout import chunk_grid

__all__ = [
    "Piece",
    "TensorTable",
    "pieces_problem",
    "chunk_nbytes",
    "content_checksum",
    "MAX_CHUNK_BYTES",
    "chunk_boxes",
]

#: Largest chunk a table may declare (and ``chunk_bytes`` may ask for): a bound
#: on what one chunk read allocates, whatever a crafted table says.
MAX_CHUNK_BYTES = 1 << 32
_MAX_PIECES = 1 << 20


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

    def boxes(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]:
        """``(coord, start, stop)`` of every chunk in C order (shared, from :func:`chunk_boxes`)."""
        return chunk_boxes(self.offset, self.shape, self.chunks)

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

#: ``chunk_boxes`` results by layout: the steps of a trajectory share their layouts, so a change
#: feed computes each chunk's box once, not once per step.  Bounded by chunks held: emptied when full
#: (a plain dict: a hit costs one lookup, which matters at one lookup per piece per step).
_BOXES: dict[tuple, tuple] = {}
_BOXES_MAX = 1 << 16
_boxes_held = 0
_BOXES_LOCK = threading.Lock()


def chunk_boxes(offset: tuple, shape: tuple, chunks: tuple) -> tuple:
    """``(coord, start, stop)`` of every chunk of the piece ``(offset, shape, chunks)``, in C order.

    ``start``/``stop`` are the chunk's box in tensor coordinates (edge chunks are short).
    Cached by layout (bounded): treat the result as read-only.
    """
    global _boxes_held
    key = (offset, shape, chunks)
    hit = _BOXES.get(key)
    if hit is not None:
        return hit
    out = []
    for coord in itertools.product(*map(range, chunk_grid(shape, chunks))):
        lo = tuple(o + i * c for o, i, c in zip(offset, coord, chunks))
        hi = tuple(min(o + (i + 1) * c, o + n) for o, i, c, n in zip(offset, coord, chunks, shape))
        out.append((coord, lo, hi))
    boxes = tuple(out)
    with _BOXES_LOCK:
        if _boxes_held + len(boxes) > _BOXES_MAX:
            _BOXES.clear()
            _boxes_held = 0
        if len(boxes) <= _BOXES_MAX:
            _BOXES[key] = boxes
            _boxes_held += len(boxes)
    return boxes


def chunk_nbytes(shape, chunks, itemsize: int) -> int:
    """Bytes of the largest chunk of a piece of ``shape`` cut into ``chunks`` (a chunk never exceeds its piece)."""
    return math.prod(min(int(c), int(s)) for s, c in zip(shape, chunks)) * itemsize


#: ``pieces_problem`` answers by (shape, layouts): a step of ~10,000 tensors has a few dozen distinct
#: layouts, checked once each (a plain dict, emptied when full; its values are immutable)
_TILINGS: dict[tuple, str | None] = {}
_TILINGS_MAX = 1 << 12


def pieces_problem(shape: tuple[int, ...], layouts: list[tuple]) -> str | None:
    """Why ``layouts`` (``(offset, shape, chunks)`` each) do not tile a tensor of ``shape`` exactly, or None.

    Each piece must lie inside the tensor with chunks of at least one element
    and at most the piece's length per axis, and together they must cover every element exactly once:
    checked on the grid the pieces' boundaries cut the tensor into.
    """
    if len(layouts) > 8:  # (a sharded tensor: its own check, not worth a key of its size)
        return _pieces_problem(shape, layouts)
    key = (shape, *layouts)
    try:
        return _TILINGS[key]
    except (KeyError, TypeError):  # (TypeError: unhashable fields, lists; checked below without the cache)
        pass
    why = _pieces_problem(shape, layouts)
    try:
        if len(_TILINGS) >= _TILINGS_MAX:
            _TILINGS.clear()
        _TILINGS[key] = why
    except TypeError:
        pass
    return why


def _pieces_problem(shape: tuple[int, ...], layouts: list[tuple]) -> str | None:
    if not layouts or len(layouts) > _MAX_PIECES:
        return f"{len(layouts)} pieces"
    for off, shp, ch in layouts:
        why = _piece_problem(shape, off, shp, ch)
        if why is not None:
            return why
    if len(layouts) == 1:
        off, shp, _ = layouts[0]
        ok = all(o == 0 for o in off) and tuple(shp) == tuple(shape)
        return None if ok else "a single piece must cover the whole tensor"
    if math.prod(shape) == 0:
        return "an empty tensor has one piece"
    return _tiling_problem(shape, layouts)


def _piece_problem(shape: tuple[int, ...], off, shp, ch) -> str | None:
    """Why one piece does not lie inside the tensor with valid chunks, or None."""
    if not (len(off) == len(shp) == len(ch) == len(shape)):
        return "a piece has the wrong number of dimensions"
    # a chunk never exceeds its piece (writers clamp it): a crafted table cannot make a
    # reader pad a chunk of a few elements out to gigabytes
    if any(c < 1 or c > max(s, 1) or o < 0 or s < 0 or o + s > n for o, s, c, n in zip(off, shp, ch, shape)):
        return f"piece at {list(off)} of shape {list(shp)} (chunks {list(ch)}) is outside {list(shape)}"
    return None


def _tiling_problem(shape: tuple[int, ...], layouts: list[tuple]) -> str | None:
    """Whether pieces (each inside the tensor) cover every element exactly once, counted on the grid their
    boundaries cut the tensor into."""
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


_U64S = [struct.Struct(f"<{n}Q").pack for n in range(16)]


def _u64s(values) -> bytes:
    """Little-endian u64s: the checksum below and the table blocks (``_table_block.py``) write integers so."""
    n = len(values)
    return _U64S[n](*values) if n < 16 else struct.pack(f"<{n}Q", *values)


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
    # the bytes gathered and hashed in one call (the digest of a stream does not depend on how it
    # is cut): one update per field cost a C call each, ~10 per tensor on steps of ~10,000 tensors
    parts = [struct.pack("<Q", len(ts))]
    for t in ts:
        name = t.name.encode("utf-8")
        parts.append(struct.pack("<Q", len(name)) + name + t.dtype.name.encode() + b"\x00")
        parts.append(struct.pack("<QQ", len(t.shape), len(t.pieces)) + _u64s(t.shape))
        for p in t.pieces:
            parts.append(_u64s(p.offset) + _u64s(p.shape) + _u64s(p.chunks))
            parts.append(np.ascontiguousarray(p.content, np.uint8).tobytes())
    h.update(b"".join(parts))
    h.update(struct.pack("<Q", len(files)))
    for name in sorted(files):
        raw = name.encode("utf-8")
        h.update(struct.pack("<Q", len(raw)) + raw + bytes.fromhex(files[name]))
    h.update(canonical_json(metadata))
    return h.hexdigest(16)
