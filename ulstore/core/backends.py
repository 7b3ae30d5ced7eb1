"""What the object client must know about particular fsspec backends, and nothing else.

- which URL protocols name object stores, whose first path component is a
  bucket or container that must exist (:data:`OBJECT_STORES`);
- how to tell s3fs, whose GETs and conditional creates need their own calls
  (:func:`is_s3`);
- which of them take no credentials from a URL (:data:`BUCKET_NAMES`);
- the lock that serialises calls into fsspec's caching wrappers, which are
  not thread-safe (:func:`serial_lock`), and the context of one call
  (:class:`Calling`), which takes it and names a failure;
- which failures mean the storage cannot be used at all (no credentials,
  access denied, endpoint unreachable), and what to tell the user to do
  about them (:func:`access_failure`).
"""

from __future__ import annotations

import threading
import weakref

from fsspec.implementations.cached import CachingFileSystem

from .formatting import redact

__all__ = [
    "OBJECT_STORES",
    "BUCKET_NAMES",
    "is_s3",
    "is_cache",
    "cached_url",
    "serial_lock",
    "Calling",
    "redact_error",
    "access_failure",
]

#: Protocols whose first path component is a bucket/container that must exist.
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2"}
#: Object stores whose bucket names cannot hold an ``@``: a URL's ``user:password@`` is never a credential there.
BUCKET_NAMES = {"s3", "s3a", "gs", "gcs"}

_SERIAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SERIAL_GUARD = threading.Lock()


def is_s3(fs) -> bool:
    return type(fs).__name__ == "S3FileSystem"


def is_cache(fs) -> bool:
    """Whether ``fs`` is one of fsspec's caching wrappers (``simplecache::``, ``filecache::``, ``blockcache::``).

    They are read caches: a write through them lands in the cache (if anywhere) and reaches the
    filesystem behind only when the file is closed, and what they list or answer about existence is
    not the filesystem's.  ulstore reads through them and writes only to the filesystem itself.
    """
    return isinstance(fs, CachingFileSystem)


def cached_url(fs, root: str) -> str | None:
    """The URL of ``root`` on the filesystem behind caching wrapper ``fs`` (``file:///data/run``,
    ``s3://bucket/run``), or None if it cannot be told."""
    target = getattr(fs, "fs", None)
    while isinstance(target, CachingFileSystem):
        target = getattr(target, "fs", None)
    try:
        return target.unstrip_protocol(root) if target is not None else None
    except Exception:  # noqa: BLE001 -- only for a message
        return None


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

    ``url`` is the URL as shown (credentials redacted); ``secrets`` the credentials the URL held
    (:func:`~ulstore.core.formatting.credentials`): they are removed from the failure's message, and from
    the backend's exception and its causes, which may name the path they are part of.

    A class, not a generator-based context manager: a weight-sync follower makes about six calls per
    version, and contextlib's machinery cost several times this (tens of microseconds with cold caches).
    """

    __slots__ = ("lock", "error", "what", "url", "key", "secrets")

    def __init__(self, lock, error, what: str, url: str, key: str | None, secrets: tuple[str, ...] = ()) -> None:
        self.lock, self.error, self.what, self.url, self.key, self.secrets = lock, error, what, url, key, secrets

    def __enter__(self) -> None:
        if self.lock is not None:
            self.lock.acquire()

    def __exit__(self, kind, e, tb) -> None:
        if self.lock is not None:
            self.lock.release()
        if e is None or not isinstance(e, Exception):
            return
        if self.secrets:
            redact_error(e, self.secrets)
        if self.error is None or isinstance(e, FileExistsError):
            return  # (re-raised as it is)
        message = access_failure(e, self.url) or f"{self.what} failed on {self.url!r}: {type(e).__name__}: {e}"
        raise self.error(redact(message, self.secrets), key=self.key) from e


def redact_error(e: BaseException, secrets: tuple[str, ...]) -> None:
    """Remove ``secrets`` (and any URL's userinfo) from the message of ``e`` and of its causes, in place.

    A backend's exception may name the path a URL's credentials became part of (s3fs: the bucket
    ``KEY:SECRET@bucket``); it is re-raised as it is, so its text is what the caller shows.
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        try:
            cur.args = tuple(redact(a, secrets) if isinstance(a, str) else a for a in cur.args)
            if isinstance(cur, OSError):  # its text comes from these, not from args
                for attr in ("strerror", "filename", "filename2"):
                    value = getattr(cur, attr, None)
                    if isinstance(value, str):
                        setattr(cur, attr, redact(value, secrets))
        except (AttributeError, TypeError):  # an exception type with read-only attributes: left as it is
            pass
        cur = cur.__cause__ or cur.__context__


#: botocore's names for "no usable credentials" (raised before any request is sent).
_NO_CREDENTIALS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "NoAuthTokenError",
    "TokenRetrievalError",
    "UnauthorizedSSOTokenError",
}
#: botocore's and aiohttp's names for "the endpoint cannot be reached".
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ClientConnectorDNSError",
    "ServerTimeoutError",
}
_S3_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile in ~/.aws/credentials), or pass "
    "storage_options={'key': ..., 'secret': ...} (CLI: -o key=... -o secret=...); for a public bucket, "
    "anon=True (CLI: -o anon=true)"
)
_OTHER_CREDENTIALS = (
    "give the filesystem its credentials: its environment variables or config files, or storage_options "
    "(CLI: -o KEY=VALUE)"
)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def access_failure(e: BaseException, url: str) -> str | None:
    """What to tell the user when ``e`` means the storage at ``url`` (shown as given: redact it first)
    cannot be used at all, or None for any other failure.

    No credentials (botocore's ``NoCredentialsError``...), access denied on an object store
    (``PermissionError``), or an endpoint that cannot be reached: the message names the URL, what is
    wrong (the backend's words) and how to fix it.
    """
    protocols = {part.split("://", 1)[0] for part in str(url).split("::") if "://" in part}
    s3 = bool(protocols & {"s3", "s3a"})
    remote = bool(protocols & OBJECT_STORES)
    for cause in _chain(e):
        name = type(cause).__name__
        what = f"{name}: {cause}" if str(cause) else name
        if name in _NO_CREDENTIALS:
            return f"no credentials for {url!r} ({what}): {_S3_CREDENTIALS if s3 else _OTHER_CREDENTIALS}"
        if not remote:
            continue
        if isinstance(cause, PermissionError):
            return (
                f"access denied to {url!r} ({what}): the credentials in use may not do this; check which ones "
                f"are used and what the bucket's policy allows ({_S3_CREDENTIALS if s3 else _OTHER_CREDENTIALS})"
            )
        if name in _UNREACHABLE or isinstance(cause, (ConnectionError, TimeoutError)):
            return (
                f"cannot reach the storage of {url!r} ({what}): check the endpoint (storage_options "
                "endpoint_url=..., CLI: -o endpoint_url=...), the region and the network"
            )
    return None
