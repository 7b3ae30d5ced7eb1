"""What the object client must know about particular fsspec backends, and nothing else.

- which URL protocols name object stores, whose first path component is a
  bucket or container that must exist (:data:`OBJECT_STORES`);
- how to tell s3fs, whose GETs and conditional creates need their own calls
  (:func:`is_s3`);
- the lock that serialises calls into fsspec's caching wrappers, which are
  not thread-safe (:func:`serial_lock`), and the context of one call
  (:class:`Calling`), which takes it and names a failure.
"""

from __future__ import annotations

import threading
import weakref

from fsspec.implementations.cached import CachingFileSystem

__all__ = ["OBJECT_STORES", "is_s3", "serial_lock", "Calling"]

#: Protocols whose first path component is a bucket/container that must exist.
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2"}

_SERIAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SERIAL_GUARD = threading.Lock()


def is_s3(fs) -> bool:
    return type(fs).__name__ == "S3FileSystem"


def serial_lock(fs) -> threading.RLock | None:
    """The lock serialising calls into ``fs``, for fsspec's caching wrappers; None for everything else.

    ``filecache::`` and ``blockcache::`` keep their cache metadata in memory and
    on disk without locking: two threads reading at once can see each other's
    half-updated metadata (``TypeError: cannot unpack non-iterable bool
    object``, ``mmap length is greater than file size``).  Reads through them
    take turns; they are local once cached.
    """
    if not isinstance(fs, CachingFileSystem):
        return None
    with _SERIAL_GUARD:
        lock = _SERIAL.get(fs)
        if lock is None:
            lock = _SERIAL[fs] = threading.RLock()
        return lock


class Calling:
    """``with``: one backend call, under ``lock`` (when not None); a failure other than FileExistsError is
    raised as ``error(message, key=key)`` from it when ``error`` is given, else as it is.

    A class, not a generator-based context manager: a weight-sync follower makes about six calls per
    version, and contextlib's machinery cost several times this (tens of microseconds with cold caches).
    """

    __slots__ = ("lock", "error", "what", "url", "key")

    def __init__(self, lock, error, what: str, url: str, key: str | None) -> None:
        self.lock, self.error, self.what, self.url, self.key = lock, error, what, url, key

    def __enter__(self) -> None:
        if self.lock is not None:
            self.lock.acquire()

    def __exit__(self, kind, e, tb) -> None:
        if self.lock is not None:
            self.lock.release()
        if e is None or self.error is None or isinstance(e, FileExistsError) or not isinstance(e, Exception):
            return  # (re-raised as it is)
        raise self.error(f"{self.what} failed on {self.url!r}: {type(e).__name__}: {e}", key=self.key) from e
