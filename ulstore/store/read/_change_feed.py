"""The change feed: for each chunk of a step, what changed against its parent and where its blob is.

Built from the tables of the step and of its parent only (no blob is read):
a weight-sync follower that holds the parent's values decodes the ``delta``
chunks with :func:`ulstore.decode_changes` against its own memory, decodes
``intra``/``new``/``reshaped`` chunks on their own, and skips ``unchanged``
ones.  :meth:`Trajectory.fetch_blobs` fetches the blobs of a chosen set of
chunks with coalesced range reads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ...errors import TensorNotFoundError
from ..format._chunk_tables import Piece, TensorTable
from ..format._packs import Location
from ._chunk_reader import ChunkReader

__all__ = ["ChunkChange", "ChangeColumns", "FeedLayout", "changes_of", "change_columns", "KINDS"]

#: What a chunk's entry is against the parent step.
KINDS = ("unchanged", "delta", "intra", "new", "reshaped")


@dataclass(frozen=True)
class ChunkChange:
    """One chunk of a step in the change feed.

    Attributes
    ----------
    tensor : str
    piece : int
        Index of the piece (0 for an unsharded tensor).
    coord : tuple of int
        Chunk coordinate in the piece's grid.
    start, stop : tuple of int
        The chunk's box in tensor coordinates.
    kind : str
        ``"unchanged"`` (same content as the parent's co-located chunk; the
        entry is reused), ``"delta"`` (coded against step ``ref``, normally the
        parent), ``"intra"`` (coded on its own), ``"new"`` (the parent has no
        such tensor), ``"reshaped"`` (the parent holds it with another dtype or
        shape).
    content : str
        BLAKE3-128 hex of the chunk's values.
    ref : int or None
        The step the blob is coded against (None: intra).
    blob : (pack id, offset, length)
    snapshot : (pack id, offset, length) or None
        An intra blob of the same values, kept alongside a delta.
    """

    tensor: str
    piece: int
    coord: tuple[int, ...]
    start: tuple[int, ...]
    stop: tuple[int, ...]
    dtype: np.dtype
    kind: str
    content: str
    ref: int | None
    blob: Location
    snapshot: Location | None


def changes_of(
    reader: ChunkReader, step: int, names=None, *, against_parent: bool = True, read_ahead: bool = False
) -> list[ChunkChange]:
    """The change feed of ``step`` (all tensors, or ``names``), in name, piece and C order.

    ``against_parent=False`` reads this step's tables only (every chunk is then
    ``new``): enough for a reader that loads the step whole from its snapshots.
    ``read_ahead``: see :meth:`ChunkReader.blocks` (``own_blobs``).
    """
    doc = reader.doc(step)
    if read_ahead:
        reader.blocks(step, own_blobs=True)
    if names is None and against_parent and doc.parent is not None:
        fast = _same_layout_changes(reader, step, doc)
        if fast is not None:
            return fast
    tables = reader.tables(step)
    if names is not None:
        names = list(names)
        for n in names:
            if n not in tables:
                raise TensorNotFoundError("no such tensor", step=step, tensor=n)
        tables = {n: tables[n] for n in sorted(names)}
    parent = reader.tables(doc.parent) if doc.parent is not None and against_parent else {}
    out: list[ChunkChange] = []
    packs = doc.packs
    for name, t in tables.items():
        pt = parent.get(name)
        if pt is None:
            tensor_kind = "new"
        elif pt.dtype != t.dtype or pt.shape != t.shape:
            tensor_kind = "reshaped"
        else:
            tensor_kind = None
        for j, p in enumerate(t.pieces):
            pp = _parent_piece(pt, j, p) if tensor_kind is None and pt is not None else None
            _piece_changes(out, name, j, p, t.dtype, tensor_kind, pp, packs)
    return out


def _same_layout(reader: ChunkReader, step: int, doc) -> tuple[list, list] | None:
    """The table blocks of ``step`` and of its parent when they have, block by block, the exact header bytes
    (the same tensors, dtypes, shapes and pieces: the usual step); else None.

    Equal header bytes mean equal parses, so every chunk is co-located with the parent's chunk at the
    same column index, and what each chunk is (name, piece, box) was derived once for those headers.
    """
    blocks, parents = reader.blocks(step), reader.blocks(doc.parent)
    if len(blocks) != len(parents):
        return None
    for b, pb in zip(blocks, parents):
        if b.heads is None or pb.heads is None or (b.heads is not pb.heads and b.heads.prefix != pb.heads.prefix):
            return None
    return blocks, parents


def _same_layout_changes(reader: ChunkReader, step: int, doc) -> list[ChunkChange] | None:
    """The feed of a step with its parent's layout (:func:`_same_layout`), from whole columns; else None."""
    pair = _same_layout(reader, step, doc)
    if pair is None:
        return None
    out: list[ChunkChange] = []
    packs = doc.packs
    for b, pb in zip(*pair):
        assert b.heads is not None
        same = (b.content == pb.content).all(axis=1).tolist()
        hexes = b.content.tobytes().hex()
        refs, pack, off, length = b.ref.tolist(), b.pack.tolist(), b.off.tolist(), b.length.tolist()
        snaps = b.snap.tolist() if b.snap is not None else None
        for i, name, j, coord, start, stop, dtype in b.heads.feed():
            ref = refs[i]
            snap = snaps[i] if snaps is not None and snaps[i][0] >= 0 else None
            kind = "unchanged" if same[i] else "intra" if ref < 0 else "delta"
            blob, hexed = (packs[pack[i]], off[i], length[i]), hexes[32 * i : 32 * i + 32]
            out.append(_change(name, j, coord, start, stop, dtype, kind, hexed, ref, blob, snap, packs))
    return out


