"""A hypothesis state machine against a plain model: commits, branches and refs, delete, gc, reads, reopen, verify.

The model is a dict ``step -> state`` (exact bits), each step's parent, and the refs.  Every rule checks what it
must (a read compares bits exactly; ``verify`` must find nothing; an expected error must be that error and change
nothing) and the invariant compares the store's steps and refs with the model after every rule.

- :class:`StoreMachine` runs in this process, on local disk and on ``memory://`` (a fresh location per example).
- :class:`ConcurrentStoreMachine` adds a rule that runs a commit, delete or gc here while **another process** does a
  gc or a delete at a chosen write of it (``tests/helpers/interleave.py``), on local disk.  The outcome must be one
  of the two serial orders (an operation that refused with a documented error counting as not applied), and
  every step must then read back exactly and ``verify`` must pass.

``ULSTORE_STATEFUL_EXAMPLES`` sets the number of examples (by default a quarter in the fast lane, the whole
count in CI; the ``slow`` variants run more);
``ULSTORE_STATEFUL_SHRINK=1`` shrinks a failing example of the concurrent machine (a few minutes);
``ULSTORE_RACES=gc:delete,delete:gc`` races only those pairs (operation here : operation in the other process);
``ULSTORE_RACE_GRACE=3600`` gives the other process's gc only the grace period that has not passed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import ulstore
from tests.helpers import lanes
from tests.helpers.interleave import interleave, is_write
from tests.helpers.sides import Side, run_side
from tests.helpers.small_states import SMALL_STORE, assert_same, fresh_state, mutate
from ulstore.errors import ConflictError, NotFoundError, RefMovedError, StepExistsError, StepNotFoundError

# shapes and dtypes change mid-chain on purpose here: the commit's warning about it is tested in
# tests/store/test_features.py and tests/cli/test_cli_diff.py
pytestmark = pytest.mark.filterwarnings("ignore::ulstore.errors.FewSharedNamesWarning")

BRANCHES = ("main", "b1", "b2", "tag")
STORE = SMALL_STORE  # the settings of every example's store: chunks of a few rows


# -- the model ---------------------------------------------------------------------------------------------------


class Model:
    """What the store must hold: ``states[step]``, ``parents[step]``, ``refs[name]``."""

    def __init__(self):
        self.states: dict[int, dict] = {}
        self.parents: dict[int, int | None] = {}
        self.refs: dict[str, int] = {}

    def copy(self) -> Model:
        m = Model()
        m.states, m.parents, m.refs = dict(self.states), dict(self.parents), dict(self.refs)
        return m

    def commit(self, step: int, state: dict, parent: int | None, branch: str | None, move: bool = True) -> None:
        """``branch``: the ref the commit asked to move (it moves if it is absent or at ``parent``)."""
        self.states[step], self.parents[step] = state, parent
        if move and branch is not None and self.refs.get(branch) in (None, parent):
            self.refs[branch] = step

    def delete(self, step: int) -> None:
        """Children re-parented to the step's parent; refs at it move there (removed if it had none)."""
        parent = self.parents.pop(step)
        del self.states[step]
        for s, p in self.parents.items():
            if p == step:
                self.parents[s] = parent
        for name, target in list(self.refs.items()):
            if target == step:
                if parent is None:
                    del self.refs[name]
                else:
                    self.refs[name] = parent

    def chain(self, step: int) -> list[int]:
        out = []
        while step is not None:
            out.append(step)
            step = self.parents[step]
        return out


