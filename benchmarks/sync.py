"""Weight-sync benchmark: ULPack deltas against TRL's sparse_weight_patch files, on a real RL trajectory.

For every version of a real RL-regime run (toytrain, bf16, lr 3e-6 after warm-up)
this prints the bytes a replica must download to move from the previous
version to this one, in four formats, and what each costs in time:

- **ULPack**: what a :class:`ulstore.sync.Follower` in step downloads per
  version from a bucket written by :class:`ulstore.sync.Publisher` (a
  trajectory: SPARSE delta blobs applied by position, the step's table block,
  its step document and the branch ref), counted at the object client;
- **dense**: the same with ``Publisher(sparse=False)``: smaller, but followers
  decode every element;
- **objs**: objects a delta version leaves in the bucket (pack, step
  document, ref log entry; the store's commit intent is written and removed);
- **TRL int32**: ``<name>.indices`` int32 + ``<name>.values`` bf16, one
  safetensors file (the first format of the TRL branch);
- **TRL gap u16**: ``<name>.idx`` uint16 gaps (uint32 fallback per
  parameter) + ``<name>.val`` (its later default);
- **zstd-19** of each of the three (ULPack: of its packs);
- **publish**: :meth:`Publisher.publish` wall time (host state in, packs
  written to a local store); **apply**: :meth:`Follower.poll` wall time
  (read, verify, decode, write in place) of a default follower, which also
  re-sums 1/16 of the state per version, in the background once the version
  is written (the time until that check is done is printed below the
  table); **trusted**: the same with
  ``Follower(trust_state=True)``; both cost time in proportion to the
  changed elements.  Both are told the version and handed its step
  document, ``poll(to=v, document=info.document)``, as a control plane's
  message tells them (and as TRL's replica is handed its file's name), so
  each version is one request, a range of its pack; **polled**: a trusted follower that finds the version itself, by
  reading the branch head (``poll()``: one LIST and one GET more); **floor**: writing the changed values at known positions
  with a compiled loop, which every format's apply must do (TRL and the
  floor keep their own state across versions, as a replica does, so every
  apply finds its memory as the last version left it); **dl@1GB/s**:
  the ULPack bytes at 1 GB/s; **TRL apply**: reading the int32 file from
  its bucket (a local directory, like the followers'), parsing it and
  scattering its values into the state: the faster of numpy fancy
  assignment and TRL's own torch ``index_copy_`` (when torch is installed);
  **stage** (below the table): a trusted follower of pipeline stage 0 of 2
  (``Follower(tensors=...)``, the model's first tensors up to half its
  parameters), its bytes and apply time against a whole replica's.

Last, the trainer's side (with torch): how long :meth:`Publisher.submit`
blocks the trainer (its host copy; the commit runs in the background, and is
waited for, untimed, before the next submit; and with ``copy=False``, taking
the tensors as they are) against
``safetensors.torch.save_file`` of the same state (torch bf16 tensors) to a
local file, each the fastest of a few versions.

Every kind of replica (default, trusted, polled, TRL's numpy apply and its
torch ``index_copy_``) runs ``--replicas`` times (5 by default, 3 above 100M
parameters to bound memory), each keeping its own state; a version's time
for a kind is the median of its replicas.  They take turns going first, the
kinds alternating, so that a pause of this shared machine (a run's single
worst apply is often 1.5x its median) costs one replica of each kind rather
than deciding a version for one of them.

Every replica's timed apply starts right after a full garbage collection
(untimed): this one process also holds torch, every checkpoint, two
publishers and a dozen followers, and a full collection of its ~180k objects
(about 100 ms) would otherwise land on whichever replica happens to allocate
when the threshold trips, whoever made the garbage.

Then whether the issue's targets hold, and an on-paper extrapolation to 7B
and 1T parameters from the measured bytes per parameter and throughputs.

Usage::

    python benchmarks/sync.py                      # preset "bench" (~13M params), 10 steps, cached
    python benchmarks/sync.py --preset tiny --steps 4
    python benchmarks/sync.py --preset 204M --steps 8                   # 204M params (trained once, cached: _big.py)
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import zstandard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ulstore import toytrain  # noqa: E402
from ulstore.core.safetensors import dumps, loads  # noqa: E402
from ulstore.sync import Follower, Publisher, gap_encode  # noqa: E402

GB = 1e9


def bits(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(f"<u{a.dtype.itemsize}")


def changes(prev: dict, cur: dict) -> dict[str, np.ndarray]:
    """Flat positions of the elements whose bits differ, per parameter that changed."""
    out = {}
    for k in cur:
        idx = np.flatnonzero(bits(cur[k]) != bits(prev[k]))
        if idx.size:
            out[k] = idx
    return out


def trl_file(cur: dict, changed: dict, gap: bool) -> bytes:
    tensors = {}
    for k, idx in changed.items():
        vals = cur[k].reshape(-1)[idx]
        if gap:
            tensors[k + ".idx"], tensors[k + ".val"] = gap_encode(idx), vals
        else:
            tensors[k + ".indices"], tensors[k + ".values"] = idx.astype(np.int32), vals
    n = sum(i.size for i in changed.values())
    total = sum(v.size for v in cur.values())
    meta = {
        "format": "sparse_weight_patch",
        "version": "1",
        "num_changed_params": str(len(changed)),
        "total_changed_elements": str(n),
        "total_elements": str(total),
        "sparsity": str(1 - n / total),
    }
    if gap:
        meta.update(sparse="True", encoding="gap_delta")
    return dumps(tensors, meta)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def trl_apply(state: dict, path: str) -> float:
    """What a TRL replica does once the version is announced: read the file from the bucket (a local directory,
    as the followers' is), parse it, scatter its values into ``state`` (numpy, one thread); returns the seconds."""
    gc.collect()  # untimed: see the module docstring
    t0 = time.perf_counter()
    tensors, _ = loads(read(path), ValueError)
    for k in tensors:
        if k.endswith(".indices"):
            name = k[: -len(".indices")]
            bits(state[name])[tensors[k]] = bits(tensors[name + ".values"])
    return time.perf_counter() - t0


def torch_state(state: dict):
    """``state``'s bits as torch integer tensors (None without torch)."""
    try:
        import torch
    except ImportError:
        return None
    return {k: torch.from_numpy(bits(v).view(f"<i{v.dtype.itemsize}").copy()) for k, v in state.items()}


def trl_torch_apply(state: dict, path: str) -> float:
    """TRL's own apply: read and parse the file, ``index_copy_`` the values into ``state`` (torch tensors); the
    seconds."""
    import torch

    gc.collect()  # untimed: see the module docstring
    t0 = time.perf_counter()
    tensors, _ = loads(read(path), ValueError)
    for k in tensors:
        if k.endswith(".indices"):
            name = k[: -len(".indices")]
            values = bits(tensors[name + ".values"])
            with warnings.catch_warnings():  # the parsed arrays are read-only; index_copy_ only reads them
                warnings.simplefilter("ignore", UserWarning)
                idx = torch.from_numpy(tensors[k]).long()
                state[name].index_copy_(0, idx, torch.from_numpy(values.view(f"<i{values.dtype.itemsize}")))
    return time.perf_counter() - t0


def floor_apply(state: dict, cur: dict, changed: dict) -> float:
    """Writing the changed values at known positions (compiled loop, one thread): every format's minimum."""
    from ulstore.codec._backend import kernels

    scatter = kernels().scatter
    values = {k: bits(cur[k])[idx] for k, idx in changed.items()}
    gc.collect()  # untimed: see the module docstring
    t0 = time.perf_counter()
    for k, idx in changed.items():
        scatter(bits(state[k]), idx, values[k])
    return time.perf_counter() - t0


def same_bits(state: dict, cur: dict, name: str) -> None:
    for k in cur:  # exact, or the numbers mean nothing
        got = state[k].numpy() if hasattr(state[k], "numpy") else bits(state[k])
        assert np.array_equal(got.view(bits(cur[k]).dtype), bits(cur[k])), f"{name}: {k}"


class Counter:
    """Objects and bytes through an object client (wraps its methods in place)."""

    def __init__(self, io, reads: bool):
        self.io = io
        self.objects = self.bytes = 0
        self.keys: list[str] = []
        names = ("get", "get_ranges") if reads else ("put", "create", "open_writer")
        for name in names:
            orig = getattr(io, name)

            def wrapped(key, *a, _orig=orig, _name=name, **kw):
                out = _orig(key, *a, **kw)
                self.objects += 1
                self.keys.append(key)
                if _name == "get" and out is not None:
                    self.bytes += len(out)
                elif _name == "get_ranges" and out is not None:
                    self.bytes += sum(len(b) for b in out)
                elif _name in ("put", "create"):
                    self.bytes += len(a[0])
                return out

            setattr(io, name, wrapped)

    def take(self) -> tuple[int, int]:
        out = (self.objects, self.bytes)
        self.objects = self.bytes = 0
        self.keys = []
        return out

    def left(self) -> int:
        """Objects written since the last :meth:`take` that still exist (transient intents excluded)."""
        return sum(self.io.exists(k) for k in dict.fromkeys(self.keys))


def zstd19(raw: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=19).compress(raw))


