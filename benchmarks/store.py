"""The store at speed and scale (issue 10): every figure side by side, from one run.

On a real trained bf16 model (default: the ~204M-parameter toytrain run of
``_big.py``; ``--preset tiny|small|bench`` for the small cached trajectories):

1. speed, as ratios measured in this run (medians of ``--reps`` interleaved
   repetitions; the machine is shared and noisy, so absolute MB/s move):
   ``traj.commit`` of a delta step (kept parent) vs ``ulstore.encode_many`` of
   the same delta; a fresh process's ``traj.read`` of an anchor step vs
   ``ulstore.decode_many`` of the same tensors; a depth-7 read; consecutive
   reads; ``safetensors`` save/load beside them; the floors (what the codec
   plus the unavoidable copies and hashes allow);
2. peak memory of a delta commit (tracemalloc, in a fresh process: numpy
   buffers and Python objects) with the kept parent on and off, vs the step;
3. on a moto S3 server started here on 127.0.0.1: requests per commit, and
   GET requests and bytes of a one-element lazy slice at depth 0 and 7;
4. a simulated 1T-parameter step (synthetic entries, the real table-block and
   step-document encoders): manifest bytes vs a 1.5%-of-raw delta.

Usage::

    python benchmarks/store.py                     # 204M model (trained once, ~6 min; cached)
    python benchmarks/store.py --reps 3 --no-s3
    python benchmarks/store.py --preset tiny --steps 8 --no-s3   # smoke run

moto is a single-process Python server: its numbers are request counts and
bytes, not S3 latency.  Nothing here is asserted; the targets are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ml_dtypes  # noqa: E402

import ulstore  # noqa: E402
from ulstore.store.format._chunkcodec import content_digest  # noqa: E402

_CHILD = r"""
import json, sys, time, tracemalloc
sys.path.insert(0, {here!r})
import ulstore
job = json.loads(sys.argv[1])
if job["kind"] == "read":
    t = ulstore.open(job["url"], mode="r")
    s, c = time.perf_counter(), time.process_time()
    t.read(job["step"])
    print(json.dumps({{"seconds": time.perf_counter() - s, "cpu": time.process_time() - c}}))
else:  # peak memory of one delta commit on top of a kept (or not) parent
    from store import load_states, rss
    states = load_states(job["preset"], 1)  # loaded before tracing: the caller's arrays are not counted
    t = ulstore.open(job["url"], mode="w", keep_parent=job["keep"], cache_bytes=job["cache"])
    base = rss()[0]
    tracemalloc.start()
    t.commit(0, states[0])
    kept = tracemalloc.get_traced_memory()[0]
    kept_rss = rss()[0] - base
    tracemalloc.reset_peak()
    reset = rss(reset=True)[1] is not None
    t.commit(1, states[1])
    peak_rss = rss()[1] - base if reset else None
    print(json.dumps({{"peak": tracemalloc.get_traced_memory()[1], "before": kept, "peak_rss": peak_rss,
                      "before_rss": kept_rss}}))
"""


def rss(reset: bool = False) -> tuple[int, int | None]:
    """This process's resident bytes now and at their peak (Linux ``/proc``), after resetting the peak if asked."""
    if reset:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
        except OSError:
            return 0, None
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if k in ("VmRSS", "VmHWM")}
    return kib.get("VmRSS", 0), kib.get("VmHWM")


def load_states(preset: str, steps: int) -> list[dict[str, np.ndarray]]:
    if preset == "moe":
        from _moe import load_moe

        return load_moe(steps)
    if preset == "204M":
        from _big import load_big

        return load_big(steps)
    from _data import load_trajectory

    return load_trajectory("rl", "bfloat16", preset, steps=steps)