class FeedLayout:
    """Every chunk of a step in change-feed order, for the steps whose table blocks have the same headers.

    Built once per headers and shared: the steps of a trajectory mostly have one layout, so two
    :class:`ChangeColumns` with the same layout (compared with ``is``) describe the same chunks.

    Attributes
    ----------
    rows : tuple
        Per chunk: ``(tensor, piece, coord, start, stop, dtype)`` (as in :class:`ChunkChange`).
    """

    __slots__ = ("rows", "columns", "tensors", "_masks", "_lock")

    def __init__(self, heads: tuple) -> None:
        rows, columns, base = [], [], 0
        for h in heads:
            for i, name, j, coord, start, stop, dtype in h.feed():
                rows.append((name, j, coord, start, stop, dtype))
                columns.append(base + i)
            base += h.total
        self.rows = tuple(rows)
        self.columns = np.array(columns, np.int64)  # per row, its index in the blocks' columns end to end
        # every tensor, with rows or not (a tensor with no elements has no chunk)
        self.tensors = frozenset(t[0] for h in heads for t in h.tensors)
        self._masks: dict[frozenset, np.ndarray] = {}
        self._lock = threading.Lock()

    def mask(self, names: frozenset) -> np.ndarray:
        """Per row, whether its tensor is one of ``names`` (made once per set of names: a follower of part of
        a model asks it at every version).  TensorNotFoundError names one that the layout does not have."""
        with self._lock:
            out = self._masks.get(names)
        if out is None:
            missing = names - self.tensors
            if missing:
                raise TensorNotFoundError("no such tensor", tensor=min(missing))
            out = np.fromiter((r[0] in names for r in self.rows), bool, len(self.rows))
            with self._lock:
                if len(self._masks) >= 8:  # (a process follows a few parts of a model, not many)
                    self._masks.clear()
                self._masks[names] = out
        return out


#: Layouts of recent headers (the steps of a trajectory mostly share one).
_LAYOUTS: dict[tuple[bytes, ...], FeedLayout] = {}
_LAYOUTS_KEPT = 8
_LAYOUTS_LOCK = threading.Lock()


def _layout(heads: tuple) -> FeedLayout:
    # keyed by the header bytes, not the parsed objects: headers parsed again (once the parse cache,
    # _table_block._HEADS, dropped them) still give the layout of the parent
    key = tuple(h.prefix for h in heads)
    with _LAYOUTS_LOCK:
        out = _LAYOUTS.get(key)
        if out is None:
            out = _LAYOUTS[key] = FeedLayout(heads)
            while len(_LAYOUTS) > _LAYOUTS_KEPT:
                del _LAYOUTS[next(iter(_LAYOUTS))]
        return out


@dataclass(frozen=True, eq=False)
class ChangeColumns:
    """The changed chunks of a step with its parent's chunk layout, as columns (:meth:`Trajectory.change_columns`).

    The same facts as the :class:`ChunkChange` objects of the chunks whose
    kind is not ``unchanged``, in the same order, without an object per chunk:
    a step of a 1T-parameter model in 2 MB chunks has a million of them.

    Attributes
    ----------
    layout : FeedLayout
        Every chunk of the step (and of its parent); ``layout.rows[i]`` is what
        row ``i`` is.
    changed : np.ndarray of int64
        The rows whose content differs from the parent's, ascending.
    ref : np.ndarray of int64
        Per changed chunk, the step its blob is coded against (``delta``), or
        -1 (``intra``).
    content : np.ndarray of uint8, shape (len(changed), 16)
        Per changed chunk, the BLAKE3-128 of its values.
    blobs : list of (pack id, offset, length)
        Per changed chunk, its blob (:meth:`Trajectory.fetch_blobs` takes the
        columns whole).
    """

    layout: FeedLayout
    changed: np.ndarray
    ref: np.ndarray
    content: np.ndarray
    blobs: list


