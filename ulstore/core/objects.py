"""Keyed byte objects over any fsspec filesystem: get, byte ranges, put, streaming writes, create, list, delete.

The one object client of ulstore: the trajectory store and the sync bucket
both speak in keys relative to a root (``steps/10/zarr.json``,
``packs/<h>.ulpk``); only this module knows paths and backends.

Atomicity, per backend (what a crashed or racing writer can leave behind):

- **local disk**: every write goes to ``.tmp/<uuid>`` first, then
  ``os.replace`` (overwrite) or ``os.link`` (create: fails if the key exists),
  so a reader never sees half an object and exactly one of two racing creators
  wins.  A killed writer leaves at most a file in ``.tmp/``, which
  :meth:`ObjectStore.sweep_tmp` removes.  With ``durable=True`` (the default)
  the file is fsynced before it is linked, and so is every directory whose
  entries changed (the object's own, and the parent of each directory the
  write created): when a write returns, a power cut cannot lose it.
- **S3 (s3fs)**: a single PUT is atomic; create sends ``If-None-Match: *``.
  GCS and Azure PUTs are atomic too.
- **memory://**: in-process, so a lock around exists-then-write is a real
  conditional create.
- **other fsspec backends**: create is exists-then-write, which is racy
  between processes (fsspec's own ``mode="create"`` fallback); documented in
  ``docs/layout.md``.

Byte ranges (:meth:`ObjectStore.get_ranges`): one GET with a ``Range``
header per range on S3 (no HEAD first; ranges of one call run
concurrently), ``os.pread`` or a read-only mapping on local disk (refusing
symlinks, FIFOs and devices: ``local_disk.py``), slices of the object
elsewhere.  Streaming writes (:meth:`ObjectStore.open_writer`) hold a
bounded buffer: ``object_writer.py``.

Errors: a missing object is ``None`` from :meth:`ObjectStore.get` (and an
empty listing).  Anything else the backend raises (network, permission,
throttling) propagates unchanged, unless the client was made with
``access_error=``: then it becomes that exception, naming the operation, the
URL and the key, with the backend's exception as ``__cause__`` (the sync
layer's :class:`~ulstore.sync.BucketAccessError`).  ``FileExistsError`` from
:meth:`ObjectStore.create` is an answer, not a failure, and is never wrapped.
"""

from __future__ import annotations

import builtins
import errno
import os
import threading
from collections.abc import Callable
from typing import Any

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ..errors import InvalidInputError, OutcomeUnknownError
from . import local_disk
from .backends import BUCKET_NAMES, OBJECT_STORES, Calling, access_failure, is_s3, redact_error, serial_lock
from .formatting import credentials, redact, redact_url
from .object_writer import ObjectWriter

__all__ = ["ObjectStore", "ObjectWriter", "MISSING_ERRORS", "MAX_DOCUMENT_BYTES", "TMP_DIR"]

#: The most bytes a whole-object read of a document (step document, ref entry, marker) accepts.
MAX_DOCUMENT_BYTES = 256 << 20

#: Exceptions backends raise for a missing object.
MISSING_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError)

_MEMORY_LOCK = threading.Lock()

TMP_DIR = ".tmp"
#: Local disk: the file whose ``flock`` serialises conditional rewrites and removals (:meth:`ObjectStore.replace_if`).
_LOCK_KEY = ".lock"

#: Builds the error raised for a failed backend call: ``access_error(message, key=key)``.
AccessError = Callable[..., Exception]


