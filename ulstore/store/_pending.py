"""Commits and deletes in flight: so that ``delete`` and a concurrent commit never leave a broken step.

A commit's new step refers to its parent and, through the entries it reuses
verbatim, to older steps; ``delete(S)`` rewrites every step that refers to
``S`` and then removes ``S``.  A child committed while the delete runs would
refer to a step that is gone.  Each side therefore announces itself, then looks
for the other (on a store with read-after-write listings, of two that overlap at
least one sees the other), and the one that sees a conflict **refuses** with a
named error, before changing anything:

.. code-block:: text

    pending/commit/<parent>/<step>.json   sealed {"branch"}: a commit of <step> on <parent>
                                          is in flight (put after encoding, before the
                                          commit point; removed once its ref has moved)
    pending/delete/<step>.json            sealed {}: a delete of <step> is in flight

- **commit** of ``C`` on ``P`` (:meth:`Pending.publish`): put the intent; then
  refuse (:class:`ConflictError`) if a delete of ``P`` or of any step ``C``'s
  entries refer to is in flight, or if one of those steps is already gone (a
  delete finished during the encode).
- **delete** of ``S`` (:meth:`Pending.delete`): put the marker; then refuse if
  another delete is in flight, or if a commit whose parent is ``S`` or a step
  that refers to ``S`` has announced itself but not created its step yet.
- An intent left by a commit killed *after* its commit point (its step exists,
  its branch did not move) is how the next commit on that branch notices the
  interrupted one (D12) instead of silently taking the older head as parent.

Stale objects (a writer killed before its commit point, or mid-delete) are
removed by ``gc(older_than=...)`` once older than the grace period; until then
a delete of the parent, or commits on a step whose delete was killed, refuse,
naming the key.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..core.objects import MAX_DOCUMENT_BYTES, ObjectStore
from ..core.sealed import open_sealed, seal
from ..errors import ConflictError, CorruptManifestError, RefMovedError, StepNotFoundError
from ._refs import RefLog, RefState

__all__ = ["Pending", "Intent", "PENDING_DIR"]

PENDING_DIR = "pending"
_COMMIT_RE = re.compile(r"^pending/commit/(0|[1-9][0-9]*)/(0|[1-9][0-9]*)\.json\Z")
_DELETE_RE = re.compile(r"^pending/delete/(0|[1-9][0-9]*)\.json\Z")


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


def _commit_key(parent: int, step: int) -> str:
    return f"{PENDING_DIR}/commit/{parent}/{step}.json"


def _delete_key(step: int) -> str:
    return f"{PENDING_DIR}/delete/{step}.json"


@dataclass(frozen=True)
class Intent:
    """A commit in flight (or killed): ``step`` on ``parent`` for ``branch`` (None if unreadable)."""

    parent: int
    step: int
    branch: str | None
    key: str


class Pending:
    """The in-flight markers under ``pending/`` of ``io``."""

    def __init__(self, io: ObjectStore):
        self.io = io

    def listing(self) -> tuple[dict[int, str], list[Intent]]:
        """(deletes in flight: step -> key, commits in flight) in one LIST."""
        deletes, commits = {}, []
        for key in self.io.find(PENDING_DIR):
            if m := _DELETE_RE.match(key):
                deletes[int(m.group(1))] = key
            elif m := _COMMIT_RE.match(key):
                commits.append(Intent(int(m.group(1)), int(m.group(2)), self._branch(key), key))
        return deletes, commits

    def _branch(self, key: str) -> str | None:
        raw = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
        if raw is None:
            return None
        try:
            branch = open_sealed(raw, CorruptManifestError).get("branch")
        except CorruptManifestError:
            return None
        return branch if isinstance(branch, str) else None

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
    ) -> None:
        """The end of every commit: checks, the commit point ``create()``, then the branch's compare-and-swap.

        ``refers``: the steps the new step's entries are coded against;
        ``branch``: the branch as read when the commit started (None: move no
        ref); ``existing(steps)``: which of ``steps`` are committed.

        Raises
        ------
        RefMovedError
            The branch moved since it was read.  Before the commit point the step
            is not created (retry with the same step); after it (a narrow window)
            the step exists off the branch and the message says so.
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
            if parent is not None:
                deletes, commits = self.listing()
                needed = {parent, *refers}
                found = existing(needed | {i.step for i in commits if i.parent == parent})
                if branch is not None:
                    _refuse_interrupted(step, parent, branch.name, commits, found)
                _refuse_deleted(step, needed, deletes, found)
            if branch is not None:  # last, to keep the window to the ref move short
                refs.check(branch)
            create()
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
                raise RefMovedError(
                    f"step {step} was committed (parent {parent}) but branch {branch.name!r} moved to "
                    f"{e.head} meanwhile, so the branch does not include it; the step is kept. To put this state "
                    f"on the branch, delete({step}) and commit it again, or commit it under a new step number",
                    head=e.head,
                    step=step,
                    key=e.key,
                ) from None
            # any other failure keeps the intent: the next commit on this head reports the step (D12)
        if key is not None:
            self.io.delete(key)

    def _announce(self, step: int, parent: int, branch: RefState | None) -> str:
        key = _commit_key(parent, step)
        self.io.put(key, seal({"branch": branch.name if branch is not None else None}))
        return key

    def clear(self, step: int, parent: int) -> None:
        """Remove the intent of ``step`` on ``parent`` if one is left (a finished retry)."""
        self.io.delete(_commit_key(parent, step))

    # -- delete side ----------------------------------------------------------------

    @contextlib.contextmanager
    def deleting(self, step: int, dependants: Callable[[], set[int]], steps: Callable[[], list[int]]) -> Iterator[None]:
        """Hold the delete marker of ``step`` for the body; refuse first if it would race a writer.

        ``dependants()``: steps whose parent is ``step`` or whose entries refer to it.

        Raises
        ------
        ConflictError
            Another delete is in flight, or a commit on ``step`` or on one of its
            dependants has announced itself but not created its step yet.
        """
        key = _delete_key(step)
        self.io.put(key, seal({}))
        try:
            deletes, commits = self.listing()
            others = sorted(s for s in deletes if s != step)
            if others:
                raise ConflictError(
                    f"a delete of step {others[0]} is in flight; deletes run one at a time: retry when it is done "
                    "(if none is running, it was killed: gc(older_than=...) removes its marker)",
                    step=step,
                    key=deletes[others[0]],
                )
            if commits:
                near = dependants() | {step}
                existing = set(steps())
                for intent in commits:
                    if intent.parent in near and intent.step not in existing:
                        raise ConflictError(
                            f"step {intent.step} is being committed on step {intent.parent}, which depends on "
                            f"step {step}; nothing was deleted: retry when that commit is done (if no commit is "
                            "running, it was killed: gc(older_than=...) removes its marker)",
                            step=step,
                            key=intent.key,
                        )
            yield
        finally:
            self.io.delete(key)

    # -- cleaning -------------------------------------------------------------------

    def stale(self) -> list[str]:
        """Every key under ``pending/`` (for gc, which applies its grace period)."""
        return list(self.io.find(PENDING_DIR))
