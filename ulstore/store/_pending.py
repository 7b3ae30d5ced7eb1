"""Work in flight: the markers that commits, deletes and gc announce, so that they never break each other.

A commit's new step refers to its parent and, through the entries it reuses
verbatim, to older steps; ``delete(S)`` rewrites every step that refers to
``S`` and then removes ``S``; gc rewrites step documents to move their blobs.
Each announces itself under ``pending/``, then looks for the others (on a
store with read-after-write listings, of two that overlap at least one sees
the other), and the one that sees a conflict **refuses** with a named error
(gc: skips its destructive half), before changing anything:

.. code-block:: text

    pending/commit/<parent>/<step>.<token>.json  a commit of <step> on <parent> is in flight (put after
                                                 encoding, before the commit point; removed once its ref
                                                 has moved)
    pending/delete/<step>.<token>.json           a delete of <step> is in flight
    pending/gc/<token>.json                      a gc is in flight

Each is sealed JSON ``{"branch" (commits), "writer": "host:pid", "expires": "<ISO time>"}``; ``token`` is
random, so two writers never share (and never remove) each other's marker.  Format-2 markers without a
token are read too.

- **commit** of ``C`` on ``P`` (:meth:`Pending.publish`): put the intent; then
  refuse (:class:`ConflictError`) if a delete of ``P`` or of any step ``C``'s
  entries refer to is in flight, or if one of those steps is already gone (a
  delete finished during the encode); then **prove the parent**: ``P``'s
  document as stored now must have the content checksum ``C`` was coded
  against (another writer may have deleted ``P`` and committed a different
  ``P`` since this process read it), else :class:`StaleParentError`.
- **delete** of ``S`` (:meth:`Pending.deleting`): put the marker; then refuse
  if another delete or a gc is in flight, or if a commit whose parent is ``S``
  or a step that refers to ``S`` has announced itself but not created its step.
  A commit *of* ``S`` whose step exists but whose branch has not moved yet is
  **fenced**: its branch gets a new entry (same head), so that commit's
  compare-and-swap fails and it can never move its branch to the deleted step.
- **gc** (:meth:`Pending.collecting`): put the marker; if a delete or another gc
  is in flight, it only reports and removes nothing (the other is rewriting
  documents and writing a pack it has not named yet).
- An intent left by a commit killed *after* its commit point (its step exists,
  its branch did not move) is how the next commit on that branch notices the
  interrupted one (D12) instead of silently taking the older head as parent.
  Its ``expires`` (or, on the same host, a writer process that no longer runs)
  tells an interrupted commit from one still finishing: :meth:`Intent.live`.

Stale markers (a writer killed mid-way) are removed by ``gc(older_than=...)``
once older than the grace period.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..core.objects import MAX_DOCUMENT_BYTES, ObjectStore
from ..core.sealed import open_sealed, seal
from ..errors import (
    ConflictError,
    CorruptManifestError,
    OutcomeUnknownError,
    RefMovedError,
    StaleParentError,
    StepNotFoundError,
)
from .format._refs import RefLog, RefState

__all__ = ["Pending", "Intent", "PENDING_DIR", "LEASE_SECONDS"]

PENDING_DIR = "pending"
#: How long a commit's intent counts as in flight (its writer announces it after encoding, a few
#: requests before it removes it): past this, a step it created off its branch is an orphan.
LEASE_SECONDS = 120.0
_TOKEN = r"(?:\.([0-9a-f]{32}))?"
_COMMIT_RE = re.compile(rf"^pending/commit/(0|[1-9][0-9]*)/(0|[1-9][0-9]*){_TOKEN}\.json\Z")
_DELETE_RE = re.compile(rf"^pending/delete/(0|[1-9][0-9]*){_TOKEN}\.json\Z")
_GC_RE = re.compile(r"^pending/gc/([0-9a-f]{32})\.json\Z")
_HOST = socket.gethostname()
#: Markers of this process whose work is running (a marker it left behind after a failure is not).
_ACTIVE: set[str] = set()


def _writer() -> str:
    return f"{_HOST}:{os.getpid()}"


def _marker(**fields) -> bytes:
    expires = _dt.datetime.now(_dt.UTC) + _dt.timedelta(seconds=LEASE_SECONDS)
    return seal({**fields, "writer": _writer(), "expires": expires.isoformat(timespec="milliseconds")})


@dataclass(frozen=True)
class Marker:
    """A marker under ``pending/``: its key, and who wrote it until when (None if unreadable)."""

    key: str
    writer: str | None = None
    expires: float | None = None

    def live(self) -> bool:
        """Whether its work may still be running: its lease has not expired and, when it ran on this
        host, its process still exists.  (A marker that cannot tell counts as live.)"""
        if self.writer == _writer():  # this process: live while its call is running
            return self.key in _ACTIVE
        if self.writer is not None:
            host, _, pid = self.writer.rpartition(":")
            if host == _HOST and pid.isdigit() and not _alive(int(pid)):
                return False
        if self.expires is None:
            return True
        return _dt.datetime.now(_dt.UTC).timestamp() < self.expires


@dataclass(frozen=True)
class Intent(Marker):
    """A commit in flight (or killed): ``step`` on ``parent`` for ``branch``."""

    parent: int = -1
    step: int = -1
    branch: str | None = None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


class _Lost(Exception):
    """The branch moved between a commit's commit point and its branch move (raised as RefMovedError)."""

    def __init__(self, step: int, parent: int | None, branch: str, moved: RefMovedError):
        self.step, self.parent, self.branch, self.moved = step, parent, branch, moved

    def error(self, kept: bool) -> RefMovedError:
        """``kept``: the step stored is this commit's (else another writer discarded it, maybe committed its own)."""
        step, e = self.step, self.moved
        return RefMovedError(
            f"step {step} was committed (parent {self.parent}) but branch {self.branch!r} moved to {e.head} "
            "meanwhile, so the branch does not include it; "
            + (
                f"the step is kept. To put this state on the branch, delete({step}) and commit it again, or commit "
                "it under a new step number"
                if kept
                else "another writer then deleted it as an interrupted commit: commit it again (a new step number "
                "if that writer committed its own)"
            ),
            head=e.head,
            step=step,
            key=e.key,
        )


