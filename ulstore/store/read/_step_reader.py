"""Reading steps: lazy zarr groups, whole tensors, boxes, files, step info and ancestry.

A full read plans its chunks with ``_decode_plan.py`` and runs the job from here (``Reader.read`` ->
``_Job.run`` -> the codec's door -> kernel); lazy slices go through the zarr ``Store`` of ``_logical.py``
and :class:`ChunkReader`; the change feed is ``_change_feed.py``.
"""

from __future__ import annotations

import numbers
import weakref
from dataclasses import dataclass, field

import numpy as np

from ...core.objects import MAX_DOCUMENT_BYTES
from ...errors import CorruptManifestError, IntegrityError, InvalidInputError
from .._base import MAIN, TrajectoryBase
from ..format._layout import check_step, step_key
from ._change_feed import ChangeColumns, ChunkChange, FeedLayout, change_columns, changes_of, feed_layout
from ._decode_plan import _Job, read_job
from ._diff import TensorDiff, diff_steps
from ._logical import LogicalStore
from ._missing import StepGroup, explained

__all__ = ["Reader", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What :meth:`Trajectory.log` reports about one step.

    ``content`` is the step's logical checksum (BLAKE3-128 hex of its tensors'
    content hashes, files and metadata) and ``parent_content`` the parent's:
    the hash chain.
    """

    step: int
    parent: int | None
    anchor_distance: int
    created: str
    metadata: dict = field(default_factory=dict)
    content: str = ""
    parent_content: str | None = None
    #: the read-cost model and why the step is an anchor, as its step document stores them (``{"cost",
    #: "anchor_cost", "step_cost", "anchor": None or {"policy": ...}}``), or None (a step written before it)
    anchoring: dict | None = None


class Reader:
    """What a trajectory reads: steps as zarr groups, tensors, boxes, files, step info, change feeds, diffs."""

    def __init__(self, trajectory: TrajectoryBase):
        # a proxy, not a reference: the trajectory owns this object, and a trajectory dropped
        # must free its caches and kept step at once (no cycle left for the garbage collector)
        self._t = weakref.proxy(trajectory)
        self._last_read: int | None = None  # reads refresh the kept step once they look sequential

    # -- reading ------------------------------------------------------------------

    def __getitem__(self, step_or_ref):
        """The step as a read-only, lazy :class:`zarr.Group`.

        ``traj[1200]`` is step NUMBER 1200 (not the 1200th step), ``traj["main"]``
        the step a ref points to, and a negative int counts from the last step by
        number: ``traj[-1]`` is ``traj[traj.steps[-1]]``, ``traj[-2]`` the one
        before it.  Indexing an array fetches and decodes only the chunks it
        touches (and their reference chains).  bfloat16/fp8 arrays have their
        real dtype.  A tensor the step does not have is a
        :class:`~ulstore.errors.TensorNotFoundError` (a ``KeyError``) naming the
        closest ones it has.

        Raises
        ------
        StepNotFoundError
            No such step or ref (or fewer steps than a negative index asks for).
        InvalidInputError
            Not an int or a ref name (slices included: iterate ``traj.steps[a:b]``).
        """
        import zarr

        if isinstance(step_or_ref, slice):
            raise InvalidInputError(
                "a Trajectory is indexed by one step number or ref, not a slice: use [traj[s] for s in traj.steps[a:b]]"
            )
        if isinstance(step_or_ref, numbers.Integral) and not isinstance(step_or_ref, bool) and step_or_ref < 0:
            step_or_ref = self._t._step_at(int(step_or_ref))
        step = self._t._resolve(step_or_ref)
        group = zarr.open_group(store=self._t._store, path=str(step), mode="r", zarr_format=3, use_consolidated=False)
        return StepGroup(group._async_group)

    def zarr_store(self, step_or_ref=None) -> LogicalStore:
        """The read-only zarr v3 store of one step (or, with no step, of every step).

        Rooted at the step: ``zarr.json`` is the step's group, ``<tensor>/zarr.json``
        an array, ``<tensor>/c/0/0`` a decoded chunk.  Follows zarr's store
        conventions (``read_only=True``, ``with_read_only``, writes raise
        ``ValueError``), pickles (dask workers that reach the same storage read
        it), and its arrays carry ``dimension_names`` (``<tensor>.dim_<i>``), so
        ``xarray.open_zarr(traj.zarr_store(step))`` opens a step as a Dataset
        (``xarray.open_datatree`` for tensor names with ``/``).  A ref is
        resolved now: the store keeps the step, not the branch.

        Examples
        --------
        >>> import numpy as np, ulstore, zarr
        >>> traj = ulstore.open("memory://doctest-zarr-store", mode="w")
        >>> traj.commit(3, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
        3
        >>> z = zarr.open_array(traj.zarr_store(3), path="w", mode="r")
        >>> z[1].tolist(), z.metadata.dimension_names
        ([3.0, 4.0, 5.0], ('w.dim_0', 'w.dim_1'))
        """
        step = None if step_or_ref is None else self._t._resolve(step_or_ref)
        return LogicalStore(self._t._reader, step=step)

    def read(self, step_or_ref, names=None) -> dict[str, np.ndarray]:
        """Decode whole tensors of a step (all by default) into fresh, writable arrays.

        Reading consecutive steps decodes about one blob per chunk per step:
        once reads look sequential (this step's parent, or this step itself,
        was read last), the trajectory keeps the step read (``keep_parent``),
        unless it keeps the step it committed last.  A one-off read keeps
        nothing (no second copy of the step in memory).

        Parameters
        ----------
        step_or_ref : int or str
        names : iterable of str, optional

        Returns
        -------
        dict of str to numpy.ndarray
            Bit-exact, original dtypes (``ml_dtypes.bfloat16`` for bf16).
        """
        step = self._t._resolve(step_or_ref)
        with explained(self._t._reader, step):
            # TableReader.settled, written out: the job's run is this frame's call (a read's path to the
            # kernels is Trajectory.read -> Reader.read -> _Job.run -> codec door -> kernel)
            for again in (False, True):
                job = None
                try:
                    if again:  # a missing pack, a reference to a step gone: read the step documents anew
                        self._t._reader.forget_docs()
                    job = self._job(step, names)
                    return job.run()
                except IntegrityError:
                    if again:
                        raise
                finally:
                    if job is not None:
                        job.close()
        raise AssertionError("unreachable")

    def _job(self, step: int, names) -> _Job:
        """The read's job, with the kept step (its lock held until the job is closed) when it is free."""
        kept = self._t._kept
        last, self._last_read = self._last_read, step
        if not (kept.enabled and kept.lock.acquire(blocking=False)):
            return read_job(self._t._reader, step, names)
        try:
            parent = self._t._reader.doc(step).parent
            sequential = kept.step is not None and kept.step == parent or last is not None and last in (parent, step)
            refresh = names is None and kept.origin != "commit" and sequential
            job = read_job(self._t._reader, step, names, kept=kept, refresh_kept=refresh)
        except BaseException:
            kept.lock.release()
            raise
        job.on_close = kept.lock.release
        return job

    def read_box(self, step_or_ref, name: str, offset, shape) -> np.ndarray:
        """The values of tensor ``name`` over the box at ``offset`` of ``shape`` (fresh array).

        Whatever pieces the step stores the tensor in, the box is assembled
        from the chunks it overlaps (what a resharded load needs).
        """
        step = self._t._resolve(step_or_ref)
        with explained(self._t._reader, step):
            return self._t._reader.settled(
                lambda: np.array(self._t._reader.box(step, name, *self._box(step, name, offset, shape)), copy=True)
            )

    def read_boxes(self, step_or_ref, boxes, *, out=None) -> list[np.ndarray]:
        """:meth:`read_box` of each ``(name, offset, shape)`` of ``boxes``, together: fresh arrays, in order.

        The chunks of all the boxes are fetched in coalesced range reads and
        decoded on the trajectory's threads, each once however many boxes
        overlap it (a rank's share of a checkpoint: one plan, not one per
        tensor, so a few large requests instead of one or more per tensor).

        ``out``: the caller's arrays, one per box (its shape, the tensor's
        dtype, writable; strided views are fine), filled and returned instead
        of fresh arrays.  A chunk lying whole in its box decodes straight into
        the caller's memory where that part is contiguous (no temporary, no
        copy: a DCP load decodes into the model's tensors); a chunk cut by the
        box's edge is decoded aside and its part copied in.  After a failure,
        what ``out`` holds is unspecified.
        """
        step = self._t._resolve(step_or_ref)

        def read():
            requests = [(name, *self._box(step, name, offset, shape)) for name, offset, shape in boxes]
            if out is None:
                return self._t._reader.boxes(step, requests)
            return self._read_into(step, requests, out)

        with explained(self._t._reader, step):
            return self._t._reader.settled(read)

    def _read_into(self, step: int, requests: list, out) -> list[np.ndarray]:
        """``read_boxes(..., out=out)``: chunks whole in their box decoded in place (one batched
        ``materialize``), the chunks a box's edge cuts read as their part of the box (one batched read)."""
        reader = self._t._reader
        out = list(out)
        if len(out) != len(requests):
            raise InvalidInputError(f"read_boxes got {len(out)} arrays in out for {len(requests)} boxes")
        targets: dict = {}  # node -> its materialize target (a chunk whole in two boxes is decoded once)
        again, cut = [], []
        for (name, lo, hi), dest in zip(requests, out):
            t = reader.tensor(step, name)
            _check_out(dest, name, t.dtype, tuple(b - a for a, b in zip(lo, hi)))
            for j, c, clo, chi in t.overlapping(lo, hi):
                node = (step, name, j, c)
                if all(a <= x and y <= b for a, b, x, y in zip(lo, hi, clo, chi)):
                    region = tuple(slice(x - a, y - a) for a, x, y in zip(lo, clo, chi))
                    if node in targets:
                        again.append((dest, region, targets[node]))
                    else:
                        targets[node] = (node, dest, region, None, 0)
                else:
                    part = tuple(max(a, x) for a, x in zip(lo, clo)), tuple(min(b, y) for b, y in zip(hi, chi))
                    cut.append((name, part, dest, tuple(slice(x - a, y - a) for a, x, y in zip(lo, *part))))
        if targets:
            reader.materialize(list(targets.values()))
        for dest, region, (_, first, first_region, _, _) in again:
            dest[region] = first[first_region]
        if cut:
            for (_, _, dest, region), value in zip(cut, reader.boxes(step, [(n, *part) for n, part, _, _ in cut])):
                dest[region] = value
        return out

    def _box(self, step: int, name: str, offset, shape) -> tuple[tuple, tuple]:
        """``(lo, hi)`` of the box at ``offset`` of ``shape`` in tensor ``name``; InvalidInputError outside it."""
        t = self._t._reader.tensor(step, name, chain=True)
        lo = tuple(int(o) for o in offset)
        hi = tuple(a + int(n) for a, n in zip(lo, shape))
        if (
            len(lo) != len(t.shape)
            or len(hi) != len(t.shape)
            or any(a < 0 or b < a or b > n for a, b, n in zip(lo, hi, t.shape))
        ):
            raise InvalidInputError(f"box at {list(lo)} of shape {list(shape)} is outside {list(t.shape)}", tensor=name)
        return lo, hi

    def pieces(self, step_or_ref, name: str) -> list[tuple[tuple[int, ...], ...]]:
        """How a step stores tensor ``name``: ``(offset, shape, chunk shape)`` of each piece (box) of it.

        An unsharded tensor is one piece at offset 0; a tensor saved by several writers
        (``piece_writer``, DCP ranks) has one piece per box they wrote.  Reads no blob.
        """
        step = self._t._resolve(step_or_ref)
        with explained(self._t._reader, step):
            return [p.layout for p in self._t._reader.tensor(step, name).pieces]

    def files(self, step_or_ref) -> list[str]:
        """Names of the files stored with a step (``commit(..., files=...)``), sorted."""
        return sorted(self._t._reader.doc(self._t._resolve(step_or_ref)).files)

    def read_file(self, step_or_ref, name: str) -> bytes:
        """The bytes of file ``name`` of a step, checked against its content hash."""
        step = self._t._resolve(step_or_ref)
        return self._t._reader.settled(lambda: self._t._reader.file(step, name))

    def changes(
        self, step_or_ref, names=None, *, against_parent: bool = True, read_ahead: bool = False
    ) -> list[ChunkChange]:
        """The change feed of a step against its parent: one :class:`ChunkChange` per chunk.

        Reads the step's tables (and its parent's), never a blob.  Fetch the
        blobs of the chunks you need with :meth:`fetch_blobs`.  With
        ``against_parent=False`` the parent is not read and every chunk is
        ``new`` (loading a snapshot step whole needs nothing else).

        ``read_ahead=True``, for a caller about to fetch the blobs of every
        changed chunk (a weight-sync follower): where the bytes the step's
        commit wrote before its tables are all such blobs (the step carries
        no snapshot and no file there), they are read in the same request as
        the tables and kept for the next :meth:`fetch_blobs`, which then
        sends no request for them: one round trip per step fewer, the same
        bytes.
        """
        step = self._t._resolve(step_or_ref)
        with explained(self._t._reader, step):
            return changes_of(self._t._reader, step, names, against_parent=against_parent, read_ahead=read_ahead)

    def change_columns(self, step_or_ref, names=None, *, read_ahead: bool = False) -> ChangeColumns | None:
        """The changed chunks of a step as columns, without an object per chunk; None when the step has no
        parent or not its parent's chunk layout (a tensor added, removed, reshaped or chunked otherwise).

        What :meth:`changes` says of the chunks that are not ``unchanged``, in
        its order, for callers that go through a step's chunks at scale (a
        weight-sync follower: a million chunks per version at 1T parameters).
        ``names``: only the chunks of these tensors (TensorNotFoundError if the
        step has no such tensor); the rows keep their indices in the whole
        layout.  :meth:`fetch_blobs` takes the columns whole; ``read_ahead`` is
        :meth:`changes`' (without ``names``: it reads all the step's blobs).
        """
        wanted = None if names is None else frozenset(names)
        step = self._t._resolve(step_or_ref)
        with explained(self._t._reader, step):
            return change_columns(self._t._reader, step, wanted, read_ahead=read_ahead)

    def feed_layout(self, step_or_ref) -> FeedLayout | None:
        """Every chunk of a step in change-feed order: the :class:`FeedLayout` that the :meth:`change_columns` of
        its children with its chunk layout carry (the very object: compare with ``is``).

        For a caller that holds a step (a weight-sync follower after a
        bootstrap) and applies its children from their columns.  None where
        this process wrote the step's tables (they were never parsed from
        storage); a reader opened on the trajectory has them.
        """
        return feed_layout(self._t._reader, self._t._resolve(step_or_ref))

    def fetch_blobs(self, changes, *, snapshot: bool = False, copy: bool = True) -> list:
        """The blobs (or, with ``snapshot``, the snapshots) of ``changes`` (:class:`ChunkChange` objects, or
        :class:`ChangeColumns`), fetched with coalesced range reads.

        Unchanged chunks have no blob of their own in their step; asking for
        one returns the blob their entry names (the same bytes as the parent's).

        ``copy=False``: read-only memoryviews into the range reads instead of
        bytes (on local disk, large reads are views of a mapping of the pack),
        for callers that decode the blobs and drop them, such as weight sync's
        in-place apply; a view keeps its whole range read alive.
        """
        if isinstance(changes, ChangeColumns):
            if snapshot:
                raise InvalidInputError("change columns name no snapshots: use changes()")
            locs, changes = list(changes.blobs), ()
        else:
            locs = []
        for c in changes:
            loc = c.snapshot if snapshot else c.blob
            if loc is None:
                raise InvalidInputError(f"chunk {c.coord} of {c.tensor!r} has no {'snapshot' if snapshot else 'blob'}")
            locs.append(loc)
        views = self._t._reader.fetch(locs)
        return views if not copy else [bytes(b) for b in views]

    def info(self, step_or_ref) -> StepInfo:
        """Parent, anchor distance, creation time, metadata and content checksums of one step."""
        return _info(self._t._reader.doc(self._t._resolve(step_or_ref)))

    def step_document(self, step_or_ref) -> bytes:
        """The step's document exactly as stored: a few hundred bytes of canonical JSON.

        Hand it, with the step number, to another process that is about to
        read the step (a replica told of a new version): its
        :meth:`accept_step_document` then spares it the request for it.
        """
        return self._t._reader.doc(self._t._resolve(step_or_ref)).to_bytes()

    def accept_step_document(self, step: int, document, *, parent: tuple[int, str]) -> StepInfo:
        """Check ``step``'s document received from another process (:meth:`step_document`); keep it if it links.

        Reading the step then needs no request for its document.  The bytes
        are checked as if read from storage (canonical form, checksum, the
        step number) and must link to a step this reader holds: ``parent``.
        They are not compared with the stored copy, so they are trusted as
        the storage is: they decide what the step holds for this reader (a
        crafted document, or one delivered after its step was deleted and
        committed again, names other data).  Give only what the committing
        process returned, over a channel you trust as you trust the writers.

        Parameters
        ----------
        step : int
        document : bytes or str
            The document's bytes (its ASCII text also works, as a JSON control
            message carries it).
        parent : (int, str)
            The step the reader holds and its content checksum
            (:attr:`StepInfo.content`).  A document committed on that step
            with that checksum as its parent's is kept; any other is returned
            but not kept (the reader cannot link it: read the step from
            storage instead, whose chain says which of the two moved on).

        Returns
        -------
        StepInfo
            The document's; kept if and only if its ``parent`` and
            ``parent_content`` are ``parent``.

        Raises
        ------
        CorruptManifestError
            The bytes are not a sound step document of ``step``, or this
            trajectory already read a different document of ``step``.
            Nothing is kept.
        InvalidInputError
            ``document`` is neither bytes nor str, or longer than a step
            document may be; or the trajectory is writable (a writer reads
            the documents of its own commits).
        """
        step = check_step(step)
        if not self._t.read_only:
            raise InvalidInputError("accept_step_document is for readers: open the trajectory with mode='r'")
        if isinstance(document, str):
            document = document.encode("ascii", "replace")  # canonical documents are ASCII: '?' fails the check
        if not isinstance(document, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"a step document is bytes or str, not {type(document).__name__}")
        if len(document) > MAX_DOCUMENT_BYTES:
            raise InvalidInputError(f"a step document is at most {MAX_DOCUMENT_BYTES} bytes, got {len(document)}")
        held, content = parent
        return _info(self._t._reader.accept_doc(step, bytes(document), held, content))

    def tensors(self, step_or_ref) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Tensor names of a step with their shape and dtype, without decoding anything."""
        return self._t._reader.specs(self._t._resolve(step_or_ref))

    def diff(self, a, b, names=None) -> list[TensorDiff]:
        """What changed from step ``a`` to step ``b``, per tensor, most changed first.

        For each tensor: the fraction of its elements whose bit patterns
        differ, the relative L2 change ``||b - a|| / ||a||`` (float64) and the
        largest absolute change.  ``a`` is read whole (its norm needs every
        value); of ``b``, only the chunks whose content hash differs from
        ``a``'s are decoded when the tensor kept its chunk layout (consecutive
        steps of a run: an RL step with few changed weights costs little).

        Parameters
        ----------
        a, b : int or str
            Steps or ref names (negative ints are not positions here).
        names : iterable of str, optional
            Only these tensors (default: every tensor of either step).

        Returns
        -------
        list of TensorDiff
            Sorted by ``fraction_changed`` (descending), then ``rel_l2``
            (descending), then name.  Tensors in only one step, or whose shape
            or dtype changed, come first with ``status`` ``"added"``,
            ``"removed"`` or ``"reshaped"`` and no numbers.  NaN and infinite
            values: positions where either step holds one are left out of the
            norms and the largest change, counted in ``nonfinite``, and still
            count as changed if their bits differ (see :class:`TensorDiff`).

        Raises
        ------
        StepNotFoundError
            No such step or ref.
        TensorNotFoundError
            A name in ``names`` is in neither step.

        Examples
        --------
        >>> import numpy as np, ulstore
        >>> traj = ulstore.open("memory://doctest-diff", mode="w")
        >>> w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        >>> traj.commit(0, {"w": w, "b": np.zeros(2, np.float32)})
        0
        >>> traj.commit(1, {"w": w + np.array([0, 0, 0, 0.5], np.float32), "b": np.zeros(2, np.float32)})
        1
        >>> d = traj.diff(0, 1)
        >>> [(t.name, t.changed, t.fraction_changed, t.max_abs_change) for t in d]
        [('w', 1, 0.25, 0.5), ('b', 0, 0.0, 0.0)]
        >>> round(d[0].rel_l2, 6)   # 0.5 / sqrt(1 + 4 + 9 + 16)
        0.091287
        """
        return diff_steps(self._t, self._t._resolve(a), self._t._resolve(b), names)

    def log(self, start=MAIN) -> list[StepInfo]:
        """The ancestry of a step or branch head, newest first, back to its root.

        Raises
        ------
        CorruptManifestError
            The parent links loop (crafted step documents): its ``key`` names the step whose parent closes the loop.
        """
        step: int | None = self._t._resolve(start)
        out: list[StepInfo] = []
        seen = set()
        while step is not None:
            if step in seen:  # crafted parents (a later step may be a parent, so two documents can loop)
                last = out[-1].step
                raise CorruptManifestError(
                    f"parent links loop: step {last}'s parent {step} is one of its descendants "
                    f"({' -> '.join(str(i.step) for i in out[-8:])} -> {step})",
                    step=last,
                    key=step_key(last),
                )
            seen.add(step)
            d = self._t._reader.doc(step)
            out.append(_info(d))
            step = d.parent
        return out


def _check_out(dest, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """Refuse an ``out`` array of ``read_boxes`` that cannot take the box's values as they are."""
    if not isinstance(dest, np.ndarray):
        raise InvalidInputError(f"out holds a {type(dest).__name__}, not a numpy array", tensor=name)
    if dest.dtype != dtype or dest.shape != shape:
        raise InvalidInputError(
            f"out array is {dest.dtype}{list(dest.shape)}, the box is {dtype}{list(shape)}", tensor=name
        )
    if not dest.flags.writeable:
        raise InvalidInputError("out array is read-only", tensor=name)


def _info(d) -> StepInfo:
    anchoring = d.anchoring.to_json() if d.anchoring is not None else None
    return StepInfo(
        d.step, d.parent, d.anchor_distance, d.created, dict(d.metadata), d.content, d.parent_content, anchoring
    )
