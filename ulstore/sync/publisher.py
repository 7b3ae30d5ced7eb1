"""The trainer side: :class:`Publisher` commits every version as a step of a trajectory.

One ``publish(version, state)`` is one commit of the trajectory store on
``branch``: each chunk that changed is a ULPack delta against the previous
version (SPARSE by default, so followers apply it in O(changes)), unchanged
chunks reuse the previous entry, and every ``anchor_every`` versions the step
also carries a snapshot (a full intra copy of every chunk) for late joiners.
The store writes one pack (blobs + tables), then the step document by
conditional create, then moves the branch: three objects per delta version.
A publish that fails or is killed at any point leaves the branch on the
previous version; retrying the same version, or publishing a later one, is safe.

``submit(version, state)`` is the trainer's non-blocking call: it copies the
state to host memory (one contiguous buffer per tensor, at memory speed, no
encoding) and returns a future; one background thread encodes and commits the
versions in the order submitted (:class:`~ulstore.sync._queue.CommitQueue`).
``publish`` is ``submit(...).result()`` without the copy.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..core.caller import held_warnings, warn_at_caller
from ..core.sealed import plain_json
from ..core.torch import is_tensor
from ..errors import ConflictError, InvalidInputError, RefMovedError, StepExistsError
from ..store import MAIN, check_ref_name, choose_chunks
from . import _open
from ._arrays import host_array, host_copy, words
from ._queue import CommitQueue
from ._workers import WorkerOwner, Workers, default_threads

__all__ = ["Publisher", "PublishInfo", "DEFAULT_ANCHOR_EVERY", "DEFAULT_CHUNK_ELEMS", "DEFAULT_PACK_BYTES"]

log = logging.getLogger("ulstore.sync")

#: A snapshot every this many versions (the TRL branch uses 10 or 20 for its anchors).
DEFAULT_ANCHOR_EVERY = 10
#: Elements per chunk at most: the unit of change detection, parallel coding and in-place writes.
DEFAULT_CHUNK_ELEMS = 1 << 20
#: A submit's copy is split over threads in parts of at least this many bytes.
COPY_PART_BYTES = 8 << 20
#: Largest pack object; snapshots of big models span several (S3 caps one PUT at 5 GB).
DEFAULT_PACK_BYTES = 256 << 20


@dataclass(frozen=True)
class PublishInfo:
    """What one :meth:`Publisher.publish` wrote.

    Attributes
    ----------
    version : int
    kind : {"delta", "reset"}
        ``reset``: no delta could be coded (first version, or ``resume=False``):
        every chunk is intra-coded and followers load it whole.
    anchor : bool
        The step carries a full copy (a snapshot, or a reset).
    changed_chunks, total_chunks : int
        Chunks with a new blob / chunks in the state.
    skipped_tensors : int
        Device tensors not copied to host because a detector proved them unchanged.
    delta_bytes, anchor_bytes : int
        Blob bytes written for the delta and for the snapshot.
    seconds : float
        Wall time of :meth:`Publisher.publish`; of a :meth:`Publisher.submit`, the
        time its commit took in the background (encode and upload).
    document : bytes
        The version's step document as stored (a few hundred bytes of ASCII
        JSON).  A control plane that sends it with the version lets followers
        skip reading it from the bucket: ``Follower.poll(to=version,
        document=document)`` then makes one request for the version, as a
        replica told the name of a TRL delta file does.
    """

    version: int
    kind: str
    anchor: bool
    changed_chunks: int
    total_chunks: int
    skipped_tensors: int
    delta_bytes: int
    anchor_bytes: int
    seconds: float
    document: bytes = field(repr=False, default=b"")


class Publisher(WorkerOwner):
    """Publish a trainer's weights to a bucket after every optimizer step.

    The bucket is a ulstore trajectory: ``ulstore.open(url)``, ``ulstore log``,
    ``export``, ``verify`` and lazy slicing all work on it.

    Parameters
    ----------
    url : str or os.PathLike
        fsspec URL of the store (``s3://bucket/run-7``, a local directory, ``memory://x``).
    anchor_every : int, default 10
        Every ``anchor_every`` versions the step also carries a snapshot (0:
        only the first version is whole).  A replica that joins late loads the
        newest snapshot and replays at most ``anchor_every - 1`` deltas.
    storage_options : dict, optional
        fsspec options (credentials, ``client_kwargs={"endpoint_url": ...}``).
    branch : str, default "main"
        The branch versions are committed on (followers follow it).
    chunk_elems : int, default 2**20
        Elements per chunk at most (chunks are bands of whole rows where they fit).
    pack_bytes : int, default 256 MiB
        Largest pack object (a setting of a new store).
    threads : int, optional
        Encoding threads (default: CPU count).
    detector : ChangeDetector, optional
        Optimizer hooks that prove tensors unchanged: device tensors it vouches
        for are not copied to host again (checked at every snapshot).  Host
        tensors are always hashed chunk by chunk (BLAKE3, GB/s per core).
    resume : bool, default True
        If the branch already holds versions, code the first new one as a delta
        against its head; False: the first new version is a reset (all intra).
    sparse : bool, default True
        Code each delta chunk by the positions of its changed elements when at
        most 1/8 change or it has at most 4096 elements (ULPack's SPARSE mode):
        followers then apply it in place, in time proportional to the changes.  False: dense deltas, about a quarter
        smaller on RL steps, that followers decode element by element.
    max_in_flight : int, default 2
        Versions :meth:`submit` lets be in flight (copied, not yet committed):
        a further submit waits for room.  Each holds a host copy of the state;
        the copies are reused from version to version (warm memory, so the
        copy runs at memory speed), so the publisher keeps up to this many.
    on_commit : callable, optional
        Called with the :class:`PublishInfo` of each version once it is
        committed (on the background thread, before its future resolves;
        keep it short, e.g. tell the inference engines).  An exception it
        raises is logged, not raised: the version is committed.

    Raises
    ------
    BucketAccessError
        The bucket is missing, unreachable, or not writable.
    InvalidInputError
        ``url`` holds something that is not a trajectory, or bad settings.

    Examples
    --------
    >>> import numpy as np, ml_dtypes
    >>> from ulstore.sync import Publisher, Follower
    >>> w = {"w": np.linspace(-1, 1, 1000).astype(ml_dtypes.bfloat16)}
    >>> pub = Publisher("memory://doc-sync", anchor_every=4)
    >>> pub.publish(0, w).kind
    'reset'
    >>> w["w"][:10] = 0.5
    >>> info = pub.publish(1, w)
    >>> info.kind, info.changed_chunks
    ('delta', 1)
    >>> replica = {"w": np.zeros(1000, ml_dtypes.bfloat16)}
    >>> f = Follower("memory://doc-sync", state=replica)
    >>> f.bootstrap()
    1
    >>> bool((replica["w"].view(np.uint16) == w["w"].view(np.uint16)).all())
    True
    """

    def __init__(
        self,
        url,
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        storage_options: dict | None = None,
        *,
        branch: str = MAIN,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        threads: int | None = None,
        detector=None,
        resume: bool = True,
        sparse: bool = True,
        max_in_flight: int = 2,
        on_commit: Callable[[PublishInfo], object] | None = None,
    ):
        self.anchor_every = _check_int("anchor_every", anchor_every, 0)
        self.chunk_elems = _check_int("chunk_elems", chunk_elems, 1)
        if self.chunk_elems >= 1 << 32:
            raise InvalidInputError("chunk_elems must be below 2**32 (a ULPack blob's limit)")
        self.pack_bytes = _check_int("pack_bytes", pack_bytes, 1)
        self.branch = check_ref_name(branch)
        self.detector = detector
        self.resume = bool(resume)
        self.sparse = bool(sparse)
        if on_commit is not None and not callable(on_commit):
            raise InvalidInputError(f"on_commit must be callable, got {on_commit!r:.100}")
        self.on_commit = on_commit
        self._queue = CommitQueue(_check_int("max_in_flight", max_in_flight, 1), "ulstore-publish-commit")
        self._submitting = threading.Lock()  # one submit or publish at a time: the order of versions is the calls'
        self._last: int | None = None  # the last version submitted (a smaller one is refused at once)
        self._spare: list[dict] = []  # host copies of committed versions, reused by the next submits
        self._closed = False
        io = _open.objects(url, storage_options)
        self.url = io.url
        #: The trajectory the versions are steps of (read it like any other).
        self.trajectory = _open.trajectory(io, "a", pack_bytes=self.pack_bytes, threads=threads)
        self._workers = Workers(min(4, default_threads(threads)), "ulstore-publish")  # (compute: submit's copies)
        self._first = True
        self._since_anchor = 0
        self._host: dict[str, np.ndarray] = {}  # last host copy of each device tensor (detector skips)
        #: Counters: ``versions``, ``anchors``, ``bytes`` written, ``detector_misses``.
        self.stats = {"versions": 0, "anchors": 0, "bytes": 0, "detector_misses": 0}

    def __repr__(self) -> str:
        return f"<Publisher {self.url!r} branch={self.branch!r} latest={self.latest}>"

    @property
    def latest(self) -> int | None:
        """The newest version readers can see (the branch head; None before the first publish)."""
        return self.trajectory.head(self.branch)

    @property
    def in_flight(self) -> int:
        """Versions submitted and not yet committed (at most ``max_in_flight``)."""
        return self._queue.in_flight

    def wait(self) -> None:
        """Block until every version submitted is committed.

        Raises
        ------
        PublishError
            A version failed in the background (and was not reported by an
            earlier call): it names the version, the later ones that were not
            committed, and chains the original error.  Reported once.
        """
        self._queue.wait()

    def close(self) -> None:
        """Wait for the versions in flight (raising as :meth:`wait` does), then stop the publisher's threads."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.wait()
        finally:
            self._queue.close()
            self._spare.clear()
            super().close()
            self.trajectory.close()

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
            return
        try:  # an error is on its way out already: a background failure too would only hide it
            self.close()
        except Exception as e:
            log.error("%s: %s", self.url, e)

    # -- publishing -------------------------------------------------------------------

    def publish(self, version, state: Mapping, *, metadata: dict | None = None, unchanged=None) -> PublishInfo:
        """Publish ``state`` as ``version`` (a new step of the trajectory on :attr:`branch`), and wait for it.

        The blocking form of :meth:`submit`, with no copy: the version is
        committed after every version submitted before it, and the call
        returns once it is.  A failure of an earlier submitted version is
        raised first (PublishError), and this version is then not published.

        Parameters
        ----------
        version : int
            Greater than every published version (gaps are fine, e.g. the optimizer step).  The latest
            version again with the same state and metadata returns its info and writes nothing: a
            retry after a lost answer is safe.
        state : Mapping of str to array
            numpy arrays or torch tensors (CPU or CUDA), 0-d included.  Not
            modified; do not modify it during the call.
        metadata : dict, optional
            JSON-serializable; followers see it as ``Follower.metadata``.
        unchanged : iterable of str, optional
            Names known bit-identical to the last published version: device
            tensors among them are not copied to host again.  Ignored at snapshots.

        Returns
        -------
        PublishInfo

        Raises
        ------
        InvalidInputError
            ``version`` is not greater than the latest, or the state is unusable.
        RefMovedError
            Another writer published on the branch meanwhile (two trainers on one
            branch): this version is not on it; the other writer's is.
        ConflictError
            Another writer is publishing this version, or an earlier publish on
            the same head is still finishing: nothing was published.
        BucketAccessError
            A write failed; the branch still names the previous version.
        OutcomeUnknownError
            A write failed and reading it back failed too: publish the same
            version and state again (idempotent).
        PublishError
            A version submitted earlier failed in the background (see :meth:`wait`).
        """
        t0 = time.perf_counter()
        version, metadata = self._check_call(version, state, metadata)
        with self._submitting:
            self._queue.reserve()
            self._last = version
            held: list = []  # the commit's warnings, given here at the caller's line once it succeeded
            future = self._queue.put(version, lambda: self._commit(version, state, metadata, unchanged, t0, held))
            try:
                info = future.result()
            except BaseException:
                self._queue.forget()  # this call reports it
                self._last = None
                raise
        for warning in held:
            warn_at_caller(warning)
        return info

    def submit(self, version, state: Mapping, *, metadata: dict | None = None, copy: bool = True) -> cf.Future:
        """Publish ``state`` as ``version`` in the background: copy it to host memory and return.

        The copy is one contiguous buffer per tensor (numpy arrays and torch
        tensors by their bits; device tensors copied to host), made at memory
        speed into buffers reused from earlier versions; nothing is encoded.
        The caller may change its tensors as soon as this returns.  One
        background thread then encodes and commits the versions in the order
        submitted, as :meth:`publish` does.

        ``copy=False`` takes ownership instead: no copy (device tensors are
        still copied to host), and the caller must leave the tensors alone
        until the future resolves, e.g. the bf16 tensors a trainer casts
        from its fp32 master weights every step, fresh each time.

        Returns
        -------
        concurrent.futures.Future of PublishInfo
            Resolved once the version is committed (on the branch, durable):
            "acknowledged".  A process killed after that loses no acknowledged
            version; one killed before leaves the branch on an earlier version
            (a later publisher on the bucket discards what it left).  Its
            exception, if the commit failed, is the one :meth:`publish` would
            raise; ``add_done_callback`` or ``on_commit`` tell a control plane.

        Raises
        ------
        PublishError
            A version submitted earlier failed in the background (see
            :meth:`wait`); this version was not submitted.  Later calls go on
            from the branch as it is (the version before the failed one).
        InvalidInputError
            ``version`` is smaller than the last one submitted, or the state or
            metadata are unusable (checked before anything is copied).

        Notes
        -----
        Blocks while ``max_in_flight`` versions are in flight.  Errors of the
        commit itself (the bucket, a version not greater than the branch head)
        fail the future and are raised again by the next call.
        """
        version, metadata = self._check_call(version, state, metadata)
        with self._submitting:
            if self._last is not None and version < self._last:
                raise InvalidInputError(
                    f"version {version} is smaller than version {self._last}, submitted before; versions must increase"
                )
            self._queue.reserve()
            try:
                hosts = self._snapshot(state) if copy else {name: host_array(name, v) for name, v in state.items()}
            except BaseException:
                self._queue.release()
                raise
            if self.detector is not None:  # the copy holds every tensor: changes from here on count for the next
                self.detector.reset()
            self._last = version
            return self._queue.put(version, lambda: self._commit_copy(version, hosts, metadata, reuse=bool(copy)))

    def _check_call(self, version, state, metadata) -> tuple[int, dict]:
        """The arguments of submit/publish checked (InvalidInputError): the version as an int, the metadata as JSON."""
        if self._closed:
            raise InvalidInputError(f"the publisher of {self.url!r} is closed")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise InvalidInputError(f"version must be an int >= 0, got {version!r}")
        if not isinstance(state, Mapping) or not state:
            raise InvalidInputError("state must be a non-empty mapping of tensor name to array")
        return int(version), _check_metadata(metadata)

    def _snapshot(self, state: Mapping) -> dict:
        """Host copies of ``state``'s tensors, into the spare buffers of a committed version where they fit."""
        spare = self._spare.pop() if self._spare else {}
        out, copies = {}, []
        for name, value in state.items():
            buf = spare.get(name)
            src = None if buf is None or _on_device(value) else host_array(name, value)
            if src is not None and buf is not None and src.shape == buf.shape and src.dtype == buf.dtype:
                copies.append((words(buf), words(src)))  # (as words: a plain memory copy, whatever the dtype)
                out[name] = buf
            else:
                out[name] = host_copy(name, value)
        self._copy(copies)
        return out

    def _copy(self, copies: list) -> None:
        """``np.copyto(dst, src)`` for each flat pair, in byte ranges of about equal size on this thread and the
        copy pool's (one core does not saturate the memory bus; numpy releases the GIL while copying)."""
        total = sum(d.nbytes for d, _ in copies)
        parts = max(1, min(self._workers.threads + 1, total // COPY_PART_BYTES))
        if parts == 1:
            for dst, src in copies:
                np.copyto(dst, src)
            return
        ranges: list[list] = [[] for _ in range(parts)]
        size, at = -(-total // parts), 0  # bytes per part; bytes assigned so far
        for dst, src in copies:
            n, step = dst.size, dst.itemsize
            start = 0
            while start < n:
                part = min(at // size, parts - 1)
                stop = n if part == parts - 1 else min(n, start + -(-((part + 1) * size - at) // step))
                ranges[part].append((dst[start:stop], src[start:stop]))
                at += (stop - start) * step
                start = stop
        helpers = [self._workers.compute.submit(_copy_all, r) for r in ranges[1:]]
        _copy_all(ranges[0])
        for f in helpers:
            f.result()

    def _commit_copy(self, version: int, hosts: dict, metadata: dict, reuse: bool) -> PublishInfo:
        """The background commit of a submitted version; its host copy (``reuse``: not the caller's own arrays)
        then serves the next submit."""
        try:
            return self._commit(version, hosts, metadata, None, time.perf_counter())
        finally:
            if reuse:
                self._spare.append(hosts)

    def _commit(
        self, version: int, state: Mapping, metadata: dict, unchanged, t0: float, held: list | None = None
    ) -> PublishInfo:
        """Commit ``version`` (on the queue's thread, after every version before it); ``on_commit`` is told.
        ``held``: a blocking publish's list for the commit's warnings (it gives them at its caller's line);
        None for a submit's host copy (no device tensor to skip; the detector was read by submit), whose
        warnings are given on this thread."""
        copied = held is None
        if copied:
            self._host.clear()  # device copies kept by a publish are older than this version: none may stand for it
        with held_warnings(held) if held is not None else contextlib.nullcontext():
            info = self._commit_now(version, state, metadata, unchanged, t0, copied)
        if self.on_commit is not None:
            try:
                self.on_commit(info)
            except Exception:
                log.exception("%s: on_commit raised for version %d (the version is committed)", self.url, version)
        return info

    def _commit_now(
        self, version: int, state: Mapping, metadata: dict, unchanged, t0: float, copied: bool
    ) -> PublishInfo:
        """What :meth:`publish` does, on the queue's thread."""
        traj = self.trajectory
        head = traj.head(self.branch)
        if head is not None and version == head:
            return self._republish(version, state, metadata, t0)
        if head is not None and version < head:
            raise InvalidInputError(
                f"version {version} is not greater than the latest published version {head}; versions must increase"
            )
        for attempt in range(2):
            try:
                return self._publish(version, head, state, metadata, unchanged, t0, copied)
            except ConflictError as e:
                # an earlier publish on this head created its step but never moved the branch (killed after its
                # commit point): discard it (the branch is fenced first, so that writer can never publish it) and
                # publish again; discard refuses while that commit may still be running
                if attempt or not isinstance(e.step, int) or e.step == version or isinstance(e, RefMovedError):
                    raise
                log.warning("%s: discarding step %d left by a publish that did not complete", self.url, e.step)
                traj.discard(e.step, branch=self.branch)
        raise AssertionError("unreachable")

    def _publish(
        self, version: int, head, state: Mapping, metadata: dict, unchanged, t0: float, copied: bool
    ) -> PublishInfo:
        traj = self.trajectory
        if self._first and head is not None:
            self._since_anchor = traj.info(head).anchor_distance
        reset = head is None or (self._first and not self.resume)
        snapshot = not reset and self.anchor_every > 0 and self._since_anchor + 1 >= self.anchor_every
        hosts, skipped = self._hosts(state, unchanged, whole=snapshot or reset, compare=snapshot)
        self._drop_orphan(version, head)
        w = traj.piece_writer(
            version,
            parent=head,
            branch=self.branch,
            anchor=True if reset else None,
            snapshot=snapshot,
            sparse=self.sparse,
        )
        try:
            for name, arr in hosts.items():
                chunks = choose_chunks(arr.shape, arr.dtype.itemsize, self.chunk_elems * arr.dtype.itemsize)
                w.write(name, arr, chunks=chunks)
        except BaseException:
            w.abort()
            raise
        traj.finalize(version, [], branch=self.branch, metadata=metadata, writer=w)
        self._first = False
        self._since_anchor = 0 if snapshot or reset else self._since_anchor + 1
        if self.detector is not None and not copied:  # (submit resets it when it copies)
            self.detector.reset()
        info = self._info(version, reset, snapshot, skipped, t0)
        self.stats["versions"] += 1
        self.stats["anchors"] += int(info.anchor)
        self.stats["bytes"] += info.delta_bytes + (info.anchor_bytes if not reset else 0)
        return info

    def _republish(self, version: int, state: Mapping, metadata: dict, t0: float) -> PublishInfo:
        """``version`` is the head already: a retry of a publish whose answer was lost.  Idempotent if the
        state and metadata are what the head holds; else InvalidInputError."""
        hosts, _ = self._to_host(state, set(), set())
        try:
            self.trajectory.commit(version, hosts, branch=self.branch, metadata=metadata)
        except StepExistsError:
            raise InvalidInputError(
                f"version {version} is not greater than the latest published version {version}, which holds "
                "other contents; versions must increase (publishing the same state again is a no-op)"
            ) from None
        feed = self.trajectory.changes(version)
        reset = self.trajectory.info(version).parent is None
        return self._info(version, reset, any(c.snapshot is not None for c in feed), 0, t0)

    def _info(self, version: int, reset: bool, snapshot: bool, skipped: int, t0: float) -> PublishInfo:
        """What the step of ``version`` holds (its tables are cached after a commit: no read)."""
        traj = self.trajectory
        feed = traj.changes(version)
        new = [c for c in feed if c.kind != "unchanged" or c.ref is None and reset]
        delta_bytes = sum(c.blob[2] for c in feed if c.kind != "unchanged")
        anchor_bytes = sum(c.snapshot[2] for c in feed if c.snapshot is not None) + (delta_bytes if reset else 0)
        document = traj.step_document(version)  # cached: no read
        return PublishInfo(
            version,
            "reset" if reset else "delta",
            snapshot or reset,
            len(new),
            len(feed),
            skipped,
            0 if reset else delta_bytes,
            anchor_bytes,
            time.perf_counter() - t0,
            document,
        )

    def _drop_orphan(self, version: int, head: int | None) -> None:
        """A step ``version`` left by a publish killed before the branch moved is discarded, so it can be retried."""
        traj = self.trajectory
        if version not in traj:  # one small GET, no LIST
            return
        info = traj.info(version)
        if info.parent != head or version in traj.refs.values():
            raise StepExistsError(
                f"step {version} exists in {self.url!r} but is not the leftover of a failed publish on "
                f"{self.branch!r}; publish a greater version",
                step=version,
            )
        log.warning("%s: discarding step %d left by a publish that did not complete", self.url, version)
        traj.discard(version, branch=self.branch)

    def _hosts(self, state: Mapping, unchanged, *, whole: bool, compare: bool) -> tuple[dict, int]:
        """Host arrays of ``state`` for a commit; device tensors known unchanged (``unchanged``, the detector) reuse
        their last host copy unless the step is ``whole`` (snapshot or reset); ``compare`` counts detector misses."""
        known = set(unchanged or ())
        if self.detector is not None:
            known |= self.detector.unchanged()
        return self._to_host(state, set() if whole else known, known if compare else set())

    def _to_host(self, state: Mapping, skip: set, compare: set) -> tuple[dict, int]:
        """Host arrays of ``state``; device tensors in ``skip`` reuse their last host copy."""
        out, skipped = {}, 0
        for name, value in state.items():
            device = _on_device(value)
            if device and name in skip and name in self._host:
                out[name] = self._host[name]
                skipped += 1
                continue
            arr = host_array(name, value)
            if device:
                old = self._host.get(name)
                if name in compare and old is not None and old.shape == arr.shape and old.dtype == arr.dtype:
                    self.stats["detector_misses"] += int(not np.array_equal(words(old), words(arr)))
                self._host[name] = arr
            out[name] = arr
        for name in [n for n in self._host if n not in state]:
            del self._host[name]
        return out, skipped

    # -- retention --------------------------------------------------------------------

    def prune(self, keep_anchors: int = 2) -> dict:
        """Delete the versions of :attr:`branch` older than its ``keep_anchors``-th newest snapshot, then gc.

        Kept: that snapshot and every version after it (a follower bootstraps
        from any kept snapshot).  A follower that was replaying a deleted
        version finds it missing and re-bootstraps (reported as ``missing``).
        Call it from the publishing process; it first waits for the versions in flight (:meth:`wait`).

        Returns
        -------
        dict
            ``{"objects": steps deleted + packs removed, "cutoff": oldest version kept}``.
        """
        if isinstance(keep_anchors, bool) or not isinstance(keep_anchors, int) or keep_anchors < 1:
            raise InvalidInputError(f"keep_anchors must be an int >= 1, got {keep_anchors!r}")
        self._queue.wait()
        traj = self.trajectory
        head = traj.head(self.branch)
        if head is None:
            return {"objects": 0, "cutoff": None}
        ancestry = traj.log(self.branch)  # newest first
        snaps = [i.step for i in ancestry if i.anchor_distance == 0]
        if len(snaps) <= keep_anchors:
            return {"objects": 0, "cutoff": snaps[-1] if snaps else None}
        cutoff = snaps[keep_anchors - 1]
        old = sorted((i.step for i in ancestry if i.step < cutoff), reverse=True)
        # newest first: the first delete makes the cutoff's snapshots its entries (it then depends on no older
        # step), and each later one only re-parents it, one step document each; oldest first re-encoded, per
        # step deleted, every changed chunk of its child, which the next delete threw away
        for s in old:
            traj.delete(s)
        removed = traj.gc()
        return {"objects": len(old) + int(removed.get("packs", 0)), "cutoff": cutoff}


def _copy_all(pairs: list) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def _on_device(value) -> bool:
    return is_tensor(value) and value.device.type != "cpu"


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInputError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_metadata(metadata) -> dict:
    """``metadata`` as the plain JSON followers read back (NumPy scalars as numbers), or a named error."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidInputError("metadata must be a dict")
    return plain_json(metadata)