class Heartbeat:
    """Renews a marker's lease while its (long) work runs: call it between units of work."""

    def __init__(self, io: ObjectStore, key: str):
        self.io, self.key = io, key
        self.renewed = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.renewed > LEASE_SECONDS / 4:
            self.io.put(self.key, _marker())
            self.renewed = time.monotonic()


def _refuse_interrupted(step: int, parent: int, branch: str, commits: list[Intent], existing: set[int]) -> None:
    for intent in commits:
        if (
            intent.parent == parent
            and intent.step != step
            and intent.step in existing
            and intent.branch in (branch, None)
        ):
            raise ConflictError(
                f"step {intent.step} was committed on step {parent} for branch {branch!r}, but the branch was "
                "never moved to it (its commit was interrupted after its commit point, or is finishing right "
                f"now); nothing was committed. Retry that commit (commit({intent.step}, ...) completes it), "
                f"or set_ref({branch!r}, {intent.step}), or delete({intent.step}); then commit again",
                step=intent.step,
                key=intent.key,
            )


def _refuse_deleted(step: int, needed: set[int], deletes: dict[int, str], existing: set[int]) -> None:
    for s in sorted(needed & set(deletes)):
        raise ConflictError(
            f"step {s}, which this commit is coded against, is being deleted; nothing was committed. "
            f"Retry once the delete is done (if no delete is running, it was killed: run delete({s}) "
            "again, or gc(older_than=...) removes the marker)",
            step=step,
            key=deletes[s],
        )
    gone = needed - existing
    if gone:
        raise StepNotFoundError(
            f"step {min(gone)}, which this commit is coded against, was deleted during the commit; nothing "
            "was committed: commit again on an existing parent",
            step=step,
        )


def _token() -> str:
    return uuid.uuid4().hex


@dataclass
class Listing:
    """What one LIST of ``pending/`` found (each marker read: one GET each)."""

    deletes: list[tuple[int, Marker]]  # (step, marker)
    commits: list[Intent]
    gcs: list[Marker]


