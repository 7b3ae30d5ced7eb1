"""The floor of a position code conditioned on the reference exponent (issue 39), measured.

On RL-regime deltas the default encoding is small because it codes "unchanged" under the
reference exponent; SPARSE blobs are fast because their positions never look at the reference
(``benchmarks/codec.py`` Table 4 shows where the bytes go).  A blob that is both has to code the
positions as ranks within bands of reference exponents, and its decoder has to classify every
reference exponent.  This benchmark measures what that classification costs at best, with the
compiled prototype ``benchmarks/_band_floor.c`` (AVX2 and BMI2; built here with the C compiler):
on the last step pair of the ``rl-bf16`` trajectory, all tensors concatenated, the exponents split
into K contiguous bands (the split with the fewest ideal position bits), for K = 1, 2, 4, 8:

    positions ideal   bits per change of the K-band model (``codec.py``'s Table 4 rows)
    decode            copy of the reference + classification + the changes written, MB/s
    in-place apply    classification + the changes written over the reference: ns per change,
                      against the scatter of the known changes (the floor of any in-place apply)

    keyed apply       the same apply when the bands are a key's that a reader indexed once (the
                      chain's anchor): rank -> position by one lookup, ns per change; and the
                      index build, ns per element, paid once per key

The entropy decoding of gaps and residuals is left out (it is per change, as in today's SPARSE
decoder), so these are floors.  CPU time, best of ``--reps``; every decode is checked bit for bit.

A second table measures what keying the bands to the anchor costs in bits: on a long real RL run
(preset ``--keyed-preset``, 300 steps, an anchor at step 100), the ideal position bits of the
8-band model under the parent's exponents (what Table 4 assumes) and under the anchor's, by depth.

Run::

    python benchmarks/band_floor.py                 # preset "bench" (~13M params)
    python benchmarks/band_floor.py --preset tiny --keyed-preset tiny   # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

if __package__:
    from . import _bands, _data
else:  # run as a script: python benchmarks/band_floor.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _bands
    import _data

HERE = Path(__file__).resolve().parent
BANDS = (1, 2, 4, 8)
KEYED_ANCHOR = 100
KEYED_DEPTHS = (1, 4, 16, 32, 64, 84, 128, 190)


def build(workdir: Path) -> Path | None:
    """Compile the prototype; None (with a message) where there is no C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        print("no C compiler found (set CC): nothing measured", file=sys.stderr)
        return None
    exe = workdir / "band_floor"
    subprocess.run([cc, "-O2", "-march=x86-64-v3", "-o", str(exe), str(HERE / "_band_floor.c")], check=True)
    return exe


