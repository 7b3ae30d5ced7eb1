"""How a :class:`~ulstore.sync.Follower` checks the state it holds: on demand, and in the default mode's
background re-sum of part of the state after each version.

:class:`StateChecks` is a mixin of :class:`~ulstore.sync.Follower` and uses its
replica, worker pools, counters and event reporting.  A finding marks the
state invalid (the next poll bootstraps) and is reported as a ``corrupt``
event.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from ._events import FollowerStats
from ._replica import Replica
from ._workers import Workers

__all__ = ["StateChecks"]


class StateChecks:
    """``verify``, ``wait_scan`` and the default mode's rotating background scan."""

    # provided by Follower
    trust_state: bool
    check_every: int
    stats: FollowerStats
    _replica: Replica
    _workers: Workers
    _scan: int
    _scanning: Future | None

    if TYPE_CHECKING:

        @property
        def version(self) -> int | None: ...

        def _check_open(self) -> None: ...

        def _event(self, kind: str, version, detail: str = "", error: BaseException | None = None) -> None: ...

    def verify(self) -> bool:
        """Re-hash the whole state against the store's content hashes of the version held.

        One pass over the weights (BLAKE3, GB/s per core, chunks in parallel).
        Catches writes to the state by anyone but the follower.  Device
        tensors are checked through the host mirror the follower writes through.

        Returns
        -------
        bool
            True if every chunk holds exactly the published values, or nothing
            is held yet.  False: a ``corrupt`` event names the chunks, the state
            is marked invalid (:attr:`version` is None) and the next
            :meth:`poll` bootstraps.
        """
        self._check_open()
        if not self._scan_result():
            return False
        if self.version is None:
            return True
        return self._bound() and self._check(None)

    def _check(self, keys) -> bool:
        return self._report(self._replica.verify(keys))

    def _report(self, bad: list[str]) -> bool:
        """True if ``bad`` (chunks whose bits differ) is empty; else a ``corrupt`` event, and the state is invalid."""
        if not bad:
            return True
        return self._corrupt(
            f"the state differs from version {self.version} in {len(bad)} chunk(s): "
            f"{', '.join(bad[:5])}{'...' if len(bad) > 5 else ''}"
        )

    def _bound(self) -> bool:
        """False if the caller replaced tensors of the state dict since they were bound (the follower would go on
        writing the old memory): a ``corrupt`` event names them and the state is invalid (the next bootstrap binds
        and loads the new ones)."""
        gone = self._replica.replaced()
        if not gone:
            return True
        return self._corrupt(
            f"{len(gone)} tensor(s) of the state dict are not the ones written in place any more (replaced, or "
            f"another storage): {', '.join(gone[:5])}{'...' if len(gone) > 5 else ''}; they are loaded again"
        )

    def _corrupt(self, message: str) -> bool:
        """The state held is not the version it claims: mark it invalid, then a ``corrupt`` event; False."""
        held = self.version
        self._replica.invalidate()  # first: the event goes to on_event, which may raise
        self.stats.corrupt += 1
        self._event("corrupt", held, message)
        return False

    def _start_scan(self) -> None:
        """Default mode, a version just applied: re-sum the next ``1/check_every`` of the state (by bytes, rotating
        over chunks) in the background, off the apply path; :meth:`_scan_result` takes its result."""
        if self.trust_state or self.version is None:
            return
        sizes = self._replica.chunk_bytes()
        if not sizes:
            return
        keys = list(sizes)
        budget = sum(sizes.values()) / self.check_every
        picked, total = [], 0
        for i in range(len(keys)):
            key = keys[(self._scan + i) % len(keys)]
            picked.append(key)
            total += sizes[key]
            if total >= budget:
                break
        self._scan = (self._scan + len(picked)) % len(keys)
        # it only reads the state and the sums kept: whatever changes them takes the result first
        self._scanning = self._workers.prefetch.submit(self._replica.verify, picked, sums=True)

    def _scan_result(self) -> bool:
        """Wait for the background scan, if one runs; False if it found a chunk that differs (reported, and the
        state is invalid)."""
        scanning, self._scanning = self._scanning, None
        return True if scanning is None else self._report(scanning.result())

    def wait_scan(self) -> bool:
        """Wait for the default mode's background check of the version last applied.

        In the default mode each version applied starts a re-sum of the next
        ``1/check_every`` of the state in the background, so that :meth:`poll`
        returns as soon as the version is written; the next version waits for
        it before it is applied.  Call this to have the result now (before
        handing the state on, or to free the core the check runs on).

        Returns
        -------
        bool
            True if the chunks checked hold exactly the published values (or no
            check was running).  False: a ``corrupt`` event names the chunks,
            the state is marked invalid (:attr:`version` is None) and the next
            :meth:`poll` bootstraps.
        """
        return self._scan_result()
