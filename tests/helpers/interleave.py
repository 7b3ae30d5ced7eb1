"""Forced interleavings of real processes: run the other side at one chosen object call of this process.

:func:`interleave` hooks every public method of
:class:`ulstore.core.objects.ObjectStore` (``get``, ``put``, ``create``,
``delete``, ``delete_many``, ``find``... and whatever methods it grows, such as
conditional rewrites: the hook wraps them by name when it is installed) and
``write`` / ``close`` of the pack writer it opens (:class:`ObjectWriter`, named
``writer.write`` / ``writer.close``).  When a call matches the predicate (its
method and key), for the ``nth`` time, the callback runs first (or right after
the call, ``when="after"``); then the call proceeds.  The callback is typically
the other side's whole operation (a gc, a delete, a commit, a publish) in
another process, against the same URL::

    with interleave(on=("put", r"^steps/\\d+/zarr\\.json$"), run=lambda call: run_python(GC, url)) as il:
        traj.delete(7)          # its first step document PUT waits for a whole gc in another process
    assert il.fired             # the gc ran, at that call

While a callback runs, every hooked call that another thread of this process
starts waits for it (a commit's pack writer and readers are threads), so the
other side sees this process stopped at the call.  Calls the callback itself
makes in this process are neither counted nor matched.  Nested calls (an
``ObjectStore`` method calling another) count once, as the outer call.

The hook is on the class, so it sees every trajectory, publisher and follower
of the process, whichever object client they opened; ``on=`` can also look at
``call.url``.  :func:`kill_at_env` uses it to SIGKILL a child process at its
Nth write (the crash trials).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ulstore.core.object_writer import ObjectWriter
from ulstore.core.objects import ObjectStore

__all__ = [
    "Call",
    "Interleaving",
    "interleave",
    "hooked_methods",
    "READS",
    "is_write",
    "kill_at_env",
    "KILL_ENV",
    "run_python",
    "REPO",
]

#: The repository (worktree) these tests run from: children import its ulstore and tests.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Methods that only read (or compute a path): every other hooked method may change storage.
READS = frozenset({"get", "get_ranges", "size", "exists", "list", "find", "probe"})

#: Public methods of ObjectStore that are not storage calls (pure, or the staging directory of a local write).
_NOT_CALLS = frozenset({"path", "local_tmp_dir", "from_url"})

#: Methods of the pack writer that are hooked, under ``writer.<name>``.
_WRITER_METHODS = ("write", "close", "abort")

#: Environment variable :func:`kill_at_env` reads: ``N`` (SIGKILL before the Nth write), or ``N:regex``.
KILL_ENV = "ULSTORE_KILL_AT"


@dataclass(frozen=True)
class Call:
    """One hooked call: ``method`` (``"put"``, ``"writer.close"``...), ``key`` (``""`` if it has none),
    ``keys`` (all keys of a ``delete_many``), ``url`` of the object client, ``index`` (1-based, among the
    calls that matched the predicate so far; 0 if it did not match)."""

    method: str
    key: str
    keys: tuple[str, ...]
    url: str
    index: int = 0
    thread: str = ""


def is_write(call: Call) -> bool:
    """Whether ``call`` may change storage (everything but :data:`READS`)."""
    return call.method not in READS


def hooked_methods() -> list[str]:
    """Names of the ObjectStore methods the hook wraps (every public function of the class, as it is now)."""
    out = []
    for name, value in vars(ObjectStore).items():
        if name.startswith("_") or name in _NOT_CALLS:
            continue
        if isinstance(value, staticmethod | classmethod | property) or not inspect.isfunction(value):
            continue
        out.append(name)
    return sorted(out)


def _keys_of(args: tuple, kwargs: dict) -> tuple[str, tuple[str, ...]]:
    first = args[0] if args else kwargs.get("key", kwargs.get("keys", kwargs.get("prefix")))
    if isinstance(first, str):
        return first, (first,)
    if isinstance(first, list | tuple) and all(isinstance(k, str) for k in first):
        keys = tuple(first)
        return (keys[0] if keys else ""), keys
    return "", ()


Predicate = Callable[[Call], bool]


def _predicate(on) -> Predicate:
    """``on``: None (every call), a callable of a :class:`Call`, or ``(method(s), key regex)``.

    ``method(s)``: a name, a set/tuple of names, or ``"*"``; a regex matches with ``re.search`` against any of
    the call's keys (``None``: any key).
    """
    if on is None:
        return lambda call: True
    if callable(on):
        return on
    methods, pattern = on
    names = None if methods == "*" else {methods} if isinstance(methods, str) else set(methods)
    rx = None if pattern is None else re.compile(pattern)

    def match(call: Call) -> bool:
        if names is not None and call.method not in names:
            return False
        return rx is None or any(rx.search(k) for k in call.keys or ("",))

    return match


@dataclass
class Interleaving:
    """What one :func:`interleave` saw: ``calls`` (every hooked call while it was active, with ``record``),
    ``matched`` (the calls that matched ``on``), ``fired`` (the calls the callback ran at) and ``results``
    (what the callback returned, one per firing)."""

    predicate: Predicate
    run: Callable[[Call], Any]
    nth: int
    times: int
    when: str
    record: bool
    calls: list[Call] = field(default_factory=list)
    matched: list[Call] = field(default_factory=list)
    fired: list[Call] = field(default_factory=list)
    results: list = field(default_factory=list)

    def _wants(self, index: int) -> bool:
        return self.nth <= index < self.nth + self.times


_ACTIVE: list[Interleaving] = []
_STATE = threading.Lock()  # guards _ACTIVE, the counters and the installation
_GATE = threading.RLock()  # held while a callback runs: other threads' calls wait at it
_LOCAL = threading.local()  # depth (nested calls), in_callback
_ORIGINALS: dict[tuple[type, str], Any] = {}
_FOR_LIFE: list = []  # interleavings active for the life of the process (kill_at_env)


def _depth() -> int:
    return getattr(_LOCAL, "depth", 0)


def _wrap(cls: type, name: str, public: str, fn):
    def hooked(self, *args, **kwargs):
        if _depth() or getattr(_LOCAL, "in_callback", False) or not _ACTIVE:
            return fn(self, *args, **kwargs)
        if cls is ObjectWriter:
            key, keys, url = self.key, (self.key,), self.store.url
        else:
            key, keys = _keys_of(args, kwargs)
            url = self.url
        _LOCAL.depth = 1
        try:
            with _GATE:  # wait for a callback another thread is running
                before, after = _decide(Call(public, key, keys, url, 0, threading.current_thread().name))
                _fire(before)
            result = fn(self, *args, **kwargs)
            if after:
                with _GATE:
                    _fire(after)
            return result
        finally:
            _LOCAL.depth = 0

    hooked.__wrapped__ = fn  # type: ignore[attr-defined]
    hooked.__name__ = name
    return hooked


def _decide(call: Call) -> tuple[list, list]:
    before, after = [], []
    with _STATE:
        for il in list(_ACTIVE):
            if il.record:
                il.calls.append(call)
            if not il.predicate(call):
                continue
            hit = Call(call.method, call.key, call.keys, call.url, len(il.matched) + 1, call.thread)
            il.matched.append(hit)
            if il._wants(hit.index):
                (before if il.when == "before" else after).append((il, hit))
    return before, after


def _fire(pending: list) -> None:
    for il, hit in pending:
        _LOCAL.in_callback = True
        try:
            il.fired.append(hit)
            il.results.append(il.run(hit))
        finally:
            _LOCAL.in_callback = False


def _install() -> None:
    if _ORIGINALS:
        return
    for name in hooked_methods():
        fn = vars(ObjectStore)[name]
        _ORIGINALS[(ObjectStore, name)] = fn
        setattr(ObjectStore, name, _wrap(ObjectStore, name, name, fn))
    for name in _WRITER_METHODS:
        fn = vars(ObjectWriter)[name]
        _ORIGINALS[(ObjectWriter, name)] = fn
        setattr(ObjectWriter, name, _wrap(ObjectWriter, name, f"writer.{name}", fn))


def _uninstall() -> None:
    for (cls, name), fn in _ORIGINALS.items():
        setattr(cls, name, fn)
    _ORIGINALS.clear()


@contextlib.contextmanager
def interleave(
    on=None,
    run: Callable[[Call], Any] | None = None,
    *,
    nth: int = 1,
    times: int = 1,
    when: str = "before",
    record: bool = True,
) -> Iterator[Interleaving]:
    """Run ``run(call)`` at the ``nth`` call matching ``on`` (and the ``times - 1`` matching calls after it).

    Parameters
    ----------
    on : None, callable or (method(s), key regex)
        Which calls count (see :func:`_predicate`): ``("put", r"^steps/\\d+/zarr\\.json$")``,
        ``(("put", "create"), r"^refs/")``, ``is_write``, ``lambda call: ...``.
    run : callable
        Called with the matching :class:`Call`, in the calling thread, while every other hooked call of this
        process waits; its return value is kept in ``.results``.  Exceptions propagate into the call.
    nth, times : int
        The first matching call that fires (1-based) and how many consecutive matching calls fire.
    when : {"before", "after"}
        Run the callback before the call proceeds, or after it returned (a call that raises fires nothing).
    record : bool
        Keep every hooked call in ``.calls`` (turn off for long runs).
    """
    if when not in ("before", "after"):
        raise ValueError(f"when must be 'before' or 'after', got {when!r}")
    if nth < 1 or times < 0:
        raise ValueError("nth must be >= 1 and times >= 0")
    il = Interleaving(_predicate(on), run or (lambda call: None), nth, times, when, record)
    with _STATE:
        _install()
        _ACTIVE.append(il)
    try:
        yield il
    finally:
        with _STATE:
            _ACTIVE.remove(il)
            if not _ACTIVE:
                _uninstall()


def kill_at_env(environ=None) -> Interleaving | None:
    r"""In a child process: SIGKILL this process before its Nth write, as :data:`KILL_ENV` says.

    ``ULSTORE_KILL_AT=N`` counts every write (:func:`is_write`: put, create, delete, pack writes...);
    ``N:regex`` counts the writes for which ``regex`` matches ``"<method> <key>"`` (``"create steps/3/zarr.json"``;
    ``^(?!writer\.write )`` skips the bytes streamed into packs).  Unset or ``0``: no kill, but the writes are
    still counted (``.matched``), so a child can report how many its operation made.  Stays active for the
    life of the process.
    """
    spec = (environ if environ is not None else os.environ).get(KILL_ENV, "0")
    n, _, pattern = spec.partition(":")
    rx = re.compile(pattern) if pattern else None

    def counted(call: Call) -> bool:
        return is_write(call) and (rx is None or any(rx.search(f"{call.method} {k}") for k in call.keys or ("",)))

    def kill(call: Call) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    nth = int(n)
    cm = interleave(on=counted, run=kill, nth=max(nth, 1), times=1 if nth > 0 else 0, record=False)
    _FOR_LIFE.append(cm)  # (a generator context manager closed by the collector would end the interleaving)
    return cm.__enter__()


def run_python(code: str, *args, env: dict | None = None, timeout: float = 300, check: bool = True) -> Any:
    """Run ``code`` in a fresh interpreter (``python -c code args...``) from :data:`REPO`; returns the JSON its
    last line of stdout prints (None if it printed nothing), or with ``check=False`` the CompletedProcess.

    The child imports this worktree's ulstore and tests (``PYTHONPATH``).  With ``check``, a non-zero exit
    raises ``AssertionError`` carrying the child's stderr.
    """
    child_env = dict(os.environ if env is None else env)
    if env is None:
        child_env.pop(KILL_ENV, None)  # a kill meant for this process is not the child's
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, child_env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if not check:
        return proc
    if proc.returncode != 0:
        raise AssertionError(f"child exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None
