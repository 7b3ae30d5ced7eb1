"""The thread pools of a publisher or follower, and the context-manager plumbing of their owners."""

from __future__ import annotations

import concurrent.futures as cf
import os

__all__ = ["Workers", "WorkerOwner", "default_threads"]


class Workers:
    """The thread pools of a publisher or follower.

    Three pools so that no task ever waits on a task queued behind it in its
    own pool: ``compute`` codes chunks (the ULPack kernels release the GIL),
    ``io`` runs single GETs/PUTs, ``prefetch`` runs whole-version downloads
    (which fan out their GETs to ``io``).
    """

    def __init__(self, threads: int | None, name: str):
        n = self.threads = default_threads(threads)
        self.compute = cf.ThreadPoolExecutor(n, thread_name_prefix=f"{name}-compute")
        self.io = cf.ThreadPoolExecutor(max(8, 2 * n), thread_name_prefix=f"{name}-io")
        self.prefetch = cf.ThreadPoolExecutor(2, thread_name_prefix=f"{name}-prefetch")
        # a pool starts its threads on first use, and starting one takes about 0.3 ms, which the first version
        # a follower applies would otherwise pay: one thread of each now
        for pool in (self.compute, self.io, self.prefetch):
            pool.submit(int)

    def close(self) -> None:
        for pool in (self.prefetch, self.io, self.compute):
            pool.shutdown(wait=True, cancel_futures=True)


class WorkerOwner:
    """Context-manager plumbing of an object that owns a :class:`Workers`."""

    _workers: Workers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Stop the worker threads (the store itself needs no closing)."""
        self._workers.close()


def default_threads(threads: int | None) -> int:
    return max(1, int(threads)) if threads else max(2, os.cpu_count() or 1)
