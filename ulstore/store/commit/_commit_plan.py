"""Before a commit writes anything: its parent, whether its branch moves, anchor or delta, a retry.

:class:`CommitPlanner` holds the decisions :meth:`Trajectory.commit`,
:meth:`Trajectory.piece_writer` and :meth:`Trajectory.finalize` share:
resolve ``parent`` against the branch as read, choose between a full anchor
and delta coding (``anchor_every``, ``anchor=``), refuse up front what
``anchor=False`` forbids, and recognise a step that exists because an earlier
commit of the same content was interrupted after its commit point (D12):
that commit is completed (the branch moves) instead of refused.
"""

from __future__ import annotations

import weakref

import numpy as np

from ...errors import ConflictError, InvalidInputError, NotFoundError, StepExistsError, StepNotFoundError
from .._base import TrajectoryBase
from ..format._chunk_tables import Piece, TensorTable, content_checksum
from ..format._chunkcodec import ULPACK, codec_for, content_digest, digest
from ..format._layout import step_key
from ..format._read_cost import DEFAULT_ANCHOR_EVERY
from ..format._refs import RefState
from ..format._stepdoc import StepDoc
from ._change_sample import sampled_delta_cost
from ._commit_input import HEAD

__all__ = ["CommitPlanner"]


class CommitPlanner:
    """Parent, branch, anchoring and retry decisions of a commit (see the module docstring)."""

    def __init__(self, trajectory: TrajectoryBase):
        # a proxy, not a reference: the trajectory owns this object, and a trajectory dropped
        # must free its caches and kept step at once (no cycle left for the garbage collector)
        self._t = weakref.proxy(trajectory)

    def _prepare(self, step: int, parent, ref: RefState, branch_given: bool) -> tuple[int | None, bool]:
        """Resolve ``parent`` against the branch as read (``ref``); whether the branch moves to ``step``."""
        head = ref.step
        if parent is HEAD:
            if head is None and self._t.steps:
                raise NotFoundError(
                    f"branch {ref.name!r} does not exist, so it has no head to commit on; pass parent=<step> "
                    "(CLI: --parent) to start it from a step, or parent=None (CLI: --root) for a new root",
                    step=step,
                    key=ref.key,
                )
            parent = head
        elif parent is not None:
            parent = self._t._resolve(parent)
        if parent is not None:
            # the parent as stored now: another process may have rewritten it (gc moved its blobs, a delete
            # re-coded it) since this process read it, and the entries this commit reuses must name where its
            # bytes are now (a gc's grace period covers a commit, not a document read long before)
            self._t._reader.forget_docs([parent])
        if branch_given and head is not None and head != parent:
            raise ConflictError(
                f"branch {ref.name!r} is at step {head}, not at parent {parent}; "
                "pass parent=None/HEAD or another branch name",
                step=step,
                key=ref.key,
            )
        return parent, head is None or head == parent

    # -- an existing step: the retry of an interrupted commit (D12) ---------------------

    def _existing(self, step: int, parent, ref: RefState) -> StepDoc:
        """``step`` exists: its document if this commit may retry one interrupted after its commit point.

        That is: ``step``'s parent is the head of the branch (as read) and the
        parent this commit asks for.  Otherwise ``StepExistsError``.
        """
        doc = self._t._reader.doc(step)
        if ref.step == step:
            # the branch is at the step already: the retry of a commit that completed (its answer may have been
            # lost); idempotent if it asks for the same parent and content (:meth:`_complete` checks the content)
            if parent is HEAD or doc.parent == (None if parent is None else self._t._resolve(parent)):
                return doc
            raise StepExistsError("step already exists; steps are immutable", step=step, key=step_key(step))
        wanted = ref.step if parent is HEAD else (None if parent is None else self._t._resolve(parent))
        if doc.parent != wanted or doc.parent != ref.step:
            raise StepExistsError("step already exists; steps are immutable", step=step, key=step_key(step))
        return doc

    def _complete(self, step: int, doc: StepDoc, ref: RefState, content: str | None) -> int:
        """Finish the interrupted commit of ``step`` if ``content`` is what it stored: move the branch (D12).

        ``content`` is the logical content checksum (format 2: tensor names,
        dtypes, shapes, pieces, every chunk's BLAKE3, files, metadata) of what
        the retry would commit; any other content is refused.
        """
        if content != doc.content:
            raise StepExistsError(
                f"step already exists with different contents (parent {doc.parent}, not on branch "
                f"{ref.name!r}); steps are immutable: delete({step}) first, or use a new step number",
                step=step,
                key=step_key(step),
            )
        if ref.step != step:
            self._t._refs.move(ref, step)
        if doc.parent is not None:
            self._t._pending.clear(step, doc.parent)
        return step

    def _state_content(self, doc: StepDoc, step: int, arrays: dict, files: dict, metadata: dict) -> str | None:
        """The content checksum ``arrays``, ``files`` and ``metadata`` would have on ``step``'s piece grids.

        Hashes every chunk (BLAKE3), decodes nothing; None if the tensors' names,
        dtypes or shapes already differ.
        """
        stored = self._t._reader.tables(step)
        if set(stored) != set(arrays):
            return None
        tables = []
        for name, t in stored.items():
            arr = arrays[name]
            if arr.dtype != t.dtype or tuple(arr.shape) != t.shape:
                return None
            pieces = []
            for p in t.pieces:
                box = arr[(..., *(slice(o, o + n) for o, n in zip(p.offset, p.shape)))]
                content = np.zeros((p.n, 16), np.uint8)
                for i, coord in enumerate(p.coords()):
                    region = np.ascontiguousarray(box[p.region(coord)]).reshape(p.region_shape(coord))
                    content[i] = np.frombuffer(content_digest(region), np.uint8)
                pieces.append(Piece(p.offset, p.shape, p.chunks, content, p.ref, p.pack, p.off, p.length))
            tables.append(TensorTable(name, t.dtype, t.shape, t.codec, tuple(pieces)))
        return content_checksum(tables, {n: digest(d).hex() for n, d in files.items()}, metadata)

    def _is_anchor(self, parent: int | None, anchor: bool | None, draw: bool = True) -> tuple[bool, dict | None]:
        """Anchor or delta, and on an anchor why (the step document's ``anchoring`` reason, ``_stepdoc.py``).

        ``draw``: after an anchor by cost, let the 1-in-:data:`RETRY_ONE_IN` draw (:func:`retry_due`) try a delta
        again; a commit that has the step's values passes False and asks :meth:`_retry_limit` instead."""
        if anchor is False and parent is None:
            raise InvalidInputError("anchor=False needs a parent to delta-code against")
        if parent is None:
            return True, {"policy": "root"}
        if anchor is True:
            return True, {"policy": "asked"}
        if anchor is False:
            return False, None
        pdoc = self._t._reader.doc(parent)
        k = self._t.anchor_cost
        if k is not None and pdoc.anchoring is not None:
            return _by_cost(pdoc, k, self._t._reader.doc, draw)
        # a fixed count; also a cost policy whose parent has no cost recorded (an older writer's step)
        every = self._t.anchor_every if k is None else DEFAULT_ANCHOR_EVERY
        if every > 0 and pdoc.anchor_distance + 1 >= every:
            return True, {"policy": "every", "every": every}
        return False, None

    def _probe_limit(
        self, parent: int | None, anchor: bool | None, is_anchor: bool, draw: bool = True
    ) -> tuple[int, float, int] | None:
        """For a delta the cost policy tries with no delta cost known (after the root, ``anchor=True`` or a fixed
        count's anchor: :func:`_next_delta` is 0), ``(parent's cost, k, limit)``: a commit checks the delta it
        wrote against the limit before its commit point, and writes the step as an anchor instead if it is over
        (its read would break the bound).  None otherwise.  ``draw`` as for :meth:`_is_anchor`."""
        k = self._t.anchor_cost
        if is_anchor or anchor is not None or k is None or parent is None:
            return None
        pdoc = self._t._reader.doc(parent)
        a = pdoc.anchoring
        if a is None or pdoc.anchor_distance > 0 or _next_delta(pdoc, self._t._reader.doc, draw):
            return None
        return a.cost, k, int(k * a.anchor_cost)

    def _retry_limit(
        self, parent: int | None, why: dict | None, arrays: dict, sparse: bool
    ) -> tuple[int, float, int] | None:
        """The measured retry: for an anchor by cost (``why``) predicted with the estimate carried on from the
        parent, itself an anchor by cost (:func:`_next_delta`), the probe ``(parent's cost, k, limit)`` of a delta
        to try instead when a sample of what ``arrays`` changed prices it within the limit
        (:func:`sampled_delta_cost`): the first step of a run that turned sparse is a delta, and a dense run pays
        a compare of a few chunks a step, not a delta encode.  With nothing to sample (no float tensor the parent
        holds in the same dtype and shape), the 1-in-:data:`RETRY_ONE_IN` draw decides.  None: anchor as planned."""
        if why is None or why.get("policy") != "cost" or parent is None:
            return None
        pdoc = self._t._reader.doc(parent)
        a = pdoc.anchoring
        if a is None or pdoc.anchor_distance > 0 or (a.why or {}).get("policy") != "cost":
            return None  # a measured estimate (the parent's own delta), or none carried
        probe = (a.cost, why["k"], why["limit"])
        kept = self._t._kept
        owned = kept.enabled and kept.lock.acquire(blocking=False)  # (never wait: a read may hold it)
        try:
            est = sampled_delta_cost(
                self._t._reader, kept if owned else None, parent, arrays, self._t.chunk_bytes, sparse
            )
        finally:
            if owned:
                kept.lock.release()
        if est is None:
            return probe if retry_due(pdoc) else None
        return probe if a.cost + est <= why["limit"] else None

    def _check_strict(self, step: int, parent, arrays: dict) -> None:
        """``anchor=False``: refuse, before writing anything, tensors that would need intra blobs."""
        for name, arr in arrays.items():
            if codec_for(arr.dtype) != ULPACK:
                continue
            try:
                pt = self._t._reader.tensor(parent, name)
            except KeyError:
                pt = None
            if pt is None or pt.dtype != arr.dtype or pt.shape != tuple(arr.shape):
                why = (
                    "is new"
                    if pt is None
                    else f"changed from {pt.dtype}{list(pt.shape)} to {arr.dtype}{list(arr.shape)}"
                )
                raise InvalidInputError(
                    f"tensor {why}, which needs an intra-coded chunk, but anchor=False forbids it; "
                    "commit with anchor=None or anchor=True",
                    step=step,
                    tensor=name,
                )


