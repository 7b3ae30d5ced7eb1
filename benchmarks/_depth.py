"""``benchmarks/store.py --only depth``: reading any step, at any depth, against storing near the pure chain (issue 35).

Per trajectory (two real toytrain runs of ``--depth-steps`` steps, bf16: the
RL regime, lr 3e-6 after warm-up, and dense pretraining, lr 1e-3), measured
before anything is chosen:

1. the pure chain: one root anchor plus every step's delta, as
   ``ulstore.encode_many`` makes them (dense deltas; SPARSE deltas beside);
   an anchor's size;
2. union growth: the delta from step t to t+k (bytes, dense and SPARSE, and
   changed elements) as k grows: whether deltas against an older step
   (long-range references, snapshots) could beat anchors;
3. the cost model of ``ulstore/store/format/_read_cost.py`` (bytes fetched
   plus decode work) calibrated against decode and apply timings here, and
   from it the best storage/read trade-off each policy family reaches against
   the acceptance bounds (slowest full read <= 2.0x the fastest; stored bytes
   <= 1.25x the pure chain on RL, <= 1.10x on dense), or the floor where both
   cannot hold at once;
4. the trajectory stored with the default policy: stored bytes vs the pure
   chain, anchors and why; the full read of a step at each depth from a fresh
   process (the time is taken inside it, from ``ulstore.open`` to the arrays
   returned, the interpreter's start and imports excluded; in rounds, each
   round a new process per step in a shuffled order, and per step the min
   across rounds: a shared machine's load moves between one process and the
   next, and min of N is what stays put), modelled cost beside it; and the GETs of a one-element lazy slice
   per depth on a moto S3 server on 127.0.0.1 (a copy of the same trajectory).

The figures go side by side with the bounds; nothing is asserted.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

import ulstore
from ulstore.codec import ApplyPlan, apply_sparse, content_sum, is_sparse_blob
from ulstore.store.format import _read_cost as rc
from ulstore.store.format._read_cost import cost_of, own_blobs

HERE = Path(__file__).resolve().parent

#: (toytrain regime, what it is, the storage bound vs the pure chain)
RUNS = (("rl", "RL regime: lr 3e-6 after warm-up (sparse)", 1.25), ("pretrain", "pretraining: lr 1e-3 (dense)", 1.10))
READ_BOUND = 2.0
UNION_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

_READ_CHILD = r"""
import json, sys, time
import ulstore
job = json.loads(sys.argv[1])
open_ = ulstore.open  # imports the store (lazily loaded, ~1 s): before the clock, as the interpreter's start
best = cpu = first = None
for _ in range(job["reps"]):
    s, c = time.perf_counter(), time.process_time()
    t = open_(job["url"], mode="r")
    t.read(job["step"])
    took, used = time.perf_counter() - s, time.process_time() - c
    first = first or (took, used)
    best = took if best is None else min(best, took)
    cpu = used if cpu is None else min(cpu, used)
    del t
