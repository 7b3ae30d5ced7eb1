"""Streaming one new object in bounded memory: :class:`ObjectWriter` (``ObjectStore.open_writer``).

Local disk writes to ``.tmp/`` and renames the file into place at close
(durable: fsynced first, and its directories after, like a put); S3 uploads
parts of ``block_size`` bytes (the object appears at close); ``memory://``
keeps the bytes and stores them at close.  Backend failures are mapped the
way the object client maps them (:meth:`ObjectStore._calling`).

The writer names what it needs of its client (:class:`WriteTarget`) rather
than the client's class: the object client opens writers, so the writer must
not depend back on it.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import uuid
from typing import Any, Protocol

from . import local_disk
from .backends import Calling

__all__ = ["ObjectWriter", "WriteTarget"]

#: Write buffer of a local object (bytes): small appends are gathered into few system calls.
_FILE_BUFFER = 1 << 20


class WriteTarget(Protocol):
    """What a writer uses of the object client that opens it (``ObjectStore`` is one)."""

    fs: Any
    url: str
    local: bool
    memory: bool
    durable: bool

    def path(self, key: str) -> str: ...

    def local_tmp_dir(self) -> str: ...

    def _calling(self, what: str, key: str | None) -> Calling: ...


class ObjectWriter:
    """Streams one new object (see :meth:`ObjectStore.open_writer`); not thread-safe.

    ``tell()`` is the number of bytes written so far.  Memory held: nothing on
    local disk (the file is written as it goes), one part (``block_size``) on
    S3 and other object stores, the whole object on ``memory://``.
    """

    def __init__(self, store: WriteTarget, key: str, block_size: int):
        self.store = store
        self.key = key
        self._n = 0
        self._done = False
        self._tmp: str | None = None
        self._f: Any
        # one backend-call guard for every write (it holds nothing per call): a commit appends thousands of
        # small blobs, and building one per write cost about as much as the write itself
        self._put = store._calling("PUT", key)
        with self._put:
            if store.local:
                self._tmp = os.path.join(store.local_tmp_dir(), uuid.uuid4().hex)
                # a large buffer: a commit appends thousands of small blobs, one system call (and one release
                # of the GIL, which the workers then hold for up to a switch interval) each with the default
                self._f = builtins.open(self._tmp, "wb", buffering=_FILE_BUFFER)
            elif store.memory:
                self._f = io.BytesIO()
            else:
                self._f = store.fs.open(store.path(key), "wb", block_size=max(5 << 20, int(block_size)))

    def tell(self) -> int:
        return self._n

    def write(self, data) -> int:
        """Append ``data`` (bytes-like); returns the offset it starts at."""
        at = self._n
        with self._put:
            self._f.write(data)
        self._n = at + memoryview(data).nbytes
        return at

    def close(self) -> None:
        """Finish the object: it exists from now on."""
        if self._done:
            return
        self._done = True
        st = self.store
        with st._calling("PUT", self.key):
            if st.local:
                assert self._tmp is not None
                path = st.path(self.key)
                try:
                    if st.durable:
                        self._f.flush()
                        os.fsync(self._f.fileno())
                    self._f.close()
                    local_disk.makedirs(os.path.dirname(path), st.durable)
                    os.replace(self._tmp, path)
                except BaseException:
                    self._f.close()
                    self._unlink_tmp()
                    raise
                local_disk.sync_dir(os.path.dirname(path), st.durable)
            elif st.memory:
                st.fs.pipe_file(st.path(self.key), self._f.getvalue())
                self._f = io.BytesIO()
            else:
                self._f.close()

    def abort(self) -> None:
        """Give up: no object appears (a partial upload is discarded)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            if self.store.local:
                self._f.close()
                self._unlink_tmp()
            elif self.store.memory:
                self._f = io.BytesIO()
            else:
                discard = getattr(self._f, "discard", None)  # s3fs: abort the multipart upload
                if discard is not None:
                    discard()
                    self._f.closed = True  # nothing left to flush (fsspec would try again when collected)
                else:
                    self._f.close()

    def _unlink_tmp(self) -> None:
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
