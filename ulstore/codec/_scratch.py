"""Per-thread reusable buffers for the codec's intermediate arrays.

A fresh multi-megabyte allocation is fresh pages from the OS, and the first touch
of every 4 KiB page is a page fault: on a VM that was a third of encode time.  Each
thread keeps one buffer per purpose and reuses it.  Buffers never leave the codec:
everything returned to callers is a copy or a new array.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["scratch"]

MAX_CACHED_BYTES = 256 << 20  # larger requests are allocated afresh, not kept
_local = threading.local()


def scratch(name: str, count: int, dtype) -> np.ndarray:
    """A 1-d array of ``count`` elements of ``dtype`` with undefined contents."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if nbytes > MAX_CACHED_BYTES:
        return np.empty(count, dtype=dtype)
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    buf = pool.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = pool[name] = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes].view(dtype)
