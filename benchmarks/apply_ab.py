"""The compiled in-place apply alone: two builds of the kernels against each other, in one process.

A follower applies versions 1-10 of the bench RL trajectory (13.3M bf16
parameters; ``--preset``, ``--steps``) while its ``apply_sparse`` calls are recorded; the calls are then
replayed on fresh replica states (one huge-page arena each, as a follower's)
with the caches flushed and a full garbage collection before each call, the
builds taking turns call by call.  The machine's drift over minutes then
lands on both builds alike, which a whole benchmark run per build cannot
promise: this is how the in-place job's changes were measured (two copies of
one build give the same figure).

Usage::

    python benchmarks/apply_ab.py A.so B.so            # two builds of ulstore/codec/_kernels_x86_64_v3*.so (or _kernels)
    python benchmarks/apply_ab.py A.so B.so --threads 1 --rounds 6
    python benchmarks/apply_ab.py K.so K2.so --a-contexts  # A's deltas with exponent contexts, B's as the store codes them

``--a-contexts``: A replays the versions coded as the store coded SPARSE
deltas before it dropped their exponent contexts (``encode(econd=True)``),
B as it codes them now; with two copies of one build, this measures what
the one-pass apply of context-free deltas gains (``_apply.pxi``, ``fused_put``).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _builds import load_build  # noqa: E402
from _data import cache_options, load_trajectory  # noqa: E402

from ulstore.codec import ApplyPlan, _sparse_apply  # noqa: E402
from ulstore.codec._backend import kernels  # noqa: E402
from ulstore.sync import Follower, Publisher  # noqa: E402
from ulstore.sync._arrays import Spec, allocate  # noqa: E402


def record(preset: str, steps: int, contexts: bool = False) -> tuple[dict, list]:
    """Version 0's state and every ``apply_sparse`` call a follower makes for versions 1..steps, as
    ``(its plan without the arrays, [(tensor, first element, elements)])``;
    ``contexts``: the SPARSE deltas coded with exponent contexts (the store codes them without)."""
    states = load_trajectory("rl", "bfloat16", preset, steps=steps)
    if contexts:
        from ulstore.store.format import _chunkcodec

        real_encode = _chunkcodec._ulpack.encode
        _chunkcodec._ulpack.encode = lambda *a, **kw: real_encode(*a, **{**kw, "econd": True})
        try:
            return record(preset, steps)
        finally:
            _chunkcodec._ulpack.encode = real_encode
    where = tempfile.mkdtemp(prefix="ulstore-apply-ab-")
    calls: list = []
    try:
        with Publisher(where, anchor_every=0) as pub:
            pub.publish(0, states[0])
            with Follower(where, trust_state=True) as f:
                f.bootstrap()
                mirrors = {n: b.mirror for n, b in f._replica._bindings.items()}
                real = _sparse_apply.apply_sparse

                def spy(plans, **kw):  # one plan, or one per dtype: a recorded call each
                    for plan in [plans] if isinstance(plans, ApplyPlan) else plans:
                        calls.append((replace(plan, blobs=[bytes(b) for b in plan.blobs], arrays=[]), spans(plan)))
                    return real(plans, **kw)

                def spans(plan):
                    out = []
                    for a in plan.arrays:
                        for n, m in mirrors.items():
                            offset = (a.ctypes.data - m.ctypes.data) // m.dtype.itemsize
                            if 0 <= offset < m.size:
                                out.append((n, offset, a.size))
                                break
                    return out

                from ulstore.sync import _in_place, _replica

                _sparse_apply.apply_sparse = _in_place.apply_sparse = _replica.apply_sparse = spy
                try:
                    for v in range(1, steps + 1):
                        pub.publish(v, states[v])
                        assert f.poll(to=v) == v
                finally:
                    _sparse_apply.apply_sparse = _in_place.apply_sparse = _replica.apply_sparse = real
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return states[0], calls


def run(k, call, state: dict, pool, threads: int) -> float:
    """One recorded call on ``state`` with kernel module ``k``: the seconds of the job (made, worked, finished)."""
    plan, spans = call
    arrays = [state[n].reshape(-1)[o : o + c].view(plan.word) for n, o, c in spans]
    t = time.perf_counter()
    job = k.SparseApply(replace(plan, arrays=arrays), True, None, None, True)
    helper = pool.submit(job.work) if threads > 1 else None
    job.work()
    if not job.join() and helper is not None:
        helper.result()
    status = job.finish()[0]
    took = time.perf_counter() - t
    assert status == 0, f"a recorded call failed with status {status}"
    return took


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "a", help="a build of the kernel module in use (e.g. a copy of ulstore/codec/_kernels_x86_64_v3*.so)"
    )
    p.add_argument("b", help="another build of it")
    p.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    p.add_argument("--steps", type=int, default=10, help="versions recorded (default 10)")
    p.add_argument("--threads", type=int, default=2, help="threads in each job (default 2)")
    p.add_argument("--rounds", type=int, default=4, help="passes over the 10 versions (default 4)")
    p.add_argument("--replicas", type=int, default=8, help="replicas per build and round (default 8)")
    p.add_argument(
        "--a-contexts",
        action="store_true",
        help="A replays the deltas coded with exponent contexts, B as the store codes them (no contexts)",
    )
    cache_options(p)
    args = p.parse_args(argv)
    name = kernels().__name__
    where = tempfile.mkdtemp(prefix="ulstore-apply-ab-")
    atexit.register(shutil.rmtree, where, True)  # the builds' copies (loaded until the process ends)
    builds = {
        label: load_build(path, os.path.join(where, label), name) for label, path in (("A", args.a), ("B", args.b))
    }
    state0, calls = record(args.preset, args.steps)
    calls_of = {"A": record(args.preset, args.steps, contexts=True)[1] if args.a_contexts else calls, "B": calls}
    if args.a_contexts:  # the same chunks changed: the same calls, blob for blob
        assert [len(c[1]) for c in calls_of["A"]] == [len(c[1]) for c in calls]
        sizes = {k: sum(len(b) for c in v for b in c[1]) for k, v in calls_of.items()}
        print(f"blob bytes: A {sizes['A']} (exponent contexts), B {sizes['B']} ({sizes['B'] / sizes['A'] - 1:+.1%})")
    specs = [Spec(n, a.shape, a.dtype) for n, a in state0.items()]
    junk = np.ones(1 << 26, np.uint8)
    times: dict[str, list] = {"A": [], "B": []}
    with cf.ThreadPoolExecutor(max(1, args.threads - 1)) as pool:
        for rnd in range(args.rounds):
            replicas = []
            for _ in range(2 * args.replicas):
                arena = allocate(specs)
                for n, (arr, _) in arena.items():
                    arr[...] = state0[n]
                replicas.append({n: arr for n, (arr, _) in arena.items()})
            for v in range(len(calls)):
                for r, state in enumerate(replicas):
                    which = "AB"[(r + v + rnd) % 2]
                    junk[::64] += 1  # 64 MB touched: the state and the job's buffers leave the caches
                    gc.collect()
                    times[which].append(run(builds[which], calls_of[which][v], state, pool, args.threads))
    ms = {k: (statistics.mean(t) * 1e3, statistics.median(t) * 1e3) for k, t in times.items()}
    print(
        f"in-place apply job, {len(calls)} versions x {args.rounds} rounds x {args.replicas} replicas, "
        f"{args.threads} thread(s):"
    )
    for k, path in (("A", args.a), ("B", args.b)):
        print(f"  {k}: mean {ms[k][0]:.3f} ms, median {ms[k][1]:.3f} ms  ({path})")
    print(f"  B/A: mean {ms['B'][0] / ms['A'][0]:.3f}, median {ms['B'][1] / ms['A'][1]:.3f}")


if __name__ == "__main__":
    main()
