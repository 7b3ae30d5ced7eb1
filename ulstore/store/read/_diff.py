"""What changed between two steps, per tensor: :meth:`Trajectory.diff` (``ulstore diff``).

Step ``a`` is read whole (its norm needs every value); of step ``b`` only the
chunks whose content hash differs from ``a``'s co-located chunk are decoded,
when the tensor kept its chunk layout (the usual case along a run: in an RL
run most chunks of a step are unchanged and cost nothing).  Values are
compared in float64 (complex128 for complex), a bounded block at a time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import numpy as np

from ...errors import TensorNotFoundError

__all__ = ["TensorDiff", "diff_steps"]

#: elements converted to float64 at a time (bounds the memory of a diff to a few MB per block)
_BLOCK = 1 << 20


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor changed from step ``a`` to step ``b`` (:meth:`Trajectory.diff`).

    ``status`` is ``"compared"`` (same shape and dtype in both steps),
    ``"added"`` (only in ``b``), ``"removed"`` (only in ``a``) or
    ``"reshaped"`` (its shape or dtype changed; ``dtype`` and ``shape`` are
    ``b``'s, ``dtype_a`` and ``shape_a`` what it was in ``a``).  Only compared
    tensors have numbers; the others count as wholly changed
    (``fraction_changed`` 1.0) and have ``rel_l2`` and ``max_abs_change`` None.

    ``changed``: elements whose bit patterns differ (a NaN that keeps its
    payload is unchanged; -0.0 against 0.0 is a change).  ``rel_l2``:
    ``||b - a|| / ||a||`` in float64 (``inf`` if ``a`` is all zeros and
    ``b`` is not, 0.0 if both are).  ``max_abs_change``: the largest
    ``|b - a|``.  Positions where either value is NaN or infinite are left
    out of both norms and of the largest change, and counted in
    ``nonfinite``; they still count in ``changed`` by their bits.  Booleans
    and integers are compared as numbers (True is 1), complex values by
    their modulus.
    """

    name: str
    status: str
    dtype: str
    shape: tuple[int, ...]
    elements: int
    changed: int
    fraction_changed: float
    rel_l2: float | None
    max_abs_change: float | None
    nonfinite: int = 0
    dtype_a: str | None = None  # a reshaped tensor's dtype and shape in step a (None for the others)
    shape_a: tuple[int, ...] | None = None

    def to_dict(self) -> dict:
        """A plain dict (shapes as lists), as ``ulstore diff --json`` prints each tensor."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        if self.shape_a is not None:
            d["shape_a"] = list(self.shape_a)
        return d


class _Sums:
    """Running sums of one tensor: ||a||^2 and ||b - a||^2 over finite pairs, max |b - a|, counts."""

    def __init__(self):
        self.aa = 0.0
        self.dd = 0.0
        self.max = 0.0
        self.changed = 0
        self.nonfinite = 0

    def whole_a(self, a: np.ndarray) -> None:
        """Every position of ``a``, as if ``b`` equalled it there (the unchanged chunks' share)."""
        for x in _blocks(a):
            f = np.isfinite(x)
            self.aa += float(np.sum(np.square(np.abs(x[f]))))
            self.nonfinite += int(x.size - np.count_nonzero(f))

    def changed_box(self, a: np.ndarray, b: np.ndarray) -> None:
        """A box where ``b`` may differ from ``a``; :meth:`whole_a` has already counted ``a`` there."""
        self.changed += int(np.count_nonzero(_bits_differ(a, b)))
        for x, y in zip(_blocks(a), _blocks(b)):
            fa, fb = np.isfinite(x), np.isfinite(y)
            lost = fa & ~fb  # finite in a, not in b: out of ||a|| now, and one more non-finite pair
            self.aa -= float(np.sum(np.square(np.abs(x[lost]))))
            self.nonfinite += int(np.count_nonzero(lost))
            both = fa & fb
            d = np.abs(y[both] - x[both])
            if d.size:
                self.dd += float(np.sum(np.square(d)))
                self.max = max(self.max, float(d.max()))


def _blocks(arr: np.ndarray):
    """``arr`` flattened, in float64 (complex128 for complex) blocks of :data:`_BLOCK` elements."""
    flat = arr.reshape(-1)
    wide = np.complex128 if arr.dtype.kind == "c" else np.float64
    for i in range(0, flat.size, _BLOCK):
        yield flat[i : i + _BLOCK].astype(wide)


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = a.dtype.itemsize
    if n in (1, 2, 4, 8):
        u = np.dtype(f"u{n}")
        return np.ascontiguousarray(a).view(u) != np.ascontiguousarray(b).view(u)
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(-1, n)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(-1, n)
    return (x != y).any(axis=1)


def _whole(name, status, shape, dtype) -> TensorDiff:
    n = math.prod(shape)
    return TensorDiff(name, status, dtype.name, tuple(shape), n, n, 1.0 if n else 0.0, None, None)


def diff_steps(traj, a: int, b: int, names=None) -> list[TensorDiff]:
    """:meth:`Trajectory.diff` of two resolved steps (see there)."""
    reader = traj._reader
    specs_a, specs_b = _wanted(reader.specs(a), reader.specs(b), names, a, b)
    out: list[TensorDiff] = []
    common = []
    for name in sorted(set(specs_a) | set(specs_b)):
        if name not in specs_b:
            out.append(_whole(name, "removed", *specs_a[name]))
        elif name not in specs_a:
            out.append(_whole(name, "added", *specs_b[name]))
        elif specs_a[name] != specs_b[name]:
            shape_a, dtype_a = specs_a[name]
            was = {"dtype_a": dtype_a.name, "shape_a": tuple(shape_a)}
            out.append(dataclasses.replace(_whole(name, "reshaped", *specs_b[name]), **was))
        else:
            common.append(name)
    boxes = _changed_boxes(reader, a, b, common)
    values_a = traj.read(a, common) if common else {}
    values_b = traj.read_boxes(b, boxes) if boxes else []
    sums = {name: _Sums() for name in common}
    for name in common:
        sums[name].whole_a(values_a[name])
    for (name, lo, shape), vb in zip(boxes, values_b):
        region = tuple(slice(o, o + n) for o, n in zip(lo, shape))
        sums[name].changed_box(values_a[name][region], vb)
    out += [_compared(name, sums[name], *specs_a[name]) for name in common]
    out.sort(key=lambda d: (-d.fraction_changed, -(d.rel_l2 if d.rel_l2 is not None else math.inf), d.name))
    return out


def _wanted(specs_a: dict, specs_b: dict, names, a: int, b: int) -> tuple[dict, dict]:
    """The specs of the tensors ``names`` asks for (all with None); TensorNotFoundError for one in neither step."""
    if names is None:
        return specs_a, specs_b
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in specs_a and n not in specs_b]
    if missing:
        raise TensorNotFoundError(f"no tensor {missing[0]!r} in step {a} or step {b}", tensor=missing[0])
    return {n: v for n, v in specs_a.items() if n in wanted}, {n: v for n, v in specs_b.items() if n in wanted}