# -- the machine -------------------------------------------------------------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """One trajectory, operated on in this process."""

    #: Set by the test: a callable returning (url, storage_options) of a fresh location, and one removing it.
    location = staticmethod(lambda: (f"memory://stateful-{uuid.uuid4().hex}", None))
    #: Local disk: fsync every write (what power cuts need; the machine checks logic, not power cuts: the fast
    #: variants skip the fsyncs, the slow one makes them).
    durable = True

    def __init__(self):
        super().__init__()
        self.url, self.so = self.location()
        self.traj = ulstore.open(self.url, mode="w", storage_options=self.so, threads=1, durable=self.durable, **STORE)
        self.model = Model()
        self.next_step = 0
        self.deleted: list[int] = []  # numbers a commit may reuse

    def teardown(self):
        self.traj.close()
        remove_location(self.url, self.so)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _new_step(self, data) -> int:
        if self.deleted and data.draw(st.booleans(), label="reuse a deleted number"):
            return data.draw(st.sampled_from(self.deleted), label="reused step")
        self.next_step += 1
        return self.next_step - 1

    def _state_for(self, data, parent: int | None) -> dict:
        seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        if parent is None:
            return fresh_state(seed)
        how = data.draw(st.sampled_from(["few", "few", "few", "many", "same", "add", "drop", "reshape"]), label="how")
        return mutate(self.model.states[parent], seed, how)

    def _options(self, data) -> dict:
        return {
            "snapshot": data.draw(st.booleans(), label="snapshot"),
            "sparse": data.draw(st.booleans(), label="sparse"),
            "anchor": data.draw(st.sampled_from([None, None, None, True]), label="anchor"),
        }

    def _plan_commit(self, data):
        """(step, state, kwargs of commit, expected error or None, model parent, branch asked) of a random commit."""
        m = self.model
        how = data.draw(st.sampled_from(["head", "head", "head", "fork", "root", "detached"]), label="commit kind")
        step = self._new_step(data)
        kw = self._options(data)
        if how == "head" or not m.states:
            branch = data.draw(st.sampled_from(sorted(m.refs) or ["main"]), label="branch")
            head = m.refs.get(branch)
            kw["branch"] = branch
            if head is None and m.states:
                return step, fresh_state(0), kw, NotFoundError, None, branch
            return step, self._state_for(data, head), kw, None, head, branch
        if how == "root":
            branch = data.draw(st.sampled_from(BRANCHES), label="branch")
            kw.update(parent=None, branch=branch)
            error = ConflictError if m.refs.get(branch) is not None else None
            return step, self._state_for(data, None), kw, error, None, branch
        parent = data.draw(st.sampled_from(sorted(m.states)), label="parent")
        if how == "fork":
            branch = data.draw(st.sampled_from(BRANCHES), label="branch")
            kw.update(parent=parent, branch=branch)
            error = ConflictError if m.refs.get(branch) not in (None, parent) else None
            return step, self._state_for(data, parent), kw, error, parent, branch
        kw["parent"] = parent  # detached: the default branch moves only if it is absent or at the parent
        return step, self._state_for(data, parent), kw, None, parent, "main"

    def _commit_expected(self, step, state, kw, error, parent, branch) -> None:
        if step in self.model.states and error is None:
            error = StepExistsError  # steps are immutable
        if error is not None:
            with pytest.raises(error):
                self.traj.commit(step, state, **kw)
            return
        assert self._once_more(lambda: self.traj.commit(step, state, **kw)) == step
        self.model.commit(step, state, parent, branch)
        if step in self.deleted:
            self.deleted.remove(step)

    def _delete_expected(self, step: int, by_ref: str | None = None) -> None:
        self._once_more(lambda: self.traj.delete(by_ref if by_ref is not None else step))
        self.model.delete(step)
        self.deleted.append(step)

    def _once_more(self, operation):
        """Run an operation the model says succeeds (here: it must)."""
        return operation()

    # -- rules ---------------------------------------------------------------------------------------------------

    @initialize(seed=st.integers(0, 2**32 - 1), length=st.integers(0, 5))
    def history(self, seed, length):
        """A chain of ``length`` steps on main to start from (every rule can also build one)."""
        state, parent = fresh_state(seed), None
        for step in range(length):
            if step:
                state = mutate(state, seed + step, "few")
            self.traj.commit(step, state)
            self.model.commit(step, state, parent, "main")
            parent = step
        self.next_step = length

    @rule(data=st.data())
    def commit(self, data):
        self._commit_expected(*self._plan_commit(data))

    @rule(data=st.data())
    def commit_more(self, data):  # commits are what the other rules need: twice the weight
        self._commit_expected(*self._plan_commit(data))

    @precondition(lambda self: self.model.states)
    @rule(data=st.data())
    def set_ref(self, data):
        m = self.model
        name = data.draw(st.sampled_from(BRANCHES), label="ref")
        step = data.draw(st.sampled_from(sorted(m.states)), label="step")
        mode = data.draw(st.sampled_from(["any", "right", "wrong"]), label="expected")
        if mode == "any":
            self.traj.set_ref(name, step)
        elif mode == "right":
            self.traj.set_ref(name, step, expected=m.refs.get(name))
        else:
            wrong = next(s for s in [*sorted(m.states), None] if s != m.refs.get(name))
            with pytest.raises(RefMovedError):
                self.traj.set_ref(name, step, expected=wrong)
            return
        m.refs[name] = step

    @precondition(lambda self: self.model.refs)
    @rule(data=st.data())
    def delete_ref(self, data):
        m = self.model
        name = data.draw(st.sampled_from(sorted(m.refs)), label="ref")
        if data.draw(st.booleans(), label="with expected"):
            self.traj.delete_ref(name, expected=m.refs[name])
        else:
            self.traj.delete_ref(name)
        del m.refs[name]

    @precondition(lambda self: self.model.states)
    @rule(data=st.data())
    def delete(self, data):
        m = self.model
        step = data.draw(st.sampled_from(sorted(m.states)), label="step")
        names = [n for n, s in m.refs.items() if s == step]
        by_ref = data.draw(st.sampled_from([None, *names]), label="by ref")
        self._delete_expected(step, by_ref)

    @precondition(lambda self: self.model.states)
    @rule(data=st.data())
    def delete_more(self, data):  # deletes rewrite the most: twice the weight
        self.delete(data)

    @rule(repack_below=st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]))
    def gc(self, repack_below):
        self._once_more(lambda: self.traj.gc(older_than=0, repack_below=repack_below))

    @precondition(lambda self: self.model.states)
    @rule(data=st.data())
    def read(self, data):
        m = self.model
        step = data.draw(st.sampled_from(sorted(m.states)), label="step")
        how = data.draw(st.sampled_from(["read", "ref", "slice"]), label="read how")
        want = m.states[step]
        if how == "slice":
            name = data.draw(st.sampled_from(sorted(want)), label="tensor")
            got = self.traj[step][name][...]
            assert_same({name: np.asarray(got)}, {name: want[name]}, f"traj[{step}][{name!r}][...]")
            return
        names = [n for n, s in m.refs.items() if s == step]
        if how == "ref" and names:
            assert_same(self.traj.read(names[0]), want, f"read({names[0]!r}) = step {step}")
        else:
            assert_same(self.traj.read(step), want, f"read({step})")

    @rule(keep_parent=st.booleans())
    def reopen(self, keep_parent):
        self.traj.close()
        self.traj = ulstore.open(
            self.url, mode="a", storage_options=self.so, threads=1, keep_parent=keep_parent, durable=self.durable
        )

    def _fresh(self):
        """The store as a new reader sees it (no cached step document of this process's trajectory)."""
        return ulstore.open(self.url, mode="r", storage_options=self.so, threads=1)

    @rule()
    def verify(self):
        report = self.traj.verify(raise_on_error=False)
        assert report.ok, report.errors
        assert report.steps == len(self.model.states)
        m, fresh = self.model, self._fresh()
        for s in m.states:
            assert fresh.info(s).parent == m.parents[s], (s, fresh.info(s).parent, m.parents[s])
        for name, head in m.refs.items():
            assert [i.step for i in fresh.log(name)] == m.chain(head), name

    @invariant()
    def steps_refs_and_parents_are_the_model(self):
        assert self.traj.steps == sorted(self.model.states)
        assert self.traj.refs == self.model.refs
        fresh = self._fresh()  # parents as stored (this process's trajectory may hold older step documents)
        parents = {s: fresh.info(s).parent for s in self.model.states}
        assert parents == self.model.parents, f"parents stored {parents}, model {self.model.parents}"


