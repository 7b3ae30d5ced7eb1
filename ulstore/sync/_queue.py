"""The publisher's commit queue: versions committed one at a time, in the order submitted, in the background.

:class:`CommitQueue` runs each version's commit on one thread (so in order),
bounds the versions in flight (each holds a snapshot of a state: memory), and
keeps the first failure until a caller has been told.  After a failure, every
version queued behind it is refused rather than committed: a branch never
skips a version that was submitted before one it holds.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable

from ..errors import InvalidInputError
from ._errors import PublishError

__all__ = ["CommitQueue"]


class CommitQueue:
    """At most ``limit`` versions in flight (reserved, queued or committing), committed in order by one thread."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._cond = threading.Condition()
        self._in_flight = 0
        self._failed: tuple[int, BaseException] | None = None  # the first failure no caller was told of yet
        self._refused: list[int] = []  # versions refused behind it
        self._thread: int | None = None  # the committing thread's ident, once it ran

    @property
    def in_flight(self) -> int:
        """Versions submitted and not yet committed (or refused)."""
        return self._in_flight

    def reserve(self) -> None:
        """Take room for one more version, waiting while ``limit`` are in flight; a failure not yet reported is
        raised first (PublishError), and then no room is taken."""
        self._not_from_a_commit("submit or publish")
        with self._cond:
            self._report()
            while self._in_flight >= self.limit:
                self._cond.wait()
                self._report()
            self._in_flight += 1

    def release(self) -> None:
        """Give back a reservation that was not put (its snapshot failed)."""
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def put(self, version: int, commit: Callable[[], object]) -> cf.Future:
        """Run ``commit()`` (room reserved) after every version put before; its future."""
        future = self._pool.submit(self._run, version, commit)
        future.add_done_callback(lambda _: self.release())  # after the future resolved: acknowledged, then room
        return future

    def wait(self) -> None:
        """Block until every version put is committed or refused; raise the first failure not yet reported."""
        self._not_from_a_commit("wait or close")
        with self._cond:
            while self._in_flight:
                self._cond.wait()
            self._report()

    def forget(self) -> None:
        """A blocking publish failed, and its caller was told why (its own failure, or the earlier version's
        that refused it): not again."""
        with self._cond:
            while self._in_flight:  # (nothing is queued behind a blocking publish: this waits for its own callback)
                self._cond.wait()
            self._failed, self._refused = None, []

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _not_from_a_commit(self, what: str) -> None:
        if threading.get_ident() == self._thread:  # (it would wait for itself)
            raise InvalidInputError(f"{what} cannot be called from on_commit (the thread that commits versions)")

    def _run(self, version: int, commit: Callable[[], object]):
        self._thread = threading.get_ident()
        with self._cond:
            failed = self._failed
            if failed is not None:
                self._refused.append(version)
        if failed is not None:
            raise PublishError(
                f"version {version} was not committed: version {failed[0]}, submitted before it, failed "
                f"({type(failed[1]).__name__}: {failed[1]})",
                version=failed[0],
                refused=(version,),
            )
        try:
            return commit()
        except BaseException as e:
            with self._cond:
                self._failed = (version, e)
            raise

    def _report(self) -> None:
        """Raise the failure not yet reported, once the versions behind it are refused (holding the lock)."""
        if self._failed is None:
            return
        while self._in_flight:
            self._cond.wait()
        (version, error), refused = self._failed, self._refused
        self._failed, self._refused = None, []
        behind = f"; not committed either, submitted after it: {refused}" if refused else ""
        raise PublishError(
            f"version {version} was not published ({type(error).__name__}: {error}){behind}; the branch is on the "
            "version before it",
            version=version,
            refused=tuple(refused),
        ) from error