def load_states(args) -> tuple[list[dict], str]:
    if args.preset == "204M":
        from _big import CONFIG, WARMUP, load_big

        return load_big(args.steps), f"ToyConfig(bench, {CONFIG}), {WARMUP} warm-up steps, cached by _big.py"
    if args.hidden or args.intermediate or args.layers:
        cfg = toytrain.ToyConfig.preset(
            "bench",
            **{
                k: v
                for k, v in (
                    ("hidden_size", args.hidden),
                    ("intermediate_size", args.intermediate),
                    ("num_hidden_layers", args.layers),
                )
                if v
            },
        )
        print(
            f"training {cfg.num_params / 1e6:.1f}M params: {args.warmup} warm-up + {args.steps} RL steps ...",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.perf_counter()
        states = [s for _, s, _ in toytrain.train(cfg, args.steps, lr=3e-6, warmup_steps=args.warmup)]
        print(f"trained in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return states, f"ToyConfig({cfg.hidden_size=}, {cfg.intermediate_size=}, {cfg.num_hidden_layers=})"
    from _data import load_trajectory, warmup_steps

    states = load_trajectory("rl", "bfloat16", args.preset, steps=args.steps)
    return states, f"preset {args.preset!r}, {warmup_steps('rl', args.preset)} warm-up steps at lr 1e-3"


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.1f} s" if s < 600 else f"{s / 60:.0f} min"


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="bench", choices=["tiny", "small", "bench", "204M"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=None, help="train a custom ToyConfig (based on bench)")
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="publisher/follower threads (default: CPU count)")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="replicas of each kind; a version's time is their median (default 5; 3 above 100M parameters)",
    )
    from _data import cache_options

    cache_options(p)
    return p.parse_args(argv)


