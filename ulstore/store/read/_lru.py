"""A byte-bounded, thread-safe LRU: the reader's caches of table blocks and decoded chunks.

Entries are charged the size their caller gives; an entry larger than the
whole budget is never kept, and putting a key that is already there only
refreshes it (values under one key are equal: they are keyed by content).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["_LRU"]


class _LRU:
    """A byte-bounded LRU; thread-safe."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self._d: OrderedDict = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return None if v is None else v[0]

    def put(self, key, value, size: int) -> None:
        if size > self.budget:
            return
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return
            self._d[key] = (value, size)
            self._used += size
            while self._used > self.budget:
                _, (_, n) = self._d.popitem(last=False)
                self._used -= n

    def drop(self, keep) -> None:
        """Remove every entry whose key ``keep(key)`` rejects."""
        with self._lock:
            for key in [k for k in self._d if not keep(k)]:
                self._used -= self._d.pop(key)[1]

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._used = 0
