"""Many tensors at once: :func:`encode_many` / :func:`decode_many` on a thread pool.

The kernels release the GIL, so batches of tensors code in parallel; each
result depends only on its own item, never on batching or scheduling.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Iterable, Sequence

import numpy as np

from ._api import decode, encode

__all__ = ["encode_many", "decode_many"]


def _batches(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Group indices, largest first, into batches of at most ``budget`` bytes (one item may exceed it)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + sizes[i] > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += sizes[i]
    if current:
        batches.append(current)
    return batches


def _run_batched(fn, items: list, sizes: list[int], threads: int | None, budget: int) -> list:
    """``[fn(item) for item in items]``, in parallel batches.

    A batch holds at most ``budget`` bytes, and at most a sixteenth of one thread's
    share of the work so that every thread stays busy to the end.  Batches are
    submitted largest first.  Each result depends only on its item, so neither
    batching nor scheduling can change it.
    """
    threads = (os.cpu_count() or 1) if threads is None else max(1, int(threads))
    if threads == 1 or len(items) <= 1:
        return [fn(item) for item in items]
    results: list = [None] * len(items)

    def run(batch):
        for i in batch:
            results[i] = fn(items[i])

    per_task = max(1, min(budget, sum(sizes) // (16 * threads)))
    with cf.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(run, b) for b in _batches(sizes, per_task)]:
            f.result()
    return results


def _nbytes(array) -> int:
    if hasattr(array, "nbytes"):
        return int(array.nbytes)
    if hasattr(array, "element_size"):  # torch
        return int(array.numel() * array.element_size())
    return int(np.asarray(array).nbytes)


def encode_many(
    pairs: Iterable,
    *,
    threads: int | None = None,
    budget: int = 64 << 20,
    econd: bool = True,
    sparse: bool = False,
    backend: str | None = None,
) -> list[bytes]:
    """Encode many tensors in parallel; returns exactly what :func:`encode` returns for each.

    Parameters
    ----------
    pairs : iterable
        ``(target, reference)`` tuples, or bare targets (intra).
    threads : int, optional
        Worker threads (default: all cores).  The kernels release the GIL.
    budget : int
        Bytes of raw input grouped into one task, so many small tensors share one
        call.  Batching never changes a blob.
    """
    items = [p if isinstance(p, tuple) else (p, None) for p in pairs]
    sizes = [_nbytes(t) for t, _ in items]
    return _run_batched(
        lambda p: encode(p[0], p[1], econd=econd, sparse=sparse, backend=backend), items, sizes, threads, budget
    )


def decode_many(
    pairs: Iterable, *, threads: int | None = None, budget: int = 64 << 20, backend: str | None = None
) -> list[np.ndarray]:
    """Decode many ``(blob, reference)`` pairs (or bare intra blobs) in parallel."""
    items = [p if isinstance(p, tuple) else (p, None) for p in pairs]
    sizes = [len(b) for b, _ in items]
    return _run_batched(lambda p: decode(p[0], p[1], backend=backend), items, sizes, threads, budget)
