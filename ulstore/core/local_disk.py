"""Local-disk primitives of the object client: durable files and directories, safe range reads, temp sweeps.

Writes: a file is written whole under the staging directory, fsynced when
durable, then linked or renamed into place by the caller; every directory
whose entries changed is fsynced too (:func:`sync_dir`, :func:`makedirs`),
so when a write returns a power cut cannot lose it.  A write that fails (a full
disk) removes its staged file (:func:`discard`): only a killed writer leaves one.

Directories are only the prefixes of object names: :func:`find_keys` lists
objects without following a symlink, :func:`remove_empty_directories` removes
what a delete leaves empty, and :func:`place` puts a staged file in again if
another process removed its fresh directory meanwhile.

Reads (:func:`read_file`, :func:`read_ranges`): one descriptor, opened without
following a final symlink and refused unless it is a regular file, so a FIFO
or device planted in the root can neither hang nor flood a reader; reads of
1 MiB or more map the file read-only instead of copying, which assumes
nobody truncates the file meanwhile (packs are never modified).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import time
import uuid
from collections.abc import Callable

__all__ = [
    "exclusive",
    "read_file",
    "read_ranges",
    "find_keys",
    "staging_dir",
    "write_staged",
    "discard",
    "place",
    "makedirs",
    "sync_dir",
    "remove_empty_directories",
    "sweep_staging",
]

_MMAP_BYTES = 1 << 20  # local range reads at least this large map the file instead of copying
#: times a write places its file again after another process removed the (empty) directory it made
_DIRECTORY_RACES = 8


@contextlib.contextmanager
def exclusive(lock_path: str):
    """Hold an exclusive ``flock`` of ``lock_path`` (created if missing) for the body.

    The kernel releases it when the process dies, so a killed writer never
    leaves it held.  Threads of one process exclude each other too (each call
    opens its own descriptor).
    """
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(lock_path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _open_regular(path: str, root: str | None = None) -> tuple[int, os.stat_result] | None:
    """A read-only descriptor of ``path`` and its stat; None if it is missing, a symlink or not a regular file.

    ``root`` (a real path): PermissionError if the file opened is not under it (a directory on the way was a
    symlink out of the root).
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink: never followed
            return None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device would hang or never end
        os.close(fd)
        return None
    if root is not None and not _under(fd, path, root):
        os.close(fd)
        raise PermissionError(f"{path!r} lies outside {root!r} (a directory on its way is a symlink): not read")
    return fd, st


