"""The trainer and follower processes of the sync end-to-end tests.

Run from the repository root (:func:`tests.helpers.sync.run_role` does)::

    python -m tests.helpers.sync_roles trainer  --url URL --opts JSON --log FILE [--kill-at V:KEYPREFIX] ...
    python -m tests.helpers.sync_roles follower --url URL --opts JSON --out FILE --until V [--join-after V] ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

from ulstore import toytrain

from .sync import E2E_LR, E2E_WARMUP, e2e_config, flat_bits, state_digest


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
        io = pub.trajectory._io
        for method in ("put", "create", "open_writer"):  # every write of the trajectory's objects
            orig = getattr(io, method)

            def write(key, *args, _orig=orig, **kw):
                # a real kill (SIGKILL, no cleanup) at a precise point of one publish
                if current["version"] == int(kill_version) and key.startswith(prefix):
                    os.kill(os.getpid(), signal.SIGKILL)
                return _orig(key, *args, **kw)

            setattr(io, method, write)
    prev = None
    for step, state, loss in toytrain.train(e2e_config(), a.steps, lr=E2E_LR, warmup_steps=E2E_WARMUP):
        changed = None if prev is None else sum(int((flat_bits(state[k]) != flat_bits(prev[k])).sum()) for k in state)
        prev = state
        if step < start:
            continue
        _append(
            a.log,
            {
                "version": step,
                "digest": state_digest(state),
                "changed": changed,
                "total": int(sum(v.size for v in state.values())),
            },
        )
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
    _append(
        a.out,
        {
            "done": True,
            "joined_at": joined_at,
            "verified": f.verify(),
            "stats": vars(f.stats),
            "events": [[e.kind, e.version, e.detail] for e in f.events],
        },
    )
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