print(json.dumps({"seconds": best, "cpu": cpu, "first": first}))
"""


def _fresh_read(url: str, step: int, reps: int) -> dict:
    """Seconds of a full read of ``step`` in a new process, wall and CPU (the process's threads): from
    ``ulstore.open`` to the arrays (``seconds``, ``cpu``: each the min of ``reps`` opens in that process, each with
    cold ulstore caches; ``first``: (wall, CPU) of its first, whatever the process does once included: its
    imports are done before the clock starts)."""
    p = subprocess.run(
        [sys.executable, "-c", _READ_CHILD, json.dumps({"url": url, "step": step, "reps": reps})],
        capture_output=True,
        text=True,
    )
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def fresh_reads(url: str, steps: list[int], reps: int, rounds: int) -> dict:
    """:func:`_fresh_read` of every step in ``rounds`` rounds, each round a new process per step, the steps in a
    shuffled order (a fixed seed per round: no step always read first, after the same neighbour, or in the same
    phase of the machine's load); per step the min across rounds of wall and of CPU (the same measure with its
    noise cut: min of N), and of a process's first read.  Also the load average before and after each round."""
    wall: dict[int, float] = {}
    cpu: dict[int, float] = {}
    first: dict[int, tuple[float, float]] = {}
    load = [os.getloadavg()[0]]
    for r in range(max(1, rounds)):
        order = list(steps)
        random.Random(r).shuffle(order)
        for s in order:
            got = _fresh_read(url, s, reps)
            wall[s] = min(wall.get(s, math.inf), got["seconds"])
            cpu[s] = min(cpu.get(s, math.inf), got["cpu"])
            f = first.get(s, (math.inf, math.inf))
            first[s] = (min(f[0], got["first"][0]), min(f[1], got["first"][1]))
        load.append(os.getloadavg()[0])
    return {"wall": wall, "cpu": cpu, "first": first, "load": load, "rounds": max(1, rounds), "reps": reps}


def _bits_changed(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.count_nonzero(a.view(np.uint16) != b.view(np.uint16)))


def _step_costs(blobs: list, raw: list[int], delta: bool) -> int:
    """The modelled read cost of one step's blobs (``delta``: coded against the step before; an anchor's
    includes the fixed cost of a read)."""
    return sum(cost_of(b, n, delta) for b, n in zip(blobs, raw)) + (0 if delta else rc.PER_READ)


# -- 1-2. measured before choosing ------------------------------------------------------------------------------


def measure(states: list[dict]) -> dict:
    """Pure-chain bytes, anchors, SPARSE deltas, changed elements, modelled costs, per step; union growth."""
    names = list(states[0])
    raw = [states[0][n].nbytes for n in names]
    out: dict = {"raw": sum(raw), "elements": sum(states[0][n].size for n in names)}
    anchors, dense, sparse, changed, c_anchor, c_dense, c_sparse = [], [], [], [], [], [], []
    for t, state in enumerate(states):
        if t % 25 == 0:  # an anchor's size drifts slowly: sampled
            intra = ulstore.encode_many([state[n] for n in names])
            anchors.append(sum(map(len, intra)))
            c_anchor.append(_step_costs(intra, raw, False))
        if t == 0:
            out["root"] = anchors[0]
            continue
        prev = states[t - 1]
        d = ulstore.encode_many([(state[n], prev[n]) for n in names])
        s = ulstore.encode_many([(state[n], prev[n]) for n in names], sparse=True)
        dense.append(sum(map(len, d)))
        sparse.append(sum(map(len, s)))
        c_dense.append(_step_costs(d, raw, True))
        c_sparse.append(_step_costs(s, raw, True))
        changed.append(sum(_bits_changed(state[n], prev[n]) for n in names))
    out |= {
        "anchor": float(np.mean(anchors)),
        "dense": np.array(dense),
        "sparse": np.array(sparse),
        "changed": np.array(changed),
        "c_anchor": float(np.mean(c_anchor)),
        "c_dense": np.array(c_dense),
        "c_sparse": np.array(c_sparse),
    }
    out["pure"] = out["root"] + int(out["dense"].sum())
    out["union"] = _union(states, names, raw)
    out["calibration"] = _calibrate(states, names, raw)
    return out


def _union(states, names, raw) -> dict:
    """The delta from a base step to base + k, for k in UNION_KS: bytes (dense, SPARSE), changed elements, costs."""
    rows = {}
    bases = [b for b in (1, len(states) // 3) if b + 1 < len(states)]
    for k in UNION_KS:
        got = []
        for b in bases:
            if b + k >= len(states):
                continue
            x, r = states[b + k], states[b]
            d = ulstore.encode_many([(x[n], r[n]) for n in names])
            s = ulstore.encode_many([(x[n], r[n]) for n in names], sparse=True)
            ch = sum(_bits_changed(x[n], r[n]) for n in names)
            got.append((sum(map(len, d)), sum(map(len, s)), ch, _step_costs(d, raw, True), _step_costs(s, raw, True)))
        if got:
            rows[k] = tuple(float(np.mean(c)) for c in zip(*got))
    return rows


def _calibrate(states, names, raw, reps: int = 3) -> dict:
    """ns per byte (CPU), one thread: a full decode (per byte out), a dense delta, a SPARSE apply in place (per blob
    byte), a read of the blob bytes from a warm local file (the model's unit, a byte fetched); what the model's
    per-byte weights stand for (:func:`fixed_terms` adds the fixed ones, from full reads)."""
    t = min(len(states) - 1, 30)
    x, r = states[t], states[t - 1]
    intra = ulstore.encode_many([x[n] for n in names])
    dense = ulstore.encode_many([(x[n], r[n]) for n in names])
    sparse = [b for b in ulstore.encode_many([(x[n], r[n]) for n in names], sparse=True)]
    pairs = [(b, n) for b, n in zip(sparse, names) if is_sparse_blob(b)]

    def best(fn) -> float:  # CPU time: on a shared machine wall time moves with the load
        out = []
        for _ in range(reps):
            s = time.process_time()
            fn()
            out.append(time.process_time() - s)
        return min(out)

    total = sum(raw)
    t_intra = best(lambda: ulstore.decode_many(intra, threads=1))
    t_dense = best(lambda: ulstore.decode_many([(b, r[n]) for b, n in zip(dense, names)], threads=1))
    applied = []
    for _ in range(reps):
        arrs = [r[n].copy() for _, n in pairs]
        plan = ApplyPlan.of(arrs[0].dtype, [b for b, _ in pairs], arrs, [content_sum(a) for a in arrs],
                            shapes=[a.shape for a in arrs])  # fmt: skip
        s = time.process_time()
        apply_sparse(plan)
        applied.append(time.process_time() - s)
    sparse_bytes = max(1, sum(len(b) for b, _ in pairs))
    joined = b"".join(intra)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "pack"
        path.write_bytes(joined)

        def fetch() -> None:
            with open(path, "rb", buffering=0) as f:
                f.readinto(bytearray(len(joined)))

        fetch()  # warm: the page cache holds it, as it holds a pack read before
        t_fetch = best(fetch)
    return {
        "intra_ns_per_byte": t_intra / total * 1e9,
        "dense_ns_per_byte": t_dense / total * 1e9,
        "apply_ns_per_blob_byte": min(applied) / sparse_bytes * 1e9,
        "fetch_ns_per_byte": t_fetch / len(joined) * 1e9,
    }


# -- 3. the trade-off each policy family reaches -----------------------------------------------------------------


def frontier(m: dict, bound: float) -> list[tuple]:
    """Per policy family: the least stored bytes (vs the pure chain) whose modelled slowest read is within
    READ_BOUND of an anchor's, and the least read ratio whose storage is within ``bound``.

    Families: a chain of dense deltas or of SPARSE deltas with an anchor every N steps; a star (every step a
    delta against its chain's anchor: the long-range reference, union growth) of dense or SPARSE deltas; and
    each chain anchored where the read bound would break (:func:`_greedy`: the least storage of a chain).
    Modelled in the units of ``_read_cost.py``; N from 1 to the run's length.
    """
    steps = len(m["dense"])
    pure, anchor, ca = m["pure"], m["anchor"], m["c_anchor"]
    union_k = np.array(sorted(m["union"]), float)

    def union(col: int, k: int) -> float:  # measured at UNION_KS, linear in between (and beyond: extrapolated)
        ys = np.array([m["union"][int(j)][col] for j in union_k])
        if k <= union_k[-1]:
            return float(np.interp(k, union_k, ys))
        slope = (ys[-1] - ys[-2]) / (union_k[-1] - union_k[-2])
        return float(ys[-1] + slope * (k - union_k[-1]))

    families = {
        "chain, dense deltas": lambda n: _chain(m["dense"], m["c_dense"], n, steps, anchor, ca),
        "chain, SPARSE deltas": lambda n: _chain(m["sparse"], m["c_sparse"], n, steps, anchor, ca),
        "star, dense deltas (vs anchor)": lambda n: _star(
            lambda k: union(0, k), lambda k: union(3, k), n, steps, anchor, ca
        ),  # fmt: skip
        "star, SPARSE deltas (vs anchor)": lambda n: _star(
            lambda k: union(1, k), lambda k: union(4, k), n, steps, anchor, ca
        ),  # fmt: skip
    }
    rows = []
    for name, fn in families.items():
        pts = [(n, *fn(n)) for n in range(1, steps + 2)]  # (N, stored bytes, read ratio)
        ok_read = [p for p in pts if p[2] <= READ_BOUND]
        ok_store = [p for p in pts if p[1] / pure <= bound]
        best_store = min(ok_read, key=lambda p: p[1]) if ok_read else None
        best_read = min(ok_store, key=lambda p: p[2]) if ok_store else None
        rows.append((name, best_store, best_read))
    for name, delta, cost in (
        ("chain, dense deltas", m["dense"], m["c_dense"]),
        ("chain, SPARSE deltas", m["sparse"], m["c_sparse"]),
    ):
        stored, worst = _greedy(delta, cost, steps, anchor, ca)  # an anchor where the bound would break: the
        rows.append((f"{name}, anchored by cost", ("by cost", stored, worst), None))  # fewest anchors a chain needs
    return rows


def _greedy(delta, cost, steps: int, anchor: float, ca: float) -> tuple[float, float]:
    """(stored bytes, slowest read / anchor read) of a chain that anchors where the next delta would take a read
    past READ_BOUND x an anchor's (the cost policy with the model exact): no cadence needs fewer anchors."""
    return _walk(delta, cost, steps, anchor, ca, lambda t, run: run + cost[t - 1] > READ_BOUND * ca)


def _chain(delta, cost, n: int, steps: int, anchor: float, ca: float) -> tuple[float, float]:
    """(stored bytes, slowest read / anchor read) of a chain with an anchor every ``n`` steps."""
    return _walk(delta, cost, steps, anchor, ca, lambda t, run: t % n == 0)


def _walk(delta, cost, steps: int, anchor: float, ca: float, anchors) -> tuple[float, float]:
    """(stored bytes, slowest read / anchor read) of a chain of steps 0..steps whose step 0 and every step where
    ``anchors(t, read so far)`` holds are anchors (bytes ``anchor``, read ``ca``), the rest deltas."""
    stored, worst, run = 0.0, 1.0, 0.0
    for t in range(steps + 1):
        if t == 0 or anchors(t, run):
            stored += anchor
            run = ca
        else:
            stored += delta[t - 1]
            run += cost[t - 1]
        worst = max(worst, run / ca)
    return stored, worst


def _star(nbytes, cost, n: int, steps: int, anchor: float, ca: float) -> tuple[float, float]:
    """The same for a star: each step a delta against its chain's anchor, ``k`` steps back."""
    stored, worst = 0.0, 1.0
    for t in range(steps + 1):
        k = t % n
        if k == 0:
            stored += anchor
        else:
            stored += nbytes(k)
            worst = max(worst, (ca + cost(k)) / ca)
    return stored, worst


# -- 4. the default policy, stored and read ----------------------------------------------------------------------


def store_default(states: list[dict], url: str, k: float | None = None) -> ulstore.Trajectory:
    """The states committed in order with the cost policy (``k``: its factor; None: the default)."""
    traj = ulstore.open(url, mode="w", anchor_cost=k)
    for t, state in enumerate(states):
        traj.commit(t, state)
    return traj


def by_depth(traj) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for s in traj.steps:
        out.setdefault(traj.info(s).anchor_distance, []).append(s)
    return out


def _sample_depths(depths: list[int], most: int = 12) -> list[int]:
    if len(depths) <= most:
        return depths
    idx = np.unique(np.linspace(0, len(depths) - 1, most).round().astype(int))
    return [depths[i] for i in idx]


def s3_gets(local: str, steps: list[int], name: str, states) -> dict[int, int]:
    """GET requests of a one-element lazy slice of each step, on a moto S3 copy of the trajectory at ``local``."""
    import s3fs
    from store import _S3Log, moto_bucket

    with moto_bucket() as opts:
        root = f"bench/{uuid.uuid4().hex}"
        s3fs.S3FileSystem(**opts).put(local.rstrip("/") + "/", root, recursive=True)
        out = {}
        for s in steps:
            ro = ulstore.open(f"s3://{root}", mode="r", storage_options=opts)
            log = _S3Log(ro._io.fs)
            value = ro[s][name][(0,) * states[s][name].ndim]
            want = states[s][name][(0,) * states[s][name].ndim]
            assert np.asarray(value).view(np.uint16) == np.asarray(want).view(np.uint16)
            out[s] = sum(1 for c in log.calls if c[0] == "get_object")
        return out


def _print_measures(m: dict, bound: float) -> None:
    raw, pure = m["raw"], m["pure"]
    print(
        f"  pure chain: root anchor {m['root'] / 1e6:.2f} MB + {len(m['dense'])} dense deltas "
        f"{m['dense'].sum() / 1e6:.2f} MB = {pure / 1e6:.2f} MB (a delta {100 * m['dense'].mean() / raw:.2f}% of raw; "
        f"SPARSE deltas {m['sparse'].mean() / m['dense'].mean():.2f}x a dense one)"
    )
    print(
        f"  an anchor: {m['anchor'] / 1e6:.2f} MB ({100 * m['anchor'] / raw:.0f}% of raw = "
        f"{m['anchor'] / m['dense'].mean():.0f} dense deltas); changed per step "
        f"{100 * m['changed'].mean() / m['elements']:.2f}% of elements"
    )
    cal = m["calibration"]
    unit = cal["fetch_ns_per_byte"]
    print(
        f"  calibration, per-byte terms (one thread, CPU ns/byte, min of 3): intra decode {cal['intra_ns_per_byte']:.3f}, "
        f"dense delta decode {cal['dense_ns_per_byte']:.3f} (per byte out), SPARSE apply "
        f"{cal['apply_ns_per_blob_byte']:.3f} (per blob byte), fetch from a warm local file {unit:.3f} (the unit); "
        f"in units: intra {cal['intra_ns_per_byte'] / unit:.2f}, dense {cal['dense_ns_per_byte'] / unit:.2f}, "
        f"apply {cal['apply_ns_per_blob_byte'] / unit:.2f} (constants: intra {rc.INTRA_PER_BYTE:g}, dense "
        f"{rc.DENSE_PER_BYTE:g}, apply {rc.APPLY_PER_BYTE:g})"
    )
    print("  union growth, step t -> t+k (mean over two bases):")
    print(f"    {'k':>4s} {'dense MB':>9s} {'SPARSE MB':>10s} {'changed %':>10s} {'vs k x one step':>16s}")
    for k, (d, s, ch, _, _) in sorted(m["union"].items()):
        print(
            f"    {k:4d} {d / 1e6:9.3f} {s / 1e6:10.3f} {100 * ch / m['elements']:10.2f} "
            f"{ch / (k * m['changed'].mean()):15.2f}x"
        )
    print(f"  modelled trade-offs (bounds: read <= {READ_BOUND}x the anchor's, stored <= {bound}x the pure chain):")
    rows = frontier(m, bound)
    for name, best_store, best_read in rows:
        a = f"N={best_store[0]}: stored {best_store[1] / pure:.2f}x" if best_store else "none"
        b = f"N={best_read[0]}: read {best_read[2]:.2f}x" if best_read else "none"
        print(
            f"    {name:34s} least storage with read <= {READ_BOUND}: {a:24s} least read with storage <= {bound}: {b}"
        )
    return _print_floor(rows, pure, bound)


def _print_floor(rows: list, pure: float, bound: float) -> dict:
    """Whether a family holds both bounds; if none does, the floor: the best each bound allows of the other
    (returned: ``store``, the least storage with reads within READ_BOUND; ``read``, the least read with storage
    within ``bound``; as text)."""
    both = [r[0] for r in rows if r[1] is not None and r[1][1] / pure <= bound]
    if both:
        print(f"  both bounds hold at once (modelled): {', '.join(both)}")
        return {"store": "none (both hold)", "read": "none (both hold)"}
    by_store = min((r for r in rows if r[1]), key=lambda r: r[1][1], default=None)
    by_read = min((r for r in rows if r[2]), key=lambda r: r[2][2], default=None)
    fs = f"{by_store[1][1] / pure:.2f}x ({by_store[0]}, N={by_store[1][0]})" if by_store else "none"
    fr = f"{by_read[2][2]:.2f}x ({by_read[0]}, N={by_read[2][0]})" if by_read else "none"
    print(
        f"  FLOOR (modelled): no family measured holds both bounds on this data; with reads <= {READ_BOUND}x "
        f"the least storage is {fs}; with storage <= {bound}x the least read is {fr}"
    )
    return {"store": fs, "read": fr}


def _picks(depth: dict[int, list[int]]) -> list[int]:
    """Steps to read: one at each of up to 12 depths, more at each when there are few (a dense run's depths 0
    and 1: three of each, so the fit of :func:`fixed_terms` has more than one read of each kind)."""
    depths = _sample_depths(sorted(depth))
    per = max(1, 6 // len(depths))
    out = []
    for d in depths:
        steps = depth[d]
        idx = np.unique(np.linspace(0, len(steps) - 1, min(per, len(steps)) + 2).round().astype(int)[1:-1])
        out.extend(steps[i] for i in (idx if len(idx) else [len(steps) // 2]))
    return out


def read_terms(traj, step: int) -> dict:
    """What the model counts in a full read of ``step``: blobs, bytes fetched, bytes a full decode outputs
    (intra, dense delta), SPARSE blob bytes; along the parent path back to the anchor, as a commit prices it."""
    r = traj._reader
    out = {"depth": r.doc(step).anchor_distance, "blobs": 0, "fetched": 0, rc.INTRA: 0, rc.DENSE: 0, rc.SPARSE: 0}
    s = step
    while True:
        d = r.doc(s)
        anchor = d.anchor_distance == 0 or d.parent is None
        pd = None if anchor else r.doc(d.parent)  # type: ignore[arg-type]
        ptables = None if pd is None else r.tables(pd.step)
        for n, nbytes, kind in own_blobs(r.tables(s), d.packs, ptables, pd.packs if pd else (), r.fetch):
            out["blobs"] += 1
            out["fetched"] += n
            out[kind] += n if kind == rc.SPARSE else nbytes
        if anchor:
            return out
        s = d.parent  # type: ignore[assignment]


def calibration_reads(url: str, steps: list[int], reps: int = 5) -> dict[int, float]:
    """CPU seconds of a full read of each step in this process (all its threads), from a new ``ulstore.open``
    (cold ulstore caches), min of ``reps``: the reads the model's fixed terms are fitted to (CPU, not wall: on a
    shared machine wall times move with the load; more repeats than the fresh-process reads afford)."""
    out = {}
    for s in steps:
        best = float("inf")
        for _ in range(reps):
            t0 = time.process_time()
            ulstore.open(url, mode="r").read(s)
            best = min(best, time.process_time() - t0)
        out[s] = best
    return out


def fixed_terms(times: dict[int, float], terms: dict[int, dict], cal: dict, per_blob_ns: float | None = None) -> dict:
    """The model's fixed terms fitted to full reads (ns), by least squares over the steps read.

    What a read takes beyond its blobs' modelled byte work (the per-byte terms of ``cal``) is fitted as
    ``per_read + per_blob x blobs``.  Given ``per_blob`` (from the RL run, whose deltas are SPARSE), the dense
    run's reads fit ``dense`` instead: what a dense delta's read costs per byte out in the read path, which
    decodes the anchor's chunk and then the delta against it (the kernel's own figure is in ``cal``).
    """
    unit = cal["fetch_ns_per_byte"]
    steps = sorted(times)
    ns = np.array([times[s] * 1e9 for s in steps])
    blobs = np.array([terms[s]["blobs"] for s in steps], float)
    dense = np.array([terms[s][rc.DENSE] for s in steps], float)
    work = np.array(
        [
            unit * terms[s]["fetched"]
            + cal["intra_ns_per_byte"] * terms[s][rc.INTRA]
            + cal["apply_ns_per_blob_byte"] * terms[s][rc.SPARSE]
            for s in steps
        ]
    )
    out: dict = {}
    if per_blob_ns is None or not dense.any():
        rest = ns - work - cal["dense_ns_per_byte"] * dense
        slope, out["per_read"] = np.polyfit(blobs, rest, 1) if len(set(blobs)) > 1 else (0.0, float(rest.mean()))
        out["per_blob"] = float(slope) if per_blob_ns is None else per_blob_ns
        if per_blob_ns is not None:
            out["per_read"] = float((rest - per_blob_ns * blobs).mean())
        return out
    rest = ns - work - per_blob_ns * blobs
    slope, intercept = np.polyfit(dense, rest, 1) if len(set(dense)) > 1 else (cal["dense_ns_per_byte"], 0.0)
    return {"per_blob": per_blob_ns, "per_read": float(intercept), "dense": float(slope)}


def _dense_terms(states, cal: dict, per_blob_ns: float) -> dict:
    """:func:`fixed_terms` of a run whose default policy stored no dense delta (every step an anchor): fitted to
    the reads of 8 of its steps stored apart, an anchor every other step and dense deltas between."""
    with tempfile.TemporaryDirectory() as d:
        t = ulstore.open(str(Path(d) / "dense"), mode="w", anchor_every=2)
        for s in range(8):
            t.commit(s, states[s], sparse=False)
        steps = list(range(8))
        terms = {s: read_terms(t, s) for s in steps}
        return fixed_terms(calibration_reads(t.url, steps), terms, cal, per_blob_ns)


def _ok(value: float, bound: float) -> str:
    return "ok" if value <= bound else "MISS"


def _print_store(traj, m: dict, bound: float, reads: tuple[int, int], s3: bool, states, floor: dict, fit: dict) -> None:
    """The trajectory stored with the default policy: bytes, anchors, each picked step's fresh-process read
    (``reads``: reads per process, rounds: :func:`fresh_reads`) and GETs, the fixed terms, the acceptance."""
    st = traj.stats()
    depth = by_depth(traj)
    anchors = [s for s in traj.steps if traj.info(s).anchor_distance == 0]
    policies: dict = {}
    for s in anchors:
        why = (traj.info(s).anchoring or {}).get("anchor") or {"policy": "?"}
        policies[why["policy"]] = policies.get(why["policy"], 0) + 1
    which = "the default" if traj.anchor_cost == rc.DEFAULT_ANCHOR_COST else "NOT the default"
    print(
        f"  stored with the cost policy (k={traj.anchor_cost}, {which}): {st['stored_bytes'] / 1e6:.2f} MB = "
        f"{st['stored_bytes'] / m['pure']:.2f}x the pure chain (bound {bound}x; blobs alone "
        f"{st['blob_bytes'] / m['pure']:.2f}x); {len(anchors)} anchors ({policies}), depths 0..{max(depth)}"
    )
    picks = _picks(depth)
    name = max(states[0], key=lambda n: states[0][n].size)
    gets = s3_gets(traj.url, picks, name, states) if s3 else {}
    measured = fresh_reads(traj.url, picks, *reads)
    times, cpu = measured["wall"], measured["cpu"]
    terms = {s: read_terms(traj, s) for s in picks}
    fastest = min(times.values())
    base = min(cpu[s] for s in picks if traj.info(s).anchor_distance == 0)  # the fastest anchor's CPU
    modelled = {s: _modelled(traj, s) for s in picks}
    print(
        f"    {'depth':>5s} {'step':>5s} {'read ms':>8s} {'vs fastest':>10s} {'CPU ms':>7s} {'vs anchor':>9s} "
        f"{'modelled':>9s} {'blobs':>6s} {'GETs':>5s}"
    )
    for s in picks:
        g = gets.get(s, "-")
        print(
            f"    {traj.info(s).anchor_distance:5d} {s:5d} {times[s] * 1e3:8.1f} {times[s] / fastest:9.2f}x "
            f"{cpu[s] * 1e3:7.1f} {cpu[s] / base:8.2f}x {modelled[s]:8.2f}x {terms[s]['blobs']:6d} {g!s:>5s}"
        )
    _print_per_link(traj, picks, cpu)
    cal = m["calibration"]
    got = fixed_terms(calibration_reads(traj.url, picks), terms, cal, fit.get("per_blob"))
    if fit.get("per_blob") is not None and not any(t[rc.DENSE] for t in terms.values()):
        got = _dense_terms(states, cal, fit["per_blob"])  # no dense delta stored: measure some apart
    fit.setdefault("per_blob", got["per_blob"])
    fit.setdefault("runs", []).append((cal, got))
    unit = cal["fetch_ns_per_byte"]
    dense = (
        f", dense delta read {got['dense']:.3f} ns/byte out = {got['dense'] / unit:.2f} units" if "dense" in got else ""
    )
    print(
        "  calibration, fixed terms (least squares over these steps' reads in this process, CPU, min of 5): per read "
        f"{got['per_read'] / 1e3:.0f} us = "
        f"{got['per_read'] / unit:.0f} units, per blob {got['per_blob'] / 1e3:.1f} us = {got['per_blob'] / unit:.0f} "
        f"units{' (from the RL run)' if 'dense' in got else ''}{dense} (constants: per read {rc.PER_READ}, per blob "
        f"{rc.PER_BLOB}, dense {rc.DENSE_PER_BYTE:g})"
    )
    measured["anchors"] = [s for s in picks if traj.info(s).anchor_distance == 0]
    _print_acceptance(measured, modelled, st["stored_bytes"] / m["pure"], gets, bound, floor)


def _modelled(traj, s: int) -> float:
    """A step's modelled read over its chain's anchor's (its stored ``anchoring`` figures)."""
    a = traj.info(s).anchoring or {}
    return a["cost"] / a["anchor_cost"] if a.get("anchor_cost") else float("nan")


def _print_acceptance(measured: dict, modelled: dict, stored: float, gets: dict, bound: float, floor: dict) -> None:
    """Each bound with ok/MISS, measured (wall and CPU reads of :func:`fresh_reads`, stored bytes vs the pure
    chain), the floor beside; the model's slowest read beside the measured one."""
    times, cpu = measured["wall"], measured["cpu"]
    worst = max(times.values()) / min(times.values())
    most = max(gets.values()) if gets else None
    load = measured["load"]
    print(
        f"  acceptance (bound, measured, floor of the other bound modelled on this data); reads: min of "
        f"{measured['rounds']} rounds x {measured['reps']} reads per fresh process, load average "
        f"{min(load):.1f}..{max(load):.1f} during them ({os.cpu_count()} cores):"
    )
    print(
        f"    read: slowest / fastest full read {worst:.2f}x <= {READ_BOUND}x: {_ok(worst, READ_BOUND)} "
        f"(floor: with storage <= {bound}x the least read is {floor['read']})"
    )
    cpu_worst = max(cpu.values()) / min(cpu.values())
    spread = [times[s] / cpu[s] for s in times]
    first = [f[1] for f in measured["first"].values()]
    print(
        f"    read, CPU time (what the load moves least): slowest / fastest {cpu_worst:.2f}x <= {READ_BOUND}x: "
        f"{_ok(cpu_worst, READ_BOUND)} (wall / CPU of these reads {min(spread):.2f}..{max(spread):.2f}: the "
        f"machine's noise; a process's first read alone: {max(first) / min(first):.2f}x)"
    )
    slow = max(cpu, key=cpu.__getitem__)
    same = [cpu[s] for s in measured["anchors"]]  # anchors: about the same work, so their spread is the noise
    noise = f"; the anchors' own spread (the same work) {max(same) / min(same):.2f}x" if len(same) > 1 else ""
    print(
        f"    model: slowest modelled {max(modelled.values()):.2f}x its anchor; measured CPU slowest / fastest "
        f"{cpu_worst:.2f}x (step {slow}, modelled {modelled[slow]:.2f}x): the model "
        f"{'at least as pessimistic as' if max(modelled.values()) >= cpu_worst else 'UNDER'} the measurement{noise}"
    )
    print(
        f"    storage: {stored:.2f}x the pure chain <= {bound}x: {_ok(stored, bound)} (floor: with reads <= "
        f"{READ_BOUND}x the least storage is {floor['store']})"
    )
    if most is not None:  # the bound counts dependent round trips; the GETs of one round run in parallel
        print(
            f"    round trips: GETs of a one-element slice {min(gets.values())}..{most} (the bound, 4 dependent "
            "round trips, is on rounds, not GETs: the chain's table blocks are fetched in one parallel round)"
        )


def _print_per_link(traj, picks: list[int], cpu: dict[int, float]) -> None:
    """What each step of a chain adds to a full read's CPU time: (deepest - an anchor's) / depth (CPU, not wall:
    on a shared machine wall times move with the load)."""
    depth = {s: traj.info(s).anchor_distance for s in picks}
    anchors = [cpu[s] for s in picks if depth[s] == 0]
    deep = max(picks, key=depth.__getitem__)
    if anchors and depth[deep]:
        per = (cpu[deep] - min(anchors)) / depth[deep]
        print(f"  per link (CPU): {per * 1e3:.2f} ms ((depth {depth[deep]} - depth 0) / {depth[deep]})")


def _print_calibration(fit: dict) -> None:
    """The model's constants as both runs measured them, in its units (a byte fetched from a warm local file)."""
    runs = fit.get("runs", [])
    if not runs:
        return
    unit = float(np.mean([c["fetch_ns_per_byte"] for c, _ in runs]))
    intra = float(np.mean([c["intra_ns_per_byte"] for c, _ in runs])) / unit
    apply = float(np.mean([c["apply_ns_per_blob_byte"] for c, _ in runs])) / unit
    dense = [g["dense"] for _, g in runs if "dense" in g]
    per_read = float(np.mean([g["per_read"] for _, g in runs])) / unit
    print(
        f"\n== calibration measured (units of a byte fetched, {unit:.3f} ns): INTRA_PER_BYTE {intra:.2f}, "
        f"DENSE_PER_BYTE {(dense[0] / unit if dense else float('nan')):.2f} (read path), APPLY_PER_BYTE {apply:.2f}, "
        f"PER_BLOB {fit['per_blob'] / unit:.0f}, PER_READ {per_read:.0f}; in use: {rc.INTRA_PER_BYTE:g}, "
        f"{rc.DENSE_PER_BYTE:g}, {rc.APPLY_PER_BYTE:g}, {rc.PER_BLOB}, {rc.PER_READ}"
    )


def run(args) -> None:
    """The depth section: every trajectory measured, modelled, stored with the default policy, read per depth."""
    from _data import load_trajectory

    print(
        f"\n== depth: two real toytrain runs, preset {args.depth_preset!r}, {args.depth_steps} steps, bf16 "
        "(reads: a fresh process each, timed inside from ulstore.open to the arrays returned)"
    )
    fit: dict = {}  # the fixed terms fitted so far (the RL run's per-blob term prices the dense run's)
    kinds = set(getattr(args, "depth_kinds", "rl,pretrain").split(","))
    for kind, what, bound in (r for r in RUNS if r[0] in kinds):
        t0 = time.perf_counter()
        states = load_trajectory(kind, "bfloat16", args.depth_preset, args.depth_steps)
        print(
            f"\n-- {kind}: {what}; {len(states)} checkpoints of {sum(v.nbytes for v in states[0].values()) / 1e6:.1f} MB"
        )
        m = measure(states)
        floor = _print_measures(m, bound)
        with tempfile.TemporaryDirectory() as d:
            traj = store_default(states, str(Path(d) / kind), getattr(args, "depth_k", None))
            reads = (args.depth_reps, getattr(args, "depth_rounds", 1))
            _print_store(traj, m, bound, reads, not args.no_s3, states, floor, fit)
        print(f"  ({time.perf_counter() - t0:.0f} s)")
        del states
    _print_calibration(fit)