def _under(fd: int, path: str, root: str) -> bool:
    """Whether the file open at ``fd`` (opened as ``path``) is really under directory ``root``."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")  # the file opened, whatever the path went through
    except OSError:  # no /proc: resolve the path instead
        real = os.path.realpath(path)
    return real.startswith(root.rstrip(os.sep) + os.sep)


def read_file(path: str, root: str | None = None, limit: int | None = None) -> bytes | None:
    """The bytes of file ``path``; None if it is missing, a symlink or not a regular file (as :func:`read_ranges`).

    ``limit``: read at most ``limit + 1`` bytes (the caller refuses more).
    """
    opened = _open_regular(path, root)
    if opened is None:
        return None
    fd, st = opened
    with open(fd, "rb", buffering=0) as f:  # takes the descriptor (and closes it)
        # read(n) allocates n bytes first: ask for what the file holds (one more byte shows it grew past limit)
        return f.readall() if limit is None else f.read(min(limit, st.st_size) + 1)


def read_ranges(path: str, ranges: list[tuple[int, int]], root: str | None = None) -> list | None:
    """The bytes ``[start, end)`` of file ``path`` per range; None if it is missing, a symlink or not a regular file.

    ``root``: the real path of the directory ``path`` must lie in (PermissionError if it does not).
    """
    opened = _open_regular(path, root)
    if opened is None:
        return None
    fd, st = opened
    try:
        if st.st_size and sum(b - a for a, b in ranges) >= _MMAP_BYTES:
            # large reads: views of a read-only mapping, no copy (objects read this way are
            # immutable packs; the views keep the mapping alive)
            view = memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
            return [view[min(a, st.st_size) : min(b, st.st_size)] for a, b in ranges]
        # a range past the end comes back short (crafted offsets up to 2**63 included: no EINVAL, no huge buffer)
        size = st.st_size
        return [os.pread(fd, min(b, size) - a, a) if min(b, size) > a else b"" for a, b in ranges]
    finally:
        os.close(fd)


def staging_dir(d: str, name: str) -> str:
    """Directory ``d`` (created), refused if it is a symlink or not a directory (``name``: for the message)."""
    if not os.path.islink(d):
        os.makedirs(d, exist_ok=True)
    if os.path.islink(d) or not os.path.isdir(d):
        raise OSError(errno.ENOTDIR, f"{name} under the root is not a real directory (a symlink?)", d)
    return d


def write_staged(d: str, data: bytes, durable: bool) -> str:
    """Write ``data`` to a fresh file in directory ``d`` (fsynced if ``durable``); returns its path.

    A write that fails (``ENOSPC``...) removes its half-written file and raises.
    """
    tmp = os.path.join(d, uuid.uuid4().hex)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        discard(tmp)
        raise
    return tmp


def discard(path: str) -> None:
    """Remove the staged file ``path`` after a failed write, if it is there (never raises: the failure does)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def find_keys(path: str, head: str) -> list[str]:
    """Keys (``head/...``) of every object under directory ``path``, sorted: symlinks listed, never followed.

    The object client's LIST on local disk.  A walk with ``os.scandir``: ``steps/`` holds a directory per
    step, and fsspec's generic walk took 3.4x as long.  ``path`` that is an object itself lists as
    ``[head]`` (a symlink is an object; the root, ``head`` empty, may be a symlink and is followed).
    """
    if (head and os.path.islink(path)) or not os.path.isdir(path):
        return [head] if head and os.path.lexists(path) else []
    keys, todo = [], [(path, head)]
    while todo:  # iterative: a crafted tree cannot exhaust the stack
        directory, key = todo.pop()
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):  # removed meanwhile
            continue
        for e in entries:
            name = f"{key}/{e.name}" if key else e.name
            if e.is_dir(follow_symlinks=False):
                todo.append((e.path, name))
            else:
                keys.append(name)
    return sorted(keys)


def place(tmp: str, path: str, put: Callable[[], None], durable: bool) -> None:
    """Make ``path``'s directory, then ``put()`` the staged file ``tmp`` there (a rename or a link).

    Tried again if another process removed the directory in between (it found it empty,
    :func:`remove_empty_directories`); a missing ``tmp`` is an error at once.
    """
    for attempt in range(_DIRECTORY_RACES):
        try:
            makedirs(os.path.dirname(path), durable)  # (a directory on its way may go meanwhile, too)
            put()
            break
        except FileNotFoundError:
            if attempt == _DIRECTORY_RACES - 1 or not os.path.exists(tmp):
                raise
    sync_dir(os.path.dirname(path), durable)  # holds the file now: nobody removes it


def remove_empty_directories(root: str, key: str) -> None:
    """Remove the directories of ``key`` under ``root`` that are empty now, up to (not including) the top-level
    ones.

    Every commit puts and deletes ``pending/commit/<parent>/<step>.json``: without this a run of n steps
    left n empty directories, walked by every later commit's LIST of ``pending/``.  A writer that made one
    of them just before it is removed places its file again (:func:`place`).
    """
    parts = key.split("/")[:-1]
    while len(parts) >= 2:
        try:
            os.rmdir(os.path.join(root, *parts))
        except OSError:  # not empty, already gone, or not a directory: the ones above are not empty either
            return
        parts.pop()


def makedirs(d: str, durable: bool) -> None:
    """``os.makedirs(d)``; durable: fsync the parent of every directory it created."""
    missing = []
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    if not missing:
        return
    os.makedirs(missing[0], exist_ok=True)
    for made in reversed(missing):
        sync_dir(os.path.dirname(made), durable)


def sync_dir(d: str, durable: bool) -> None:
    """Durable: fsync directory ``d`` so the entries just linked into it survive a power cut."""
    if not durable:
        return
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sweep_staging(d: str, older_than: float) -> int:
    """Remove regular files and symlinks directly in ``d`` at least ``older_than`` seconds old; returns how many.

    A symlink is removed itself, never followed, and a ``d`` that is not a
    real directory is left alone.
    """
    if os.path.islink(d) or not os.path.isdir(d):
        return 0
    now = time.time()
    n = 0
    with os.scandir(d) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue
                if older_than and now - st.st_mtime < older_than:
                    continue
                os.unlink(entry.path)
                n += 1
            except FileNotFoundError:
                pass
    return n