def _changed_boxes(reader, a: int, b: int, common: list[str]) -> list[tuple[str, tuple, tuple]]:
    """The boxes of b to decode: per tensor, the chunks whose content differs from a's (same layout), or all of it."""
    boxes: list[tuple[str, tuple, tuple]] = []
    for name in common:
        ta, tb = reader.tensor(a, name), reader.tensor(b, name)
        if ta.layout() != tb.layout():
            boxes.append((name, (0,) * len(tb.shape), tb.shape))
            continue
        for pa, pb in zip(ta.pieces, tb.pieces):
            differ = np.flatnonzero((pa.content != pb.content).any(axis=1))
            all_boxes = pb.boxes()
            for i in differ:
                _, lo, hi = all_boxes[i]
                boxes.append((name, lo, tuple(h - s for s, h in zip(lo, hi))))
    return boxes


def _compared(name: str, s: _Sums, shape, dtype) -> TensorDiff:
    """The diff of a tensor both steps hold with the same shape and dtype, from its sums."""
    n = math.prod(shape)
    if s.dd == 0.0:
        rel = 0.0
    else:
        rel = math.sqrt(s.dd) / math.sqrt(s.aa) if s.aa > 0 else math.inf
    return TensorDiff(
        name, "compared", dtype.name, tuple(shape), n, s.changed, s.changed / n if n else 0.0, rel, s.max, s.nonfinite
    )