class ObjectStore:
    """Keyed byte objects under ``root`` of fsspec filesystem ``fs``.

    Parameters
    ----------
    fs : fsspec.AbstractFileSystem
    root : str
        Path of the root on ``fs`` (no trailing slash, no protocol).
    url : str, optional
        The URL the root was opened from (for messages: :attr:`url` holds it with any
        ``user:password@`` redacted, as every message does).
    access_error : callable, optional
        Exception type for backend failures (see the module docstring).
    durable : bool, default True
        Local disk only: fsync every written object and the directories it
        changed before the write returns (object stores are durable on success).

    Notes
    -----
    Thread-safe: the methods hold no state but the filesystem, and fsspec
    filesystems are safe to call from several threads.
    """

    def __init__(
        self,
        fs,
        root: str,
        *,
        url: str | None = None,
        protocol: str | None = None,
        access_error: AccessError | None = None,
        durable: bool = True,
    ):
        self.fs = fs
        self.durable = bool(durable)
        self.root = root.rstrip("/")
        given = url if url is not None else self.root
        self._secrets = credentials(given)  # removed from every message that could show them
        self.url = redact_url(given)
        self.protocol = protocol or "file"
        self.access_error = access_error
        self.local = isinstance(fs, LocalFileSystem)
        self._real_root: str | None = None  # local: the root's real path, once it exists (reads stay under it)
        self.memory = isinstance(fs, MemoryFileSystem)
        self.s3 = is_s3(fs)

    @classmethod
    def from_url(
        cls,
        url,
        storage_options: dict | None = None,
        *,
        access_error: AccessError | None = None,
        durable: bool = True,
    ) -> ObjectStore:
        """Open the objects under an fsspec URL (``s3://bucket/run-7``, ``memory://x``, a local path...).

        ``storage_options`` go to the filesystem (credentials, ``client_kwargs``...).
        Each call makes a fresh filesystem instance: async filesystems bind to the
        first event loop that uses them.
        """
        url = os.fspath(url)
        options = dict(storage_options or {})
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        if protocol in BUCKET_NAMES and credentials(url):
            raise InvalidInputError(
                f"{redact_url(url)}: credentials in a {protocol}:// URL are not used (they would be read as part "
                "of the bucket name): pass them in storage_options (s3fs: key= and secret=; on the command line "
                "-o key=... -o secret=...) or through the backend's environment variables or config files"
            )
        if protocol in ("file", "local"):
            options.setdefault("auto_mkdir", True)  # fsspec's local fs refuses to create parents otherwise
        elif protocol in OBJECT_STORES:
            # several writers share a root: a cached listing would hide their objects from
            # LIST and from existence checks (s3fs answers HEAD from a cached listing)
            options.setdefault("use_listings_cache", False)
        try:
            fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
        except Exception as e:  # unknown protocol, missing backend package, bad options
            secrets = credentials(url)
            redact_error(e, secrets)
            if access_error is None:
                raise
            message = f"cannot open {redact_url(url)!r}: {type(e).__name__}: {redact(str(e), secrets)}"
            raise access_error(message) from e
        return cls(fs, root, url=url, protocol=protocol, access_error=access_error, durable=durable)

    def path(self, key: str) -> str:
        """Backend path of ``key``."""
        return f"{self.root}/{key}" if key else self.root

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __getstate__(self) -> dict:
        # the root's real path is this machine's: a process that unpickles the client (a dask worker, maybe on
        # another host mounting the root elsewhere) resolves its own
        return {**self.__dict__, "_real_root": None}

    def _local_root(self) -> str:
        """The local root's real path: every file read must be under it (no symlinked directory out of it)."""
        real = self._real_root
        if real is None:
            real = os.path.realpath(self.root)
            if os.path.isdir(real):  # (kept once it exists: a writer may create it after this client)
                self._real_root = real
        return real

    def _calling(self, what: str, key: str | None) -> Calling:
        """Map a backend failure to ``access_error`` when the client has one.

        Calls into a filesystem that cannot be shared between threads (fsspec's
        ``filecache::`` and ``blockcache::`` wrappers) are serialised.
        """
        return Calling(serial_lock(self.fs), self.access_error, what, self.url, key, self._secrets)

    # -- probing ----------------------------------------------------------------

    def probe(self) -> None:
        """Check that the bucket exists and can be listed; raise ``access_error`` if not.

        An empty or missing *prefix* is fine (writers create it); a missing
        *bucket*, an unreachable endpoint or denied access is not.
        """
        error = self.access_error or (lambda message, key=None: OSError(message))

        def fail(message: str, key: str) -> Exception:  # (a container may hold a URL's credentials)
            return error(redact(message, self._secrets), key=redact(key, self._secrets))

        if self.protocol in OBJECT_STORES:
            container = self.root.split("/", 1)[0]
            try:
                self.fs.ls(container, detail=False)
            except Exception as e:
                redact_error(e, self._secrets)
                if isinstance(e, FileNotFoundError):
                    raise fail(
                        f"bucket {container!r} does not exist at {self.url!r} (create it first, "
                        "or check the endpoint/region in storage_options)",
                        key=container,
                    ) from e
                text = access_failure(e, self.url)  # no credentials, access denied, unreachable: and what to do
                if text is not None:
                    raise fail(text, key=container) from e
                raise fail(f"listing the bucket failed on {self.url!r}: {type(e).__name__}: {e}", key=container) from e
        elif self.local and os.path.exists(self.root) and not os.path.isdir(self.root):
            raise fail(f"{self.root!r} is a file, not a directory", key="")

    def missing_bucket(self) -> str | None:
        """The bucket (container) of an object-store root, shown redacted, if it does not exist; else None.

        None too when the root is not on an object store, or when the listing fails otherwise (denied,
        unreachable): the caller then reports its own error.  One LIST; for messages about a root that
        holds nothing.
        """
        if self.protocol not in OBJECT_STORES:
            return None
        container = self.root.split("/", 1)[0]
        try:
            self.fs.ls(container, detail=False)
        except FileNotFoundError:
            return redact(container, self._secrets)
        except Exception:  # noqa: BLE001 -- not a missing bucket: the caller's own error says what failed
            return None
        return None

    # -- reads ------------------------------------------------------------------

    def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None if there is no such object.

        ``limit``: the most bytes the caller accepts (a document): a larger object raises ``OSError``
        (``EFBIG``) naming it, after reading at most ``limit + 1`` bytes of it, so that a planted huge
        object cannot exhaust a reader's memory.
        """
        with self._calling("GET", key):
            try:
                if self.local:  # never through a symlink or into a FIFO (a planted one would hang every reader)
                    data = local_disk.read_file(self.path(key), self._local_root(), limit)
                else:
                    ranged = {} if limit is None else {"start": 0, "end": limit + 1}
                    # s3fs's default max_concurrency > 1 sends a HEAD (for the size) before
                    # every GET; one plain GET is all a chunk-sized object needs
                    extra = {"max_concurrency": 1} if self.s3 else {}
                    data = self.fs.cat_file(self.path(key), **ranged, **extra)
            except MISSING_ERRORS:
                return None
            if data is not None and limit is not None and len(data) > limit:
                raise OSError(errno.EFBIG, f"object {key!r} holds more than {limit} bytes, more than any document")
            return data

    def get_ranges(self, key: str, ranges) -> builtins.list | None:
        """The bytes ``[start, end)`` of the object for each ``(start, end)`` in ``ranges``.

        Returns None if there is no such object; else one bytes-like object per
        range (``bytes``, or on local disk for large reads a ``memoryview`` of a
        read-only mapping of the file).  A range that runs past the end of the
        object comes back short: the caller checks lengths.
        """
        ranges = [(int(a), int(b)) for a, b in ranges]
        if any(a < 0 or b < a for a, b in ranges):
            raise ValueError(f"byte ranges must satisfy 0 <= start <= end, got {ranges}")
        if not ranges:
            return []
        with self._calling("GET", key):
            if self.local:
                return local_disk.read_ranges(self.path(key), ranges, self._local_root())
            return self._fetch_ranges(key, ranges)

    def _fetch_ranges(self, key: str, ranges: builtins.list[tuple[int, int]]) -> builtins.list | None:
        """:meth:`get_ranges` through fsspec (object stores, memory://): the non-empty ranges in one batch."""
        path = self.path(key)
        wanted = [r for r in ranges if r[1] > r[0]]  # an empty range would read as the whole object on S3
        if not wanted:
            return [b""] * len(ranges) if self.exists(key) else None
        try:
            if self.s3 or len(wanted) > 1:
                out = self.fs.cat_ranges([path] * len(wanted), [a for a, _ in wanted], [b for _, b in wanted])
            else:
                out = [self.fs.cat_file(path, start=wanted[0][0], end=wanted[0][1])]
        except MISSING_ERRORS:
            return None
        for r in out:
            if isinstance(r, MISSING_ERRORS):
                return None
            if isinstance(r, BaseException):
                raise r
        got = iter(out)
        return [bytes(next(got)) if b > a else b"" for a, b in ranges]

    def size(self, key: str) -> int | None:
        """Size in bytes of the object, or None if there is none."""
        with self._calling("HEAD", key):
            try:
                info = self.fs.info(self.path(key))
            except MISSING_ERRORS:
                return None
        return int(info.get("size") or 0) if info.get("type", "file") != "directory" else None

    def exists(self, key: str) -> bool:
        """Whether an object named ``key`` exists."""
        with self._calling("HEAD", key):
            return bool(self.fs.isfile(self.path(key)))

    def list(self, prefix: str) -> builtins.list[str]:
        """Keys of the objects directly under ``prefix`` (a directory key), sorted."""
        with self._calling("LIST", prefix):
            try:
                if self.local:  # fsspec's local ls normalises every entry's path: a ref log has dozens
                    return self._list_local(prefix)
                paths = self.fs.ls(self.path(prefix), detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
        return sorted(k for p in paths if (k := self._key(p.rstrip("/"))) is not None)

    def _list_local(self, prefix: str) -> builtins.list[str]:
        """:meth:`list` on local disk, answering as fsspec's ``ls`` does (an object lists as itself)."""
        path, head = self.path(prefix), prefix.rstrip("/")
        try:
            # names sorted before the prefix is added (the same order: one prefix), and listdir, not scandir:
            # a follower lists its ref's log (up to 2 * KEEP entries) at every poll
            names = sorted(os.listdir(path))
            return [f"{head}/{n}" for n in names] if head else names
        except NotADirectoryError:
            if os.path.isfile(path):
                return [head]
            raise

    def find(self, prefix: str, *, detail: bool = False) -> Any:
        """Keys of all objects under ``prefix`` (recursively); with ``detail``, ``{key: info}``."""
        with self._calling("LIST", prefix):
            if self.local and not detail:  # fsspec's walk builds an info dict per entry, several times over
                return local_disk.find_keys(self.path(prefix.rstrip("/")), prefix.rstrip("/"))
            try:
                found = self.fs.find(self.path(prefix), detail=detail)
            except FileNotFoundError:
                return {} if detail else []
        if detail:
            return {k: info for p, info in found.items() if (k := self._key(p)) is not None}
        return [k for p in found if (k := self._key(p)) is not None]

    def _key(self, path: str) -> str | None:
        """The key of backend path ``path``, or None if it is not under the root."""
        head = self.root + "/"
        if not head.startswith("/"):
            path = path.lstrip("/")
        return path[len(head) :] if path.startswith(head) else None

    # -- writes -----------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any object there, atomically for readers."""
        path = self.path(key)
        with self._calling("PUT", key):
            if self.local:
                self._put_local(key, data)
            else:
                self.fs.pipe_file(path, data)

    def create(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` only if no object is there.

        Idempotent: if the object already holds exactly ``data``, the create
        succeeds.  That is what a lost response looks like on S3 (the first PUT
        landed, its answer was lost, the client's retry gets 412 from our own
        object); every document ulstore creates carries a timestamp and names
        fresh packs, so equal bytes are this writer's own.

        Raises
        ------
        FileExistsError
            Another object already exists at ``key`` (another writer won).
        OutcomeUnknownError
            The write failed in a way that leaves unknown whether it landed, and
            reading the key back failed too: retry the same call.
        """
        try:
            self._create(key, data)
        except FileExistsError:
            if not self._holds(key, data):
                raise
        except OSError as e:
            if not self.s3:  # local disk and memory://: a failed write did not happen
                raise
            self._settle(key, data, e)

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether the object at ``key`` is exactly ``data`` (another writer's may be larger or smaller)."""
        return self.get(key, limit=max(len(data), MAX_DOCUMENT_BYTES)) == data

    def _settle(self, key: str, data: bytes, error: OSError) -> None:
        """After a failed conditional write of ``data`` on an object store: did it land?  (Read it back.)"""
        try:
            now = self.get(key, limit=max(len(data), MAX_DOCUMENT_BYTES))
        except Exception:
            raise OutcomeUnknownError(
                f"writing {key!r} on {self.url!r} failed ({type(error).__name__}: {error}) and reading it back "
                "failed too: the write may or may not have happened; retry the same call (it is idempotent)",
                key=key,
            ) from error
        if now == data:
            return  # it landed: the failure was the answer's
        if now is not None:
            raise FileExistsError(errno.EEXIST, "object exists", self.path(key)) from error
        raise error

    def _create(self, key: str, data: bytes) -> None:
        path = self.path(key)
        with self._calling("PUT", key):
            if self.local:
                tmp = self._local_tmp(data)
                try:  # a link: atomic, and it fails if path exists
                    local_disk.place(tmp, path, lambda: os.link(tmp, path), self.durable)
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
                    if _precondition_failed(e):
                        raise FileExistsError(errno.EEXIST, "object exists", path) from e
                    raise
            else:
                self.fs.pipe_file(path, data, mode="create")

    # -- conditional rewrites: compare-and-swap on what was read ----------------------

    def replace_if(self, key: str, data: bytes, expected: bytes) -> bool:
        """Overwrite ``key`` with ``data`` only if it still holds exactly ``expected``; False if it does not.

        The compare-and-swap every rewrite of an existing document goes through
        (gc's repack, delete's re-parenting): a document another writer changed
        or removed since it was read is never overwritten with a stale version.

        - local disk: read, compare and ``os.replace`` under an exclusive
          ``flock`` of ``<root>/.lock`` (released by the kernel if the process dies);
        - S3: GET (bytes and ETag), compare, then ``PutObject`` with ``If-Match``;
        - memory://: under the process lock;
        - other fsspec backends: compare, then write (racy between processes).

        A write whose answer was lost (retried, then refused: the object changed,
        to ``data``) is recognised by reading the object back: holding ``data``,
        it succeeded.  So ``data`` must be this writer's own: every document
        ulstore rewrites names fresh packs or a new parent, and a writer that
        wrote the very same bytes left the same state.
        """
        if data == expected:
            return self._holds(key, data)
        with self._calling("PUT", key):
            if self.local:
                with local_disk.exclusive(self.path(_LOCK_KEY)):
                    if local_disk.read_file(self.path(key), self._local_root(), len(expected)) != expected:
                        return False
                    self._put_local(key, data)
                    return True
            if self.memory:
                with _MEMORY_LOCK:
                    if not self.fs.exists(self.path(key)) or self.fs.cat_file(self.path(key)) != expected:
                        return False
                    self.fs.pipe_file(self.path(key), data)
                    return True
            if self.s3:
                return self._s3_swap(key, data, expected)
            if self.get(key, limit=len(expected)) != expected:
                return False
            self.fs.pipe_file(self.path(key), data)
            return True

    def delete_if(self, key: str, expected: bytes) -> bool:
        """Remove ``key`` only if it still holds exactly ``expected``; False if it does not (or is gone)."""
        with self._calling("DELETE", key):
            if self.local:
                with local_disk.exclusive(self.path(_LOCK_KEY)):
                    if local_disk.read_file(self.path(key), self._local_root(), len(expected)) != expected:
                        return False
                    os.unlink(self.path(key))
                local_disk.remove_empty_directories(self.root, key)
                return True
            if self.memory:
                with _MEMORY_LOCK:
                    if not self.fs.exists(self.path(key)) or self.fs.cat_file(self.path(key)) != expected:
                        return False
                    self.fs.rm_file(self.path(key))
                    return True
            if self.s3:
                return self._s3_swap(key, None, expected)
            if self.get(key, limit=len(expected)) != expected:
                return False
            self.fs.rm_file(self.path(key))
            return True

    def _put_local(self, key: str, data: bytes) -> None:
        path = self.path(key)
        tmp = self._local_tmp(data)
        try:
            local_disk.place(tmp, path, lambda: os.replace(tmp, path), self.durable)
        except BaseException:  # (a failed write leaves no staged file)
            local_disk.discard(tmp)
            raise

    def _s3_swap(self, key: str, data: bytes | None, expected: bytes) -> bool:
        """S3: ``key`` -> ``data`` (None: delete) if it holds ``expected``, by ETag (``If-Match``)."""
        fs, path = self.fs, self.path(key)
        bucket, name, _ = fs.split_path(path)

        async def swap() -> str:
            try:
                got = await fs._call_s3("get_object", Bucket=bucket, Key=name)
            except FileNotFoundError:
                return "changed"
            if await got["Body"].read() != expected:
                return "changed"
            try:
                if data is None:
                    await fs._call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=got["ETag"])
                else:
                    await fs._call_s3("put_object", Bucket=bucket, Key=name, Body=data, IfMatch=got["ETag"])
            except FileNotFoundError:
                return "changed"
            except OSError as e:
                if not _precondition_failed(e):
                    raise
                return "412"
            return "done"

        try:
            outcome = fsspec.asyn.sync(fs.loop, swap)
        finally:
            fs.invalidate_cache(path)
        if outcome == "412":  # changed since the GET -- or a retry of our own write whose first answer was lost
            return data is not None and self._holds(key, data)
        return outcome == "done"

    def open_writer(self, key: str, *, block_size: int = 32 << 20) -> ObjectWriter:
        """A writer that streams a new object to ``key``; it appears only at :meth:`ObjectWriter.close`.

        Meant for objects with fresh, unique names (packs): a key that exists is
        replaced.  :meth:`ObjectWriter.abort` (or an exception inside a ``with``
        block) leaves no object.
        """
        return ObjectWriter(self, key, block_size)

    def delete(self, key: str) -> None:
        """Remove the object at ``key`` if it exists (on local disk, with the directories it leaves empty)."""
        with self._calling("DELETE", key):
            try:
                self.fs.rm_file(self.path(key))
            except FileNotFoundError:
                pass
            if self.local:
                local_disk.remove_empty_directories(self.root, key)

    def delete_many(self, keys: builtins.list[str]) -> None:
        """Remove many objects, missing ones ignored (one batched request on S3)."""
        if not keys:
            return
        if self.s3:
            with self._calling("DELETE", keys[0]):
                self.fs.rm([self.path(k) for k in keys])
        else:
            for k in keys:
                self.delete(k)

    def remove_tree(self) -> None:
        """Delete everything under the root."""
        with self._calling("DELETE", ""):
            if self.fs.exists(self.root):
                self.fs.rm(self.root, recursive=True)

    def sweep_tmp(self, older_than: float = 0.0) -> int:
        """Remove temporary files left by killed local writers; returns how many.

        Only regular files and symlinks directly in ``.tmp/`` that are at least
        ``older_than`` seconds old are removed (a live writer's file is younger);
        a symlink is removed itself, never followed, and a ``.tmp`` that is not
        a real directory is left alone.
        """
        if not self.local:
            return 0
        return local_disk.sweep_staging(self.path(TMP_DIR), older_than)

    def local_tmp_dir(self) -> str:
        """The local staging directory ``.tmp/`` (created); refused if it is a symlink or not a directory."""
        return local_disk.staging_dir(self.path(TMP_DIR), TMP_DIR)

    def _local_tmp(self, data: bytes) -> str:
        return local_disk.write_staged(self.local_tmp_dir(), data, self.durable)


def _precondition_failed(e: BaseException) -> bool:
    """Whether an s3fs error is HTTP 412 (a conditional write's condition did not hold)."""
    response = getattr(e.__cause__, "response", None)  # s3fs keeps botocore's ClientError as the cause
    if isinstance(response, dict) and response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
        return True
    text = str(e)
    return "PreconditionFailed" in text or "412" in text or "condition" in text.lower()
