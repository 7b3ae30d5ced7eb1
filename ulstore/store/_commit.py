"""Committing a step: plan each tensor's chunks, encode the changed ones, write blobs, then the manifest.

Where a chunk is *encoded*: :meth:`CommitMixin._encode` -> ``_chunkcodec.encode_chunk``
-> :func:`ulstore.codec.encode`.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import json
import math
from collections.abc import Mapping

import numpy as np

from ..core.sealed import canonical_json
from ..core.torch import as_numpy
from ..errors import ConflictError, DtypeError, InvalidInputError, NotFoundError, StepExistsError
from ._base import MAIN, TrajectoryBase
from ._chunkcodec import ULPACK, codec_for, content_digest, encode_chunk
from ._layout import blob_key, check_ref_name, check_step, check_tensor_names, choose_chunks, step_key
from ._manifest import Entry, Manifest, TensorManifest
from ._pool import run_bounded
from ._refs import RefState

__all__ = ["CommitMixin", "HEAD"]


class _Head:
    def __repr__(self) -> str:
        return "HEAD"


#: ``parent=HEAD`` (the default of :meth:`Trajectory.commit`): the head of the branch.
HEAD = _Head()


def _as_array(name: str, value) -> np.ndarray:
    """Accept numpy arrays/scalars, torch tensors and other ``__array__`` objects; never lists."""
    try:
        arr = as_numpy(value, array_like=True)
    except InvalidInputError as e:  # a torch tensor with no plain data (meta, sparse)
        raise type(e)(e.message, tensor=name) from None
    if arr is None:
        raise InvalidInputError(
            f"tensor values must be arrays (numpy, torch, ...), got {type(value).__name__}; "
            "wrap Python numbers and lists with np.asarray and an explicit dtype",
            tensor=name,
        )
    try:
        codec_for(arr.dtype)
    except DtypeError as e:
        raise DtypeError(e.message, tensor=name) from None
    return arr


def _check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    metadata = dict(metadata)
    if "ulstore" in metadata:
        raise InvalidInputError("the metadata key 'ulstore' is reserved")
    try:
        return json.loads(canonical_json(metadata))
    except RecursionError:
        raise InvalidInputError("metadata is nested too deeply to store as JSON") from None
    except (TypeError, ValueError) as e:
        raise InvalidInputError(
            f"metadata must be JSON-serializable (finite numbers, str, lists, dicts): {e}"
        ) from None


class CommitMixin(TrajectoryBase):
    """The commit half of :class:`~ulstore.store.Trajectory`."""

    # -- writing ------------------------------------------------------------------

    def commit(
        self,
        step,
        state: Mapping,
        *,
        parent=HEAD,
        branch: str | None = None,
        metadata=None,
        anchor: bool | None = None,
        executor: cf.Executor | None = None,
    ) -> int:
        """Store ``state`` as a new, immutable ``step``.

        Parameters
        ----------
        step : int
            The new step's number; must not exist.
        state : Mapping of str to array
            Tensor name -> numpy array / torch tensor.  Names may contain ``/``
            (nested groups), dots and any unicode.  Do not modify the arrays
            during the call.
        parent : int, str or None, default HEAD
            The step this one derives from: by default the head of ``branch``;
            any existing step (or ref name) to branch off it; None for a new root.
        branch : str, optional
            Ref to advance to ``step`` (default ``"main"``).  A branch is only
            moved if it points at ``parent`` or does not exist yet; with the
            default branch and another ``parent``, the step is committed
            without moving any ref.
        metadata : dict, optional
            JSON-serializable; becomes the step group's attributes.
        anchor : bool, optional
            None: follow ``anchor_every``.  True: make this step a full anchor
            (every chunk intra-coded).  False: forbid intra coding: every float
            tensor must be delta-coded against the parent, so a new tensor or a
            shape or dtype change raises InvalidInputError instead of silently
            starting a new chain.
        executor : concurrent.futures.Executor, optional
            Overrides the trajectory's executor for this commit.

        Returns
        -------
        int
            ``step``.

        Raises
        ------
        StepExistsError
            ``step`` exists, or another writer created it during this commit.
            (Retrying a commit that was interrupted after its commit point,
            with the same state, completes it instead: the branch moves.)
        StepNotFoundError
            ``parent`` does not exist, or was deleted during the commit.
        NotFoundError
            ``parent`` is HEAD, the branch does not exist and the trajectory has
            steps: pass ``parent=None`` for a new root, or a step.
        InvalidInputError, DtypeError
            A value is not an array, a name or metadata is invalid, or ``anchor=False``
            and a tensor cannot be delta-coded.
        RefMovedError
            The branch moved while committing (another writer won): re-read the
            head and retry; the message says whether the step was created.
        ConflictError
            ``branch`` was given and points at a step other than ``parent``; a
            step this commit refers to is being deleted; or an earlier commit on
            the same head created its step but never moved the branch.
        ReadOnlyError
            The trajectory was opened with mode="r".
        """
        self._check_writable()
        step = check_step(step)
        if not isinstance(state, Mapping):
            raise InvalidInputError(f"state must be a mapping of tensor name to array, got {type(state).__name__}")
        check_tensor_names(state.keys())
        arrays = {name: _as_array(name, v) for name, v in state.items()}
        metadata = _check_metadata(metadata)
        branch_given = branch is not None
        branch = check_ref_name(branch if branch_given else MAIN)
        ref = self._refs.read(branch)
        head = ref.step
        if self._io.exists(step_key(step)):
            return self._commit_again(step, arrays, metadata, parent, ref)
        if parent is HEAD:
            if head is None and self.steps:
                raise NotFoundError(
                    f"branch {branch!r} does not exist, so it has no head to commit on; pass parent=<step> "
                    "(CLI: --parent) to start it from a step, or parent=None (CLI: --root) for a new root",
                    step=step,
                    key=ref.key,
                )
            parent = head
        elif parent is not None:
            parent = self._resolve(parent)
        pm = self._reader.manifest(parent) if parent is not None else None
        if branch_given and head is not None and head != parent:
            raise ConflictError(
                f"branch {branch!r} is at step {head}, not at parent {parent}; "
                "pass parent=None/HEAD or another branch name",
                step=step,
                key=ref.key,
            )
        move_branch = head is None or head == parent

        if anchor is False and pm is None:
            raise InvalidInputError("anchor=False needs a parent to delta-code against", step=step)
        if anchor is True or pm is None:
            is_anchor = True
        elif anchor is False:
            is_anchor = False
        else:
            is_anchor = self.anchor_every > 0 and pm.anchor_distance + 1 >= self.anchor_every
        plan = self._plan(step, arrays, pm, anchor is False)
        tensors = self._encode(plan, pm, is_anchor, executor or self._executor)
        manifest = Manifest(
            step=step,
            parent=parent,
            anchor_distance=0 if is_anchor or pm is None else pm.anchor_distance + 1,
            tensors=tensors,
            metadata=metadata,
            created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        )

        def create():  # the commit point: conditional create, so of two writers exactly one wins
            try:
                self._io.create(step_key(step), manifest.to_bytes())
            except FileExistsError:
                raise StepExistsError(
                    "another writer committed this step first", step=step, key=step_key(step)
                ) from None

        refers = {e.ref for t in tensors.values() for e in t.entries if e.ref is not None}
        branch_state = ref if move_branch else None
        self._pending.publish(
            step, parent, refers, create, refs=self._refs, branch=branch_state, steps=lambda: self.steps
        )
        return step

    def _commit_again(self, step: int, arrays: dict, metadata: dict, parent, ref: RefState) -> int:
        """``step`` exists: finish a commit of the same state interrupted after its commit point, or refuse.

        If ``step``'s parent is the branch head and it holds exactly ``arrays``
        and ``metadata`` (every chunk's content hash), the earlier commit of this
        state stopped before moving the branch: move it now (D12).
        """
        key = step_key(step)
        m = self._reader.manifest(step)
        wanted = ref.step if parent is HEAD else (None if parent is None else self._resolve(parent))
        if ref.step == step or m.parent != wanted or m.parent != ref.step:
            raise StepExistsError("step already exists; steps are immutable", step=step, key=key)
        if not self._same_state(m, arrays, metadata):
            raise StepExistsError(
                f"step already exists with different contents (parent {m.parent}, not on branch "
                f"{ref.name!r}); steps are immutable: delete({step}) first, or use a new step number",
                step=step,
                key=key,
            )
        self._refs.move(ref, step)
        if m.parent is not None:
            self._pending.clear(step, m.parent)
        return step

    def _same_state(self, m: Manifest, arrays: dict, metadata: dict) -> bool:
        """Whether ``arrays`` and ``metadata`` are exactly what manifest ``m`` stores (hashing, no decode)."""
        if m.metadata != metadata or set(m.tensors) != set(arrays):
            return False
        for name, t in m.tensors.items():
            arr = arrays[name]
            if arr.shape != t.shape or arr.dtype != t.dtype:
                return False
            for coord, e in zip(t.coords(), t.entries):
                region = np.ascontiguousarray(arr[t.region(coord)]).reshape(t.region_shape(coord))
                if content_digest(region) != e.content:
                    return False
        return True

    def _plan(self, step, arrays, pm: Manifest | None, strict: bool) -> dict:
        """Per tensor: (array, codec, chunks, parent tensor or None if it cannot be a reference)."""
        plan = {}
        for name, arr in arrays.items():
            codec = codec_for(arr.dtype)
            pt = pm.tensors.get(name) if pm is not None else None
            same = pt is not None and pt.shape == arr.shape and pt.dtype == arr.dtype
            if strict and not same and codec == ULPACK:
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
            chunks = (
                pt.chunks if same and pt is not None else choose_chunks(arr.shape, arr.dtype.itemsize, self.chunk_bytes)
            )
            plan[name] = (arr, codec, chunks, pt if same else None)
        return plan

    def _encode(self, plan: dict, pm: Manifest | None, is_anchor: bool, executor) -> dict[str, TensorManifest]:
        """Encode and write every changed chunk; returns the new tensor manifests."""
        entries: dict[str, list] = {}
        jobs = []
        for name, (arr, codec, chunks, _pt) in plan.items():
            tm = TensorManifest(arr.shape, arr.dtype, chunks, codec, ())
            entries[name] = [None] * math.prod(tm.grid)
            jobs += [(name, i, coord) for i, coord in enumerate(tm.coords())]
        parent = pm.step if pm is not None else None
        reader, io = self._reader, self._io

        def run(job):
            name, i, coord = job
            arr, codec, chunks, pt = plan[name]
            tm = TensorManifest(arr.shape, arr.dtype, chunks, codec, ())
            # ascontiguousarray makes 0-d arrays 1-d: restore the chunk's own shape
            region = np.ascontiguousarray(arr[tm.region(coord)]).reshape(tm.region_shape(coord))
            content = content_digest(region)
            pe = pt.entry(coord) if pt is not None else None
            # unchanged: reuse the parent's entry, no new blob (an anchor only reuses intra entries)
            if pe is not None and pe.content == content and (not is_anchor or pe.ref is None):
                return name, i, pe
            ref_step = parent if pe is not None and codec == ULPACK and not is_anchor else None
            ref = reader.chunk(parent, name, coord) if ref_step is not None else None
            if executor is None:
                blob, digest = encode_chunk(region, ref, codec)
            else:
                blob, digest = executor.submit(encode_chunk, region, ref, codec).result()
            io.put(blob_key(digest), blob)
            # keep a copy: the next commit codes against it without a decode
            reader.remember((content, arr.dtype.str, region.shape), np.array(region, copy=True))
            return name, i, Entry(digest, ref_step, content)

        run_bounded(run, jobs, self._threads, entries)
        return {
            name: TensorManifest(arr.shape, arr.dtype, chunks, codec, tuple(entries[name]))
            for name, (arr, codec, chunks, _) in plan.items()
        }
