"""torch.distributed.checkpoint on ulstore vs DCP's own FileSystemWriter/Reader, at 2 and 4 ranks.

A real FSDP2 job (the toytrain language model ported to torch, sharded with ``fully_shard``
over CPU ranks on gloo, AdamW) trains and saves its full sharded state (model, Adam moments
and step counters, non-tensor leaves) after every optimizer step; then a second job of the
same world size loads every step back.  Both jobs run once per storage:

- ``FileSystemWriter`` / ``FileSystemReader``: one directory per step (``torch.save`` of
  every shard, one file per rank, fsync on);
- ``ulstore.dcp.Writer`` / ``Reader`` (when available): one trajectory, a step per save,
  each rank coding its shards against its own shards of the previous step.

Prints, per world size and storage: save time of the first step and the mean of the later
ones (the first ulstore step is intra-coded, later ones are deltas), load time of the first
step and the mean over all steps (a later ulstore step decodes its chain: one decode per step
back to its anchor), and the stored bytes (all steps, and per later step).  Times are the
slowest rank's wall time of ``dcp.save`` / ``dcp.load`` (training and the processes' start-up
are not counted); with ``--repeats N`` the load job loads every step N times (all steps in
order, N rounds) and each step's figure is the least of its N.  Then the ratios
ulstore / FileSystemReader of each world size.

Usage::

    python benchmarks/dcp.py [--preset small] [--steps 5] [--worlds 2,4] [--dtype float32] [--repeats 1]
                             [--anchor-every N]

The jobs live in ``benchmarks/_fsdp.py``.  On a 2-core
machine 4 ranks oversubscribe the cores; the figures are what this machine does, not a
scaling claim.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _fsdp as jobs  # noqa: E402
from ulstore import toytrain  # noqa: E402


def _kinds() -> list[str]:
    try:
        import ulstore.dcp  # noqa: F401
    except ImportError:
        return ["fs"]
    return ["fs", "ulstore"]


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _step_bytes(kind: str, url: Path, steps: int) -> list[int]:
    """Stored bytes added by each step."""
    if kind == "fs":
        return [_bytes(url / f"step-{s}") for s in range(steps)]
    import ulstore
    from ulstore.io import storage_report

    rows = storage_report(ulstore.open(str(url), mode="r"))["steps"]
    return [r["stored_bytes"] for r in rows]


def run(world: int, kind: str, config, steps: int, dtype: str, work: Path, *, repeats: int = 1, options=()) -> dict:
    url = work / f"{kind}-w{world}"
    storage = jobs.Storage(kind, str(url), tuple(options) if kind == "ulstore" else ())
    kw = {"config": config, "dtype": dtype}
    t0 = time.perf_counter()
    saved = jobs.run_job(world, jobs.save_job, storage, steps, workdir=work, kwargs=kw)
    t1 = time.perf_counter()
    loaded = jobs.run_job(world, jobs.load_job, storage, steps, workdir=work, kwargs={**kw, "repeats": repeats})
    t2 = time.perf_counter()
    save = [max(r[s] for r in saved) for s in range(steps)]
    # each load's figure is the slowest rank's; each step's, the least of its rounds
    load = [min(max(r[k * steps + s] for r in loaded) for k in range(repeats)) for s in range(steps)]
    per_step = _step_bytes(kind, url, steps)
    return {
        "world": world,
        "kind": kind,
        "save_first": save[0],
        "save_later": sum(save[1:]) / max(1, steps - 1),
        "load_first": load[0],
        "load": sum(load) / steps,
        "bytes": _bytes(url),
        "bytes_first": per_step[0],
        "bytes_later": sum(per_step[1:]) / max(1, steps - 1),
        "job_seconds": (t1 - t0, t2 - t1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="toytrain preset of the model (tiny, small, bench)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps, each saved")
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    p.add_argument("--dtype", default="float32", help="parameter dtype (float32 or bfloat16)")
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--repeats", type=int, default=1, help="load every step this many times; the least counts")
    p.add_argument("--anchor-every", type=int, default=None, help="ulstore.open's anchor_every for the ulstore writer")
    args = p.parse_args(argv)
    options = () if args.anchor_every is None else (("anchor_every", args.anchor_every),)
    config = toytrain.ToyConfig.preset(args.preset)
    worlds = [int(w) for w in args.worlds.split(",")]
    raw = config.num_params * (4 if args.dtype == "float32" else 2) * 3  # weights + two Adam moments
    print(
        f"model: toytrain {args.preset!r} ({config.num_params:,} parameters, {args.dtype}), AdamW; "
        f"{args.steps} steps saved; state ~{raw / 1e6:.1f} MB per step; {os.cpu_count()} cores; "
        f"loads: least of {args.repeats}; ulstore options {dict(options)}"
    )
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        rows = [
            run(w, k, config, args.steps, args.dtype, Path(tmp), repeats=args.repeats, options=options)
            for w in worlds
            for k in _kinds()
        ]
    print()
    print(
        "| ranks | storage | save step 0 (s) | save later (s, mean) | load step 0 (s) | load (s, mean) "
        "| stored total (MB) | step 0 (MB) | later step (MB, mean) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    names = {"fs": "DCP FileSystemWriter", "ulstore": "ulstore.dcp"}
    for r in rows:
        print(
            f"| {r['world']} | {names[r['kind']]} | {r['save_first']:.3f} | {r['save_later']:.3f} "
            f"| {r['load_first']:.3f} | {r['load']:.3f} "
            f"| {r['bytes'] / 1e6:.2f} | {r['bytes_first'] / 1e6:.2f} | {r['bytes_later'] / 1e6:.2f} |"
        )
    _ratios(rows)


def _ratios(rows: list[dict]) -> None:
    """ulstore / FileSystemReader of each world size, for each time column."""
    by = {(r["world"], r["kind"]): r for r in rows}
    cols = ["save_first", "save_later", "load_first", "load"]
    for world in sorted({r["world"] for r in rows}):
        u, f = by.get((world, "ulstore")), by.get((world, "fs"))
        if u is None or f is None:
            continue
        print(f"ranks {world}, ulstore / FileSystemReader: " + ", ".join(f"{c} {u[c] / f[c]:.2f}x" for c in cols))


if __name__ == "__main__":
    main()