# -- the concurrent machine --------------------------------------------------------------------------------------


#: The errors an operation may refuse with when another process's maintenance races it; it then changed nothing,
#: except a commit's RefMovedError after its commit point, which keeps the step off the branch (documented).
#: A gc may refuse (ConflictError) only while another gc or delete runs (their mutual exclusion), never because
#: of a commit, and never with StepNotFoundError (issue 40: skip what vanished).
def allowed(op: str, racing: str) -> tuple[type, ...]:
    if op == "commit":
        return (ConflictError, StepNotFoundError)
    if op == "delete":
        return (ConflictError,)
    return (ConflictError,) if racing in ("gc", "delete") else ()


def _races() -> list[tuple[str, str]]:
    """(operation here, operation in the other process) pairs: all, or ``ULSTORE_RACES=gc:delete,delete:gc``."""
    every = [(here, there) for here in ("commit", "delete", "gc") for there in ("gc", "delete")]
    chosen = os.environ.get("ULSTORE_RACES")
    if not chosen:
        return every
    pairs = [tuple(p.split(":")) for p in chosen.split(",")]
    unknown = [p for p in pairs if p not in every]
    assert not unknown, f"ULSTORE_RACES: unknown pairs {unknown}; choose among {every}"
    return pairs  # type: ignore[return-value]


RACES = _races()
#: The grace periods of the other process's gc racing a delete or a gc here: ``ULSTORE_RACE_GRACE=3600`` keeps
#: only the one that has not passed.
GRACES = [int(g) for g in os.environ.get("ULSTORE_RACE_GRACE", "3600,0").split(",")]


