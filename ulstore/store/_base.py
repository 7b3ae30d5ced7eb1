"""What every part of a :class:`~ulstore.store.Trajectory` stands on: its objects, caches, steps and refs.

:class:`TrajectoryBase` holds the state (the object client, the chunk reader,
the settings) and the naming: listing steps, resolving a step or ref name,
reading and moving refs.  The jobs on top of it live in their own modules:
``_read.py``, ``_commit.py``, ``_integrity.py``, ``_delete.py``, ``_gc.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..codec.zarr3 import register as _register_zarr_dtypes
from ..core.formatting import missing_step_message, redact_url
from ..core.objects import ObjectStore
from ..errors import InvalidInputError, NotFoundError, ReadOnlyError, RefMovedError, StepNotFoundError
from ._pending import Pending
from .format._layout import STEPS_DIR, check_ref_name, check_step, step_key, step_of
from .format._packs import DEFAULT_PACK_BYTES
from .format._refs import RefLog
from .read._chunk_reader import DEFAULT_CACHE_BYTES, ChunkReader
from .read._kept import KeptStep
from .read._logical import LogicalStore

__all__ = ["TrajectoryBase", "MAIN", "ANY"]

#: Default main branch.
MAIN = "main"
#: a commit checks that at most this many steps exist with a stat (HEAD) each, more with one LIST of
#: ``steps/``; local disk and memory:// walk a directory per step to list them, an object store pages
#: through 1,000 steps a request
_HEADS_NOT_LIST = {"near": 64, "remote": 4}


class _Any:
    def __repr__(self) -> str:
        return "ANY"


#: ``expected=ANY`` (the default of :meth:`set_ref` / :meth:`delete_ref`): move whatever the ref holds.
ANY = _Any()


class TrajectoryBase:
    """State, steps and refs of a trajectory (see :class:`~ulstore.store.Trajectory`)."""

    def __init__(
        self,
        io: ObjectStore,
        *,
        url: str,
        read_only: bool,
        anchor_every: int,
        chunk_bytes: int,
        anchor_cost: float | None = None,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        keep_parent: bool | int = True,
        executor=None,
        threads=None,
    ):
        _register_zarr_dtypes()
        self._io = io
        self.url = redact_url(url)  # (shown in messages: never the credentials a URL may hold)
        self.read_only = read_only
        self._why_read_only: str | None = None  # what a write says instead of "opened with mode='r'"
        self.anchor_every = anchor_every
        #: the cost policy's k (None: the fixed count ``anchor_every``), see ``format/_read_cost.py``
        self.anchor_cost = anchor_cost
        self.chunk_bytes = chunk_bytes
        self.pack_bytes = pack_bytes
        self._executor = executor
        self._threads = threads or max(4, os.cpu_count() or 1)  # reads: I/O latency hides behind threads
        self._encode_threads = threads or os.cpu_count() or 1  # commits: CPU-bound, scratch memory per thread
        self._reader = ChunkReader(io, cache_bytes, self._threads)
        self._refs = RefLog(io)
        self._pending = Pending(io)
        self._store = LogicalStore(self._reader)
        budget = None if keep_parent is True else 0 if keep_parent is False else int(keep_parent)
        self._kept = KeptStep(budget)

    def __repr__(self) -> str:
        return f"<Trajectory {self.url!r} ({'read-only' if self.read_only else 'read/write'})>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Drop caches and the kept step (the trajectory holds no other resources)."""
        self._reader.clear_cache()
        self._reader.forget()
        with self._kept.lock:
            self._kept.clear()

    # -- names --------------------------------------------------------------------

    @property
    def steps(self) -> list[int]:
        """All committed steps, sorted (one LIST of ``steps/``)."""
        keys = self._io.find(STEPS_DIR)
        out = []
        for k in keys:
            parts = k.split("/")
            if len(parts) == 3 and parts[2] == "zarr.json" and step_of(parts[1]) is not None:
                out.append(int(parts[1]))
        return sorted(out)

    def _committed(self, steps: set[int]) -> set[int]:
        """Which of ``steps`` are committed: a stat (HEAD) each if they are few, else one LIST of ``steps/``.

        A commit asks this of the steps it is coded against (mostly just its parent).  Listing every step
        instead made each commit of a long run slower than the last: a directory walk per step on local
        disk, a request per 1,000 steps on an object store.
        """
        near = self._io.local or self._io.memory
        if len(steps) <= _HEADS_NOT_LIST["near" if near else "remote"]:
            return {s for s in steps if self._io.exists(step_key(s))}
        return steps & set(self.steps)

    def __contains__(self, step) -> bool:
        """Whether ``step`` (a step number or a ref name) exists; False for anything that cannot name one."""
        try:
            self._resolve(step, explain=False)
            return True
        except (NotFoundError, InvalidInputError):  # -1, "bad/ref name": no step is called that
            return False

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[int]:
        """The step numbers, in order (a snapshot of :attr:`steps`: one LIST)."""
        return iter(self.steps)

    def __reversed__(self) -> Iterator[int]:
        """The step numbers, newest (largest) first."""
        return iter(self.steps[::-1])

    def _step_at(self, index: int) -> int:
        """The step at a negative position of :attr:`steps` (``-1``: the last by number)."""
        steps = self.steps
        if -index > len(steps):
            has = f"only {len(steps)} steps" if steps else "no steps"
            raise StepNotFoundError(
                f"traj[{index}]: {self.url!r} has {has} (a negative index counts steps from the last by number)"
            )
        return steps[index]

    @property
    def refs(self) -> dict[str, int]:
        """Branches and tags: name -> step.

        A ref whose head entry is damaged is left out, with a warning naming its key (reading that ref by
        name raises :class:`~ulstore.errors.CorruptManifestError`; :meth:`verify` reports it).
        """
        return self._refs.names()

    def head(self, branch: str = MAIN) -> int | None:
        """The step ``branch`` points to (None if the branch does not exist).

        Raises
        ------
        CorruptManifestError
            The ref is damaged (its key is named): never an older value instead.
        """
        return self._refs.read(check_ref_name(branch)).step

    def set_ref(self, name: str, step, *, expected=ANY) -> None:
        """Point branch or tag ``name`` at ``step`` (creating or moving it).

        Parameters
        ----------
        expected : int, str or None, optional
            Compare-and-swap: move only if ``name`` points at this step (None:
            only if it does not exist).  By default, move whatever it holds.

        Raises
        ------
        RefMovedError
            ``name`` is not at ``expected`` (its ``head`` is where it is).
        """
        self._check_writable()
        step = self._resolve(step)
        self._move_ref(check_ref_name(name), step, expected)

    def delete_ref(self, name: str, *, expected=ANY) -> None:
        """Remove branch or tag ``name`` (its steps stay); ``expected`` as for :meth:`set_ref`."""
        self._check_writable()
        self._move_ref(check_ref_name(name), None, expected)

    def _move_ref(self, name: str, step: int | None, expected) -> None:
        if expected is not ANY and expected is not None:
            expected = self._resolve(expected) if isinstance(expected, str) else check_step(expected)
        for _ in range(16):  # without expected, a concurrent move only means: read again
            state = self._refs.read(name)
            if expected is not ANY and state.step != expected:
                want = "absent" if expected is None else f"at step {expected}"
                raise RefMovedError(
                    f"ref {name!r} is not {want}: it is "
                    + ("absent" if state.step is None else f"at step {state.step}")
                    + "; nothing was moved",
                    head=state.step,
                    key=state.key,
                )
            if state.step == step:
                return
            try:
                self._refs.move(state, step)
                return
            except RefMovedError:
                if expected is not ANY:
                    raise
        raise RefMovedError(f"ref {name!r} keeps moving under concurrent writers; retry", key=state.key)

    def resolve(self, step_or_ref) -> int:
        """The step a step number or a ref name (branch or tag) names now; the step must exist.

        Raises
        ------
        StepNotFoundError
            No such step, or no such ref.
        InvalidInputError
            Neither a non-negative integer nor a valid ref name.
        """
        return self._resolve(step_or_ref)

    def _resolve(self, step_or_ref, *, explain: bool = True) -> int:
        """A step number, or a ref name resolved to its step; the step must exist.

        A missing one is a StepNotFoundError naming the steps (or refs) that exist, the
        nearest ones in a long run; ``explain=False`` spares that listing (``in``).
        """
        if isinstance(step_or_ref, str):
            state = self._refs.read(check_ref_name(step_or_ref))
            if state.step is None:
                text = missing_step_message(self.url, step_or_ref, (), self.refs) if explain else "no such ref"
                raise StepNotFoundError(text, key=state.key)
            step = state.step
        else:
            step = check_step(step_or_ref)
        try:
            self._reader.doc(step)
        except StepNotFoundError as e:
            if not explain or e.step != step or step_or_ref != step:
                raise  # (a ref's step gone meanwhile: the store's own words)
            err = StepNotFoundError(missing_step_message(self.url, step, self.steps, listing="`traj.steps` lists them"))
            err.step, err.key = e.step, e.key  # (not repeated in the text)
            raise err from None
        return step

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(
                self._why_read_only or f"{self.url!r} was opened with mode='r'; open with mode='a' to write"
            )
