"""Keyed objects in a bucket, over any fsspec filesystem: get, put, list, delete, probe.

Only this module knows paths and backends; everything above speaks in keys
relative to the store root (see :mod:`._layout`).

Atomicity (what a reader can see while a writer is killed):

- **S3 / GCS / Azure**: one PUT is atomic; an object is absent or whole.
- **local disk**: a write goes to ``<root>/.tmp/<uuid>`` and is
  ``os.replace``-d into place, so a reader never sees half a file.
- **memory://**: in-process, atomic per call.

Errors: a missing object is ``None`` from :meth:`Bucket.get`; anything else
the backend raises (network, permission, throttling) becomes
:class:`~ulstore.sync.BucketAccessError` naming the key, with the backend's
exception as ``__cause__``.
"""
from __future__ import annotations

import os
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ._errors import BucketAccessError

__all__ = ["Bucket"]

TMP_DIR = ".tmp"
# Protocols whose first path component is a bucket/container that must exist.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2"}


class Bucket:
    """The objects under one store root.

    Parameters
    ----------
    url : str or os.PathLike
        fsspec URL (``s3://bucket/run-7``, ``memory://x``, a local path...).
    storage_options : dict, optional
        Passed to the filesystem (credentials, ``client_kwargs={"endpoint_url": ...}``).

    Notes
    -----
    Thread-safe: it holds no state but the filesystem, and fsspec filesystems
    may be called from several threads.
    """

    def __init__(self, url, storage_options: dict | None = None):
        self.url = os.fspath(url)
        options = dict(storage_options or {})
        protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        self.protocol = protocol
        if protocol in ("file", "local"):
            options.setdefault("auto_mkdir", True)
        try:
            # a fresh instance: async filesystems bind to the first event loop that uses them
            self.fs, root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **options)
        except Exception as e:  # unknown protocol, missing backend package, bad options
            raise BucketAccessError(f"cannot open {self.url!r}: {type(e).__name__}: {e}") from e
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self._s3 = type(self.fs).__name__ == "S3FileSystem"

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _fail(self, what: str, key: str | None, e: BaseException) -> BucketAccessError:
        return BucketAccessError(f"{what} failed on {self.url!r}: {type(e).__name__}: {e}", key=key)

    # -- probing ----------------------------------------------------------------

    def probe(self) -> None:
        """Check that the bucket exists and can be listed; raise BucketAccessError if not.

        An empty or missing *prefix* is fine (the publisher creates it); a
        missing *bucket*, an unreachable endpoint or denied access is not.
        """
        if self.protocol in _OBJECT_STORES:
            container = self.root.split("/", 1)[0]
            try:
                self.fs.ls(container, detail=False)
            except FileNotFoundError as e:
                raise BucketAccessError(
                    f"bucket {container!r} does not exist at {self.url!r} (create it first, "
                    "or check the endpoint/region in storage_options)", key=container) from e
            except PermissionError as e:
                raise BucketAccessError(f"access to bucket {container!r} denied: check credentials", key=container) from e
            except Exception as e:
                raise self._fail("listing the bucket", container, e) from e
        elif self.local and os.path.exists(self.root) and not os.path.isdir(self.root):
            raise BucketAccessError(f"{self.root!r} is a file, not a directory", key="")

    # -- reads ------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is no such object."""
        try:
            if self._s3:
                # s3fs sends a HEAD before every GET when max_concurrency > 1; one GET is enough
                return self.fs.cat_file(self.path(key), max_concurrency=1)
            return self.fs.cat_file(self.path(key))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except Exception as e:
            raise self._fail("GET", key, e) from e

    def list(self, prefix: str) -> list[str]:
        """Keys of the objects directly under ``prefix`` (a directory key)."""
        try:
            paths = self.fs.ls(self.path(prefix), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as e:
            raise self._fail("LIST", prefix, e) from e
        head = self.root + "/"
        out = []
        for p in paths:
            p = p.rstrip("/")
            if not head.startswith("/"):
                p = p.lstrip("/")
            if p.startswith(head):
                out.append(p[len(head):])
        return sorted(out)

    # -- writes -----------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` (replacing it), atomically for readers."""
        path = self.path(key)
        try:
            if self.local:
                tmp_dir = self.path(TMP_DIR)
                os.makedirs(tmp_dir, exist_ok=True)
                tmp = os.path.join(tmp_dir, uuid.uuid4().hex)
                with open(tmp, "wb") as f:
                    f.write(data)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.replace(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except Exception as e:
            raise self._fail("PUT", key, e) from e

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.isfile(self.path(key)))
        except Exception as e:
            raise self._fail("HEAD", key, e) from e

    def delete(self, keys: list[str]) -> None:
        """Remove objects (missing ones are ignored)."""
        if not keys:
            return
        try:
            if self._s3:
                self.fs.rm([self.path(k) for k in keys])
                return
            for k in keys:
                try:
                    self.fs.rm_file(self.path(k))
                except FileNotFoundError:
                    pass
        except Exception as e:
            raise self._fail("DELETE", keys[0], e) from e