def _by_cost(pdoc: StepDoc, k: float, doc, draw: bool = True) -> tuple[bool, dict | None]:
    """The cost policy: an anchor when reading the next step would cost more than ``k`` x reading the anchor.

    The next step's read is predicted from the parent's: its cost plus what
    the next delta is expected to add (:func:`_next_delta`, ``draw`` passed on).
    """
    a = pdoc.anchoring
    assert a is not None
    predicted = a.cost + _next_delta(pdoc, doc, draw)
    limit = int(k * a.anchor_cost)
    if predicted > limit:
        return True, {"policy": "cost", "k": k, "predicted": predicted, "limit": limit}
    return False, None


#: After an anchor by cost, about one step in this many tries a delta again (:func:`_next_delta`) where the step's
#: values cannot be sampled (a piece writer's, or a commit with no float tensor the parent holds alike): a dense
#: run pays one extra delta encode per this many steps, and a run that turned sparse is found within about as many.
#: A commit of a whole state samples its changes instead (``CommitPlanner._retry_limit``).
RETRY_ONE_IN = 16


def retry_due(pdoc: StepDoc) -> bool:
    """Whether the step after the anchor ``pdoc`` tries a delta again: a 1-in-:data:`RETRY_ONE_IN` draw from
    its content hash (hex; anything else never draws)."""
    try:
        return int(pdoc.content[-4:], 16) % RETRY_ONE_IN == 0
    except ValueError:
        return False


