"""Helpers of the sync tests: real RL trajectories, state digests, exact comparison, the e2e processes.

Nothing here compares floats: digests and bit views only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from ulstore import toytrain

from .bits import assert_bits_equal, flat_bits

__all__ = [
    "E2E_LR",
    "E2E_WARMUP",
    "e2e_config",
    "state_digest",
    "assert_same_bits",
    "rl_states",
    "delta_modes",
    "run_role",
    "read_jsonl",
    "flat_bits",
    "columns_taken",
]

ROOT = Path(__file__).resolve().parents[2]  # the repository: where `python -m tests.helpers.sync_roles` runs

#: The end-to-end model: a real toytrain MLP LM (~250K params, ~40 ms/step on one core).
E2E_CONFIG = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2)
E2E_WARMUP = 40
E2E_LR = 3e-6


def e2e_config() -> toytrain.ToyConfig:
    return toytrain.ToyConfig.preset("tiny", **E2E_CONFIG)


def state_digest(state) -> str:
    """sha256 over sorted names of (name, dtype width, shape, bits)."""
    h = hashlib.sha256()
    for name in sorted(state):
        v = state[name]
        bits = flat_bits(v)
        h.update(name.encode() + b"\0" + str(tuple(v.shape)).encode() + str(bits.dtype).encode())
        h.update(bits.tobytes())
    return h.hexdigest()


def assert_same_bits(got, want) -> None:
    """Two states (name -> array or tensor) hold the same names and, name by name, the same bits."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k in want:
        assert_bits_equal(got[k], want[k], k)


def rl_states(steps: int, preset: str = "tiny", warmup: int = 20, **overrides) -> list[dict]:
    """A real RL-regime bf16 trajectory of ``steps + 1`` checkpoints."""
    cfg = toytrain.ToyConfig.preset(preset, **overrides)
    return [s for _, s, _ in toytrain.train(cfg, steps, lr=E2E_LR, warmup_steps=warmup, dtype="bfloat16")]


def delta_modes(follower, version: int) -> set[str]:
    """ULPack modes ("sparse", "rans", ...) of the delta chunks of ``version``, read through ``follower``."""
    from ulstore import inspect_blob

    traj = follower.trajectory
    deltas = [c for c in traj.changes(version) if c.kind == "delta"]
    return {inspect_blob(b)["mode"] for b in traj.fetch_blobs(deltas)}


def run_role(role: str, *args, wait: bool = True, timeout: float = 120):
    """Start ``python -m tests.helpers.sync_roles <role> ...`` from the repository root; CompletedProcess or Popen."""
    import subprocess

    cmd = [sys.executable, "-m", "tests.helpers.sync_roles", role, *map(str, args)]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def read_jsonl(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def columns_taken(monkeypatch) -> list[bool]:
    """A list that gets, per version a replica applies with change columns, whether it went the columns way
    (True: planned from the columns, written in place) or was declined and took the feed (False)."""
    from ulstore.sync._replica import Replica

    taken: list[bool] = []
    record, feed = Replica._record_columns, Replica._apply_feed

    def recorded(self, f, *args):
        taken.append(True)
        return record(self, f, *args)

    def fed(self, f):
        if f.columns is not None:
            taken.append(False)
        return feed(self, f)

    monkeypatch.setattr(Replica, "_record_columns", recorded)
    monkeypatch.setattr(Replica, "_apply_feed", fed)
    return taken
