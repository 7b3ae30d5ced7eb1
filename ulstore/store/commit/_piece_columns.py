"""The columns of one piece of a tensor: as a piece writer fills them, and as it hands them over.

:class:`_PieceState` is a piece being written (its input array, its parent
piece, its columns as chunks finish, in any order); when the last chunk is
placed, the writer turns it into a :class:`PieceRecord`: plain, picklable
columns that a DCP rank sends to the process that finalizes the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..format._chunk_tables import Piece, TensorTable
from ..format._packs import Location
from ..read._kept import KeptPiece

__all__ = ["PieceRecord", "_PieceState"]


@dataclass
class PieceRecord:
    """What a piece writer wrote for one piece of one tensor: picklable, handed to the finalizer.

    ``pack`` and ``snap[:, 0]`` index :attr:`packs` (this record's own list of pack ids).
    """

    step: int
    parent: int | None
    parent_content: str | None
    anchor: bool
    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    offset: tuple[int, ...]
    piece_shape: tuple[int, ...]
    chunks: tuple[int, ...]
    packs: tuple[str, ...]
    content: np.ndarray
    ref: np.ndarray
    pack: np.ndarray
    off: np.ndarray
    length: np.ndarray
    snap: np.ndarray | None = None
    cost: int = 0  # modelled read cost of the piece's new blobs (``_read_cost.py``; an anchor's: all its blobs)
    why: dict | None = None  # why the step is an anchor (the same in every record of a step), None for a delta
    # a float tensor the parent holds under this name with another dtype or shape: ((parent shape, dtype), (shape,
    # dtype)); its chunks are intra-coded, not deltas (a delta needs its parent's dtype and shape), and the commit
    # warns of it once the step exists (byte order included: a dtype *name* drops it)
    retyped: tuple | None = None

    @property
    def layout(self) -> tuple:
        return self.offset, self.piece_shape, self.chunks

    def piece(self, index: dict[str, int], remaps: dict | None = None) -> Piece:
        """This record as a :class:`Piece` whose pack numbers index a step's pack list (``index``: id -> number;
        ``remaps``: the maps made so far for this ``index``, by pack list, shared between records)."""
        remap = remaps.get(self.packs) if remaps is not None else None
        if remap is None:
            remap = np.array([index[p] for p in self.packs] or [0], np.int64)
            if remaps is not None:
                remaps[self.packs] = remap
        snap = None
        if self.snap is not None:
            snap = self.snap.copy()
            has = snap[:, 0] >= 0
            snap[has, 0] = remap[snap[has, 0]]
        return Piece(
            self.offset,
            self.piece_shape,
            self.chunks,
            self.content,
            self.ref,
            remap[self.pack] if len(self.pack) else self.pack,
            self.off,
            self.length,
            snap,
        )


class _PieceState:
    """A piece being written: its input, its parent piece, its columns as they fill."""

    __slots__ = (
        "name", "arr", "dtype", "shape", "codec", "layout", "offset", "pshape", "chunks", "grid", "n", "whole",
        "chunk_nbytes", "pt", "pp", "parent_packs", "mode", "kp", "content", "ref", "locs", "snaps", "left", "cost",
        "seen",
    )  # fmt: skip

    def __init__(
        self, name, arr, dtype, shape, codec, layout, grid, n, parent_table, parent_piece, parent_packs, mode, kp
    ):
        self.name, self.arr, self.dtype, self.shape, self.codec = name, arr, dtype, shape, codec
        self.layout = layout
        self.offset, self.pshape, self.chunks = layout
        self.grid, self.n = grid, n  # (``chunk_grid`` of the layout, its product)
        self.whole = tuple(slice(0, s) for s in self.pshape) if n == 1 else ()  # the region of the one chunk
        self.chunk_nbytes = math.prod(self.chunks) * dtype.itemsize  # at most: edge chunks are smaller
        self.pt: TensorTable | None = parent_table
        self.pp: Piece | None = parent_piece
        self.parent_packs = parent_packs
        self.mode = mode  # "intra", "colocated" or "box"
        self.kp: KeptPiece | None = kp
        self.content = np.zeros((self.n, 16), np.uint8)
        self.ref = np.empty(n, np.int64)
        self.ref.fill(-1)  # (np.full costs several times this: a piece or ~10,000 a commit)
        self.locs: list = [None] * self.n
        self.snaps: list = [None] * self.n
        self.left = self.n
        self.cost = 0  # modelled read cost of the blobs placed so far
        # how many of the writer's parent pieces (in plan order) this piece's chunks may dedup against
        self.seen = 0

    def region(self, coord) -> tuple[slice, ...]:
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(coord, self.chunks, self.pshape))

    def parent_loc(self, i: int) -> Location:
        assert self.pp is not None
        return self.parent_packs[int(self.pp.pack[i])], int(self.pp.off[i]), int(self.pp.length[i])

    def parent_snap(self, i: int) -> Location | None:
        assert self.pp is not None
        s = self.pp.snapshot(i)
        return None if s is None else (self.parent_packs[s[0]], s[1], s[2])