def _child(job: dict) -> dict:
    code = _CHILD.format(here=str(HERE))
    p = subprocess.run([sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True, cwd=HERE)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def _timed(fn, cpu: list | None = None) -> float:
    """Wall seconds of ``fn()``; appends its process CPU seconds (every thread) to ``cpu`` if given."""
    c, t = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    if cpu is not None:
        cpu.append(time.process_time() - c)
    return wall


def _mbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _row(label: str, mbs: float, ratio: float | None = None, note: str = "") -> None:
    r = f"{ratio:6.2f}x" if ratio is not None else " " * 7
    print(f"  {label:44s} {mbs:8.0f} MB/s {r}  {note}")


# -- 1. speed -------------------------------------------------------------------------------------


def speed(states, args, workdir: Path) -> dict:
    raw = sum(v.nbytes for v in states[0].values())
    med = statistics.median
    url = str(workdir / "local")
    traj = ulstore.open(url, mode="w", anchor_every=0, chunk_bytes=args.chunk_bytes)
    enc, com, st_save, st_load = [], [], [], []
    from safetensors.numpy import load_file, save_file

    st_path = workdir / "step.safetensors"
    traj.commit(0, states[0])
    n_delta = min(args.reps, len(states) - 1)
    for k in range(1, len(states)):  # a training loop: every step a delta on the kept parent
        if k <= n_delta:
            pairs = [(states[k][n], states[k - 1][n]) for n in states[k]]
            enc.append(_timed(lambda pairs=pairs: ulstore.encode_many(pairs)))
            st_save.append(_timed(lambda k=k: save_file(states[k], str(st_path))))
            st_load.append(_timed(lambda: load_file(str(st_path))))
        com.append(_timed(lambda k=k: traj.commit(k, states[k])))
    com = com[:n_delta]
    blob_sizes = sum(map(len, ulstore.encode_many([(states[1][n], states[0][n]) for n in states[1]])))
    stats = traj.stats()
    # anchor reads: a fresh process vs decode_many of the same tensors; the floors
    intra = ulstore.encode_many(list(states[0].values()))
    dec, fresh, deep, copies, hashes = [], [], [], [], []
    depth = min(7, len(states) - 1)
    for _ in range(args.reps):
        dec.append(_timed(lambda: ulstore.decode_many(intra)))
        fresh.append(_child({"kind": "read", "url": url, "step": 0})["seconds"])
        deep.append(_child({"kind": "read", "url": url, "step": depth})["seconds"])
        decoded = ulstore.decode_many(intra)
        copies.append(_timed(lambda decoded=decoded: [np.array(a, copy=True) for a in decoded]))
        hashes.append(_timed(lambda decoded=decoded: [content_digest(a) for a in decoded]))
    ro = ulstore.open(url, mode="r")
    seq = [_timed(lambda s=s: ro.read(s)) for s in range(len(states))][2:]  # once the kept step is on
    e, c, d, f, dp = med(enc), med(com), med(dec), med(fresh), med(deep)
    print(f"\n== speed: {raw / 1e6:.0f} MB per step, {len(states[0])} tensors; medians of {args.reps} runs")
    print(f"  {'':44s} {'':>8s}      vs reference")
    _row("safetensors save_file", _mbs(raw, med(st_save)))
    _row("safetensors load_file", _mbs(raw, med(st_load)))
    _row("ulstore.encode_many (delta, whole tensors)", _mbs(raw, e), 1.0, f"ratio {raw / blob_sizes:.1f}x of raw")
    _row("traj.commit (delta, kept parent)", _mbs(raw, c), e / c, "target >= 0.70")
    _row("ulstore.decode_many (anchor, whole tensors)", _mbs(raw, d), 1.0)
    _row("traj.read of the anchor (fresh process)", _mbs(raw, f), d / f, "target >= 0.70")
    floor = d / (d + med(copies))
    _row("  floor: decode_many + a copy into user arrays", _mbs(raw, d + med(copies)), floor)
    _row(f"traj.read at depth {depth} (fresh process)", _mbs(raw, dp), d / dp, f"each chain once: {depth + 1} decodes")
    _row("traj.read of consecutive steps (per step)", _mbs(raw, med(seq)), d / med(seq), "kept step: 1 decode/chunk")
    print(f"  content hashes of a step (what a commit and a read add): {_hash_speeds(states[0], raw, med(hashes))}")
    print(
        f"full-step read and commit figures above; stored {stats['stored_bytes'] / 1e6:.1f} MB for "
        f"{len(states)} steps ({stats['raw_bytes'] / stats['stored_bytes']:.1f}x), {stats['packs']} packs"
    )
    return {"commit_ratio": e / c, "read_ratio": d / f, "raw": raw}


def _hash_speeds(state: dict, raw: int, blake3_chunks: float) -> str:
    """MB/s of candidate content hashes over a step's tensors, one thread (why BLAKE3: docs/performance.md)."""
    import hashlib

    bufs = [memoryview(np.ascontiguousarray(v).reshape(-1).view(np.uint8)) for v in state.values()]
    out = {"BLAKE3-128": _mbs(raw, blake3_chunks)}
    out["blake2b-128 (format 1)"] = _mbs(
        raw, _timed(lambda: [hashlib.blake2b(b, digest_size=16).digest() for b in bufs])
    )
    try:
        import xxhash

        out["xxh3-128 (not cryptographic)"] = _mbs(raw, _timed(lambda: [xxhash.xxh3_128_digest(b) for b in bufs]))
    except ImportError:
        pass
    return "; ".join(f"{k} {v:.0f} MB/s" for k, v in out.items())


# -- 2. memory --------------------------------------------------------------------------------------


def memory(args, raw: int, workdir: Path) -> None:
    print(
        "\n== peak memory of a delta commit (fresh process; the caller's arrays not counted): tracemalloc (numpy "
        "buffers, Python objects) and RSS (peak resident during the commit minus resident before the first commit)"
    )
    for keep, target in ((True, 1.2), (False, 0.2)):
        got = _child(
            {"kind": "memory", "preset": args.preset, "url": str(workdir / f"mem-{keep}"), "keep": keep, "cache": 0}
        )
        rss_note = (
            f"; RSS {got['peak_rss'] / 1e6:.1f} MB = {got['peak_rss'] / raw:.2f}x (held {got['before_rss'] / 1e6:.1f} MB)"
            if got.get("peak_rss") is not None
            else "; RSS peak not measurable here"
        )
        print(
            f"  kept parent {'on ' if keep else 'off'}: peak tracemalloc {got['peak'] / 1e6:.1f} MB = "
            f"{got['peak'] / raw:.2f}x the step (target <= {target}; held between commits {got['before'] / 1e6:.1f} MB)"
            f"{rss_note}"
        )


# -- 2b. many tensors (issue 39) --------------------------------------------------------------------


def _ratios(states, args, workdir: Path) -> dict:
    """Delta commit vs ``encode_many`` of the same pairs, and a fresh read of the anchor vs ``decode_many``
    of the same intra blobs: medians of interleaved runs (commit k is the delta k-1 -> k on the kept parent)."""
    raw = sum(v.nbytes for v in states[0].values())
    url = str(workdir / f"ratios-{uuid.uuid4().hex}")
    traj = ulstore.open(url, mode="w", anchor_every=0, chunk_bytes=args.chunk_bytes)
    anchor = _timed(lambda: traj.commit(0, states[0]))
    enc, com, enc_cpu, com_cpu = [], [], [], []
    for k in range(1, len(states)):
        pairs = [(states[k][n], states[k - 1][n]) for n in states[k]]
        enc.append(_timed(lambda pairs=pairs: ulstore.encode_many(pairs), enc_cpu))
        com.append(_timed(lambda k=k: traj.commit(k, states[k]), com_cpu))
        del pairs
    intra = ulstore.encode_many(list(states[0].values()))
    dec, fresh, dec_cpu, fresh_cpu = [], [], [], []
    for _ in range(args.reps):
        dec.append(_timed(lambda: ulstore.decode_many(intra), dec_cpu))
        got = _child({"kind": "read", "url": url, "step": 0})
        fresh.append(got["seconds"])
        fresh_cpu.append(got["cpu"])
    med = statistics.median
    return {
        "raw": raw,
        "tensors": len(states[0]),
        "anchor": _mbs(raw, anchor),
        "encode": _mbs(raw, med(enc)),
        "commit": _mbs(raw, med(com)),
        "decode": _mbs(raw, med(dec)),
        "read": _mbs(raw, med(fresh)),
        "commit_ratio": med(enc) / med(com),
        "read_ratio": med(dec) / med(fresh),
        "commit_cpu_ratio": med(enc_cpu) / med(com_cpu),
        "read_cpu_ratio": med(dec_cpu) / med(fresh_cpu),
    }


def _peak(preset: str, workdir: Path) -> dict:
    """Peak tracemalloc and RSS of a delta commit with the kept parent on (fresh process, as ``memory``)."""
    return _child(
        {"kind": "memory", "preset": preset, "url": str(workdir / f"peak-{preset}"), "keep": True, "cache": 0}
    )


def moe(args, workdir: Path) -> None:
    """Issue 39's many-tensor figures, side by side: the MoE model of ``_moe.py`` and the bench model."""
    models = [("moe", "MoE (_moe.py)"), (args.preset if args.preset != "moe" else "204M", "bench model")]
    got = {}
    for preset, label in models:
        states = load_states(preset, max(1, args.reps))
        got[label] = _ratios(states, args, workdir) | _peak(preset, workdir)
        del states
    print(f"\n== many tensors (issue 39): medians of {args.reps} interleaved runs; load {os.getloadavg()[0]:.1f}")
    cols = list(got)
    print(f"  {'':48s}" + "".join(f"{c:>22s}" for c in cols))
    rows = [
        ("tensors; MB per step", lambda g: f"{g['tensors']:,}; {g['raw'] / 1e6:.0f}"),
        ("ulstore.encode_many (delta) MB/s", lambda g: f"{g['encode']:.0f}"),
        ("traj.commit (delta, kept parent) MB/s", lambda g: f"{g['commit']:.0f}"),
        ("  commit / encode_many (goal >= 0.8)", lambda g: f"{g['commit_ratio']:.2f}x"),
        ("  the same in process CPU time (all threads)", lambda g: f"{g['commit_cpu_ratio']:.2f}x"),
        ("traj.commit of the anchor MB/s", lambda g: f"{g['anchor']:.0f}"),
        ("ulstore.decode_many (anchor) MB/s", lambda g: f"{g['decode']:.0f}"),
        ("traj.read of the anchor (fresh process) MB/s", lambda g: f"{g['read']:.0f}"),
        ("  read / decode_many (goal >= 0.8)", lambda g: f"{g['read_ratio']:.2f}x"),
        ("  the same in process CPU time (all threads)", lambda g: f"{g['read_cpu_ratio']:.2f}x"),
        ("delta commit peak tracemalloc / step (<= 1.2)", lambda g: f"{g['peak'] / g['raw']:.2f}x"),
        (
            "delta commit peak RSS / step",
            lambda g: f"{g['peak_rss'] / g['raw']:.2f}x" if g.get("peak_rss") is not None else "n/a",
        ),
    ]
    for label, fmt in rows:
        print(f"  {label:48s}" + "".join(f"{fmt(got[c]):>22s}" for c in cols))


# -- 3. S3 -----------------------------------------------------------------------------------------


class _S3Log:
    """Counts the requests an s3fs filesystem sends (operation, key, bytes)."""

    def __init__(self, fs):
        self.calls: list[tuple[str, str, int]] = []
        orig, orig_sync = fs._call_s3, fs.call_s3

        def note(method, kw, out):
            n = int(out.get("ContentLength", 0) or 0) if isinstance(out, dict) and method == "get_object" else 0
            self.calls.append((method, kw.get("Key", ""), n))

        async def call(method, *a, **kw):
            out = await orig(method, *a, **kw)
            note(method, kw, out)
            return out

        def call_sync(method, *a, **kw):  # s3fs's file objects (multipart uploads) use the sync wrapper
            out = orig_sync(method, *a, **kw)
            note(method, kw, out)
            return out

        fs._call_s3, fs.call_s3 = call, call_sync

    def summary(self) -> str:
        ops: dict[str, int] = {}
        for m, _, _ in self.calls:
            ops[m] = ops.get(m, 0) + 1
        return ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))


