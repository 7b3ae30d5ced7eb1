"""Free-running races of maintenance against maintenance, commits and reads: the roles, one process each.

Each trial prepares a fresh trajectory (steps 0..11 on ``main``, anchors every
4), then four processes run at once on it until each has done its share:

- ``deleter``: deletes steps 2, 5, 7 and 9, retrying a refused delete;
- ``collector``: gc with repacking (a short grace period), several times;
- ``committer``: commits steps 100.. on branch ``side`` from step 11;
- ``reader``: reads random steps and compares them with what was committed.

Every role returns what it did; a wrong value, or any error other than the
named refusals, fails the trial.  The test then checks the end state.
"""

from __future__ import annotations

import random
import time

import numpy as np

import ulstore
from ulstore.errors import ConflictError, StepNotFoundError

from .bits import bits_of
from .store import CHUNK, states_bf16

__all__ = ["prepare", "role", "expected_state", "DELETED", "MAIN_STEPS"]

MAIN_STEPS = list(range(12))
DELETED = [2, 5, 7, 9]
_SIDE = 3  # commits on the side branch per trial


def expected_state(step: int) -> dict:
    states = states_bf16(20)
    return states[step] if step < 100 else states[12 + (step - 100) % 8]


def prepare(url: str, options) -> None:
    traj = ulstore.open(
        url, mode="w", storage_options=options, chunk_bytes=4 * CHUNK, anchor_every=4, pack_bytes=60_000
    )
    for s in MAIN_STEPS:
        traj.commit(s, expected_state(s))


def _same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(np.array_equal(bits_of(got[k]), bits_of(np.asarray(want[k]))) for k in want)


def _retry(fn, attempts: int = 200):
    """``fn()``, again while it is refused for work in flight (ConflictError proper) or because a step it was
    coded against was deleted meanwhile (StepNotFoundError: nothing was committed)."""
    for _ in range(attempts):
        try:
            return fn()
        except (ConflictError, StepNotFoundError) as e:
            if type(e).__name__ not in ("ConflictError", "StepNotFoundError"):  # StepExistsError, RefMovedError
                raise
            time.sleep(0.01)
    raise AssertionError("refused 200 times in a row")


def role(name: str, url: str, options, seed: int) -> dict:
    """Run role ``name`` once against the trajectory at ``url``; returns what it did."""
    rng = random.Random(seed)
    traj = ulstore.open(url, mode="r+", storage_options=options, threads=1)
    out: dict = {"role": name}
    if name == "deleter":
        for s in DELETED:
            _retry(lambda s=s: traj.delete(s))
        out["deleted"] = DELETED
    elif name == "collector":
        results = [traj.gc(repack_below=0.9, older_than=2.0) for _ in range(4)]
        out["deferred"] = sum(r["deferred"] is not None for r in results)
        out["rewritten"] = sum(r["steps_rewritten"] for r in results)
    elif name == "committer":
        done, parent = [], 11
        for i in range(_SIDE):
            step = 100 + i
            _retry(
                lambda step=step, parent=parent: traj.commit(step, expected_state(step), parent=parent, branch="side")
            )
            done.append(step)
            parent = step
        out["committed"] = done
    elif name == "reader":
        ro = ulstore.open(url, mode="r", storage_options=options, threads=1)
        reads = missing = 0
        for _ in range(8):
            s = rng.choice(MAIN_STEPS + [100, 101, 102])
            try:
                got = ro.read(s)
            except StepNotFoundError:
                missing += 1
                continue
            if not _same(got, expected_state(s)):
                raise AssertionError(f"step {s} read back different values")
            reads += 1
        out["reads"], out["missing"] = reads, missing
    else:
        raise ValueError(name)
    return out