def _critical(call) -> bool:
    """The writes at which the other side may run: every write but the bytes streamed into a pack."""
    return is_write(call) and call.method != "writer.write"


class ConcurrentStoreMachine(StoreMachine):
    """:class:`StoreMachine` plus a rule that races another process's gc or delete at a chosen write."""

    location = staticmethod(lambda: (tempfile.mkdtemp(prefix="stateful-"), None))
    #: The other process (a :class:`~tests.helpers.sides.Side`), set by the test; None: a new process per race.
    side: Side | None = None

    def _once_more(self, operation):
        """Outside the races too, this process's trajectory may hold step documents that the other process has
        rewritten or deleted since: an operation may then refuse, with a named error and changing nothing
        (issue 43: a commit proves its parent at its commit point, or refuses), but the same call again must
        succeed (it reads what is stored).  A refusal is checked by the invariant (nothing changed)."""
        try:
            return operation()
        except (ConflictError, StepNotFoundError) as e:
            assert self.traj.steps == sorted(self.model.states) and self.traj.refs == self.model.refs, (
                f"refused ({e!r}) but changed steps or refs"
            )
            return operation()

    @precondition(lambda self: len(self.model.states) >= 2)
    @rule(data=st.data())
    def race(self, data):
        m = self.model
        main_op, other_op = data.draw(st.sampled_from(RACES), label="this process, other process")
        nth = data.draw(st.integers(1, 8), label="at write")
        repack_below = data.draw(st.sampled_from([0.6, 1.0]), label="repack_below")
        # the operation here, planned on the model as it is now
        if main_op == "commit":
            step, state, kw, error, parent, branch = self._plan_commit(data)
            if error is not None or step in m.states:
                return  # a commit refused before it starts races nothing
            run_main = lambda: self.traj.commit(step, state, **kw)  # noqa: E731
            main_target = None
        elif main_op == "delete":
            main_target = data.draw(st.sampled_from(sorted(m.states)), label="delete here")
            run_main = lambda: self.traj.delete(main_target)  # noqa: E731
        else:
            main_target = None
            run_main = lambda: self.traj.gc(older_than=0, repack_below=repack_below)  # noqa: E731
        # the other side: a delete of another step, or a gc: with a grace period (3600 s), or, racing a delete
        # or a gc here, one whose grace period has passed (0: "the operation here was slower than the grace")
        # (a commit here needs the grace period: gc without one while others commit is out of scope)
        if other_op == "delete":
            others = [s for s in sorted(m.states) if s != main_target]
            other_target = data.draw(st.sampled_from(others), label="delete there")
            spec = {"step": other_target}
        else:
            other_target = None
            grace = 3600 if main_op == "commit" else data.draw(st.sampled_from(GRACES), label="grace there")
            spec = {"kwargs": {"older_than": grace, "repack_below": repack_below}}

        def other_side(call):
            if self.side is not None:
                return self.side.run(other_op, self.url, self.so, **spec)
            return run_side(other_op, self.url, self.so, **spec)

        main_error = None
        with interleave(on=_critical, run=other_side, nth=nth) as il:
            try:
                run_main()
            except allowed(main_op, other_op) as e:
                main_error = e
        if il.results:
            other = il.results[0]
        else:  # the operation here made fewer writes: the other side runs after it
            other = other_side(None)
        where = f"{il.fired[0].method} {il.fired[0].key}" if il.fired else "after it"
        there = f"delete({other_target})" if other_op == "delete" else f"gc({spec['kwargs']})"
        note = f"{main_op} here, {there} in another process at {where}"
        if not other["ok"]:
            ok = {c.__name__ for c in allowed(other_op, main_op)}
            assert ok & set(other["classes"]), f"{note}: the other process raised {other}"
        # the serial orders the outcome may be
        candidates = []
        for order in ("other first", "here first"):
            c = m.copy()
            for who in ("other", "here") if order == "other first" else ("here", "other"):
                if who == "other" and other["ok"] and other_op == "delete":
                    if other_target not in c.states:
                        break
                    c.delete(other_target)
                elif who == "here" and main_op == "delete" and main_error is None:
                    if main_target not in c.states:
                        break
                    c.delete(main_target)
                elif who == "here" and main_op == "commit":
                    moved = main_error is None
                    kept = moved or (isinstance(main_error, RefMovedError) and main_error.step == step)
                    if kept:
                        p = parent if parent in c.states or parent is None else None
                        if p != parent:
                            break  # its parent was gone first: that order cannot have committed it
                        c.commit(step, state, parent, branch, move=moved)
            else:
                candidates.append((order, c))
        fresh = self._fresh()
        seen = (fresh.steps, fresh.refs, {s: fresh.info(s).parent for s in fresh.steps})
        match = [(o, c) for o, c in candidates if seen == (sorted(c.states), c.refs, c.parents)]
        assert match, (
            f"{note}: the store is no serial order of the two. here: {main_error!r}, there: {other}; store: "
            f"{seen}; orders: {[(o, sorted(c.states), c.refs, c.parents) for o, c in candidates]}"
        )
        self.model = match[0][1]
        for s in (main_target, other_target):
            if s is not None and s not in self.model.states and s not in self.deleted:
                self.deleted.append(s)
        if main_op == "commit" and step in self.model.states and step in self.deleted:
            self.deleted.remove(step)
        report = fresh.verify(raise_on_error=False)
        assert report.ok, (note, report.errors)
        for s, want in self.model.states.items():
            assert_same(fresh.read(s), want, f"{note}: read({s}) by a new reader")
        for s, want in self.model.states.items():  # and by this process's trajectory, which read them before
            assert_same(self.traj.read(s), want, f"{note}: read({s}) by the trajectory that raced")

    # the rule this machine is for: five times the weight of the others
    @precondition(lambda self: len(self.model.states) >= 2)
    @rule(data=st.data())
    def race_2(self, data):
        self.race(data)

    @precondition(lambda self: len(self.model.states) >= 2)
    @rule(data=st.data())
    def race_3(self, data):
        self.race(data)

    @precondition(lambda self: len(self.model.states) >= 2)
    @rule(data=st.data())
    def race_4(self, data):
        self.race(data)

    @precondition(lambda self: len(self.model.states) >= 2)
    @rule(data=st.data())
    def race_5(self, data):
        self.race(data)