class Bench:
    """The buckets, publishers and replicas of one run (every replica keeps its own state across versions)."""

    def __init__(self, args, states: list[dict], threads: int) -> None:
        self.args, self.states, self.threads = args, states, threads
        n_params = self.n_params = sum(v.size for v in states[0].values())
        self.store = tempfile.mkdtemp(prefix="ulstore-sync-bench-")
        self.dense_store = tempfile.mkdtemp(prefix="ulstore-sync-bench-dense-")
        self.trl_bucket = tempfile.mkdtemp(prefix="ulstore-sync-bench-trl-")  # where the TRL trainer puts its files
        for path in self.buckets:  # scratch, removed however the run ends (an error, Ctrl-C)
            atexit.register(shutil.rmtree, path, ignore_errors=True)
        self.pub = Publisher(self.store, anchor_every=0, threads=threads)  # one anchor (version 0): deltas after it
        self.dense_pub = Publisher(self.dense_store, anchor_every=0, threads=threads, sparse=False)
        self.info0 = self.pub.publish(0, states[0])
        self.dense_pub.publish(0, states[0])
        # ``--replicas`` replicas of every kind; a version's time for a kind is the median of its replicas, so one
        # replica caught by a scheduling hiccup of this shared machine does not decide the version for its kind
        # "stage": a replica of pipeline stage 0 of 2 (the model's first tensors, half its parameters)
        counts = np.cumsum([v.size for v in states[0].values()])
        self.stage = list(states[0])[: int(np.searchsorted(counts, n_params / 2)) + 1]
        self.kinds = {
            "apply": {},
            "trusted": {"trust_state": True},
            "polled": {"trust_state": True},
            "stage": {"trust_state": True, "tensors": self.stage},
        }
        self.fleet = {
            k: [Follower(self.store, threads=threads, **kw) for _ in range(args.replicas)]
            for k, kw in self.kinds.items()
        }
        self.dense_follower = Follower(self.dense_store, threads=threads, trust_state=True)
        self.dense_follower.bootstrap()
        self.writes = Counter(self.pub.trajectory._io, reads=False)
        t1 = time.perf_counter()
        self.fleet["apply"][0].bootstrap()
        self.boot = time.perf_counter() - t1
        self._make_replicas()
        self.reads = Counter(self.fleet["polled"][0].trajectory._io, reads=True)  # a follower reading the head
        self.told_reads = Counter(self.fleet["trusted"][0].trajectory._io, reads=True)  # one told version + document
        self.dense_reads = Counter(self.dense_follower.trajectory._io, reads=True)
        self.floor_state = {k: v.copy() for k, v in states[0].items()}
        # the states made last (TRL's, the floor's) would otherwise meet the first version in a warm cache (at 204M
        # parameters, in a 300 MB L3)
        np.ones(1 << 29, np.uint8)  # 512 MB written

    @property
    def buckets(self) -> tuple[str, str, str]:
        return self.store, self.dense_store, self.trl_bucket

    def _make_replicas(self) -> None:
        # the replicas' states are made in turns too, replica i of every kind (TRL's below included) before replica
        # i + 1: a slow stretch of this VM's memory then holds one replica of each kind, as a pause of its CPUs meets
        # one of each.  (Made kind by kind, every replica of one kind shared it: its whole job ran 5-10x slower for
        # one version, on-CPU, with no page fault or context switch, while the other kinds' replicas ran as ever.)
        # the baselines are replicas too: each keeps its own state and applies every version in place, so its
        # memory is as cold (or warm) as the followers' when a version arrives
        first = self.fleet["apply"][0]
        self.trl_states: list[dict] = []
        trl_torch: list = []
        for i in range(self.args.replicas):
            for group in self.fleet.values():
                if group[i] is not first:
                    group[i].bootstrap()
            self.trl_states.append({k: v.copy() for k, v in self.states[0].items()})
            trl_torch.append(torch_state(self.states[0]))
        self.trl_torch_states = [t for t in trl_torch if t is not None]

    def version(self, v: int) -> dict:
        """Publish version ``v`` every way, apply it on every replica, check them all: the table's row."""
        prev, cur = self.states[v - 1], self.states[v]
        self.writes.take()
        info = self.pub.publish(v, cur)
        objects = self.writes.left()
        puts, _ = self.writes.take()
        self.dense_pub.publish(v, cur)
        assert self.dense_follower.poll() == v
        self.dense_follower.wait_scan()  # its background check must not share the cores with the timed replicas
        _, dense = self.dense_reads.take()
        ch = changes(prev, cur)
        i32, gap = trl_file(cur, ch, gap=False), trl_file(cur, ch, gap=True)
        i32_path = os.path.join(self.trl_bucket, f"{v}.safetensors")
        with open(i32_path, "wb") as out:  # the TRL trainer's upload; its replicas read it back, as ours do
            out.write(i32)
        staged, whole = (self.fleet[k][0].stats.bytes_downloaded for k in ("stage", "trusted"))
        median, checked = self._time_replicas(v, info, i32_path)
        gets, ulp = self.reads.take()
        told_gets, _ = self.told_reads.take()
        traj = self.pub.trajectory
        packs = b"".join(traj.fetch_blobs([c for c in traj.changes(v) if c.kind != "unchanged"]))
        r = dict(
            v=v,
            changed=sum(i.size for i in ch.values()) / self.n_params,
            objs=objects,
            puts=puts,
            ulp=ulp,
            gets=gets,
            told_gets=told_gets,
            dense=dense,
            i32=len(i32),
            gap=len(gap),
            z_ulp=zstd19(packs) + ulp - len(packs),
            z_i32=zstd19(i32),
            z_gap=zstd19(gap),
            publish=info.seconds,
            apply=median["apply"],
            checked=statistics.median(checked),
            trusted=median["trusted"],
            polled=median["polled"],
            stage=median["stage"],
            stage_bytes=self.fleet["stage"][0].stats.bytes_downloaded - staged,  # (blob bytes, as whole_bytes)
            whole_bytes=self.fleet["trusted"][0].stats.bytes_downloaded - whole,
            floor=floor_apply(self.floor_state, cur, ch),
            trl_apply=median["trl"],
            trl_torch=median.get("trl_torch"),
            trl_warm=trl_apply({k: v.copy() for k, v in prev.items()}, i32_path),  # on a state just copied: warm
        )
        self._check(cur)
        r["dl"] = r["ulp"] / GB
        # TRL's apply: the faster of numpy fancy assignment and its own torch index_copy_
        r["trl_best"] = min(r["trl_apply"], r["trl_torch"] if r["trl_torch"] is not None else r["trl_apply"])
        return r

    def _time_replicas(self, v: int, info, i32_path: str) -> tuple[dict, list]:
        """Every replica applies version ``v``: the median seconds per kind, and the default mode's applied-and-
        checked times."""
        # every replica, ours and TRL's, takes its turn at going first (the later ones find the version warm);
        # the kinds alternate, so that a pause of this machine's longer than one apply costs a replica of each
        timed, checked = {k: [] for k in (*self.kinds, "trl", "trl_torch")}, []
        groups = (*self.fleet.items(), ("trl", self.trl_states), ("trl_torch", self.trl_torch_states))
        order = [(k, g[i]) for i in range(self.args.replicas) for k, g in groups if g]
        for kind, replica in order[v % len(order) :] + order[: v % len(order)]:
            if kind.startswith("trl"):
                timed[kind].append((trl_apply if kind == "trl" else trl_torch_apply)(replica, i32_path))
                continue
            gc.collect()  # untimed: see the module docstring
            t1 = time.perf_counter()
            assert (replica.poll() if kind == "polled" else replica.poll(to=v, document=info.document)) == v
            timed[kind].append(time.perf_counter() - t1)
            replica.wait_scan()  # the default mode's check of the state, in the background after the apply
            if kind == "apply":
                checked.append(time.perf_counter() - t1)
        return {k: statistics.median(t) for k, t in timed.items() if t}, checked

    def _check(self, cur: dict) -> None:
        """Every replica holds exactly ``cur`` (a stage replica exactly its tensors)."""
        fleet = self.fleet
        replicas = [(f"{k} {i}", f.state) for k, group in fleet.items() if k != "stage" for i, f in enumerate(group)]
        for i, f in enumerate(fleet["stage"]):  # exactly the stage's tensors
            assert list(f.state) == self.stage
            same_bits(f.state, {k: cur[k] for k in self.stage}, f"stage {i}")
        replicas += [(f"TRL {i}", state) for i, state in enumerate(self.trl_states)]
        replicas += [(f"TRL torch {i}", state) for i, state in enumerate(self.trl_torch_states)]
        for name, state in (*replicas, ("floor", self.floor_state)):
            if state is not None:
                same_bits(state, cur, name)

    def close(self) -> None:
        self.dense_pub.close()
        self.dense_follower.close()
        for f in (f for group in self.fleet.values() for f in group):
            f.close()
        self.pub.close()
        for path in self.buckets:  # the buckets are scratch: 2 x (anchor + deltas) of the model
            shutil.rmtree(path, ignore_errors=True)


