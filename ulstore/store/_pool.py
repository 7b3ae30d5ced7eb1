"""The bounded thread pool that commits, deletes and re-encodes chunks run on."""

from __future__ import annotations

import concurrent.futures as cf

__all__ = ["run_bounded"]


def run_bounded(fn, jobs: list, threads: int, entries: dict) -> None:
    """Run ``fn`` over ``jobs`` on ``threads`` threads, at most ``2 * threads`` in flight.

    Bounding the window bounds memory: each job holds one chunk (and its
    reference) until its blob is written.  ``fn`` returns ``(name, i, entry)``.
    """
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            name, i, e = fn(job)
            entries[name][i] = e
        return
    with cf.ThreadPoolExecutor(threads) as pool:
        pending = set()
        it = iter(jobs)
        try:
            for job in it:
                pending.add(pool.submit(fn, job))
                if len(pending) >= 2 * threads:
                    done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    for f in done:
                        name, i, e = f.result()
                        entries[name][i] = e
            for f in cf.as_completed(pending):
                name, i, e = f.result()
                entries[name][i] = e
        except BaseException:
            for f in pending:
                f.cancel()
            raise