def _next_delta(pdoc: StepDoc, doc, draw: bool = True) -> int:
    """What a delta on ``pdoc`` is expected to add to its read: what ``pdoc``'s own blobs added, if it is a
    delta (a step adds about what the one before it did).  After an anchor by cost, the estimate that made it
    one (its reason's ``predicted`` less its parent's cost, read with ``doc``): a dense run whose deltas each
    cost more than k - 1 anchors keeps anchoring every step instead of trying a delta after each anchor (whose
    read would break the bound).  After any other anchor (the root, ``anchor=True``, a fixed count), or an
    anchor whose parent has no figures, no delta is known yet: 0, and the next step is one.

    A run that turns sparse after such a dense phase would keep anchoring on that old estimate.  A commit of a
    whole state looks at what the step changed (``draw`` False: ``CommitPlanner._retry_limit`` samples it);
    elsewhere (``draw``: a piece writer, which has no values yet) about one step in :data:`RETRY_ONE_IN` after
    an anchor by cost tries (and prices) a delta again: 0, as after any other anchor.  Which one is drawn from
    the parent's content hash: deterministic for the same input, with no counter to store
    (``commit(anchor=False)`` forces a delta at once).
    """
    a = pdoc.anchoring
    assert a is not None
    if pdoc.anchor_distance > 0:
        return a.step_cost
    why = a.why or {}
    if why.get("policy") != "cost" or pdoc.parent is None or (draw and retry_due(pdoc)):
        return 0
    try:
        before = doc(pdoc.parent).anchoring
    except StepNotFoundError:  # deleted since: nothing known
        return 0
    return max(0, why["predicted"] - before.cost) if before is not None else 0