def change_columns(
    reader: ChunkReader, step: int, names: frozenset | None = None, *, read_ahead: bool = False
) -> ChangeColumns | None:
    """The changed chunks of ``step`` (of the tensors ``names``, or all) as columns, or None when it has no parent
    or not its parent's layout.  ``read_ahead`` is ignored with ``names``: it reads every blob of the step."""
    doc = reader.doc(step)
    if read_ahead and names is None:
        reader.blocks(step, own_blobs=True)
    pair = _same_layout(reader, step, doc) if doc.parent is not None else None
    if pair is None:
        missing = sorted(set(names or ()) - reader.specs(step).keys())
        if missing:
            raise TensorNotFoundError("no such tensor", step=step, tensor=missing[0])
        return None
    blocks, parents = pair
    layout = _layout(tuple(b.heads for b in blocks))

    def joined(column, of):
        return getattr(of[0], column) if len(of) == 1 else np.concatenate([getattr(b, column) for b in of])

    content = joined("content", blocks)
    # per column (16-byte rows compared whole: a third faster than comparing bytes, then any())
    differs = content.view("V16")[:, 0] != joined("content", parents).view("V16")[:, 0]
    changed = differs[layout.columns].nonzero()[0]  # per row
    if names is not None:
        try:
            changed = changed[layout.mask(names)[changed]]
        except TensorNotFoundError as e:
            raise TensorNotFoundError("no such tensor", step=step, tensor=e.tensor) from None
    at = layout.columns[changed]
    packs = doc.packs
    pack, off, length = joined("pack", blocks)[at].tolist(), joined("off", blocks)[at], joined("length", blocks)[at]
    blobs = [(packs[p], o, n) for p, o, n in zip(pack, off.tolist(), length.tolist())]
    # (a frozen dataclass's __init__ sets each field through object.__setattr__: filled at once, as _change does)
    out = _new(ChangeColumns)
    _set(
        out,
        "__dict__",
        {
            "layout": layout,
            "changed": changed,
            "ref": joined("ref", blocks)[at],
            "content": content[at],
            "blobs": blobs,
        },
    )
    return out


def feed_layout(reader: ChunkReader, step: int) -> FeedLayout | None:
    """The :class:`FeedLayout` of ``step``'s chunks (None for tables this process wrote: no header bytes)."""
    heads = tuple(b.heads for b in reader.blocks(step))
    return None if any(h is None for h in heads) else _layout(heads)


def _parent_piece(pt: TensorTable, j: int, p: Piece) -> Piece | None:
    """The parent's piece with the layout of ``p`` (mostly the one at the same index), or None."""
    if j < len(pt.pieces):
        q = pt.pieces[j]
        if q.offset == p.offset and q.shape == p.shape and q.chunks == p.chunks:
            return q
    k = pt.find_piece(p.layout)
    return None if k is None else pt.pieces[k]


_new = object.__new__
_set = object.__setattr__


def _change(name, j, coord, start, stop, dtype, kind, content, ref, blob, snap, packs) -> ChunkChange:
    """One chunk's change (``ref`` < 0: none; ``snap``: its snapshot columns' row, or None)."""
    # a frozen dataclass's __init__ sets each of the 11 fields through object.__setattr__:
    # filling __dict__ at once makes the same object at half the cost (a feed has a change per chunk)
    c = _new(ChunkChange)
    _set(
        c,
        "__dict__",
        {
            "tensor": name,
            "piece": j,
            "coord": coord,
            "start": start,
            "stop": stop,
            "dtype": dtype,
            "kind": kind,
            "content": content,
            "ref": None if ref < 0 else ref,
            "blob": blob,
            "snapshot": None if snap is None else (packs[snap[0]], snap[1], snap[2]),
        },
    )
    return c


def _piece_changes(out: list, name: str, j: int, p: Piece, dtype, tensor_kind, pp: Piece | None, packs) -> None:
    """Append the changes of piece ``j`` of ``name`` (``pp``: the parent's co-located piece, if any)."""
    # per piece, not per chunk: columns as Python lists, contents as one bytes and one hex string
    content = p.content.tobytes()
    hexes = content.hex()
    parent_content = pp.content.tobytes() if pp is not None else None
    whole_unchanged = parent_content == content
    width = p.content.shape[1] if p.content.ndim == 2 else 0
    refs, pack, off, length = p.ref.tolist(), p.pack.tolist(), p.off.tolist(), p.length.tolist()
    snaps = p.snap.tolist() if p.snap is not None else None
    for i, (coord, start, stop) in enumerate(p.boxes()):
        ref = refs[i]
        a, b = i * width, (i + 1) * width
        if tensor_kind is not None:
            kind = tensor_kind
        elif whole_unchanged or parent_content is not None and parent_content[a:b] == content[a:b]:
            kind = "unchanged"
        else:
            kind = "intra" if ref < 0 else "delta"
        snap = snaps[i] if snaps is not None and snaps[i][0] >= 0 else None
        blob, hexed = (packs[pack[i]], off[i], length[i]), hexes[2 * a : 2 * b]
        out.append(_change(name, j, coord, start, stop, dtype, kind, hexed, ref, blob, snap, packs))
