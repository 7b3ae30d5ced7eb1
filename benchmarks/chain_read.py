"""Full reads at depth d of a chain (issue 35): time grows by the changed elements, not by d decodes.

The RL-regime trajectory of ``_data.py`` (bf16, lr 3e-6 after warm-up, trained for real) is
committed twice with no anchor after step 0 (``anchor_every=0``): with SPARSE deltas
(``sparse=True``, what a sync bucket holds: chains applied in place on their root) and
with dense deltas (the default: every blob of the chain decoded whole).  A fresh process
then reads step d (``traj.read(d)``) for each depth asked; the figure is the fastest of
``--reps`` processes, the process start-up left out (only the read is timed), and the least CPU
time of its threads (steadier than wall time on a loaded machine).

Usage::

    python benchmarks/chain_read.py                               # bench preset, depths 0 and 7
    python benchmarks/chain_read.py --steps 16 --depths 0,7,15    # trains 16 steps once (cached)
    python benchmarks/chain_read.py --preset tiny --steps 4 --depths 0,4 --reps 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import ulstore

HERE = Path(__file__).resolve().parent

_CHILD = """
import json, sys, time, ulstore
job = json.loads(sys.argv[1])
traj = ulstore.open(job["url"], mode="r")
t, c = time.perf_counter(), time.process_time()
out = traj.read(job["step"])
seconds, cpu = time.perf_counter() - t, time.process_time() - c
print(json.dumps({"seconds": seconds, "cpu": cpu, "bytes": sum(v.nbytes for v in out.values())}))
"""


def _read(url: str, step: int, reps: int, cwd: str) -> tuple[float, float, int]:
    """(fastest seconds, least CPU seconds of its threads, raw bytes) of ``traj.read(step)`` in ``reps`` fresh
    processes (started in ``cwd``, so that ``PYTHONPATH`` says which ulstore they import)."""
    best, cpu, nbytes = float("inf"), float("inf"), 0
    for _ in range(reps):
        job = json.dumps({"url": url, "step": step})
        p = subprocess.run([sys.executable, "-c", _CHILD, job], capture_output=True, text=True, check=True, cwd=cwd)
        got = json.loads(p.stdout.strip().splitlines()[-1])
        best, cpu, nbytes = min(best, got["seconds"]), min(cpu, got["cpu"]), got["bytes"]
    return best, cpu, nbytes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    p.add_argument("--steps", type=int, default=8, help="checkpoints - 1 (>= the deepest depth)")
    p.add_argument("--depths", default="0,7")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    if max(depths) > args.steps:
        p.error("a depth is deeper than --steps")
    sys.path.insert(0, str(HERE))
    from _data import load_trajectory

    states = load_trajectory("rl", "bfloat16", args.preset, steps=args.steps)
    print(f"chain reads: {args.preset} RL-regime bf16 run, {len(states)} checkpoints, backend {ulstore.backend()}")
    print(
        f"  {'deltas':8s} {'depth':>5s} {'read ms':>9s} {'MB/s':>7s} {'vs depth 0':>10s} {'CPU ms':>8s} {'vs depth 0':>10s}"
    )
    with tempfile.TemporaryDirectory() as d:
        for sparse in (True, False):
            url = str(Path(d) / ("sparse" if sparse else "dense"))
            traj = ulstore.open(url, mode="w", anchor_every=0)
            for i, s in enumerate(states):
                traj.commit(i, s, sparse=sparse)
            base = None
            for depth in depths:
                seconds, cpu, nbytes = _read(url, depth, args.reps, d)
                base = base or (seconds, cpu)
                print(
                    f"  {'SPARSE' if sparse else 'dense':8s} {depth:5d} {seconds * 1e3:9.1f} {nbytes / seconds / 1e6:7.0f}"
                    f" {seconds / base[0]:9.2f}x {cpu * 1e3:8.1f} {cpu / base[1]:9.2f}x"
                )


if __name__ == "__main__":
    main()
