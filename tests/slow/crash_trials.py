"""Crash trials: SIGKILL a commit, delete, gc (repack) or publish at a random write, then recover and check.

    python -m tests.slow.crash_trials --trials 40 --url /tmp/crash      # local disk (default: a temp directory)
    python -m tests.slow.crash_trials --trials 12 --url moto            # S3 on a moto server started here

A trajectory is prepared (a chain on ``main``, a branch ``b1``, versions published on ``sync`` by a
:class:`~ulstore.sync.Publisher`), and the trials run on it one after the other, so leftovers accumulate as they
would.  Each trial starts a child process (``tests/helpers/sides.py``) doing one operation, killed with SIGKILL
before its Nth write (``ULSTORE_KILL_AT``, :func:`tests.helpers.interleave.kill_at_env`: every put, create,
delete and pack write counts, or, in half the trials, every write but the bytes streamed into packs), N drawn at
random up to the operation's writes plus one (so some trials complete).  On local disk the writes are counted
first by the same operation on a copy of the store; elsewhere N goes up to the most writes the operation made
in the trials that completed (the first one of each operation is not killed).  A gc trial deletes a step first,
so that it has something to repack.  Then, in this process:

1. reopen; ``verify()`` must find nothing damaged;
2. every step committed before the trial reads back bit-exact; the operation's own step (a commit's, a publish's
   version), if it exists, holds exactly what was committed; the delete's target is either intact or gone;
3. finish a killed operation the documented way: a commit retried with the same state completes (on its branch;
   killed after its branch moved, the retry must be idempotent: issue 40); a delete retried; a publish retried at
   the same version, or (half the time) at a later one (issue 40: past an orphan); a gc run again;
4. ``gc(older_than=0)``, then one without repacking (a repack may leave a pack only the documents it rewrote
   listed): afterwards no ``pending/`` marker, no ``.tmp/`` file, no pack that no step names, and ``verify()``
   still clean;
5. a new commit on ``main`` works, and every step of the model reads back bit-exact.

Every check that fails is recorded (operation, kill point, check, error) and the run goes on from the store as it
is (the model follows the store where the outcome was allowed).  At the end: counts per operation (trials,
killed, completed, outcomes) and the failures; the exit status is 1 if anything failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field

import ulstore
from tests.helpers.interleave import KILL_ENV, run_python
from tests.helpers.sides import save_state
from tests.helpers.small_states import SMALL_STORE, assert_same, fresh_state, mutate

__all__ = ["run_trials", "main", "Report"]

OPS = ("commit", "delete", "gc", "publish")
SYNC = "sync"  # the Publisher's branch
_CHILD = "import sys; from tests.helpers.sides import main; main(sys.argv[1:])"
_NOT_STREAMED = r"^(?!writer\.write )"  # every write but the bytes streamed into a pack


@dataclass
class Report:
    trials: collections.Counter = field(default_factory=collections.Counter)
    killed: collections.Counter = field(default_factory=collections.Counter)
    completed: collections.Counter = field(default_factory=collections.Counter)
    outcomes: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    failures: list = field(default_factory=list)
    writes: dict = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, op: str, kill: int, check: str, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        trial = sum(self.trials.values())
        self.failures.append({"trial": trial, "op": op, "kill_at": kill, "check": check, "error": text[:2000]})

    def summary(self) -> str:
        lines = [f"crash trials: {sum(self.trials.values())} in {self.seconds:.0f} s"]
        for op in OPS:
            if self.trials[op]:
                out = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes[op].items()))
                lines.append(
                    f"  {op:8s} trials {self.trials[op]:3d}  killed {self.killed[op]:3d}  completed "
                    f"{self.completed[op]:3d}  (writes up to {self.writes.get((op, 'all'), '?')}, "
                    f"{self.writes.get((op, 'documents'), '?')} not streamed)  outcomes: {out}"
                )
        by_check = collections.Counter((f["op"], f["check"]) for f in self.failures)
        lines.append(f"failures: {len(self.failures)}")
        for (op, check), n in sorted(by_check.items()):
            first = next(f for f in self.failures if (f["op"], f["check"]) == (op, check))
            lines.append(
                f"  {n:3d} x {op}: {check}  (first: trial {first['trial']}, killed at write {first['kill_at']}: "
                f"{first['error'][:300]})"
            )
        return "\n".join(lines)


class Trials:
    """The trajectory, the model of what it must hold, and one trial at a time."""

    def __init__(self, url: str, so: dict | None, rng: random.Random, workdir: str, verbose: bool = False):
        self.url, self.so, self.rng, self.workdir, self.verbose = url, so, rng, workdir, verbose
        self.report = Report()
        self.states: dict[int, dict] = {}  # step -> state: everything committed
        self.next_step = 0
        self._prepare()

    # -- the store -----------------------------------------------------------------------------------------------

    def open(self):
        return ulstore.open(self.url, mode="a", storage_options=self.so, threads=1)

    def _new(self) -> int:
        self.next_step += 1
        return self.next_step - 1

    def _prepare(self) -> None:
        from ulstore.sync import Publisher

        traj = ulstore.open(self.url, mode="w", storage_options=self.so, threads=1, **SMALL_STORE)
        state = fresh_state(self.rng.randrange(2**32))
        for i in range(6):
            step = self._new()
            if i:
                state = mutate(state, self.rng.randrange(2**32), "few")
            traj.commit(step, state, snapshot=i == 3)
            self.states[step] = state
        fork = 2
        state = self.states[fork]
        for i in range(2):
            step = self._new()
            state = mutate(state, self.rng.randrange(2**32), "few")
            traj.commit(step, state, parent=fork if i == 0 else "b1", branch="b1")
            self.states[step] = state
        traj.close()
        pub = Publisher(self.url, anchor_every=3, storage_options=self.so, branch=SYNC, chunk_elems=64, threads=1)
        state = fresh_state(self.rng.randrange(2**32))
        for i in range(3):
            step = self._new()
            if i:
                state = mutate(state, self.rng.randrange(2**32), "few")
            pub.publish(step, state)
            self.states[step] = state
        pub.close()

    # -- one trial -----------------------------------------------------------------------------------------------

    def _plan(self, op: str, traj) -> dict:
        """The child's spec, and what the trial expects: ``new`` (step, state) or ``target``."""
        refs = traj.refs
        if op == "commit":
            branch = self.rng.choice([b for b in ("main", "b1") if b in refs] or ["main"])
            parent = refs.get(branch)
            step = self._new()
            state = (
                mutate(self.states[parent], self.rng.randrange(2**32), self.rng.choice(["few", "few", "many", "add"]))
                if parent is not None
                else fresh_state(self.rng.randrange(2**32))
            )
            spec = {"step": step, "state": save_state(state, self.workdir), "branch": branch}
            if parent is None:
                spec["parent"] = None
            return {"spec": spec, "new": (step, state), "branch": branch}
        if op == "delete":
            heads = set(refs.values())
            others = [s for s in sorted(self.states) if s not in heads]
            target = self.rng.choice(others if others and self.rng.random() < 0.7 else sorted(self.states))
            return {"spec": {"step": target}, "target": target}
        if op == "gc":
            # garbage to collect, and step documents to rewrite: a step deleted first (here, not killed)
            heads = set(refs.values())
            others = [s for s in sorted(self.states) if s not in heads]
            if others:
                gone = self.rng.choice(others)
                traj.delete(gone)
                del self.states[gone]
            return {"spec": {"kwargs": {"older_than": 0, "repack_below": self.rng.choice([0.5, 0.9, 1.0])}}}
        head = refs.get(SYNC)
        version = self._new()
        state = (
            mutate(self.states[head], self.rng.randrange(2**32), "few")
            if head is not None
            else fresh_state(self.rng.randrange(2**32))
        )
        spec = {"version": version, "state": save_state(state, self.workdir), "branch": SYNC, "anchor_every": 3}
        spec["chunk_elems"] = 64
        return {"spec": spec, "new": (version, state), "branch": SYNC}

    def trial(self, op: str) -> None:
        report = self.report
        report.trials[op] += 1
        plan = self._plan(op, self.open())
        # half the trials count every write, half skip the bytes streamed into packs (kills land on documents,
        # refs, markers); the kill is at a write drawn up to the operation's writes, plus one (it completes)
        counting = "all" if self.rng.random() < 0.5 else "documents"
        counts = self._dry_run(op, plan)
        if counts is not None:  # local disk: the same operation on a copy, here, counted its writes
            most = counts[counting]
            for counted, n in counts.items():
                report.writes[(op, counted)] = max(report.writes.get((op, counted), 0), n)
        else:  # the most writes this operation made in the trials that completed (the first one is not killed)
            most = report.writes.get((op, counting))
        kill = self.rng.randint(1, most + 1) if most is not None else 0
        spec = str(kill) if counting == "all" else f"{kill}:{_NOT_STREAMED}"
        body = json.dumps({"op": op, "url": self.url, "storage_options": self.so, **plan["spec"]})
        proc = run_python(_CHILD, body, env={**os.environ, KILL_ENV: spec}, check=False, timeout=600)
        if proc.returncode == -9:
            report.killed[op] += 1
            answer = None
        elif proc.returncode == 0:
            report.completed[op] += 1
            answer = json.loads(proc.stdout.strip().splitlines()[-1])
            for counted, n in (("all", answer["all_writes"]), ("documents", answer["documents"])):
                report.writes[(op, counted)] = max(report.writes.get((op, counted), 0), n)
            if not answer["ok"]:
                report.fail(op, kill, "the operation raised (not killed)", f"{answer['error']}: {answer['message']}")
        else:
            report.fail(op, kill, f"child exited with {proc.returncode}", proc.stderr[-2000:])
            answer = None
        if self.verbose:
            print(f"{op} kill at {kill}: {'killed' if answer is None else 'completed'}", flush=True)
        self._check(op, kill, plan, answer)

    def _dry_run(self, op: str, plan: dict) -> dict | None:
        """On local disk: the writes the operation makes, counted on a copy of the store, in this process."""
        if "://" in self.url:
            return None
        from tests.helpers.interleave import interleave, is_write
        from tests.helpers.sides import _answer

        copy = os.path.join(self.workdir, "dry-run")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(self.url, copy, symlinks=True)
        try:
            stored = lambda call: is_write(call) and call.method != "writer.write"  # noqa: E731
            with interleave(on=is_write, record=False, times=0) as every:
                with interleave(on=stored, record=False, times=0) as docs:
                    answer = _answer({"op": op, "url": copy, "storage_options": None, **plan["spec"]})
            if not answer["ok"]:
                return None
            return {"all": len(every.matched), "documents": len(docs.matched)}
        finally:
            shutil.rmtree(copy, ignore_errors=True)

    def _check(self, op: str, kill: int, plan: dict, answer) -> None:
        report = self.report

        def attempt(check: str, fn):
            try:
                return fn()
            except Exception as e:
                report.fail(op, kill, check, e)
                if self.verbose:
                    traceback.print_exc()
                return None

        traj = self.open()
        # 1. verify
        attempt("verify after the kill", lambda: _verify(traj))
        # 2. what was committed before is intact; the operation's own step is all or nothing
        target = plan.get("target")
        present = set(traj.steps)
        for s, want in sorted(self.states.items()):
            if s == target and s not in present:
                continue
            attempt(f"step committed before the trial reads back (step {s})", lambda s=s, w=want: _read(traj, s, w))
        if target is not None:
            report.outcomes[op]["deleted" if target not in present else "kept"] += 1
        new = plan.get("new")
        if new is not None:
            step, state = new
            if step in present:
                on = traj.refs.get(plan["branch"]) == step
                report.outcomes[op]["step on branch" if on else "step off branch"] += 1
                attempt("the operation's step holds what was committed", lambda: _read(traj, step, state))
            else:
                report.outcomes[op]["no step"] += 1
        if op == "gc":
            report.outcomes[op]["killed" if answer is None else "done"] += 1
        # 3. finish a killed operation the documented way
        if answer is not None:
            self._done(op, plan, present)
        else:
            if op == "commit" and traj.refs.get(plan["branch"]) == plan["new"][0]:
                # killed after its branch moved (removing its intent): the caller cannot know, and retries
                check = "retrying a killed commit whose branch had moved, same state, is idempotent (issue 40)"
            else:
                check = f"finishing the killed {op}"
            attempt(check, lambda: self._finish(op, plan, traj, present))
        # 4. gc cleans every leftover
        attempt("gc(older_than=0) after the trial", lambda: self.open().gc(older_than=0))
        # (a repack may leave a pack that only the documents it rewrote listed: the next gc removes it)
        attempt("gc(older_than=0, repack_below=0)", lambda: self.open().gc(older_than=0, repack_below=0))
        attempt("no leftovers after gc", lambda: _no_leftovers(self.open()))
        attempt("verify after gc", lambda: _verify(self.open()))
        # 5. the store takes a new commit, and everything reads back
        attempt("a new commit on main", lambda: self._commit_more(self.open()))
        traj = self.open()
        for s, want in sorted(self.states.items()):
            attempt(f"read after recovery (step {s})", lambda s=s, w=want: _read(traj, s, w))
        present = set(traj.steps)
        for s in [s for s in self.states if s not in present]:  # the model follows the store (failures recorded)
            del self.states[s]

    def _done(self, op: str, plan: dict, present: set) -> None:
        """The model after an operation that completed (its step, if any, is checked above)."""
        if op == "delete":
            self.states.pop(plan["target"], None)
        elif "new" in plan and plan["new"][0] in present:
            self.states[plan["new"][0]] = plan["new"][1]

    def _finish(self, op: str, plan: dict, traj, present: set) -> None:
        if op == "gc":
            traj.gc(older_than=0, repack_below=plan["spec"]["kwargs"]["repack_below"])
            return
        if op == "delete":
            target = plan["target"]
            if target in present:
                traj.delete(target)
            self.states.pop(target, None)
            return
        step, state = plan["new"]
        branch = plan["branch"]
        if op == "commit":
            kw = {"branch": branch}
            if "parent" in plan["spec"]:
                kw["parent"] = plan["spec"]["parent"]
            try:
                traj.commit(step, state, **kw)  # absent: commits; off the branch: completes (D12); done: idempotent
            finally:
                if step in traj.steps:
                    self.states[step] = state
            if traj.refs.get(branch) != step:
                raise AssertionError(f"the retried commit of step {step} did not leave {branch!r} on it")
            return
        from ulstore.sync import Publisher

        pub = Publisher(self.url, anchor_every=3, storage_options=self.so, branch=SYNC, chunk_elems=64, threads=1)
        try:
            if traj.refs.get(SYNC) == step:
                self.states[step] = state
                return
            again = self.rng.random() < 0.5
            if again:  # the same version again: the orphan (if any) is dropped, then published
                pub.publish(step, state)
                self.states[step] = state
            else:  # a later version (issue 40: a restarted publisher must get past an orphan)
                self.report.outcomes[op]["recovered with a later version"] += 1
                later = self._new()
                later_state = mutate(state, self.rng.randrange(2**32), "few")
                try:
                    pub.publish(later, later_state)
                finally:
                    if later in traj.steps:
                        self.states[later] = later_state
                    if step in traj.steps:
                        self.states[step] = state  # the orphan, still there (it is a step like any other)
        finally:
            pub.close()

    def _commit_more(self, traj) -> None:
        head = traj.refs.get("main")
        step = self._new()
        if head is None:
            state = fresh_state(self.rng.randrange(2**32))
            traj.commit(step, state, parent=None, branch="main")
        else:
            state = mutate(self.states[head], self.rng.randrange(2**32), "few")
            traj.commit(step, state, branch="main")
        self.states[step] = state
        assert traj.refs["main"] == step


def _verify(traj) -> None:
    report = traj.verify(raise_on_error=False)
    if not report.ok:
        raise AssertionError(f"verify: {report.errors}")


def _read(traj, step: int, want: dict) -> None:
    assert_same(traj.read(step), want, f"read({step})")


def _no_leftovers(traj) -> None:
    io = traj._io
    pending = io.find("pending")
    tmp = io.find(".tmp") if io.local else []
    named = {pid for s in traj.steps for pid in traj._reader.doc(s).packs}
    packs = {k.rsplit("/", 1)[-1].split(".")[0] for k in io.find("packs")}
    unnamed = sorted(packs - named)
    if pending or tmp or unnamed:
        raise AssertionError(f"left after gc: pending {pending}, .tmp {tmp}, packs no step names {unnamed}")


def run_trials(
    trials: int,
    url: str | None = None,
    storage_options: dict | None = None,
    *,
    seed: int | None = None,
    ops=OPS,
    verbose=False,
) -> Report:
    """Run ``trials`` trials (operations in turn) on ``url`` (None: a temporary directory; ``"moto"``: a moto S3
    server started here); returns the :class:`Report`."""
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    workdir = tempfile.mkdtemp(prefix="crash-trials-")
    moto = None
    so = storage_options
    try:
        if url is None:
            url = os.path.join(workdir, "traj")
        elif url == "moto":
            from tests.helpers.moto import MotoS3

            moto = MotoS3()
            url, so = f"s3://{moto.bucket()}/crash-{uuid.uuid4().hex[:8]}", moto.options
        t0 = time.perf_counter()
        run = Trials(url, so, rng, workdir, verbose)
        for i in range(trials):
            run.trial(ops[i % len(ops)])
        run.report.seconds = time.perf_counter() - t0
        print(f"seed {seed}, url {url}")
        return run.report
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--url", default=None, help="a local directory (default: a temporary one), or 'moto'")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ops", default=",".join(OPS), help="operations, in turn (default: all four)")
    ap.add_argument("--json", default=None, help="write the report (counts and failures) to this file")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    ops = tuple(a.ops.split(","))
    if not set(ops) <= set(OPS):
        ap.error(f"--ops: choose among {OPS}")
    report = run_trials(a.trials, a.url, seed=a.seed, ops=ops, verbose=a.verbose)
    print(report.summary())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "trials": report.trials,
                    "killed": report.killed,
                    "completed": report.completed,
                    "outcomes": report.outcomes,
                    "writes": {f"{op} {counted}": n for (op, counted), n in report.writes.items()},
                    "failures": report.failures,
                    "seconds": report.seconds,
                },
                f,
                indent=1,
            )
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
