"""How a :class:`~ulstore.sync.Follower` reaches the branch head: bootstrap, chain proof, replay, recovery.

The policy is described in :mod:`.follower`; this is its per-version loop.
:class:`CatchUp` is a mixin of :class:`~ulstore.sync.Follower` and uses its
trajectory, replica, worker pools, counters and event reporting; it builds on
the state checks of :class:`~ulstore.sync._checks.StateChecks`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import CorruptManifestError, IntegrityError, InvalidInputError, NotFoundError
from ._checks import StateChecks
from ._fetch import Fetched, fetch
from ._replica import ChainBroken

__all__ = ["CatchUp"]


class CatchUp(StateChecks):
    """Bootstrap from a snapshot, prove the chain to the head, and replay the versions after the one held."""

    # provided by Follower (the rest, through StateChecks)
    url: str
    branch: str
    max_replay: int
    poll_interval: float
    _stalled_at: int | None
    _handed: int | None

    if TYPE_CHECKING:

        def _trajectory(self): ...

        def _problem(self, version, e: BaseException) -> None: ...

        def _head(self) -> int | None: ...

    def _wait_head(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            head = self._head()
            if head is not None:
                return head
            if time.monotonic() >= deadline:
                raise NotFoundError(f"nothing has been published to {self.url!r} on {self.branch!r} yet")
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())) or 0.01)

    def _bootstrap(self, head: int, reason: str) -> None:
        """Load a snapshot and replay to ``head``; a bad version on the way stalls at the last good one.

        The state is written only once a snapshot has been fully decoded and
        verified, so if every snapshot fails the state still holds its
        previous version (if it held one) and IntegrityError is raised.
        """
        self._scan_result()  # a background scan reads the state this replaces (what it found is reported)
        traj = self._trajectory()
        path: list = []  # step infos from head back to the snapshot
        tried = []
        seen: set[int] = set()
        problem: BaseException | None = None  # the last, for the error if no snapshot loads
        step: int | None = head
        while step is not None:
            if step in seen:  # crafted parents that loop: no snapshot on the way
                problem = _loop(path[-1].step, step)
                self._problem(step, problem)
                break
            seen.add(step)
            try:
                info = traj.info(step)
            except (IntegrityError, NotFoundError) as e:
                problem = e
                self._problem(step, e)
                break
            path.append(info)
            if info.anchor_distance == 0:
                tried.append(step)
                try:
                    # a first bootstrap refuses a name the snapshot lacks (the caller's mistake); a later one drops it,
                    # as the versions applied since did
                    names, first = self._replica.names, not self.stats.bootstraps
                    fetched = fetch(traj, step, snapshot=True, names=names, strict=first)
                    self.stats.bytes_downloaded += self._replica.load(fetched)
                except (IntegrityError, NotFoundError) as e:
                    problem = e
                    self._problem(step, e)
                    step = info.parent
                    continue
                self.stats.bootstraps += 1
                if reason == "rebootstrap":
                    self.stats.rebootstraps += 1
                self._event(reason, step, f"snapshot {step}, {len(path) - 1} version(s) to replay")
                for _ in self._replay_iter([i.step for i in reversed(path[:-1])], None):
                    pass
                return
            step = info.parent
        raise IntegrityError(
            f"no usable snapshot on {self.branch!r} in {self.url!r} (tried {tried})"
            + (f": {problem}" if problem else "")
        )

    def _newest_snapshot(self, head: int) -> int | None:
        traj = self._trajectory()
        seen: set[int] = set()
        step: int | None = head
        while step is not None:
            seen.add(step)
            info = traj.info(step)
            if info.anchor_distance == 0:
                return step
            if info.parent in seen:
                raise _loop(step, info.parent)
            step = info.parent
        return None

    def _chain(self, head: int, stop_at: int) -> list[int]:
        """Steps ``stop_at`` (exclusive) .. ``head`` along parent links, oldest first, the chain proven."""
        traj = self._trajectory()
        infos: list = []
        seen: set[int] = set()
        step = head
        while True:
            if len(infos) > self.max_replay:
                raise ChainBroken(f"more than {self.max_replay} versions between {stop_at} and {head}", far=True)
            info = traj.info(step)
            infos.append(info)
            seen.add(step)
            if info.parent == stop_at:
                break
            if info.parent is None or info.parent < stop_at:
                raise ChainBroken(f"version {stop_at} is not an ancestor of version {head}")
            if info.parent in seen:
                raise _loop(step, info.parent)
            step = info.parent
        infos.reverse()
        if infos[0].parent_content != self._replica.content:
            raise ChainBroken(f"version {stop_at} in the store is not the one held")
        for a, b in zip(infos, infos[1:]):
            if b.parent_content != a.content:
                raise ChainBroken(f"version {b.step} was not coded against version {a.step} as stored")
        return [i.step for i in infos]

    def _advance(self, to: int | None = None) -> Iterator[int]:
        """What poll/follow run to reach the branch head (or ``to``): an iterator that applies the versions as it is
        advanced and yields each one reached.  Decided here, run by the caller: while a version is applied, the
        call stack is the caller's loop, the replay (:meth:`_replay_iter`) and :meth:`Replica.apply`."""
        self._check_open()
        start = self.version
        if to is not None and start is not None and to <= start:  # a stale announcement
            return iter(())
        head = self._target(to)
        if head is None or head == start:
            return iter(())
        if start is None:
            return self._first(head)
        if self._stalled_at is not None:
            return self._unstall(head)
        try:
            chain = self._chain(head, start)
        except ChainBroken as e:
            if e.far:  # far behind: a snapshot is cheaper than the replay
                return self._recover(head, start + 1, "bootstrap")
            # the history held is no longer the branch's (reset, deleted steps)
            self._event("reset", head, str(e))
            return self._recover(head, start + 1, "rebootstrap")
        except (IntegrityError, NotFoundError) as e:
            self._problem(head, e)
            return self._recover(head, start + 1, "rebootstrap")
        return self._replay_iter(chain, head)

    def _target(self, to: int | None) -> int | None:
        """The version to reach: ``to``, else the branch head (None: nothing published, or a damaged ref,
        reported; nothing is applied)."""
        if to is not None:
            return to
        try:
            return self._head()
        except IntegrityError as e:
            self._problem(None, e)
            return None

    def _first(self, head: int) -> Iterator[int]:
        """Nothing held (never loaded, or invalidated): bootstrap; yields the version reached."""
        try:
            self._bootstrap(head, "rebootstrap" if self._stalled_at is not None else "bootstrap")
        except IntegrityError as e:
            if self._stalled_at is None:
                raise
            self._event("stalled", None, f"no snapshot could be loaded: {e}", e)
            return
        yield self.version  # type: ignore[misc]

    def _unstall(self, head: int) -> Iterator[int]:
        """Stalled on a version that could not be applied: try again once a snapshot after it is published."""
        try:
            snap = self._newest_snapshot(head)
        except (IntegrityError, NotFoundError):
            return
        if snap is not None and snap >= self._stalled_at:  # type: ignore[operator]  # a snapshot past the bad version
            yield from self._recover(head, self._stalled_at, "rebootstrap")  # type: ignore[arg-type]

    def _replay_iter(self, steps: list[int], head: int | None) -> Iterator[int]:
        """Apply steps in order, fetching the next ones' blobs while applying.

        On a version that cannot be applied: with ``head``, re-bootstrap from
        a snapshot (:meth:`_recover`); without (already inside a bootstrap),
        stall on the last good version.
        """
        traj = self._trajectory()

        def prefetch(s):
            return self._workers.prefetch.submit(fetch, traj, s, names=self._replica.names)

        # one version (a poll that keeps up): nothing to overlap, so fetch it on this thread instead of
        # handing it to the prefetcher and waiting
        threaded = len(steps) > 1
        futures = [prefetch(s) for s in steps[:2]] if threaded else []
        at = self.version  # the version this replay left the state at
        for i, s in enumerate(steps):
            self._check_open()  # follow(): the generator may be resumed after close()
            if self.version != at:
                # follow(): between two yields, another call on this thread (poll, bootstrap, verify) moved the
                # state: these steps no longer follow it, and that is no damage; the caller's next poll goes on
                for f in futures[i:]:
                    f.cancel()
                return
            if threaded and i + 2 < len(steps):
                futures.append(prefetch(steps[i + 2]))
            try:
                held = self.version
                # default mode: the re-sum of part of the state that the last version applied started
                # in the background; a foreign write is still found within check_every versions
                # and tensors the caller replaced in the state dict are no longer the memory written
                if not self._scan_result() or not self._bound():
                    raise ChainBroken(f"the state held diverged from version {held}")
                fetched: Fetched = futures[i].result() if threaded else fetch(traj, s, names=self._replica.names)
                self.stats.bytes_downloaded += self._replica.apply(fetched)
                self._start_scan()
            except (IntegrityError, NotFoundError, ChainBroken) as e:
                for f in futures[i + 1 :]:
                    f.cancel()
                if s == self._handed and not isinstance(e, ChainBroken):
                    # its document came with the announcement, not from the bucket: the message is what failed
                    # (all or nothing: the state still holds the version before); forget it, no recovery
                    traj.close()  # (drops the cached documents)
                    raise InvalidInputError(
                        f"version {s} could not be applied from the document announced with it, which is "
                        f"forgotten (poll again without it): {e}"
                    ) from e
                if not isinstance(e, ChainBroken) or self.version is not None:
                    self._problem(s, e)
                if head is None:
                    self._stalled_at = s
                    self._event(
                        "stalled", self.version, f"version {s} cannot be applied; waiting for a snapshot after it"
                    )
                else:
                    yield from self._recover(head, s, "rebootstrap")
                return
            at = self.version
            self.stats.versions_applied += 1
            self._stalled_at = None
            self._event("apply", s)
            yield s

    def _recover(self, head: int, failed: int, reason: str) -> Iterator[int]:
        """Re-bootstrap after version ``failed`` could not be reached; yields the version reached, if new."""
        before = self.version
        self._stalled_at = failed
        traj = self._trajectory()
        if traj is not None:
            traj.close()  # documents read before may be of steps deleted (or committed again) since: read afresh
        try:
            self._bootstrap(head, reason)
        except IntegrityError as e:
            self._event("stalled", self.version, f"no snapshot could be loaded: {e}", e)
            if self.version is None:
                raise
            return
        if self.version is not None and (self.version >= failed or self.version == head):
            # reached the head: whatever failed is not on the branch's history now (a rollback, a reset), and
            # later versions follow this one as deltas: nothing to wait for
            self._stalled_at = None
        if self.version != before:
            yield self.version  # type: ignore[misc]


def _loop(step: int, parent: int) -> CorruptManifestError:
    """The error of a parent walk that came back to ``parent`` from ``step``: crafted step documents."""
    return CorruptManifestError(
        f"parent links loop: step {step}'s parent {parent} was already passed on the way from the head "
        "(crafted step documents); no version on that loop can be reached",
        step=step,
    )
