"""Phase 0 of applying a step: what a replica must read to apply it (no state needed, so it can be prefetched).

:func:`fetch` reads a step's change feed and the blobs a holder of its parent
(or, for a snapshot, nobody) needs; :class:`Fetched` carries them to
:meth:`~ulstore.sync._replica.Replica.apply` or ``load``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CorruptManifestError, InvalidInputError
from ..store import ChangeColumns, FeedLayout, StepInfo
from ._arrays import specs_of

__all__ = ["Fetched", "fetch"]


@dataclass
class Fetched:
    """A step's feed and blobs, read for a replica.

    ``columns``: the step's :class:`~ulstore.store.ChangeColumns`, where it has
    its parent's chunk layout.  ``feed``: the whole change feed, or (with
    columns) a function that reads it from the cached tables, called on the
    first use of :attr:`changes` if ever.  ``layout``: a snapshot's
    :class:`~ulstore.store.FeedLayout`, which the columns of its children carry.
    """

    info: StepInfo
    specs: dict
    feed: list | Callable[[], list]
    blobs: list
    snapshot: bool
    columns: ChangeColumns | None = None
    layout: FeedLayout | None = None

    @property
    def changes(self) -> list:
        if callable(self.feed):
            self.feed = self.feed()
        return self.feed

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.blobs))


def fetch(traj, step: int, *, snapshot: bool = False, names: frozenset | None = None, strict: bool = False) -> Fetched:
    """The change feed of ``step`` and the blobs a holder of its parent (or, ``snapshot``, nobody) needs.

    ``names``: of these tensors only (a replica of part of a model).  ``strict`` (a first bootstrap):
    the step must have them all (InvalidInputError); otherwise one it lacks is dropped, as a removed
    tensor is dropped, but not all of them (InvalidInputError).
    """
    info = traj.info(step)
    if names is not None:
        names = _held(step, traj.tensors(step), names, strict)
    if snapshot:
        return _snapshot(traj, info, specs_of(traj.tensors(step), names), names)
    # (the step's own blobs read with its tables where they are all changes: fetch_blobs then sends no request;
    # a replica of part of a model reads only its own; the tensors after: the tables read ahead hold them)
    ahead = names is None
    columns = traj.change_columns(step, names, read_ahead=ahead)
    specs = specs_of(traj.tensors(step), names)
    if columns is not None:  # the usual step: no object per chunk (apply() makes the feed if it needs it)
        blobs = traj.fetch_blobs(columns, copy=False)
        return Fetched(info, specs, lambda: traj.changes(step, names), blobs, False, columns)
    feed = traj.changes(step, names, against_parent=True, read_ahead=ahead)
    changed = [c for c in feed if c.kind != "unchanged"]
    # views, not copies: every blob is decoded and checked, never kept
    return Fetched(info, specs, feed, traj.fetch_blobs(changed, copy=False), False)


def _held(step: int, tensors: dict, names: frozenset, strict: bool) -> frozenset:
    """The tensors of ``names`` that ``step`` has (see :func:`fetch`'s ``strict``)."""
    if names <= tensors.keys():
        return names
    missing = sorted(names - tensors.keys())
    more = f" (nor {len(missing) - 1} more of the tensors followed)" if len(missing) > 1 else ""
    if strict:
        raise InvalidInputError(f"step {step} has no tensor {missing[0]!r}{more}")
    names = frozenset(n for n in names if n in tensors)
    if not names:
        raise InvalidInputError(f"step {step} has none of the tensors followed ({missing[0]!r}{more})")
    return names


def _snapshot(traj, info: StepInfo, specs: dict, names: frozenset | None) -> Fetched:
    """A snapshot step's full copies (its plain chunks, or the snapshot blobs it carries beside its deltas)."""
    step = info.step
    feed = traj.changes(step, names, against_parent=False, read_ahead=False)
    plain = [c for c in feed if c.snapshot is None]
    for c in plain:
        if c.ref is not None:
            raise CorruptManifestError(
                f"step {step} has anchor distance 0 but chunk {c.coord} has no full copy", step=step, tensor=c.tensor
            )
    snaps = [c for c in feed if c.snapshot is not None]
    blobs = traj.fetch_blobs(plain, copy=False) + traj.fetch_blobs(snaps, snapshot=True, copy=False)
    return Fetched(info, specs, plain + snaps, blobs, True, layout=traj.feed_layout(step))
