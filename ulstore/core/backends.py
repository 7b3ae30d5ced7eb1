"""What the object client must know about particular fsspec backends, and nothing else.

- which URL protocols name object stores, whose first path component is a
  bucket or container that must exist (:data:`OBJECT_STORES`);
- how to tell s3fs, whose GETs and conditional creates need their own calls
  (:func:`is_s3`);
- the lock that serialises calls into fsspec's caching wrappers, which are
  not thread-safe (:func:`serial_lock`).
"""

from __future__ import annotations

import threading
import weakref

from fsspec.implementations.cached import CachingFileSystem

__all__ = ["OBJECT_STORES", "is_s3", "serial_lock"]

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
