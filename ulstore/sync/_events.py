"""What a follower reports: :class:`SyncEvent` (one thing it did or ran into) and :class:`FollowerStats`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["SyncEvent", "FollowerStats"]


@dataclass(frozen=True)
class SyncEvent:
    """Something a follower did or ran into.

    ``kind`` is one of ``"bootstrap"`` (loaded an anchor), ``"apply"`` (applied a
    delta), ``"corrupt"`` / ``"missing"`` (an object failed its checks or is
    gone), ``"rebootstrap"`` (recovered from an anchor after a problem),
    ``"stalled"`` (waiting for a newer anchor), ``"reset"`` (the publisher
    restarted the chain), ``"unreachable"`` (the bucket could not be read;
    :meth:`Follower.follow` retries).  ``error`` is the exception, when there is one.
    """

    kind: str
    version: int | None
    detail: str = ""
    error: BaseException | None = None
    time: float = field(default_factory=time.time)


@dataclass
class FollowerStats:
    """Counters of a :class:`Follower` (monotonic)."""

    versions_applied: int = 0
    bootstraps: int = 0
    rebootstraps: int = 0
    corrupt: int = 0
    missing: int = 0
    unreachable: int = 0
    bytes_downloaded: int = 0