@contextlib.contextmanager
def moto_bucket():
    """A moto S3 server on 127.0.0.1 with bucket ``bench``; yields the s3fs storage options that reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="bench")
        yield {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
    finally:
        server.stop()


def s3(states, args) -> None:
    with moto_bucket() as so:
        url = f"s3://bench/{uuid.uuid4().hex}"
        traj = ulstore.open(url, mode="w", storage_options=so, anchor_every=0, chunk_bytes=args.chunk_bytes)
        log = _S3Log(traj._io.fs)
        per_commit = []
        for k in range(len(states)):
            log.calls.clear()
            traj.commit(k, states[k])
            writes = [c for c in log.calls if c[0] in ("put_object", "upload_part", "create_multipart_upload",
                                                        "complete_multipart_upload")]  # fmt: skip
            per_commit.append((len(writes), len({c[1] for c in writes}), log.summary()))
        print(f"\n== moto S3 ({len(states)} commits, {args.chunk_bytes >> 20} MiB chunks)")
        print(f"  anchor commit: {per_commit[0][0]} write requests, {per_commit[0][1]} objects ({per_commit[0][2]})")
        print(f"  delta commit:  {per_commit[1][0]} write requests, {per_commit[1][1]} objects ({per_commit[1][2]})")
        name = max(states[0], key=lambda n: states[0][n].size)
        for step in (0, min(7, len(states) - 1)):
            ro = ulstore.open(url, mode="r", storage_options=so)
            log = _S3Log(ro._io.fs)
            value = ro[step][name][1, 2]
            assert np.asarray(value).view(np.uint16) == states[step][name][1, 2].view(np.uint16)
            gets = [c for c in log.calls if c[0] == "get_object"]
            print(
                f"  one-element slice at depth {ro.info(step).anchor_distance}: {len(log.calls)} requests "
                f"({log.summary()}), {sum(c[2] for c in gets) / 1e3:.1f} KB"
            )
        # a DCP rank's load of a whole step: one read_box per tensor (before read_boxes) against read_boxes
        boxes = [(n, (0,) * v.ndim, v.shape) for n, v in states[0].items()]
        for way in ("read_box per tensor", "read_boxes"):
            ro = ulstore.open(url, mode="r", storage_options=so, cache_bytes=0)
            ro.tensors(0)  # the tables read first: blob reads only
            log = _S3Log(ro._io.fs)
            t0 = time.perf_counter()
            got = ro.read_boxes(0, boxes) if way == "read_boxes" else [ro.read_box(0, *b) for b in boxes]
            seconds = time.perf_counter() - t0
            assert all(
                np.array_equal(g.view(np.uint16), states[0][n].view(np.uint16)) for g, (n, _, _) in zip(got, boxes)
            )
            print(f"  step 0 read as {len(boxes)} boxes, {way}: {len(log.calls)} requests, {seconds * 1e3:.0f} ms")


# -- 4. the 1T manifest --------------------------------------------------------------------------------


def manifest_1t() -> None:
    """A 1T-parameter bf16 step (Kimi-K2-like: 61 layers, 384 experts), 4 MiB chunks, RL delta 1.5% of raw."""
    from ulstore.store.commit._finalize import _blocks
    from ulstore.store.format._chunk_tables import Piece, TensorTable, content_checksum
    from ulstore.store.format._layout import choose_chunks, chunk_grid, new_pack_id
    from ulstore.store.format._stepdoc import StepDoc, TableRef
    from ulstore.store.format._table_block import encode_block

    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    shapes = {"model.embed_tokens.weight": (163840, 7168), "lm_head.weight": (163840, 7168)}
    for layer in range(61):
        p = f"model.layers.{layer}."
        shapes |= {p + f"self_attn.{n}.weight": s for n, s in (("q_a_proj", (1536, 7168)), ("q_b_proj", (12288, 1536)),
                   ("kv_a_proj", (576, 7168)), ("kv_b_proj", (16384, 512)), ("o_proj", (7168, 8192)))}  # fmt: skip
        shapes |= {p + n: (7168,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        experts = 384 if layer else 0
        for e in range(experts):
            for n, s in (("gate_proj", (2048, 7168)), ("up_proj", (2048, 7168)), ("down_proj", (7168, 2048))):
                shapes[p + f"mlp.experts.{e}.{n}.weight"] = s
        shapes |= {p + f"mlp.shared.{n}.weight": (18432, 7168) for n in ("gate", "up")}
    params = sum(math.prod(s) for s in shapes.values())
    chunk_bytes = 4 << 20
    pack_bytes = 256 << 20
    delta_fraction = 0.015
    pack_ids = [new_pack_id() for _ in range(400)]
    old = [new_pack_id() for _ in range(40)]
    tables, delta, cursor = [], 0, [0, 0]  # pack, offset
    for name in sorted(shapes):
        shape = shapes[name]
        chunks = choose_chunks(shape, 2, chunk_bytes)
        n = math.prod(chunk_grid(shape, chunks))
        raw = np.full(n, math.prod(chunks) * 2, np.int64)
        length = np.maximum(64, rng.normal(delta_fraction, delta_fraction / 4, n) * raw).astype(np.int64)
        unchanged = rng.random(n) < 0.02  # a few chunks did not change: entries reused from older packs
        pack, off = np.empty(n, np.int64), np.empty(n, np.int64)
        for i in range(n):
            if unchanged[i]:
                pack[i], off[i] = len(pack_ids) + int(rng.integers(len(old))), int(rng.integers(1 << 28))
                continue
            if cursor[1] + length[i] > pack_bytes:
                cursor = [cursor[0] + 1, 0]
            pack[i], off[i] = cursor
            cursor[1] += int(length[i])
            delta += int(length[i])
        ref = np.where(unchanged, 998, 999).astype(np.int64)
        content = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        piece = Piece((0,) * len(shape), shape, chunks, content, ref, pack, off, length)
        tables.append(TensorTable(name, bf16, shape, "ulpack", (piece,)))
    packs = pack_ids[: cursor[0] + 1] + old
    table_bytes, refs = 0, []
    for block in _blocks(tables):
        raw = encode_block(block)
        refs.append(TableRef(block[0].name, block[-1].name, 0, table_bytes, len(raw), "0" * 32))
        table_bytes += len(raw)
    doc = StepDoc(
        1000, 999, content_checksum(tables, {}, {}), "f" * 32, 5, tuple(packs), tuple(refs), {}, {"loss": 1.0}
    )
    doc_bytes = len(doc.to_bytes())
    chunks_total = sum(t.n_chunks for t in tables)
    manifest = table_bytes + doc_bytes
    print(f"\n== a simulated 1T-parameter step ({params / 1e12:.2f}T bf16 parameters, {len(shapes):,} tensors)")
    print(
        f"  {chunks_total:,} chunks of <= 4 MiB; RL delta 1.5% of raw = {delta / 1e9:.1f} GB in {cursor[0] + 1} packs"
    )
    print(
        f"  manifest: step document {doc_bytes / 1e3:.0f} KB + {len(refs)} table blocks {table_bytes / 1e6:.2f} MB = "
        f"{manifest / chunks_total:.1f} B/chunk = {100 * manifest / delta:.3f}% of the delta (target <= 0.1%)"
    )
    print(f"  a lazy slice reads the step document and one table block (<= {max(r.length for r in refs) / 1e3:.0f} KB)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="204M", choices=["204M", "moe", "tiny", "small", "bench"])
    p.add_argument("--steps", type=int, default=9, help="checkpoints - 1 (>= 8 for a depth-7 read)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunk-bytes", type=int, default=4 << 20)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument(
        "--only", default="speed,memory,s3,1t", help="parts: speed,memory,s3,1t,moe,depth (moe: issue 39; depth: 35)"
    )
    p.add_argument("--depth-preset", default="small", choices=["tiny", "small", "bench"], help="depth: model size")
    p.add_argument("--depth-steps", type=int, default=300, help="depth: steps of each trajectory")
    p.add_argument("--depth-reps", type=int, default=3, help="depth: reads per step in its fresh process (min)")
    p.add_argument(
        "--depth-rounds",
        type=int,
        default=5,
        help="depth: rounds of fresh-process reads (each round a new process per step, in a shuffled order; "
        "per step the min across rounds)",
    )
    p.add_argument(
        "--depth-k", type=float, default=None, help="depth: the cost policy's k to store with (default: the default)"
    )
    p.add_argument("--depth-kinds", default="rl,pretrain", help="depth: the trajectories (rl, pretrain)")
    from _data import cache_options

    cache_options(p)
    args = p.parse_args(argv)
    parts = set(args.only.split(","))
    t0 = time.perf_counter()
    if parts == {"moe"}:  # loads its two models itself, one after the other
        with tempfile.TemporaryDirectory() as d:
            moe(args, Path(d))
        print(f"\n(total {time.perf_counter() - t0:.0f} s)")
        return
    if parts <= {"depth", "1t"}:  # sections with their own data
        _own_data(parts, args, t0)
        return
    states = load_states(args.preset, args.steps)
    params = sum(v.size for v in states[0].values())
    print(
        f"ulstore store benchmark: {args.preset} model, {params / 1e6:.1f}M bf16 parameters, {len(states)} checkpoints "
        f"(RL regime, trained for real); {os.cpu_count()} cores, backend {ulstore.backend()}; "
        f"loaded in {time.perf_counter() - t0:.0f} s"
    )
    raw = sum(v.nbytes for v in states[0].values())
    with tempfile.TemporaryDirectory() as d:
        if "speed" in parts:
            speed(states, args, Path(d))
        if "memory" in parts:
            memory(args, raw, Path(d))
        if "moe" in parts:
            del states
            moe(args, Path(d))
            states = load_states(args.preset, args.steps) if parts & {"s3"} else []
    if "s3" in parts and not args.no_s3:
        s3(states, args)
    if "1t" in parts:
        manifest_1t()
    if "depth" in parts:
        import _depth

        _depth.run(args)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


def _own_data(parts: set, args, t0: float) -> None:
    print(f"ulstore store benchmark: {os.cpu_count()} cores, backend {ulstore.backend()}")
    if "1t" in parts:
        manifest_1t()
    if "depth" in parts:
        import _depth

        _depth.run(args)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
