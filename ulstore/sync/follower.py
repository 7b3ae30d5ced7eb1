"""The replica side: :class:`Follower` keeps a state dict equal to the newest published version.

Policy, in one place (the mechanics live in :mod:`._reader` and :mod:`._replica`):

- **bootstrap**: load the anchor ``latest.json`` names (the newest one) and
  replay the deltas after it.  If that anchor is unusable, try older anchors.
- **poll**: walk the chain from ``latest.json`` back to the version held and
  apply each delta in order; each is verified completely before any byte of
  the state is written.  Far behind (more than ``max_replay`` versions): bootstrap instead.
- **a corrupt or missing object** (manifest, pack, chunk; or a delta that does
  not fit the state held): report it (log + :attr:`Follower.events` + the
  counters in :attr:`Follower.stats`), then re-bootstrap from an anchor.  If
  no anchor newer than the bad version exists yet, the follower stays on the
  last good version it reached (reported as ``stalled``) and moves on as soon
  as the publisher writes a newer anchor.  Wrong weights are never applied.
- **the bucket is unreachable**: :class:`~ulstore.sync.BucketAccessError`
  propagates; the state is untouched (still a complete version) and the next
  poll retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping

from ..errors import IntegrityError, InvalidInputError, NotFoundError
from ._bucket import open_bucket as _open_bucket
from ._documents import Latest, Manifest
from ._errors import BucketAccessError
from ._events import FollowerStats, SyncEvent
from ._layout import FORMAT, SYNC_META, is_sync_meta
from ._reader import BucketReader, ChainBroken
from ._replica import Replica
from ._workers import WorkerOwner, Workers

__all__ = ["Follower", "SyncEvent", "FollowerStats"]

log = logging.getLogger("ulstore.sync")


class Follower(WorkerOwner):
    """Keep a state dict equal to the newest version in a sync store, in place.

    Parameters
    ----------
    url : str or os.PathLike
        fsspec URL the publisher writes to.
    state : dict, optional
        The tensors to keep current (numpy arrays, or torch tensors on CPU or a
        device), written in place, chunk by changed chunk.  Names, shapes and
        dtypes must match the published ones.  None: the follower allocates
        numpy arrays, available as :attr:`state`.
    storage_options : dict, optional
        fsspec options.
    threads : int, optional
        Threads that download and decode (default: CPU count, at least 2).
    poll_interval : float, default 1.0
        Seconds between polls in :meth:`follow`.
    max_replay : int, default 64
        Replay at most this many deltas to catch up; further behind, load the newest anchor.
    on_event : callable, optional
        Called with every :class:`SyncEvent` (from the thread that polls).
    trust_state : bool, default False
        False: before a delta is applied, every chunk it changes is hashed to
        check it still holds the version's bits (several GB/s per core), so a
        state changed behind the follower's back is re-bootstrapped, never
        patched.  True: the follower trusts that only it writes the state and
        checks references through checksums it keeps, so applying a sparse
        delta costs time in proportion to the changed elements only
        (:meth:`verify` re-checks the whole state on demand).

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
        ``url`` holds something that is not a sync store.
    """

    def __init__(
        self,
        url,
        *,
        state: Mapping | None = None,
        storage_options: dict | None = None,
        threads: int | None = None,
        poll_interval: float = 1.0,
        max_replay: int = 64,
        on_event: Callable[[SyncEvent], None] | None = None,
        trust_state: bool = False,
    ):
        if state is not None and not isinstance(state, Mapping):
            raise InvalidInputError(f"state must be a mapping of tensor name to array, got {type(state).__name__}")
        self._bucket = _open_bucket(url, storage_options)
        self.url = self._bucket.url
        self._bucket.probe()
        raw = self._bucket.get(SYNC_META)  # may legitimately be absent: the publisher has not started yet
        if raw is not None and not is_sync_meta(raw):
            raise InvalidInputError(f"{self.url!r} holds a {SYNC_META} that is not a {FORMAT} store", key=SYNC_META)
        self.poll_interval = float(poll_interval)
        self.max_replay = int(max_replay)
        self.on_event = on_event
        self._workers = Workers(threads, "ulstore-follow")
        self._reader = BucketReader(self._bucket, self._workers)
        self._replica = Replica(self._reader, state, trust_state=trust_state)
        self._stalled_at: int | None = None  # a version we could not apply, waiting for a newer anchor
        self.events: list[SyncEvent] = []
        self.stats = FollowerStats()

    def __repr__(self) -> str:
        return f"<Follower {self.url!r} version={self.version}>"

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

    def published(self) -> int | None:
        """The newest version in the store (one small GET), without applying anything.

        None if nothing is published yet.  ``published() - version`` is how far behind this replica is.
        """
        latest = self._reader.latest()
        return None if latest is None else latest.version

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

    # -- checking the state ------------------------------------------------------------

    def verify(self) -> bool:
        """Re-hash the state and compare it with the checksums of what the follower wrote.

        Costs one pass over the weights (several GB/s per core, chunks in
        parallel).  It catches writes to the state by anyone but the follower,
        which ``trust_state=True`` otherwise notices only at the next anchor.
        Floating-point tensors are checked, on the host (for device tensors,
        the host mirror the follower writes through).

        Returns
        -------
        bool
            True if every chunk holds exactly what was applied, or nothing is
            held yet.  False: a ``corrupt`` event names the chunks, the state is
            marked invalid (:attr:`version` is None) and the next :meth:`poll`
            bootstraps.
        """
        if self.version is None:
            return True
        bad = self._replica.verify()
        if not bad:
            return True
        self.stats.corrupt += 1
        self._event(
            "corrupt",
            self.version,
            f"the state differs from version {self.version} in {len(bad)} chunk(s): "
            f"{', '.join(bad[:5])}{'...' if len(bad) > 5 else ''}",
        )
        self._replica.invalidate()
        return False

    # -- bootstrap --------------------------------------------------------------------

    def bootstrap(self, timeout: float = 0.0) -> int:
        """Load the newest anchor and replay the deltas after it.

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
            No anchor in the store can be loaded.
        BucketAccessError
            The bucket is unreachable.
        """
        latest = self._wait_latest(timeout)
        self._bootstrap(latest, "bootstrap")
        return self.version

    def _wait_latest(self, timeout: float) -> Latest:
        deadline = time.monotonic() + timeout
        while True:
            latest = self._reader.latest()
            if latest is not None:
                return latest
            if time.monotonic() >= deadline:
                raise NotFoundError(f"nothing has been published to {self.url!r} yet", key="latest.json")
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())) or 0.01)

    def _bootstrap(self, latest: Latest, reason: str) -> None:
        """Load an anchor and replay to ``latest``; a bad delta on the way stalls at the last good version.

        The state is written only once an anchor has been fully decoded and
        verified, so if every anchor fails the state still holds its previous
        version (if it held one) and IntegrityError is raised.
        """
        anchors = [latest.anchor]
        tried = []
        while anchors:
            a = anchors.pop(0)
            tried.append(a)
            try:
                chain = self._reader.chain(latest, a)
                anchor = self._reader.anchor(a, latest.anchor_checksum if a == latest.anchor else None)
                self.stats.bytes_downloaded += self._replica.load_anchor(anchor, chain[0])
            except (IntegrityError, NotFoundError, ChainBroken) as e:
                self._problem(a, e)
                if len(tried) == 1:  # the named anchor is unusable: fall back to older ones (one LIST)
                    anchors = [v for v in reversed(self._reader.anchors()) if v < a]
                continue
            self.stats.bootstraps += 1
            if reason == "rebootstrap":
                self.stats.rebootstraps += 1
            self._event(reason, a, f"anchor {a}, {len(chain) - 1} delta(s) to replay")
            for _ in self._replay_iter(chain[1:], None):
                pass
            return
        raise IntegrityError(f"no usable anchor in {self.url!r} (tried {tried})")

    # -- polling ----------------------------------------------------------------------

    def poll(self) -> int | None:
        """Catch up with the newest published version.

        Returns
        -------
        int or None
            The version now held if it advanced, else None.  The first call
            bootstraps (if :meth:`bootstrap` was not called).

        Raises
        ------
        BucketAccessError
            The bucket could not be read; the state still holds :attr:`version`.
        InvalidInputError
            The published tensors no longer match the caller's state dict.
        """
        before = self.version
        for _ in self._advance(one_by_one=False):
            pass
        return self.version if self.version != before else None

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
                for v in self._advance(one_by_one=True):
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

    def _advance(self, one_by_one: bool) -> Iterator[int]:
        """Generator behind poll/follow: yields each version reached."""
        try:
            latest = self._reader.latest()
        except IntegrityError as e:  # a damaged pointer: the publisher rewrites it at the next version
            self._problem(None, e)
            return
        if latest is None:
            return
        start = self.version
        if start is None:
            self._bootstrap(latest, "rebootstrap" if self._stalled_at is not None else "bootstrap")
            yield self.version
            return
        if latest.version == start and latest.checksum == self._replica.checksum:
            return
        if self._stalled_at is not None:
            if latest.anchor >= self._stalled_at:  # an anchor past the bad version: try again
                yield from self._recover(latest, self._stalled_at, "rebootstrap")
            return
        try:
            chain = self._reader.chain(latest, start, limit=self.max_replay)
            if chain[0].checksum != self._replica.checksum:
                raise ChainBroken(f"version {start} in the store is not the one held")
        except ChainBroken as e:
            if e.far:  # far behind: an anchor is cheaper than the replay
                yield from self._recover(latest, start + 1, "bootstrap")
            else:  # the history held is no longer the store's (publisher restarted without resuming)
                self._event("reset", latest.version, str(e))
                yield from self._recover(latest, start + 1, "rebootstrap")
            return
        except (IntegrityError, NotFoundError) as e:
            self._problem(latest.version, e)
            yield from self._recover(latest, start + 1, "rebootstrap")
            return
        if one_by_one:
            yield from self._replay_iter(chain[1:], latest)
        else:
            for _ in self._replay_iter(chain[1:], latest):
                pass
            if self.version != start:
                yield self.version

    def _replay_iter(self, manifests: list[Manifest], latest: Latest | None) -> Iterator[int]:
        """Apply manifests in order, prefetching the next ones' packs while decoding.

        On a version that cannot be applied: with ``latest``, re-bootstrap from
        an anchor (:meth:`_recover`); without (already inside a bootstrap),
        stall on the last good version.
        """

        def fetch(m):
            return self._workers.prefetch.submit(self._reader.fetch_packs, m) if m.kind == "delta" else None

        futures = [fetch(m) for m in manifests[:2]]
        for i, m in enumerate(manifests):
            if i + 2 < len(manifests):
                futures.append(fetch(manifests[i + 2]))
            try:
                if m.kind == "reset":
                    self._event("reset", m.version, "the publisher restarted the chain; loading its anchor")
                    self.stats.bytes_downloaded += self._replica.load_anchor(self._reader.anchor(m.version), m)
                else:
                    self.stats.bytes_downloaded += self._replica.apply(m, futures[i].result())
            except (IntegrityError, NotFoundError, ChainBroken) as e:
                for f in futures[i + 1 :]:
                    if f is not None:
                        f.cancel()
                self._problem(m.version, e)
                if latest is None:
                    self._stalled_at = m.version
                    self._event(
                        "stalled",
                        self.version,
                        f"version {m.version} cannot be applied; waiting for an anchor after it",
                    )
                else:
                    yield from self._recover(latest, m.version, "rebootstrap")
                return
            self.stats.versions_applied += 1
            self._stalled_at = None
            self._event("apply", m.version)
            yield m.version

    def _recover(self, latest: Latest, failed: int, reason: str) -> Iterator[int]:
        """Re-bootstrap after version ``failed`` could not be reached; yields the version reached, if new."""
        before = self.version
        self._stalled_at = failed
        try:
            self._bootstrap(latest, reason)
        except IntegrityError as e:
            self._event("stalled", self.version, f"no anchor could be loaded: {e}", e)
            if self.version is None:
                raise
            return
        if self.version is not None and self.version >= failed:
            self._stalled_at = None
        if self.version != before:
            yield self.version
