"""Object I/O over any fsspec filesystem: get, put, conditional create, list, delete.

Everything above this module speaks in keys relative to the trajectory root
(see :mod:`._layout`); only this module knows paths and backends.

Atomicity, per backend (what a crashed or racing writer can leave behind):

- **local disk**: every write goes to ``.tmp/<uuid>`` first, then
  ``os.replace`` (overwrite) or ``os.link`` (create: fails if the key exists),
  so a reader never sees half an object and exactly one of two racing creators
  wins.  A killed writer leaves at most a file in ``.tmp/``, which
  :meth:`ObjectIO.sweep_tmp` removes.
- **S3 (s3fs)**: a single PUT is atomic; create sends ``If-None-Match: *``.
- **memory://**: in-process, so a lock around exists-then-write is a real
  conditional create.
- **other fsspec backends**: create is exists-then-write, which is racy
  between processes (fsspec's own ``mode="create"`` fallback); documented in
  ``docs/layout.md``.
"""
from __future__ import annotations

import errno
import os
import threading
import uuid

from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

__all__ = ["ObjectIO", "MISSING_ERRORS"]

#: Exceptions backends raise for a missing object.
MISSING_ERRORS = (FileNotFoundError,)

_MEMORY_LOCK = threading.Lock()
TMP_DIR = ".tmp"


def _is_s3(fs) -> bool:
    return type(fs).__name__ == "S3FileSystem"


class ObjectIO:
    """Keyed byte objects under ``root`` of fsspec filesystem ``fs``.

    Parameters
    ----------
    fs : fsspec.AbstractFileSystem
    root : str
        Path of the trajectory root on ``fs`` (no trailing slash, no protocol).

    Notes
    -----
    Thread-safe: the methods hold no state but the filesystem, and fsspec
    filesystems are safe to call from several threads.
    """

    def __init__(self, fs, root: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.local = isinstance(fs, LocalFileSystem)
        self.memory = isinstance(fs, MemoryFileSystem)
        self.s3 = _is_s3(fs)

    def path(self, key: str) -> str:
        """Backend path of ``key``."""
        return f"{self.root}/{key}" if key else self.root

    def __repr__(self) -> str:
        return f"ObjectIO({type(self.fs).__name__}, {self.root!r})"

    # -- reads ------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is no such object."""
        try:
            if self.s3:
                # s3fs's default max_concurrency > 1 sends a HEAD (for the size) before
                # every GET; one plain GET is all a chunk-sized object needs
                return self.fs.cat_file(self.path(key), max_concurrency=1)
            return self.fs.cat_file(self.path(key))
        except MISSING_ERRORS:
            return None
        except IsADirectoryError:
            return None

    def exists(self, key: str) -> bool:
        """Whether an object named ``key`` exists."""
        return self.fs.isfile(self.path(key))

    def find(self, prefix: str, *, detail: bool = False):
        """Keys of all objects under ``prefix`` (recursively); with ``detail``, ``{key: info}``."""
        base = self.path(prefix)
        try:
            found = self.fs.find(base, detail=detail)
        except MISSING_ERRORS:
            return {} if detail else []
        head = self.root + "/"

        def strip(p: str) -> str | None:
            p = p.lstrip("/") if not head.startswith("/") else p
            return p[len(head):] if p.startswith(head) else None

        if detail:
            return {k: info for p, info in found.items() if (k := strip(p)) is not None}
        return [k for p in found if (k := strip(p)) is not None]

    # -- writes -----------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any object there, atomically for readers."""
        path = self.path(key)
        if self.local:
            tmp = self._local_tmp(data)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def create(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` only if no object is there.

        Raises
        ------
        FileExistsError
            An object already exists at ``key`` (another writer won).
        """
        path = self.path(key)
        if self.local:
            tmp = self._local_tmp(data)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                os.link(tmp, path)  # atomic, and fails if path exists
            finally:
                os.unlink(tmp)
        elif self.memory:
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    raise FileExistsError(errno.EEXIST, "object exists", path)
                self.fs.pipe_file(path, data)
        elif self.s3:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                raise
            except OSError as e:  # s3fs maps HTTP 412 PreconditionFailed to a generic OSError
                if "PreconditionFailed" in str(e) or "412" in str(e) or "conditional" in str(e).lower():
                    raise FileExistsError(errno.EEXIST, "object exists", path) from e
                raise
        else:
            self.fs.pipe_file(path, data, mode="create")

    def delete(self, key: str) -> None:
        """Remove the object at ``key`` if it exists."""
        try:
            self.fs.rm_file(self.path(key))
        except MISSING_ERRORS:
            pass

    def delete_many(self, keys: list[str]) -> None:
        """Remove many objects (one batched request on S3)."""
        if not keys:
            return
        paths = [self.path(k) for k in keys]
        if self.s3:
            self.fs.rm(paths)
        else:
            for k in keys:
                self.delete(k)

    def remove_tree(self) -> None:
        """Delete everything under the root (``mode="w"``)."""
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)

    def sweep_tmp(self) -> int:
        """Remove temporary files left by killed local writers; returns how many."""
        if not self.local:
            return 0
        d = self.path(TMP_DIR)
        n = 0
        for name in os.listdir(d) if os.path.isdir(d) else ():
            try:
                os.unlink(os.path.join(d, name))
                n += 1
            except FileNotFoundError:
                pass
        return n

    def _local_tmp(self, data: bytes) -> str:
        d = self.path(TMP_DIR)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, uuid.uuid4().hex)
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp
