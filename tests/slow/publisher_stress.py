"""Two Publishers on one branch with overlapping version numbers, and a Follower: what was acknowledged stays.

    python -m tests.slow.publisher_stress --runs 20                 # local disk (a temporary directory per run)
    python -m tests.slow.publisher_stress --runs 5 --url moto       # S3 on a moto server started here

Each run: a fresh trajectory holding version 0 (published here); two publisher processes (``--role publisher``)
each publish versions 1..K of their **own** state (a chain of small changes, different for each), started at
the same moment (a line on their stdin), as fast as they can; a follower process (``--role follower``) polls
the branch all along.  A publisher retries a version that failed (up to ``--attempts`` times: docs/sync.md,
"retrying the same version, or publishing a later one, is safe") and moves on when the branch is past it (the
other publisher won: ``InvalidInputError``, "not greater than the latest").  Every call of ``publish`` is
logged, with the digest of the state published, before and after it.

Checked at the end of every run:

- every acknowledged version (its ``publish`` returned) is on the branch's history and reads back bit-exact as
  what its publisher published (two acknowledgements of one version cannot both hold);
- every loser got an error: for each publisher and version, either the publish returned, or it raised (errors
  counted by type);
- the follower only ever held versions of the branch: after every poll it logs the version it holds and the
  digest of its state, which must be that version's on the final branch;
- ``verify()`` finds nothing damaged.

The exit status is 1 if any run failed; the counts are printed (``--json`` writes them).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

__all__ = ["run_stress", "main"]

ANCHOR_EVERY = 4
CHUNK_ELEMS = 64


def _log(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the roles (child processes) -----------------------------------------------------------------------------------


def _publisher(a) -> None:
    from tests.helpers.small_states import digest, fresh_state, mutate
    from ulstore.errors import InvalidInputError
    from ulstore.sync import Publisher

    so = json.loads(a.opts)
    pub = Publisher(a.url, anchor_every=ANCHOR_EVERY, storage_options=so, chunk_elems=CHUNK_ELEMS, threads=1)
    state = fresh_state(a.seed)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    for v in range(1, a.versions + 1):
        state = mutate(state, a.seed * 1000 + v, "few")
        d = digest(state)
        for attempt in range(a.attempts):
            _log(a.log, {"version": v, "attempt": attempt, "digest": d, "event": "call"})
            try:
                info = pub.publish(v, state)
            except InvalidInputError as e:
                if "not greater than the latest" in str(e):  # the branch is past v: the other one won
                    _log(a.log, {"version": v, "attempt": attempt, "event": "error", "error": type(e).__name__,
                                 "message": str(e), "final": True})  # fmt: skip
                    break
                _log(a.log, {"version": v, "attempt": attempt, "event": "error", "error": type(e).__name__,
                             "message": str(e)})  # fmt: skip
            except Exception as e:  # retried: the docs say a failed publish can be retried
                _log(a.log, {"version": v, "attempt": attempt, "event": "error", "error": type(e).__name__,
                             "message": str(e)[:500], "trace": traceback.format_exc()[-1500:]})  # fmt: skip
            else:
                _log(a.log, {"version": v, "attempt": attempt, "event": "ack", "digest": d, "kind": info.kind})
                break
    pub.close()
    _log(a.log, {"event": "done"})


def _follower(a) -> None:
    from tests.helpers.small_states import digest
    from ulstore.sync import Follower

    so = json.loads(a.opts)
    f = Follower(a.url, storage_options=so, threads=1)
    f.bootstrap()
    held = (f.version, digest(f.state))
    _log(a.log, {"event": "held", "version": held[0], "digest": held[1], "poll": 0})
    print("ready", flush=True)
    sys.stdin.readline()  # go
    polls, stop = 0, False
    while True:
        if not stop:  # polling as fast as it can, until told to stop; then one last poll
            stop = bool(select.select([sys.stdin], [], [], 0.002)[0])
        polls += 1
        try:
            f.poll()
        except Exception as e:
            _log(a.log, {"event": "error", "error": type(e).__name__, "message": str(e)[:500], "poll": polls})
        now = (f.version, digest(f.state)) if f.version is not None else (None, None)
        if now != held:
            held = now
            _log(a.log, {"event": "held", "version": now[0], "digest": now[1], "poll": polls})
        if stop:
            break
    kinds = collections.Counter(e.kind for e in f.events)
    _log(a.log, {"event": "done", "polls": polls, "events": dict(kinds), "version": f.version})
    f.close()


# -- one run ---------------------------------------------------------------------------------------------------------


def _start(role: str, url: str, so, log: str, **kw) -> subprocess.Popen:
    from tests.helpers.interleave import REPO

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    args = [sys.executable, "-m", "tests.slow.publisher_stress", "--role", role, "--url", url]
    args += ["--opts", json.dumps(so), "--log", log]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    return subprocess.Popen(args, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ready(p: subprocess.Popen, what: str) -> None:
    line = p.stdout.readline() if p.stdout is not None else ""
    if line.strip() != "ready":
        raise RuntimeError(f"{what} did not start (exit {p.wait()}): {line!r}")


def one_run(url: str, so, workdir: str, run: int, versions: int, attempts: int, seed: int) -> dict:
    """One run; returns its record: acks, errors by type, follower versions held, failures."""
    import ulstore
    from tests.helpers.small_states import digest, fresh_state
    from ulstore.sync import Publisher

    pub = Publisher(url, anchor_every=ANCHOR_EVERY, storage_options=so, chunk_elems=CHUNK_ELEMS, threads=1)
    pub.publish(0, fresh_state(seed))
    pub.close()
    logs = {name: os.path.join(workdir, f"run{run}-{name}.jsonl") for name in ("A", "B", "follower")}
    procs = {
        "A": _start("publisher", url, so, logs["A"], versions=versions, attempts=attempts, seed=seed * 2 + 1),
        "B": _start("publisher", url, so, logs["B"], versions=versions, attempts=attempts, seed=seed * 2 + 2),
        "follower": _start("follower", url, so, logs["follower"]),
    }
    try:
        for name, p in procs.items():
            _ready(p, name)
        for p in procs.values():  # go: all three at once
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        codes = {name: procs[name].wait(timeout=1800) for name in ("A", "B")}
        follower = procs["follower"]
        assert follower.stdin is not None
        follower.stdin.write("stop\n")
        follower.stdin.flush()
        codes["follower"] = follower.wait(timeout=600)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    out: dict = {"run": run, "failures": [], "acks": 0, "errors": collections.Counter(), "held": 0}

    def fail(what: str) -> None:
        out["failures"].append(what)

    for name, code in codes.items():
        if code != 0:
            fail(f"{name} exited with {code}")
    traj = ulstore.open(url, mode="r", storage_options=so, threads=1)
    chain = [i.step for i in traj.log("main")]
    on_branch = set(chain)
    digests: dict[int, str | None] = {}

    def digest_of(v: int) -> str | None:
        if v not in digests:
            try:
                digests[v] = digest(traj.read(v)) if v in traj else None
            except Exception as e:
                fail(f"version {v} does not read back: {type(e).__name__}: {e}")
                digests[v] = None
        return digests[v]

    acked: dict[int, list[str]] = collections.defaultdict(list)
    for name in ("A", "B"):
        records = _read_log(logs[name])
        outcome: dict[int, str] = {}
        for r in records:
            if r["event"] == "ack":
                out["acks"] += 1
                acked[r["version"]].append(name)
                outcome[r["version"]] = "ack"
                if r["version"] not in on_branch:
                    fail(f"{name}'s acknowledged version {r['version']} is not on the branch (history {chain})")
                elif digest_of(r["version"]) != r["digest"]:
                    fail(f"{name}'s acknowledged version {r['version']} reads back as other weights")
            elif r["event"] == "error":
                out["errors"][r["error"]] += 1
                outcome.setdefault(r["version"], "error")
                if r.get("trace") and r["error"] not in _NAMED:
                    fail(f"{name}: publish({r['version']}) raised an unnamed {r['error']}: {r['message']}")
        if not records or records[-1].get("event") != "done":
            fail(f"{name} did not finish (log ends with {records[-1:]})")
        for v in range(1, versions + 1):
            if v not in outcome:
                fail(f"{name}: publish({v}) neither returned nor raised")
    for v, names in acked.items():
        if len(names) > 1:
            fail(f"version {v} acknowledged by {names} (both publishes returned)")
    out["versions_on_branch"] = len([v for v in chain if v > 0])
    held = [r for r in _read_log(logs["follower"]) if r["event"] == "held"]
    out["held"] = len(held)
    for r in held:
        v = r["version"]
        if v not in on_branch:
            fail(f"the follower held version {v} (poll {r['poll']}), which is not on the branch (history {chain})")
        elif digest_of(v) != r["digest"]:
            fail(f"the follower held weights that are not version {v} of the branch (poll {r['poll']})")
    done = [r for r in _read_log(logs["follower"]) if r["event"] == "done"]
    out["follower"] = done[-1] if done else None
    out["follower_errors"] = collections.Counter(
        r["error"] for r in _read_log(logs["follower"]) if r["event"] == "error"
    )
    if done and done[-1]["version"] != chain[0]:
        fail(f"the follower ended on version {done[-1]['version']}, the branch on {chain[0]}")
    try:
        report = ulstore.open(url, mode="r", storage_options=so).verify(raise_on_error=False)
        if not report.ok:
            fail(f"verify: {report.errors}")
    except Exception as e:
        fail(f"verify raised {type(e).__name__}: {e}")
    return out


#: Errors a losing publish may raise (named, documented); anything else is reported as a failure.
_NAMED = {
    "InvalidInputError",
    "ConflictError",
    "RefMovedError",
    "StepExistsError",
    "StepNotFoundError",
    "NotFoundError",
    "BucketAccessError",
}


def run_stress(runs: int, url: str | None = None, storage_options=None, *, versions: int = 8, attempts: int = 5,
               seed: int = 0, verbose: bool = False) -> dict:  # fmt: skip
    """``runs`` runs on fresh locations under ``url`` (None: temporary directories; ``"moto"``: a moto S3 server
    started here; an ``s3://bucket/prefix``: with ``storage_options``); returns the totals."""
    workdir = tempfile.mkdtemp(prefix="publisher-stress-")
    moto = None
    totals: dict = {"runs": 0, "acks": 0, "errors": collections.Counter(), "held": 0, "failed_runs": 0}
    totals["failures"] = []
    totals["follower_errors"] = collections.Counter()
    t0 = time.perf_counter()
    try:
        so = storage_options
        if url == "moto":
            from tests.helpers.moto import MotoS3

            moto = MotoS3()
            url, so = f"s3://{moto.bucket()}/stress", moto.options
        for run in range(runs):
            where = (
                os.path.join(workdir, f"run{run}")
                if url is None
                else f"{url.rstrip('/')}/run{run}-{uuid.uuid4().hex[:6]}"
            )
            out = one_run(where, so, workdir, run, versions, attempts, seed * 1000 + run)
            totals["runs"] += 1
            totals["acks"] += out["acks"]
            totals["held"] += out["held"]
            totals["errors"].update(out["errors"])
            totals["follower_errors"].update(out["follower_errors"])
            if out["failures"]:
                totals["failed_runs"] += 1
                totals["failures"] += [f"run {run}: {f}" for f in out["failures"]]
            if verbose:
                print(
                    f"run {run}: acks {out['acks']}, on branch {out['versions_on_branch']}, errors "
                    f"{dict(out['errors'])}, follower held {out['held']} ({out['follower']}), "
                    f"failures {out['failures']}",
                    flush=True,
                )
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    totals["seconds"] = time.perf_counter() - t0
    return totals


def summary(t: dict) -> str:
    lines = [
        f"publisher stress: {t['runs']} runs in {t['seconds']:.0f} s, {t['failed_runs']} failed",
        f"  acknowledged versions {t['acks']}; loser errors {dict(t['errors'])}",
        f"  follower: versions held {t['held']}; poll errors {dict(t['follower_errors'])}",
    ]
    lines += [f"  FAIL {f}" for f in t["failures"][:40]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--url", default=None, help="a local directory for the runs (default: a temporary one), 'moto'")
    ap.add_argument("--versions", type=int, default=8, help="versions 1..K each publisher publishes")
    ap.add_argument("--attempts", type=int, default=5, help="publish attempts per version")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    # the child roles
    ap.add_argument("--role", choices=["publisher", "follower"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--opts", default="null", help=argparse.SUPPRESS)
    ap.add_argument("--log", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "publisher":
        _publisher(a)
        return 0
    if a.role == "follower":
        _follower(a)
        return 0
    if a.url is not None and a.url != "moto" and "://" not in a.url:
        os.makedirs(a.url, exist_ok=True)
    totals = run_stress(a.runs, a.url, versions=a.versions, attempts=a.attempts, seed=a.seed, verbose=a.verbose)
    print(summary(totals))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(totals, f, indent=1)
    return 1 if totals["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