HEAD = (
    f"{'ver':>3} {'changed':>8} {'objs':>4} {'ULPack':>9} {'dense':>9} {'TRL i32':>9} {'TRL gap':>9} {'zstd ULP':>9} "
    f"{'zstd i32':>9} {'zstd gap':>9} {'/i32':>6} {'/gap':>6} {'publish':>9} {'apply':>9} "
    f"{'trusted':>9} {'polled':>9} {'floor':>9} {'dl@1GB/s':>9} {'TRL apply':>9}"
)


def print_row(r: dict) -> None:
    print(
        f"{r['v']:>3} {r['changed']:>8.2%} {r['objs']:>4} {human(r['ulp']):>9} {human(r['dense']):>9} "
        f"{human(r['i32']):>9} {human(r['gap']):>9} {human(r['z_ulp']):>9} {human(r['z_i32']):>9} "
        f"{human(r['z_gap']):>9} {r['ulp'] / r['i32']:>6.3f} {r['ulp'] / r['gap']:>6.3f} {seconds(r['publish']):>9} "
        f"{seconds(r['apply']):>9} {seconds(r['trusted']):>9} {seconds(r['polled']):>9} {seconds(r['floor']):>9} "
        f"{seconds(r['dl']):>9} {seconds(r['trl_best']):>9}"
    )


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def span(rows: list[dict], key: str) -> str:
    got = sorted({r[key] for r in rows})
    return str(got[0]) if len(got) == 1 else f"{got[0]}-{got[-1]}"


