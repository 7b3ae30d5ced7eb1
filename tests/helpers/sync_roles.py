"""Shared helpers for the ulstore.sync tests, and the trainer/follower processes of the end-to-end tests.

Imported by the ``test_sync_*`` modules (``sys.path`` trick, as ``--import-mode=importlib``
gives test modules no package) and run as a script for the subprocesses::

    python tests/test_sync_support.py trainer  --url URL --opts JSON --log FILE [--kill-at V:KEYPREFIX] ...
    python tests/test_sync_support.py follower --url URL --opts JSON --out FILE --until V [--join-after V] ...

Nothing here compares floats: digests and bit views only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulstore import toytrain  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest_store import MotoS3  # noqa: E402

#: The end-to-end model: a real toytrain MLP LM (~250K params, ~40 ms/step on one core).
E2E_CONFIG = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2)
E2E_WARMUP = 40
E2E_LR = 3e-6


def e2e_config() -> toytrain.ToyConfig:
    return toytrain.ToyConfig.preset("tiny", **E2E_CONFIG)


def host_bits(value) -> np.ndarray:
    """Flat unsigned view of the bits of a numpy array or torch tensor."""
    if type(value).__module__.startswith("torch"):
        from ulstore.core.torch import from_tensor as tensor_to_numpy

        value = tensor_to_numpy(value)
    a = np.ascontiguousarray(value)
    return a.reshape(-1).view(f"<u{a.dtype.itemsize}")


def state_digest(state) -> str:
    """sha256 over sorted names of (name, dtype width, shape, bits)."""
    h = hashlib.sha256()
    for name in sorted(state):
        v = state[name]
        bits = host_bits(v)
        h.update(name.encode() + b"\0" + str(tuple(v.shape)).encode() + str(bits.dtype).encode())
        h.update(bits.tobytes())
    return h.hexdigest()


def assert_same_bits(got, want) -> None:
    assert set(got) == set(want)
    for k in want:
        assert tuple(got[k].shape) == tuple(want[k].shape), k
        np.testing.assert_array_equal(host_bits(got[k]), host_bits(want[k]), err_msg=k)


def rl_states(steps: int, preset: str = "tiny", warmup: int = 20, **overrides) -> list[dict]:
    """A real RL-regime bf16 trajectory of ``steps + 1`` checkpoints."""
    cfg = toytrain.ToyConfig.preset(preset, **overrides)
    return [s for _, s, _ in toytrain.train(cfg, steps, lr=E2E_LR, warmup_steps=warmup, dtype="bfloat16")]


# -- moto ----------------------------------------------------------------------------


def delta_modes(follower, version: int) -> set[str]:
    """ULPack modes ("sparse", "rans", ...) of the delta chunks of ``version``, read through ``follower``."""
    from ulstore import inspect_blob

    m = follower._reader.manifest(version)
    packs = follower._reader.fetch_packs(m)
    return {inspect_blob(packs[e.pack][e.offset : e.offset + e.length])["mode"] for e in m.entries if e.codec == "d"}


@pytest.fixture(scope="module")
def moto_s3():
    s3 = MotoS3()
    yield s3
    s3.stop()


def run_role(role: str, *args, wait: bool = True, timeout: float = 120):
    """Start ``python tests/test_sync_support.py <role> ...``; return the CompletedProcess or Popen."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), role, *map(str, args)]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def read_jsonl(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the processes --------------------------------------------------------------------


def _append(path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def trainer_main(a) -> None:
    """Train for real and publish every step; log each version's digest *before* publishing it."""
    from ulstore.sync import Publisher

    pub = Publisher(a.url, anchor_every=a.anchor_every, storage_options=json.loads(a.opts), chunk_elems=1 << 14)
    start = 0 if pub.latest is None else pub.latest + 1  # a restarted trainer recomputes, then resumes
    current = {"version": None}
    if a.kill_at:
        kill_version, prefix = a.kill_at.split(":", 1)
        orig_put = pub._bucket.put

        def put(key, data):
            # a real kill (SIGKILL, no cleanup) at a precise point of one publish
            if current["version"] == int(kill_version) and key.startswith(prefix):
                os.kill(os.getpid(), signal.SIGKILL)
            orig_put(key, data)

        pub._bucket.put = put
    prev = None
    for step, state, loss in toytrain.train(e2e_config(), a.steps, lr=E2E_LR, warmup_steps=E2E_WARMUP):
        changed = None if prev is None else sum(int((host_bits(state[k]) != host_bits(prev[k])).sum()) for k in state)
        prev = state
        if step < start:
            continue
        _append(a.log, {"version": step, "digest": state_digest(state), "changed": changed,
                        "total": int(sum(v.size for v in state.values()))})
        current["version"] = step
        pub.publish(step, state, metadata={"model_version": step, "loss": loss})
        time.sleep(a.delay)
    _append(a.log, {"done": True, "stats": pub.stats})
    pub.close()


def follower_main(a) -> None:
    """Follow until ``--until``; log every version reached with the digest of the state held."""
    from ulstore.sync import Follower

    opts = json.loads(a.opts)
    cfg = e2e_config()
    if a.state == "torch":
        import torch

        state = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in cfg.shapes().items()}
    else:
        state = {k: np.zeros(s, dtype=toytrain.CHECKPOINT_DTYPES["bfloat16"]) for k, s in cfg.shapes().items()}
    f = Follower(a.url, state=state, storage_options=opts, poll_interval=0.02, trust_state=a.trust_state)
    deadline = time.monotonic() + 60
    while a.join_after is not None and (f.published() or -1) < a.join_after:  # a replica that joins late
        if time.monotonic() > deadline:
            raise SystemExit("the trainer never reached the join version")
        time.sleep(0.02)
    joined_at = f.published()
    for v in f.follow(until=a.until, timeout=60):
        assert f.version == v
        _append(a.out, {"version": v, "digest": state_digest(state)})
    _append(a.out, {"done": True, "joined_at": joined_at, "verified": f.verify(), "stats": vars(f.stats),
                    "events": [[e.kind, e.version, e.detail] for e in f.events]})
    f.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["trainer", "follower"])
    p.add_argument("--url", required=True)
    p.add_argument("--opts", default="{}")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--anchor-every", type=int, default=8)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--kill-at", default=None)
    p.add_argument("--log", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--until", type=int, default=None)
    p.add_argument("--join-after", type=int, default=None)
    p.add_argument("--state", choices=["numpy", "torch"], default="numpy")
    p.add_argument("--trust-state", action="store_true", help="Follower(trust_state=True): O(changes) apply")
    a = p.parse_args(argv)
    trainer_main(a) if a.role == "trainer" else follower_main(a)


if __name__ == "__main__":
    main()