def measure(exe: Path, ref: np.ndarray, tgt: np.ndarray, bands: int, edges: list[int], reps: int, workdir: Path):
    """The prototype's figures for one band split ("key value" lines as a dict)."""
    n = ref.size - ref.size % 32
    ref[:n].tofile(workdir / "ref.u16")
    tgt[:n].tofile(workdir / "tgt.u16")
    args = [str(exe), str(workdir / "ref.u16"), str(workdir / "tgt.u16"), str(n), str(bands)]
    args += [",".join(map(str, edges)) or "0", str(reps)]
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"band_floor prototype failed ({p.returncode}): {p.stderr or 'a decode differs'}")
    return {key: float(v) for key, v in (line.split() for line in p.stdout.splitlines())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--keyed-preset", default="small", choices=["tiny", "small", "bench"])
    ap.add_argument("--keyed-steps", type=int, default=300)
    _data.cache_options(ap)
    args = ap.parse_args(argv)
    _data.ensure_cached("rl", ["bfloat16"], args.preset, args.steps)
    states = _data.load_trajectory("rl", "bfloat16", args.preset, args.steps)
    parent, child = states[-2], states[-1]
    ref = np.concatenate([parent[k].reshape(-1).view(np.uint16) for k in child])
    tgt = np.concatenate([child[k].reshape(-1).view(np.uint16) for k in child])
    mask = ref != tgt
    e = ((ref >> 7) & 0xFF).astype(np.int64)
    count = np.bincount(e, minlength=256).astype(np.float64)
    changed = np.bincount(e[mask], minlength=256).astype(np.float64)
    m = int(mask.sum())
    print(f"rl-bf16 ({args.preset}), last pair: {ref.size:,} elements, {m:,} changed ({100 * m / ref.size:.2f}%)")
    print(f"load average {os.getloadavg()[0]:.1f}; CPU time, best of {args.reps}")
    head = f"{'bands':>5}  {'positions ideal':>15}  {'decode MB/s':>11}  {'x memcpy':>8}  {'apply ns/change':>15}"
    print(head + f"  {'x scatter':>9}  {'keyed apply':>11}  {'x scatter':>9}  {'index ns/elem':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        if exe is None:
            return 0
        for bands in BANDS:
            bits, edges = _bands.band_split(count, changed, bands)
            r = measure(exe, ref, tgt, bands, edges, args.reps, Path(tmp))
            print(
                f"{bands:>5}  {bits / m:>12.2f} b/c  {r['decode_MBps']:>11.0f}  "
                f"{r['decode_MBps'] / r['memcpy_MBps']:>8.2f}  {r['apply_ns_per_change']:>15.1f}  "
                f"{r['apply_ns_per_change'] / r['scatter_ns_per_change']:>9.2f}  "
                f"{r['keyed_apply_ns_per_change']:>11.1f}  "
                f"{r['keyed_apply_ns_per_change'] / r['scatter_ns_per_change']:>9.2f}  {r['index_ns_per_element']:>13.2f}"
            )
        print(
            f"memcpy {r['memcpy_MBps']:.0f} MB/s; scatter of the known changes {r['scatter_ns_per_change']:.1f} ns each"
        )
    keyed_loss(args.keyed_preset, args.keyed_steps)
    return 0


def _position_bits(key: np.ndarray, mask: np.ndarray, bands: int) -> float:
    """Ideal bits of the changed positions ``mask`` under the best ``bands``-band split of ``key``'s exponents."""
    e = ((key >> 7) & 0xFF).astype(np.int64)
    count = np.bincount(e, minlength=256).astype(np.float64)
    return _bands.band_split(count, np.bincount(e[mask], minlength=256).astype(np.float64), bands)[0]


def keyed_loss(preset: str, steps: int) -> None:
    """Position bits per change with 8 bands keyed to the parent and to the anchor, by depth (one tensor at a time)."""
    _data.ensure_cached("rl", ["bfloat16"], preset, steps)
    states = _data.load_trajectory("rl", "bfloat16", preset, steps)
    anchor_at = min(KEYED_ANCHOR, len(states) // 3)
    anchor = {k: v.reshape(-1).view(np.uint16) for k, v in states[anchor_at].items()}
    print(
        f"\nbands keyed to the anchor: rl-bf16 ({preset}), anchor at step {anchor_at}, 8 bands, ideal bits per change"
    )
    print(
        f"{'depth':>5}  {'changed %':>9}  {'parent key':>10}  {'anchor key':>10}  {'loss %':>6}  {'exponents moved %':>17}"
    )
    for depth in KEYED_DEPTHS:
        if anchor_at + depth >= len(states):
            break
        parent, child = states[anchor_at + depth - 1], states[anchor_at + depth]
        changes = elements = moved = 0
        bits = {"parent": 0.0, "anchor": 0.0}
        for k in child:
            p, c = parent[k].reshape(-1).view(np.uint16), child[k].reshape(-1).view(np.uint16)
            mask = p != c
            changes, elements = changes + int(mask.sum()), elements + p.size
            moved += int(np.count_nonzero((p >> 7) & 0xFF != (anchor[k] >> 7) & 0xFF))
            bits["parent"] += _position_bits(p, mask, 8)
            bits["anchor"] += _position_bits(anchor[k], mask, 8)
        par, anc = bits["parent"] / max(changes, 1), bits["anchor"] / max(changes, 1)
        print(
            f"{depth:>5}  {100 * changes / elements:>9.2f}  {par:>10.3f}  {anc:>10.3f}  "
            f"{100 * (anc / par - 1):>6.2f}  {100 * moved / elements:>17.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