def print_size_targets(rows: list[dict], replicas: int) -> None:
    print(f"\ntargets (every version; a replica kind's time for a version: the median of its {replicas} replicas):")
    for label, key in (("ULPack (sparse, the default)", "ulp"), ("ULPack dense", "dense")):
        size_i32 = all(r[key] <= r["i32"] / 4 for r in rows)
        size_gap = all(r[key] <= r["gap"] / 2 for r in rows)
        print(
            f"  {label}: <= 1/4 of TRL int32 {'HOLDS' if size_i32 else 'FAILS'} "
            f"(worst {max(r[key] / r['i32'] for r in rows):.3f}, mean {mean(rows, key) / mean(rows, 'i32'):.3f}); "
            f"<= 1/2 of TRL gap-coded {'HOLDS' if size_gap else 'FAILS'} "
            f"(worst {max(r[key] / r['gap'] for r in rows):.3f}, mean {mean(rows, key) / mean(rows, 'gap'):.3f})"
        )
    print(
        f"  (vs zstd-19 of each file: /int32 {mean(rows, 'ulp') / mean(rows, 'z_i32'):.3f}, "
        f"/gap {mean(rows, 'ulp') / mean(rows, 'z_gap'):.3f}; "
        f"zstd-19 of the ULPack packs gains {1 - mean(rows, 'z_ulp') / mean(rows, 'ulp'):.1%})"
    )
    print(
        f"  objects per delta version <= 3: {'HOLDS' if all(r['objs'] <= 3 for r in rows) else 'FAILS'} "
        f"(max {max(r['objs'] for r in rows)}: pack, step document, ref log entry; "
        f"{max(r['puts'] for r in rows)} writes with the store's transient commit intent)"
    )
    print(
        f"  GET requests per version: told the version and its step document, {span(rows, 'told_gets')} (one range "
        f"of the step's pack: its blobs and table block); reading the branch head, {span(rows, 'gets')} (the head's "
        "ref and the step document too); TRL int32: 1 file.  The times here leave out each request's latency (on S3 "
        "tens of ms to the first byte): one request per version each, a told follower and TRL's pay it alike"
    )


