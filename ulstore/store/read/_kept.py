"""The kept step: one fully materialised step a trajectory keeps, overwritten in place chunk by chunk.

A commit codes every chunk against the parent's co-located chunk.  A writer
that commits step after step keeps the values it committed last (one array
per tensor piece) and codes the next commit against them without decoding
anything; after encoding a chunk it overwrites that chunk's region with the
new values.  Reads use the same mechanism, so reading consecutive steps
decodes about one blob per chunk per step.

The kept step is **content-addressed**, not step-addressed: each chunk
carries the content hash of the values it holds, and a lookup succeeds only
for the same tensor, the same piece layout and the same content hash.  A
commit that fails half way therefore leaves nothing stale behind: a chunk is
marked unknown (all-zero hash) before it is overwritten and labelled after.  The memory knob is ``keep_parent`` of
:func:`ulstore.open` (True, False, or a byte budget).

Thread rules: the owner of :attr:`KeptStep.lock` may use and change it (a
commit blocks for it; a read that cannot get it at once reads without it).
Within one owner, worker threads touch disjoint chunk regions.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["KeptStep", "KeptPiece", "release_free_memory"]

_trim: Callable[[int], int] | None = None
_trim_known = False


def release_free_memory() -> None:
    """Hand the C allocator's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Called after a commit that grew the kept step: its long-lived
    chunk arrays were allocated between short-lived blobs and scratch
    buffers, whose freed space glibc would otherwise keep resident.
    """
    global _trim, _trim_known
    if not _trim_known:
        _trim_known = True
        if sys.platform.startswith("linux"):
            try:
                _trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc
                pass
    if _trim is not None:
        _trim(0)


_UNKNOWN = bytes(16)


class KeptPiece:
    """One piece of one tensor: per chunk, its values and the content hash of those values.

    One array per chunk, so a read adopts the arrays it decoded (no copy) and a
    commit overwrites them in place (no allocation in a training loop).
    """

    __slots__ = ("layout", "arrays", "content", "dtype")

    def __init__(self, layout: tuple, dtype: np.dtype, n_chunks: int):
        self.layout = layout
        self.dtype = dtype
        self.arrays: list[np.ndarray | None] = [None] * n_chunks
        self.content = np.zeros((n_chunks, 16), np.uint8)  # all zero = unknown

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)

    def get(self, i: int, content: bytes) -> np.ndarray | None:
        """Chunk ``i``'s values if they have content hash ``content``; else None."""
        a = self.arrays[i]
        if a is None or content == _UNKNOWN or self.content[i].tobytes() != content:
            return None
        return a

    def put(self, i: int, values: np.ndarray, content: bytes) -> None:
        """Copy ``values`` (content hash ``content``) into chunk ``i``, in place when the shape allows.

        Nothing is copied if chunk ``i`` already holds values of that content
        hash (an unchanged chunk of a commit, e.g. a frozen layer).
        """
        if self.get(i, content) is not None:
            return
        self.content[i] = 0
        a = self.arrays[i]
        if a is not None and a.shape == values.shape and a.dtype == values.dtype:
            np.copyto(a, values)
        else:
            self.arrays[i] = np.array(values, dtype=self.dtype, copy=True)
        self.content[i] = np.frombuffer(content, np.uint8)

    def adopt(self, i: int, values: np.ndarray, content: bytes) -> None:
        """Keep ``values`` itself (a freshly decoded array nobody else will modify) as chunk ``i``."""
        self.content[i] = 0
        self.arrays[i] = values
        self.content[i] = np.frombuffer(content, np.uint8)


class KeptStep:
    """At most one materialised step: tensor name -> (dtype, shape, {piece layout: KeptPiece}).

    Parameters
    ----------
    budget : int or None
        Most bytes of values to keep (None: no limit, 0: keep nothing).
    """

    def __init__(self, budget: int | None):
        self.budget = budget
        self.lock = threading.Lock()
        self.step: int | None = None
        self.origin: str | None = None  # "commit" or "read": what put the step there
        self.tensors: dict[str, tuple[str, tuple, dict[tuple, KeptPiece]]] = {}

    @property
    def enabled(self) -> bool:
        return self.budget is None or self.budget > 0

    @property
    def nbytes(self) -> int:
        return sum(kp.nbytes for _, _, ps in self.tensors.values() for kp in ps.values())

    def clear(self) -> None:
        self.tensors.clear()
        self.step = self.origin = None

    def piece(self, name: str, dtype: np.dtype, shape: tuple, layout: tuple) -> KeptPiece | None:
        """The kept piece of ``name`` with exactly this dtype, tensor shape and piece layout, if any."""
        t = self.tensors.get(name)
        if t is None or t[0] != dtype.str or t[1] != shape:
            return None
        return t[2].get(layout)

    def ensure(self, name: str, dtype: np.dtype, shape: tuple, layout: tuple, n_chunks: int) -> KeptPiece | None:
        """The kept piece for this layout, allocated (values unknown) if missing; None if over budget."""
        kp = self.piece(name, dtype, shape, layout)
        if kp is not None:
            return kp
        t = self.tensors.get(name)
        if t is None or t[0] != dtype.str or t[1] != shape:
            t = self.tensors[name] = (dtype.str, shape, {})
        old = t[2].pop(layout, None)
        need = int(np.prod(layout[1], dtype=np.int64)) * dtype.itemsize
        if self.budget is not None and self.nbytes - (old.nbytes if old else 0) + need > self.budget:
            return None
        kp = t[2][layout] = KeptPiece(layout, dtype, n_chunks)
        return kp

    def retain(self, layouts: dict[str, set]) -> None:
        """Drop every tensor and piece not in ``layouts`` (name -> set of piece layouts)."""
        for name in list(self.tensors):
            keep = layouts.get(name)
            if keep is None:
                del self.tensors[name]
                continue
            pieces = self.tensors[name][2]
            for layout in list(pieces):
                if layout not in keep:
                    del pieces[layout]