class Pending:
    """The in-flight markers under ``pending/`` of ``io``."""

    def __init__(self, io: ObjectStore):
        self.io = io

    def listing(self) -> Listing:
        """Deletes, commits and gcs in flight."""
        out = Listing([], [], [])
        for key in self.io.find(PENDING_DIR):
            if m := _DELETE_RE.match(key):
                out.deletes.append((int(m.group(1)), Marker(key, *self._read(key)[1:])))
            elif m := _COMMIT_RE.match(key):
                branch, writer, expires = self._read(key)
                out.commits.append(Intent(key, writer, expires, int(m.group(1)), int(m.group(2)), branch))
            elif _GC_RE.match(key):
                out.gcs.append(Marker(key, *self._read(key)[1:]))
        return out

    def _read(self, key: str) -> tuple[str | None, str | None, float | None]:
        """(branch, writer, expires) of a marker; None where unreadable."""
        raw = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
        try:
            body = open_sealed(raw, CorruptManifestError) if raw is not None else {}
        except CorruptManifestError:
            body = {}
        branch, writer, expires = body.get("branch"), body.get("writer"), body.get("expires")
        try:
            when = _dt.datetime.fromisoformat(expires).timestamp() if isinstance(expires, str) else None
        except ValueError:
            when = None
        return (
            branch if isinstance(branch, str) else None,
            writer if isinstance(writer, str) else None,
            when,
        )

    def intents(self, step: int) -> list[Intent]:
        """The commit intents of ``step`` (on any parent)."""
        return [i for i in self.listing().commits if i.step == step]

    # -- commit side ----------------------------------------------------------------

    def publish(
        self,
        step: int,
        parent: int | None,
        refers: Iterable[int],
        create: Callable[[], None],
        *,
        refs: RefLog,
        branch: RefState | None,
        existing: Callable[[set[int]], set[int]],
        parent_content: Callable[[], str | None] | None = None,
        coded_against: str | None = None,
        still_mine: Callable[[], bool] | None = None,
    ) -> None:
        """The end of every commit: checks, the commit point ``create()``, then the branch's compare-and-swap.

        ``refers``: the steps the new step's entries are coded against;
        ``branch``: the branch as read when the commit started (None: move no
        ref); ``existing(steps)``: which of ``steps`` are committed;
        ``parent_content()``: the parent's content checksum as stored now (None:
        gone), which must be ``coded_against``; ``still_mine()``: whether the step
        stored is the one ``create()`` wrote (after a lost branch race).

        Raises
        ------
        RefMovedError
            The branch moved since it was read.  Before the commit point the step
            is not created (retry with the same step); after it (a narrow window)
            the step exists off the branch and the message says so.
        StaleParentError
            The parent stored now is not the one this commit was coded against.
        ConflictError
            A step this commit refers to is being deleted, or an earlier commit
            on the same head created its step but never moved the branch (D12).
        StepNotFoundError
            A step this commit refers to was deleted during the commit.
        StepExistsError
            From ``create()``: another writer created the step first.
        """
        key = self._announce(step, parent, branch) if parent is not None else None
        try:
            self._commit(step, parent, refers, create, refs, branch, existing, parent_content, coded_against, key)
        except _Lost as lost:
            kept = still_mine() if still_mine is not None else bool(existing({step}))
            raise lost.error(kept) from None
        finally:
            if key is not None:
                _ACTIVE.discard(key)

    def _commit(self, step, parent, refers, create, refs, branch, existing, parent_content, coded_against, key) -> None:
        try:
            if parent is not None:
                seen = self.listing()
                needed = {parent, *refers}
                found = existing(needed | {i.step for i in seen.commits if i.parent == parent})
                if branch is not None:
                    _refuse_interrupted(step, parent, branch.name, seen.commits, found)
                _refuse_deleted(step, needed, {s: m.key for s, m in seen.deletes}, found)
                if parent_content is not None:
                    now = parent_content()
                    if now != coded_against:
                        raise StaleParentError(
                            f"parent step {parent} was deleted and committed again by another writer since this "
                            "process read it (its content is not what this commit was coded against); nothing "
                            "was committed: re-open the trajectory (or commit again: the parent is read anew)",
                            step=step,
                            key=f"steps/{parent}/zarr.json",
                        )
            if branch is not None:  # last, to keep the window to the ref move short
                refs.check(branch)
            create()
        except OutcomeUnknownError:
            raise  # the step may exist: its intent stays, so the next commit on this head sees it (D12)
        except BaseException:
            if key is not None:
                self.io.delete(key)
            raise
        if branch is not None:
            try:
                refs.move(branch, step)
            except RefMovedError as e:
                if key is not None:
                    self.io.delete(key)
                raise _Lost(step, parent, branch.name, e) from None
            # any other failure keeps the intent: the next commit on this head reports the step (D12)
        if key is not None:
            self._remove(key)

    def _remove(self, key: str) -> None:
        """Remove a marker once its work is durable: a failure here only leaves a marker (gc removes it)."""
        try:
            self.io.delete(key)
        except OSError as e:
            warnings.warn(
                f"the work is done, but removing its marker {key!r} failed ({type(e).__name__}: {e}); "
                "gc(older_than=...) removes it",
                stacklevel=3,
            )

    def _announce(self, step: int, parent: int, branch: RefState | None) -> str:
        key = f"{PENDING_DIR}/commit/{parent}/{step}.{_token()}.json"
        _ACTIVE.add(key)
        self.io.put(key, _marker(branch=branch.name if branch is not None else None))
        return key

    def clear(self, step: int, parent: int) -> None:
        """Remove the intents of ``step`` on ``parent`` left by an interrupted commit (a finished retry)."""
        for intent in self.intents(step):
            if intent.parent == parent:
                self._remove(intent.key)

    # -- delete side ----------------------------------------------------------------

    @contextlib.contextmanager
    def deleting(
        self, step: int, dependants: Callable[[], set[int]], steps: Callable[[], list[int]], refs: RefLog
    ) -> Iterator[Heartbeat]:
        """Hold a delete marker of ``step`` for the body; refuse first if it would race a writer.

        ``dependants()``: steps whose parent is ``step`` or whose entries refer to it.

        Raises
        ------
        ConflictError
            Another delete or a gc is in flight, or a commit on ``step`` or on one
            of its dependants has announced itself but not created its step yet.
        """
        key = f"{PENDING_DIR}/delete/{step}.{_token()}.json"
        _ACTIVE.add(key)
        self.io.put(key, _marker())
        try:
            seen = self.listing()
            # (a delete of the same step is not refused: running a delete again finishes one that was
            # interrupted, and two at once are safe, every rewrite being a compare-and-swap)
            others = sorted((s, m.key) for s, m in seen.deletes if s != step)
            if others:
                s, k = others[0]
                raise ConflictError(
                    f"a delete of step {s} is in flight; deletes run one at a time: retry when it is done "
                    "(if none is running, it was killed: gc(older_than=...) removes its marker)",
                    step=step,
                    key=k,
                )
            gcs = [m for m in seen.gcs if m.live()]
            if gcs:
                raise ConflictError(
                    "a gc is in flight (it rewrites step documents); retry when it is done",
                    step=step,
                    key=gcs[0].key,
                )
            if seen.commits:
                near = dependants() | {step}
                existing = set(steps())
                for intent in seen.commits:
                    if intent.parent in near and intent.step not in existing:
                        raise ConflictError(
                            f"step {intent.step} is being committed on step {intent.parent}, which depends on "
                            f"step {step}; nothing was deleted: retry when that commit is done (if no commit is "
                            "running, it was killed: gc(older_than=...) removes its marker)",
                            step=step,
                            key=intent.key,
                        )
                self._fence(step, [i for i in seen.commits if i.step == step], refs)
            yield Heartbeat(self.io, key)
        finally:
            _ACTIVE.discard(key)
            self._remove(key)

    @staticmethod
    def _fence(step: int, intents: list[Intent], refs: RefLog) -> None:
        """Make sure the commits of ``step`` still in flight can never move their branches to it.

        Each such branch gets a new log entry with its head unchanged: a commit
        that read the branch before it fails its compare-and-swap.
        """
        for name in sorted({i.branch for i in intents if i.branch is not None}):
            for _ in range(16):
                state = refs.read(name)
                if state.step is None or state.step == step:
                    break  # absent, or already moved there: the delete moves it as any ref at the step
                try:
                    refs.move(state, state.step)
                    break
                except RefMovedError:
                    continue

    # -- gc side ----------------------------------------------------------------------

    @contextlib.contextmanager
    def collecting(self) -> Iterator[tuple[str, str | None]]:
        """Hold a gc marker for the body; yields (its key, the key of a live delete or other gc in flight, or
        None): a gc defers to both (another gc may be writing a pack this one would take for garbage)."""
        key = f"{PENDING_DIR}/gc/{_token()}.json"
        _ACTIVE.add(key)
        self.io.put(key, _marker())
        try:
            seen = self.listing()
            busy = [m.key for _, m in seen.deletes if m.live()] + [m.key for m in seen.gcs if m.key != key and m.live()]
            yield key, busy[0] if busy else None
        finally:
            _ACTIVE.discard(key)
            self._remove(key)

    # -- cleaning -------------------------------------------------------------------

    def stale(self) -> list[str]:
        """Every key under ``pending/`` (for gc, which applies its grace period)."""
        return list(self.io.find(PENDING_DIR))