def print_time_targets(rows: list[dict]) -> None:
    trl_total = [r["i32"] / GB + r["trl_best"] for r in rows]
    for label, key in (("trusted", "trusted"), ("default", "apply"), ("trusted, reading the branch head", "polled")):
        ours = [r["dl"] + r[key] for r in rows]
        ok = all(a <= b for a, b in zip(ours, trl_total))
        print(
            f"  per replica, download at 1 GB/s + apply <= TRL int32's, {label}: {'HOLDS' if ok else 'FAILS'} "
            f"(mean {seconds(statistics.mean(ours))} vs {seconds(statistics.mean(trl_total))}, "
            f"median {seconds(statistics.median(ours))} vs {seconds(statistics.median(trl_total))}; "
            f"{sum(a <= b for a, b in zip(ours, trl_total))}/{len(rows)} versions; "
            f"scatter floor {seconds(mean(rows, 'floor'))}, TRL int32 apply alone {seconds(mean(rows, 'trl_best'))}; "
            f"ULPack apply = {mean(rows, key) / mean(rows, 'floor'):.1f}x the scatter floor)"
        )


def print_notes(rows: list[dict], bench: Bench) -> None:
    first = bench.states[0]
    stage, n_params = bench.stage, bench.n_params
    print(
        f"     a replica of pipeline stage 0 of 2 (Follower(tensors=...): the model's first {len(stage)} of "
        f"{len(first)} tensors, {sum(first[k].size for k in stage) / n_params:.0%} of its parameters), "
        f"trusted: downloads {mean(rows, 'stage_bytes') / mean(rows, 'whole_bytes'):.2f} of a whole replica's blob "
        f"bytes, applies in {seconds(mean(rows, 'stage'))} ({mean(rows, 'stage') / mean(rows, 'trusted'):.2f} of a "
        "whole trusted replica's)"
    )
    print(
        f"     default mode's check: it re-sums 1/16 of the state in the background once a version is written (the "
        f"next version waits for it); applied and checked {seconds(mean(rows, 'checked'))} per version, against "
        f"{seconds(mean(rows, 'apply'))} applied"
    )
    print(
        f"     threads: ULPack applies on the follower's {bench.threads} decode thread(s); TRL's apply and the floor "
        "are measured on one thread (numpy fancy assignment / one compiled loop)"
    )
    print(
        "     memory: every replica (followers, TRL, floor) keeps its own state and applies each version in place; "
        f"TRL's numpy apply on a state copied just before (cache-warm) takes {seconds(mean(rows, 'trl_warm'))}"
    )
    if all(r["trl_torch"] is not None for r in rows):
        import torch

        print(
            f"     TRL's own scatter, torch index_copy_ on {torch.get_num_threads()} intra-op thread(s): "
            f"{seconds(mean(rows, 'trl_torch'))} per version against numpy's {seconds(mean(rows, 'trl_apply'))}; "
            "the targets above use the faster of the two"
        )


