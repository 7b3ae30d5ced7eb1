"""Racing writers on one branch: no acknowledged step ever falls off the branch.

Four writers (processes on local disk and on a moto S3 server; threads on
memory://) commit to the same branch at once, 20 trials each; a loser gets a
named error and retries on the new head (``tests/helpers/races.py``).  After
every trial the branch's log must hold every step a writer was told was
committed, each exactly once, as one chain back to step 0.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import threading
import uuid

import numpy as np
import pytest

import ulstore
from tests.helpers.races import race_worker

WORKERS = 4
TRIALS = 20


def _setup(url, so):
    traj = ulstore.open(url, mode="w", storage_options=so)
    traj.commit(0, {"w": np.zeros((8, 8), np.float32), "n": np.int64(-1)})
    for t in range(TRIALS):
        traj.set_ref(f"race{t}", 0)
    return traj


def _check(url, so, results):
    traj = ulstore.open(url, mode="r", storage_options=so)
    records = [r for rs in results for r in rs]
    assert len(records) == WORKERS * TRIALS
    for t in range(TRIALS):
        won = sorted(r["won"] for r in records if r["trial"] == t)
        chain = [i.step for i in traj.log(f"race{t}")]
        assert chain[-1] == 0 and len(chain) == len(set(chain))
        assert sorted(chain[:-1]) == won, (t, chain, won)  # every acknowledged step, nothing else
        for r in records:
            for s in r["after"] if r["trial"] == t else ():
                assert s in traj and s not in chain  # kept off the branch, as the error said
    assert traj.verify().ok
    return {
        "trials": TRIALS,
        "commits": len(records),
        "lost_before_commit_point": sum(r["before"] for r in records),
        "lost_after_commit_point": sum(len(r["after"]) for r in records),
        "sibling_finishing": sum(r["sibling"] for r in records),
    }


def _race_processes(url, so):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(WORKERS)
        with cf.ProcessPoolExecutor(WORKERS, mp_context=ctx) as pool:
            futures = [pool.submit(race_worker, url, so, w, TRIALS, barrier) for w in range(WORKERS)]
            return [f.result(timeout=600) for f in futures]


# process pools racing for real (7 s of CPU): the slow lane, with its S3 twin; the fast lane keeps the threads
# racing (test_racing_threads) and the forced interleavings with another process (tests/store/test_concurrency.py)
@pytest.mark.slow
def test_racing_processes_on_local_disk(tmp_path):
    url = str(tmp_path / "race")
    _setup(url, None)
    outcome = _check(url, None, _race_processes(url, None))
    print("local disk:", outcome)
    assert outcome["lost_before_commit_point"] + outcome["lost_after_commit_point"] > 0  # they did race


@pytest.mark.slow
def test_racing_processes_on_s3(moto_s3):
    url, so = f"s3://ulstore-test/race-{uuid.uuid4().hex}", moto_s3.options
    _setup(url, so)
    outcome = _check(url, so, _race_processes(url, so))
    print("moto S3:", outcome)
    assert outcome["lost_before_commit_point"] + outcome["lost_after_commit_point"] > 0


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_racing_threads(backend, tmp_path):
    url = f"memory://race-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path / "race")
    _setup(url, None)
    barrier = threading.Barrier(WORKERS)
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda w: race_worker(url, None, w, TRIALS, barrier), range(WORKERS)))
    print(backend, "threads:", _check(url, None, results))
