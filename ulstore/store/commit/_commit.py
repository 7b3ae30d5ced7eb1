"""Committing a step: piece writers encode, the finalizer writes tables, the step document, the ref.

One code path: :meth:`Committer.commit` = one :class:`PieceWriter` over the
whole state + :meth:`Committer.finalize`.  Distributed writers (a DCP rank
each) run :meth:`Committer.piece_writer` and hand their picklable records
to one process that calls :meth:`Committer.finalize`.

This module is the public surface and the order of the steps; the parts are
their own modules: ``_commit_input.py`` (checking what the caller gives),
``_commit_plan.py`` (parent, branch, anchoring, the retry of an interrupted
commit), ``_writer.py`` (the piece writer) and ``_finalize.py`` (tables, step
document, ref).

Where a chunk is *encoded*: ``_writer.PieceWriter._job`` ->
``_chunkcodec.encode_chunk`` -> :func:`ulstore.codec.encode`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import threading
import weakref
from collections.abc import Iterator, Mapping

from ...core.caller import warn_at_caller
from ...core.formatting import retyped_message
from ...errors import FewSharedNamesWarning, InvalidInputError
from .._base import MAIN, TrajectoryBase
from ..format._chunk_tables import content_checksum
from ..format._chunkcodec import digest
from ..format._layout import check_ref_name, check_step, check_tensor_names, step_key
from ..format._packs import PackStream
from ..format._refs import RefState
from ..read._kept import release_free_memory
from ._commit_input import HEAD, as_array, check_files, check_metadata
from ._commit_plan import CommitPlanner
from ._finalize import Finalizer
from ._piece_writer import PieceWriter

__all__ = ["Committer"]


class Committer:
    """What a trajectory commits: whole steps, piece writers, the finalize of their records."""

    def __init__(self, trajectory: TrajectoryBase):
        # a proxy, not a reference: the trajectory owns this object, and a trajectory dropped
        # must free its caches and kept step at once (no cycle left for the garbage collector)
        self._t = weakref.proxy(trajectory)
        self._plan = CommitPlanner(trajectory)
        self._finalizer = Finalizer(trajectory)

    # -- the high-level commit -------------------------------------------------------

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
        files: Mapping[str, bytes] | None = None,
        snapshot: bool = False,
        sparse: bool | None = None,
    ) -> int:
        """Store ``state`` as a new, immutable ``step``.

        Parameters
        ----------
        step : int
            The new step's number; must not exist.
        state : Mapping of str to array
            Tensor name -> numpy array / torch tensor (memory-mapped arrays are
            read one chunk window at a time).  Names may contain ``/`` (nested
            groups), dots and any unicode, not ``\\``.  Do not modify the
            arrays during the call.
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
            None: follow the trajectory's policy (the cost policy, or ``anchor_every``).  True: make this step a full anchor
            (every chunk intra-coded).  False: forbid intra coding: every float
            tensor must be delta-coded against the parent, so a new tensor or a
            shape or dtype change raises InvalidInputError instead of silently
            starting a new chain.
        executor : concurrent.futures.Executor, optional
            Overrides the trajectory's executor for this commit.
        files : Mapping of str to bytes, optional
            Small non-tensor files kept with the step (``config.json``,
            tokenizer files): content-hashed, Zstd-compressed, deduplicated.
            Read them back with :meth:`files` and :meth:`read_file`.
        snapshot : bool
            Also store an intra-coded copy (snapshot) of every delta-coded
            chunk: readers start from it instead of walking the chain.
        sparse : bool, optional
            Code delta chunks in which at most 1/8 of the elements changed, and
            those of at most 4096 elements, by position (ULPack SPARSE): a few
            more bytes than dense deltas, but a holder of the parent applies
            them with :func:`ulstore.decode_changes` in time proportional to the
            changes (see :meth:`changes`), and a read applies them in place.
            Default: True under the cost policy (``anchor_cost``: cheap reads are
            what lets a sparse run go long between anchors), False under
            ``anchor_every``.

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
            A value is not an array, a name, file or metadata is invalid, or
            ``anchor=False`` and a tensor cannot be delta-coded.
        RefMovedError
            The branch moved while committing (another writer won): re-read the
            head and retry; the message says whether the step was created.
        ConflictError
            ``branch`` was given and points at a step other than ``parent``; a
            step this commit refers to is being deleted; or an earlier commit on
            the same head created its step but never moved the branch.
        ReadOnlyError
            The trajectory was opened with mode="r".

        Warns
        -----
        FewSharedNamesWarning
            Float tensors whose dtype or shape differs from the parent's tensor
            of the same name: those are stored whole, not as deltas against it
            (a delta needs its parent's dtype and shape); the warning names
            them (``changed``).  Given once the step is committed, at the
            caller's line.
        """
        self._t._check_writable()
        step = check_step(step)
        if not isinstance(state, Mapping):
            raise InvalidInputError(f"state must be a mapping of tensor name to array, got {type(state).__name__}")
        check_tensor_names(state.keys())
        arrays = {name: as_array(name, v) for name, v in state.items()}
        metadata = check_metadata(metadata)
        files_ = check_files(files)
        ref = self._t._refs.read(check_ref_name(branch if branch is not None else MAIN))
        sparse = self._sparse(sparse)
        if self._t._io.exists(step_key(step)):
            doc = self._plan._existing(step, parent, ref)
            return self._plan._complete(step, doc, ref, self._plan._state_content(doc, step, arrays, files_, metadata))
        parent, move = self._plan._prepare(step, parent, ref, branch is not None)
        is_anchor, why = self._plan._is_anchor(parent, anchor, draw=False)
        probe = self._plan._probe_limit(parent, anchor, is_anchor, draw=False)
        if is_anchor:  # on an estimate carried from a run of anchors by cost: did this step's changes go sparse?
            probe = self._plan._retry_limit(parent, why, arrays, sparse)
            if probe is not None:
                is_anchor, why = False, None
        if anchor is False:
            self._plan._check_strict(step, parent, arrays)
        return self._commit(
            step,
            arrays,
            parent=parent,
            is_anchor=is_anchor,
            why=why,
            probe=probe,
            strict=anchor is False,
            branch=ref if move else None,
            metadata=metadata,
            files=files_,
            snapshot=snapshot,
            executor=executor or self._t._executor,
            sparse=sparse,
            warn=True,
        )

    def _commit(
        self,
        step: int,
        arrays: dict,
        *,
        parent: int | None,
        is_anchor: bool,
        why: dict | None = None,
        strict: bool = False,
        branch: RefState | None,
        metadata: dict,
        files: dict,
        snapshot: bool = False,
        executor=None,
        chunks: dict | None = None,
        created: str | None = None,
        sparse: bool = False,
        probe: tuple[int, float, int] | None = None,
        warn: bool = False,
    ) -> int:
        """One piece writer over ``arrays``, then the finalizer (holding the kept step meanwhile).

        The kept step is used only if no other writer or reader of this object
        holds it now (never wait: an unclosed piece writer must not hang a commit).
        ``probe`` (``_probe_limit``: a delta tried with no delta cost known): if the delta written reads more
        than its limit, it is written as an anchor by cost instead (the delta is encoded to be priced, not stored).
        ``warn``: a float tensor whose dtype or shape moved since the parent is stored whole, not as a delta
        against it: say so once the step is committed (:func:`_warn_retyped`; the re-encodes of a delete do not).
        """
        with _gc_paused():
            return self._commit_paused(
                step, arrays, parent, is_anchor, why, strict, branch, metadata, files, snapshot, executor, chunks,
                created, sparse, probe, warn,
            )  # fmt: skip

    def _commit_paused(
        self, step, arrays, parent, is_anchor, why, strict, branch, metadata, files, snapshot, executor, chunks,
        created, sparse, probe, warn,
    ) -> int:  # fmt: skip
        """:meth:`_commit`, with the cyclic garbage collector paused (see :func:`_gc_paused`)."""
        if probe is not None:
            over = self._over_limit(step, arrays, parent, probe, strict, snapshot, executor, chunks, sparse)
            if over is not None:
                is_anchor, why = True, over
        lock = self._t._kept.lock
        owned = self._t._kept.enabled and lock.acquire(blocking=False)
        kept = self._t._kept if owned else None
        held = kept.nbytes if kept is not None else 0
        try:
            w = self._new_writer(step, parent, is_anchor, strict, snapshot, kept, executor, sparse, why)
            try:
                for name, arr in arrays.items():
                    w.write(name, arr, chunks=(chunks or {}).get(name))
                records = w.flush()
                self._finalizer._finalize(
                    step,
                    records,
                    parent,
                    w.stream,
                    branch=branch,
                    metadata=metadata,
                    files=files,
                    anchor=is_anchor,
                    created=created,
                )
            except BaseException:
                w.abort()
                raise
            finally:
                w._shutdown()
            if kept is not None:
                kept.retain(_layouts(records, arrays))
                kept.step, kept.origin = step, "commit"
                if kept.nbytes > held:  # new kept arrays: return the freed space around them
                    release_free_memory()
        finally:
            if owned:
                lock.release()
        if warn:  # once the step exists: a commit that failed was not stored at all
            _warn_retyped(step, parent, records)
        return step

    def _over_limit(self, step, arrays, parent, probe, strict, snapshot, executor, chunks, sparse) -> dict | None:
        """Encode ``arrays`` as a delta on ``parent`` (no kept step, nothing stored) and price it: the anchor
        reason ``{"policy": "cost", ...}`` if its read would cost more than the limit of ``probe``, else None
        (the step is then written for real, as a delta or an anchor)."""
        cost, k, limit = probe
        w = self._new_writer(step, parent, False, strict, snapshot, None, executor, sparse, None, _Sizes())
        try:
            for name, arr in arrays.items():
                w.write(name, arr, chunks=(chunks or {}).get(name))
            own = sum(int(r.cost) for r in w.flush())
        finally:
            w.abort()
        predicted = cost + own
        return {"policy": "cost", "k": k, "predicted": predicted, "limit": limit} if predicted > limit else None

    def _sparse(self, sparse: bool | None) -> bool:
        """``sparse`` as given, else the policy's: SPARSE deltas under the cost policy (their reads are cheap)."""
        return bool(sparse) if sparse is not None else self._t.anchor_cost is not None

    def _new_writer(
        self, step, parent, is_anchor, strict, snapshot, kept, executor, sparse=False, why=None, stream=None
    ) -> PieceWriter:
        return PieceWriter(
            step=step,
            parent=parent,
            parent_content=self._t._reader.doc(parent).content if parent is not None else None,
            anchor=is_anchor,
            strict=strict,
            snapshot=snapshot,
            reader=self._t._reader,
            stream=stream if stream is not None else PackStream(self._t._io, self._t.pack_bytes),
            kept=kept,
            chunk_bytes=self._t.chunk_bytes,
            threads=self._t._threads if executor is not None else self._t._encode_threads,
            executor=executor,
            sparse=sparse,
            why=why,
        )

    # -- the low-level API ------------------------------------------------------------

    def piece_writer(
        self,
        step,
        *,
        parent=HEAD,
        branch: str | None = None,
        anchor: bool | None = None,
        snapshot: bool = False,
        executor: cf.Executor | None = None,
        sparse: bool | None = None,
    ) -> PieceWriter:
        """A writer for pieces of tensors of ``step`` (one per process or rank); see ``docs/concepts.md``.

        ``parent``, ``branch``, ``anchor``, ``snapshot`` and ``sparse`` mean what they mean
        for :meth:`commit`; every writer of one step must be given the same.
        Use ``writer.write(name, array, offset=..., shape=...)`` per piece, then
        ``records = writer.close()``, and give every writer's records to one
        :meth:`finalize`.  This writer codes against the kept parent if no
        other writer of this trajectory object holds it.  If ``step`` exists
        because its finalize was interrupted after the commit point (its parent
        is still the branch head), a writer is made anyway: :meth:`finalize`
        of the same content then completes that commit.
        """
        self._t._check_writable()
        step = check_step(step)
        ref = self._t._refs.read(check_ref_name(branch if branch is not None else MAIN))
        if self._t._io.exists(step_key(step)):
            parent = self._plan._existing(step, parent, ref).parent  # finalize completes it if the content is the same
        else:
            parent, _ = self._plan._prepare(step, parent, ref, branch is not None)
        is_anchor, why = self._plan._is_anchor(parent, anchor)
        sparse = self._sparse(sparse)
        kept = self._t._kept if self._t._kept.enabled and self._t._kept.lock.acquire(blocking=False) else None
        w = self._new_writer(
            step, parent, is_anchor, anchor is False, snapshot, kept, executor or self._t._executor, sparse, why
        )
        w.ref = ref
        if kept is not None:
            shutdown = w._shutdown

            def release() -> None:
                shutdown()
                if kept.lock.locked():
                    kept.lock.release()

            w._shutdown = release  # type: ignore[method-assign]
        return w

    def finalize(
        self,
        step,
        records,
        *,
        branch: str | None = None,
        metadata=None,
        files: Mapping[str, bytes] | None = None,
        writer: PieceWriter | None = None,
    ) -> int:
        """Make ``step`` visible: write its tables (and files), then its step document, then move the ref.

        Parameters
        ----------
        step : int
        records : iterable of PieceRecord
            From every piece writer of ``step`` (together they must tile each tensor exactly).
        branch, metadata, files
            As for :meth:`commit`.
        writer : PieceWriter, optional
            A still-open writer of this process: its records are added and the
            tables go into its pack (one pack for the whole commit).

        The branch moves by compare-and-swap from where it was when ``writer``
        was made (without ``writer``: when finalize starts).  If ``step``
        exists because an earlier finalize of the same records was interrupted
        after its commit point, this one completes it (moves the branch).

        Raises
        ------
        InvalidInputError
            Records disagree (step, parent, anchor, dtype, shape) or pieces do not tile a tensor.
        StepExistsError, ConflictError, RefMovedError
            As for :meth:`commit`.

        Warns
        -----
        FewSharedNamesWarning
            As for :meth:`commit` (the DCP writer and the publisher finalize: their saves and publishes warn).
        """
        self._t._check_writable()
        step = check_step(step)
        records = list(records)
        stream = None
        if writer is not None:
            records += writer.flush()
            stream = writer.stream
        if not records and writer is None:
            raise InvalidInputError("finalize needs the records of at least one piece writer (or the writer)")
        first = records[0] if records else writer
        parent, anchor = first.parent, first.anchor  # type: ignore[union-attr]
        name = check_ref_name(branch if branch is not None else MAIN)
        ref = writer.ref if writer is not None else None
        if ref is None or ref.name != name:
            ref = self._t._refs.read(name)
        metadata = check_metadata(metadata)
        files_ = check_files(files)
        try:
            if self._t._io.exists(step_key(step)):
                doc = self._plan._existing(step, parent, ref)
                pdoc = self._t._reader.doc(parent) if parent is not None else None
                tables, _ = self._finalizer._tables(step, records, parent, pdoc, anchor)
                content = content_checksum(tables, {n: digest(d).hex() for n, d in files_.items()}, metadata)
                if writer is not None:
                    writer.abort()  # its blobs are already in the step
                return self._plan._complete(step, doc, ref, content)
            _, move = self._plan._prepare(step, parent, ref, branch is not None)
            self._finalizer._finalize(
                step,
                records,
                parent,
                stream or PackStream(self._t._io, self._t.pack_bytes),
                branch=ref if move else None,
                metadata=metadata,
                files=files_,
                anchor=anchor,
            )
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            if writer is not None:
                writer._shutdown()
        _warn_retyped(step, parent, records)
        return step


def _warn_retyped(step: int, parent, records) -> None:
    """Warn (:class:`FewSharedNamesWarning`, at the user's line) of the float tensors of a committed ``step``
    that its ``records`` say the parent holds with another dtype or shape: stored whole, not as deltas against
    it.  The one warning of a commit, a finalize (DCP saves, publishes) and an import alike."""
    changed = {r.name: r.retyped for r in records if r.retyped is not None}
    if changed:
        text = retyped_message(step, parent, changed)
        warn_at_caller(FewSharedNamesWarning(text, parent=parent, changed=changed))


_GC_LOCK = threading.Lock()
_gc_pausers = 0  # commits running with the collector paused (of any trajectory, on any thread)
_gc_resume = False  # whether the collector was on when the first of them paused it


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the duration (nested and concurrent uses share one pause).

    A commit of a many-tensor step creates a few long-lived objects per tensor (piece states, records, tables):
    ~100,000 on a MoE step, which made the collector run full collections over the whole heap four times
    per commit (~0.15 s each with a few steps' tables cached: a tenth of a MoE commit's bookkeeping).  The commit
    makes no reference cycles of note; what the young generation holds at the end is collected as usual
    afterwards (once, not per 700 allocations).  The collector is resumed only if it was on.

    Commits that keep overlapping (several writer threads) would keep it off indefinitely, and with it the
    collection of other threads' cyclic garbage: so a pause that ends while others still hold it collects
    the young generations once (what survived them waits for the last pause's end, or the next collection).
    """
    global _gc_pausers, _gc_resume
    with _GC_LOCK:
        if _gc_pausers == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_pausers -= 1
            overlapped = _gc_pausers > 0 and _gc_resume
            if _gc_pausers == 0 and _gc_resume:
                gc.enable()
        if overlapped:
            gc.collect(1)


def _layouts(records, names) -> dict[str, set]:
    """Name -> the piece layouts ``records`` hold, for each of ``names``: one pass over the records
    (a scan of them per name was quadratic: minutes for a MoE step of ~10,000 tensors)."""
    out: dict[str, set] = {n: set() for n in names}
    for r in records:
        if r.name in out:
            out[r.name].add(r.layout)
    return out


class _Sizes:
    """A pack stream that keeps nothing: what a delta priced before it is written (``_over_limit``) appends to."""

    def __init__(self) -> None:
        self.offset = 0

    def append(self, data) -> tuple[str, int, int]:
        n = memoryview(data).nbytes
        self.offset += n
        return "0" * 32, self.offset - n, n

    def close(self) -> list[str]:
        return []

    def abort(self) -> None:
        pass