def print_why(rows: list[dict], n_params: int) -> None:
    changed_mean = mean(rows, "changed") * n_params
    ulp, floor, i32 = mean(rows, "ulp"), mean(rows, "floor"), mean(rows, "i32")
    print(
        f"     why: ULPack codes a change in {8 * ulp / changed_mean:.1f} bits, {ulp / changed_mean:.2f} ns "
        f"of download at 1 GB/s; writing it in place alone takes {floor / changed_mean * 1e9:.1f} ns here "
        f"(TRL int32: {i32 / changed_mean:.1f} ns of download, "
        f"{mean(rows, 'trl_apply') / changed_mean * 1e9:.1f} ns of numpy apply)"
    )
    print(
        f"     context: full bf16 weights at 1 GB/s: {seconds(2 * n_params / GB)}; download+apply at 1 GB/s: "
        f"ULPack {seconds(mean(rows, 'dl') + mean(rows, 'trusted'))} trusted, "
        f"{seconds(mean(rows, 'dl') + mean(rows, 'apply'))} default; "
        f"TRL int32 {seconds(i32 / GB + mean(rows, 'trl_best'))}"
    )
    gain = i32 - ulp
    extra = mean(rows, "trusted") - mean(rows, "trl_best")
    if extra > 0:
        print(
            f"     ULPack's download+apply (trusted) beats TRL int32's below {gain / extra / 1e6:.0f} MB/s of link "
            "bandwidth per replica (cross-region links, NAT'd replicas, shared egress), loses above it"
        )


def print_extrapolation(rows: list[dict], n_params: int, threads: int) -> None:
    per_param = {k: mean(rows, k) / n_params for k in ("ulp", "i32", "gap", "z_i32", "z_gap")}
    apply_rate = n_params / mean(rows, "trusted")  # params/s on `threads` threads, this machine
    publish_rate = n_params / mean(rows, "publish")
    print(
        f"\nextrapolation on paper (same change density, {mean(rows, 'changed'):.2%} of elements per step; "
        f"bytes scale with parameters; apply/publish at this machine's measured "
        f"{apply_rate / 1e6:.0f}M / {publish_rate / 1e6:.0f}M params/s on {threads} thread(s), scaling with cores):"
    )
    print(
        f"  {'model':>6} {'full bf16':>10} {'ULPack':>10} {'TRL i32':>10} {'TRL gap':>10} {'zstd i32':>10} "
        f"{'dl ULPack@1GB/s':>16} {'dl i32@1GB/s':>13} {'trusted (here)':>15} {'trusted /64 cores':>18}"
    )
    for name, n in (("7B", 7e9), ("1T", 1e12)):
        b = {k: per_param[k] * n for k in per_param}
        print(
            f"  {name:>6} {human(2 * n):>10} {human(b['ulp']):>10} {human(b['i32']):>10} {human(b['gap']):>10} "
            f"{human(b['z_i32']):>10} {seconds(b['ulp'] / GB):>16} {seconds(b['i32'] / GB):>13} "
            f"{seconds(n / apply_rate):>15} {seconds(n / apply_rate * threads / 64):>18}"
        )
    print(
        "  (a 1T model is sharded: each inference host applies only its shard's chunks, so per-host "
        "apply time divides by the number of hosts; ULPack chunks are independent)"
    )


