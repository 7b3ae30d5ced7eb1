"""Racing writers on one branch: the worker every racing test runs (in processes or threads).

Each trial has its own branch ``race<t>``, created at step 0 by the test.  Every
worker waits on the barrier, then commits its own step on the branch's head and,
when it loses, retries on the new head until it wins.  Losing is only ever a
named error:

- ``RefMovedError`` before the commit point: the step was not created, the
  retry uses the same number (outcome ``before``);
- ``RefMovedError`` after it: the step exists off the branch, the retry uses a
  new number (outcome ``after``);
- ``ConflictError`` naming a sibling that created its step but has not moved
  the branch yet (it is finishing): retry (outcome ``sibling``).

Anything else propagates and fails the test.
"""

from __future__ import annotations

import numpy as np

import ulstore
from ulstore.errors import ConflictError, RefMovedError

__all__ = ["race_worker", "first_step"]

_MAX_ATTEMPTS = 500


def first_step(trial: int, worker: int) -> int:
    """The first step number ``worker`` tries in ``trial`` (later ones follow it)."""
    return 1_000_000 * (trial + 1) + 1000 * worker


def race_worker(url: str, storage_options, worker: int, trials: int, barrier) -> list[dict]:
    """Run ``trials`` racing commits; returns, per trial, the step that won and how the losses went."""
    traj = ulstore.open(url, mode="a", storage_options=storage_options, threads=1)
    out = []
    for t in range(trials):
        barrier.wait(timeout=120)  # a worker that died fails the others, not the whole run (pytest-timeout)
        step = first_step(t, worker)
        state = {"w": np.full((8, 8), worker + t / 64, np.float32), "n": np.int64(t)}
        record = {"trial": t, "worker": worker, "before": 0, "after": [], "sibling": 0}
        for _ in range(_MAX_ATTEMPTS):
            try:
                traj.commit(step, state, branch=f"race{t}")
                break
            except RefMovedError as e:
                if e.step == step:  # committed, but the branch moved first: the step stays off the branch
                    record["after"].append(step)
                    step += 1
                else:
                    record["before"] += 1
            except ConflictError as e:
                if isinstance(e.step, int) and e.step != step:
                    record["sibling"] += 1
                else:
                    raise
        else:
            raise AssertionError(f"worker {worker} never won trial {t}")
        record["won"] = step
        out.append(record)
    return out
