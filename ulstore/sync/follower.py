"""The replica side: :class:`Follower` keeps a state dict equal to the head of a branch of a trajectory.

Policy, in one place (the mechanics live in :mod:`._replica`):

- **bootstrap**: walk back from the branch head to the newest step with a
  full copy (a snapshot, anchor distance 0), load it, then apply the steps
  after it.  If that snapshot is unusable, walk further back to an older one.
- **poll**: read the branch head; walk its parents back to the step held,
  proving the chain (each step's ``parent_content`` is the content checksum
  of the step before it, ending at the checksum of the step held), and apply
  each step's change feed in order; each is verified completely before any
  byte of the state is written.  Far behind (more than ``max_replay``
  versions): bootstrap instead.
- **a corrupt or missing object** (step document, table block, pack, chunk;
  or a delta that does not fit the state held): report it (log +
  :attr:`Follower.events` + the counters in :attr:`Follower.stats`), then
  re-bootstrap from a snapshot.  If no snapshot newer than the bad version
  exists yet, the follower stays on the last good version it reached
  (reported as ``stalled``) and moves on as soon as the publisher writes a
  newer one.  Wrong weights are never applied.
- **the bucket is unreachable**: :class:`~ulstore.sync.BucketAccessError`
  propagates; the state is untouched (still a complete version) and the next
  poll retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future

from ..errors import IntegrityError, InvalidInputError, NotFoundError
from ..store import MAIN, check_ref_name
from . import _open
from ._catchup import CatchUp
from ._errors import BucketAccessError
from ._events import FollowerStats, SyncEvent
from ._replica import Replica
from ._workers import WorkerOwner, Workers

__all__ = ["Follower", "SyncEvent", "FollowerStats"]

log = logging.getLogger("ulstore.sync")


class Follower(CatchUp, WorkerOwner):
    """Keep a state dict equal to the newest version published on a branch, in place.

    Parameters
    ----------
    url : str or os.PathLike
        fsspec URL the publisher writes to (a trajectory).
    state : dict, optional
        The tensors to keep current (numpy arrays, or torch tensors on CPU or a
        device), written in place, element by changed element.  Names, shapes
        and dtypes must match the published ones.  None: the follower
        allocates numpy arrays, available as :attr:`state`.
    tensors : iterable of str, optional
        Follow these tensors only (a replica that serves part of a model, such
        as a pipeline stage): only their chunks are downloaded, applied and
        checked, and ``state`` holds exactly them.  Every one must be in the
        snapshot the first bootstrap loads (InvalidInputError); a later version
        without one drops it from an owned ``state``, as a follower of all
        tensors drops a tensor the publisher removed (a caller's ``state``
        then no longer matches: InvalidInputError, as for any follower), and a
        version with none of them is InvalidInputError.  None (default): every
        published tensor.
    storage_options : dict, optional
        fsspec options.
    branch : str, default "main"
        The branch to follow.
    threads : int, optional
        Threads that decode (default: CPU count, at least 2).
    poll_interval : float, default 1.0
        Seconds between polls in :meth:`follow`.
    max_replay : int, default 64
        Further behind than this many versions, bootstrap instead of replaying.
    on_event : callable, optional
        Called with every :class:`SyncEvent`.
    trust_state : bool, default False
        Applying a version costs time in proportion to its changed elements in
        both modes: each delta's reference is checked through the checksum the
        follower keeps for each chunk it wrote, and the changed elements
        through ULPack's target checksum.  False (default): with each version,
        also re-sum ``1/check_every`` of the state held (rotating; in the
        background once the version is written, see :meth:`wait_scan`)
        against the word sums the follower keeps for its chunks (computed
        from values verified against the store), so a foreign write to the
        state, or any wrong value, is found within ``check_every`` versions
        and repaired by a re-bootstrap.  True: no such scan (:meth:`verify`
        checks everything on demand).
    check_every : int, default 16
        Versions per full rotation of the default mode's scan.

    Attributes
    ----------
    version : int or None
        The version :attr:`state` holds (None before :meth:`bootstrap`).
    metadata : dict
        The publisher's metadata of that version.
    events : list of SyncEvent
        Everything notable, oldest first (the last 1000).
    stats : FollowerStats

    Raises
    ------
    BucketAccessError
        The bucket is missing or unreachable (checked here, not at first use).
    InvalidInputError
        ``url`` holds something that is not a trajectory.
    """

    def __init__(
        self,
        url,
        *,
        state: Mapping | None = None,
        tensors=None,
        storage_options: dict | None = None,
        branch: str = MAIN,
        threads: int | None = None,
        poll_interval: float = 1.0,
        max_replay: int = 64,
        on_event: Callable[[SyncEvent], None] | None = None,
        trust_state: bool = False,
        check_every: int = 16,
    ):
        if state is not None and not isinstance(state, Mapping):
            raise InvalidInputError(f"state must be a mapping of tensor name to array, got {type(state).__name__}")
        names = None if tensors is None else _names(tensors)
        if names is not None and state is not None and set(state) != names:
            raise InvalidInputError(
                f"state must hold exactly the tensors followed: not in state {sorted(names - set(state))[:5]}, "
                f"not followed {sorted(set(state) - names)[:5]}"
            )
        self._io = _open.objects(url, storage_options)
        self.url = self._io.url
        self.branch = check_ref_name(branch)
        self._traj = None
        self._trajectory()  # a prefix holding something else is an error now; nothing yet is fine
        self.poll_interval = float(poll_interval)
        self.max_replay = int(max_replay)
        self.on_event = on_event
        self.trust_state = bool(trust_state)
        self.check_every = max(1, int(check_every))
        self._scan = 0  # position of the default mode's rotating scan
        self._scanning: Future | None = None  # that scan, running in the background (see _start_scan)
        self._workers = Workers(threads, "ulstore-follow")
        self._replica = Replica(state, pool=self._workers.compute, threads=self._workers.threads, names=names)
        self._stalled_at: int | None = None  # a version we could not apply, waiting for a newer snapshot
        self._handed: int | None = None  # during a poll: the version whose document came with the announcement
        self._closed = False
        self.events: list[SyncEvent] = []
        self.stats = FollowerStats()

    def __repr__(self) -> str:
        return f"<Follower {self.url!r} branch={self.branch!r} version={self.version}>"

    def _trajectory(self):
        if self._traj is None:
            try:
                self._traj = _open.trajectory(self._io, "r", keep_parent=False)
            except NotFoundError:
                return None
        return self._traj

    @property
    def trajectory(self):
        """The trajectory followed (None while nothing was ever published)."""
        return self._trajectory()

    def close(self) -> None:
        """Stop the worker threads (a second call does nothing).

        The default mode's background check, if one is running, is waited for
        first and its result taken as :meth:`wait_scan` takes it (a finding is
        reported and the state marked invalid; an exception it raised is
        raised here).  Afterwards :meth:`poll`, :meth:`follow`,
        :meth:`bootstrap` and :meth:`verify` raise InvalidInputError;
        :attr:`state`, :attr:`version`, :meth:`published` and :meth:`wait_scan`
        still work.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._scan_result()  # the last version's check: the caller may go on using the state
        finally:
            super().close()
            if self._traj is not None:
                self._traj.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"this Follower of {self.url!r} is closed; open a new one")

    @property
    def version(self) -> int | None:
        return self._replica.version

    @property
    def state(self) -> dict:
        """The tensors kept current (the caller's own dict, if one was given)."""
        return self._replica.state

    @property
    def metadata(self) -> dict:
        """The publisher's metadata of :attr:`version`."""
        return self._replica.metadata

    def _head(self) -> int | None:
        traj = self._trajectory()
        return None if traj is None else traj.head(self.branch)

    def published(self) -> int | None:
        """The newest version on the branch (one small read), without applying anything.

        None if nothing is published yet.  ``published() - version`` is how far behind this replica is.
        """
        return self._head()

    # -- events -----------------------------------------------------------------------

    def _event(self, kind: str, version, detail: str = "", error: BaseException | None = None) -> None:
        ev = SyncEvent(kind, version, detail, error)
        self.events.append(ev)
        del self.events[:-1000]
        level = logging.DEBUG if kind in ("apply", "bootstrap") else logging.WARNING
        log.log(level, "%s: %s at version %s%s", self.url, kind, version, f": {detail}" if detail else "")
        if self.on_event is not None:
            self.on_event(ev)

    def _problem(self, version, e: BaseException) -> None:
        if isinstance(e, NotFoundError):
            self.stats.missing += 1
            self._event("missing", version, str(e), e)
        else:
            self.stats.corrupt += 1
            self._event("corrupt", version, str(e), e)

    # -- bootstrap --------------------------------------------------------------------

    def bootstrap(self, timeout: float = 0.0) -> int:
        """Load the newest snapshot and replay the versions after it.

        Parameters
        ----------
        timeout : float
            Seconds to wait for a first version to be published (0: do not wait).

        Returns
        -------
        int
            The version now held.

        Raises
        ------
        NotFoundError
            Nothing is published (after ``timeout``).
        IntegrityError
            No snapshot in the store can be loaded.
        BucketAccessError
            The bucket is unreachable.
        """
        self._check_open()
        head = self._wait_head(timeout)
        self._bootstrap(head, "bootstrap")
        assert self.version is not None
        return self.version

    # -- polling ----------------------------------------------------------------------

    def poll(self, to: int | None = None, *, document=None) -> int | None:
        """Catch up with the newest published version (or with version ``to``).

        Parameters
        ----------
        to : int, optional
            A version the publisher announced (a control plane's message, as in
            ``examples/weight_sync_http.py``): catch up to exactly that version
            without reading the branch head, one read of the bucket fewer per
            version (on S3 a LIST and a GET).  The announcement only says which
            version to reach: the chain from the version held to it is proven
            from the step documents as always.  A version at or below the one
            held is a stale announcement: nothing happens.  The proof shows
            that ``to`` descends from the version held, not that it is on
            :attr:`branch`: a version of another branch is applied as told
            (a later poll of the head finds the state off the branch and
            re-bootstraps).
        document : bytes or str, optional
            Version ``to``'s step document, sent with the announcement
            (:attr:`PublishInfo.document`).  It is checked as if read from the
            bucket (canonical form, checksum, version).  When it was committed
            on the version held (its parent, and its parent's content checksum
            against the state held), it is not read again: the version takes
            one request, a range of its pack.  Otherwise (versions were
            missed, the follower bootstraps, or the bucket's history moved on
            from the version held) it is not used and the bucket's is read.
            It decides which data is applied as version ``to`` (a crafted one,
            or one delivered after its version was deleted and published
            again, names other data), so send only what the publisher
            returned, over a channel you trust as you trust the bucket's
            writers.

        Returns
        -------
        int or None
            The version now held if it advanced, else None.  The first call
            bootstraps (if :meth:`bootstrap` was not called).

        Raises
        ------
        NotFoundError
            ``to`` is not a step of the trajectory (not published yet, or pruned).
        BucketAccessError
            The bucket could not be read; the state still holds :attr:`version`.
        InvalidInputError
            The published tensors no longer match the caller's state dict, or
            ``to`` is not a version number; or ``document`` is refused: not
            a sound step document of version ``to``, or naming data the
            bucket does not hold (then the state still holds :attr:`version`
            and the document is forgotten: poll again without it).
        """
        before = self.version
        try:
            for _ in self._advance(self._announced(to, document)):
                pass
        finally:
            self._handed = None
        return self.version if self.version != before else None

    def _announced(self, to, document=None) -> int | None:
        """``to`` checked: None, or a published step (its step document read, or ``document`` accepted and marked
        as handed over, and kept for the chain proof)."""
        if document is not None and not isinstance(document, (bytes, bytearray, memoryview, str)):
            raise InvalidInputError(f"document must be bytes or str, not {type(document).__name__}")
        if to is None:
            if document is not None:
                raise InvalidInputError("poll(document=) is the document of version to=: pass both")
            return None
        if isinstance(to, bool) or not isinstance(to, int) or to < 0:
            raise InvalidInputError(f"to must be a version number (an int >= 0), got {to!r}")
        self._check_open()
        if self.version is not None and to <= self.version:
            return to
        traj = self._trajectory()
        if document is not None and traj is not None and self.version is not None and self._stalled_at is None:
            try:
                info = traj.accept_step_document(to, document, parent=(self.version, self._replica.content))
            except (IntegrityError, InvalidInputError) as e:  # a damaged message, or not this bucket's
                raise InvalidInputError(f"the document announced with version {to} is refused: {e}") from None
            if info.parent == self.version and info.parent_content == self._replica.content:
                self._handed = to
                return to
            # not committed on the version held: messages were missed, or the bucket's history moved on from it
            # (a version deleted and published again): the bucket's chain, its document too, says which
        try:
            if traj is None:
                raise NotFoundError("no trajectory")
            traj.info(to)
        except NotFoundError:
            raise NotFoundError(f"version {to} is not published to {self.url!r}") from None
        except IntegrityError:
            pass  # a damaged step document: reported and recovered from as for a head read from the ref
        return to

    def follow(self, *, until: int | None = None, timeout: float | None = None) -> Iterator[int]:
        """Yield every version as soon as it is applied (the state then holds it).

        Parameters
        ----------
        until : int, optional
            Stop after yielding a version >= ``until``.
        timeout : float, optional
            Stop when no new version arrived for this many seconds (None: never).

        Notes
        -----
        An unreachable bucket does not end the iteration: it is reported
        (event ``unreachable``, ``stats.unreachable``) and retried every
        ``poll_interval``.  :meth:`poll` raises :class:`BucketAccessError` instead.
        """
        last_new = time.monotonic()
        while True:
            advanced = False
            try:
                for v in self._advance():
                    advanced = True
                    yield v
                    if until is not None and v >= until:
                        return
            except BucketAccessError as e:  # transient: the state still holds a whole version; retry
                self.stats.unreachable += 1
                self._event("unreachable", self.version, str(e), e)
            if advanced:
                last_new = time.monotonic()
            elif timeout is not None and time.monotonic() - last_new >= timeout:
                return
            else:
                time.sleep(self.poll_interval)

    __iter__ = follow


def _names(tensors) -> frozenset:
    """``Follower(tensors=...)`` checked: a non-empty iterable of tensor names (not one name)."""
    if isinstance(tensors, (str, bytes)):
        raise InvalidInputError(f"tensors must be an iterable of tensor names, not one name: [{tensors!r}]?")
    try:
        names = frozenset(tensors)
    except TypeError:  # not iterable, or unhashable items
        raise InvalidInputError(f"tensors must be an iterable of tensor names, got {tensors!r:.100}") from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad or not names:
        raise InvalidInputError(
            f"tensors must be a non-empty iterable of tensor names, got {sorted(map(repr, bad))[:3] or 'none'}"
        )
    return names