# -- locations ---------------------------------------------------------------------------------------------------


def remove_location(url: str, so) -> None:
    if url.startswith("memory://"):
        import fsspec

        fs = fsspec.filesystem("memory")
        path = url[len("memory://") :]
        if fs.exists(path):
            fs.rm(path, recursive=True)
    elif "://" not in url:
        shutil.rmtree(url, ignore_errors=True)


def _examples(full: int) -> int:
    """``full`` in the slow lane (CI), a quarter in the fast lane (tests/helpers/lanes.py); the
    ``ULSTORE_STATEFUL_EXAMPLES`` environment variable sets the count instead."""
    return int(os.environ.get("ULSTORE_STATEFUL_EXAMPLES", lanes.examples(full)))


def _settings(examples: int, steps: int, *, shrink: bool = True) -> settings:
    phases = [Phase.explicit, Phase.reuse, Phase.generate, *([Phase.shrink] if shrink else [])]
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        phases=phases,
        report_multiple_bugs=False,
        deadline=None,
        database=None,  # examples are not kept between runs (nothing is written to the worktree)
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def _run(machine: type, location, examples: int, steps: int, *, shrink: bool = True) -> None:
    machine.location = staticmethod(location)
    run_state_machine_as_test(machine, settings=_settings(examples, steps, shrink=shrink))


@pytest.fixture
def local_location(tmp_path):
    return lambda: (tempfile.mkdtemp(prefix="ex-", dir=tmp_path), None)


def memory_location():
    return f"memory://stateful-{uuid.uuid4().hex}", None


class LocalMachine(StoreMachine):
    pass


class MemoryMachine(StoreMachine):
    pass


class LocalConcurrentMachine(ConcurrentStoreMachine):
    durable = False


class FastLocalMachine(StoreMachine):
    durable = False


def test_store_against_the_model_on_local_disk(local_location):
    _run(FastLocalMachine, local_location, _examples(50), 40)


def test_store_against_the_model_on_memory():
    _run(MemoryMachine, memory_location, _examples(50), 40)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "memory"])
def test_store_against_the_model_more_examples(where, local_location):
    location = local_location if where == "local" else memory_location
    _run(LocalMachine if where == "local" else MemoryMachine, location, _examples(100), 50)


def _race(machine: type, location, examples: int, steps: int) -> None:
    # no shrinking unless asked: a failing sequence is at most `steps` rules, printed with every draw, and
    # shrinking one takes minutes
    shrink = os.environ.get("ULSTORE_STATEFUL_SHRINK") == "1"
    with Side() as side:
        machine.side = side
        try:
            _run(machine, location, examples, steps, shrink=shrink)
        finally:
            machine.side = None


def test_store_against_the_model_with_another_process_racing_gc_and_delete(local_location):
    _race(LocalConcurrentMachine, local_location, _examples(60), 20)