def print_trainer_side(states: list[dict], threads: int, rounds: int = 5) -> None:
    """The trainer's blocking time: Publisher.submit (a host copy) against safetensors.torch.save_file."""
    try:
        import torch  # noqa: F401
        from safetensors.torch import save_file
    except ImportError:
        print("\ntrainer side: needs torch and safetensors (skipped)")
        return
    from ulstore.core.torch import to_tensor

    tensors = [{k: to_tensor(v) for k, v in s.items()} for s in states]
    nbytes = sum(v.nbytes for v in states[0].values())
    scratch = tempfile.mkdtemp(prefix="ulstore-sync-bench-submit-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    submit, owned, save = [], [], []
    with Publisher(os.path.join(scratch, "bucket"), anchor_every=0, threads=threads, max_in_flight=2) as pub:
        for i in range(max(rounds, 2)):
            state = tensors[i % len(tensors)]
            for times, copy in ((submit, True), (owned, False)):
                gc.collect()
                t0 = time.perf_counter()
                pub.submit(2 * i + (not copy), state, copy=copy)
                times.append(time.perf_counter() - t0)
                pub.wait()  # untimed: the background commit, so that the next submit finds room
            path = os.path.join(scratch, "step.safetensors")
            gc.collect()
            t0 = time.perf_counter()
            save_file(state, path)
            save.append(time.perf_counter() - t0)
            os.remove(path)
    shutil.rmtree(scratch, ignore_errors=True)
    best, saved = min(submit), min(save)
    print(
        f"\ntrainer side ({human(nbytes)} of bf16 torch tensors, fastest of {len(submit)}): submit() blocks "
        f"{seconds(best)} ({nbytes / best / 1e6:.0f} MB/s; the first, into fresh buffers, {seconds(submit[0])}) "
        f"against safetensors.torch.save_file {seconds(saved)} ({nbytes / saved / 1e6:.0f} MB/s): "
        f"{best / saved:.2f}x; submit(copy=False), taking the tensors (a fresh bf16 cast), {seconds(min(owned))}"
    )


def main(argv=None) -> None:
    args = parse(argv)
    states, desc = load_states(args)
    n_params = sum(v.size for v in states[0].values())
    threads = args.threads or os.cpu_count() or 1
    args.replicas = max(1, args.replicas or (5 if n_params < 100e6 else 3))
    print(
        f"ulstore.sync benchmark: {desc}; {n_params / 1e6:.2f}M bf16 params "
        f"({human(2 * n_params)} per full copy), {len(states) - 1} RL steps (lr 3e-6), "
        f"{threads} thread(s), {os.cpu_count()} CPU(s)\n"
    )
    bench = Bench(args, states, threads)
    info0 = bench.info0
    print(
        f"anchor (version 0): {human(info0.anchor_bytes)} (intra ULPack, {info0.anchor_bytes / (2 * n_params):.1%} "
        f"of bf16), publish {seconds(info0.seconds)}, bootstrap {seconds(bench.boot)}\n"
    )
    print(HEAD)
    print("-" * len(HEAD))
    rows = []
    for v in range(1, len(states)):
        rows.append(bench.version(v))
        print_row(rows[-1])
    bench.close()
    print_size_targets(rows, args.replicas)
    print_time_targets(rows)
    print_notes(rows, bench)
    print_why(rows, n_params)
    print_extrapolation(rows, n_params, threads)
    print_trainer_side(states, threads)


if __name__ == "__main__":
    main()
