"""ULPack against its peers on real checkpoint trajectories: size, model entropy, speed.

What it measures
----------------
Real checkpoints come from actually training the toy language model of
:mod:`ulstore.toytrain` (AdamW on a next-byte loss).  Every checkpoint is saved
as a ``.safetensors`` file under the cache (``$ULSTORE_BENCH_CACHE``, default
``~/.cache/ulstore/benchmarks``, ``--clean`` removes it; trained on first use, ~10-40 s per run on the "bench"
preset) and read back from it.  Trajectories (``--steps`` optimizer steps, so
``steps + 1`` consecutive checkpoints each):

    rl-bf16         bf16, lr 3e-6 after warm-up: sparse, ~99% of weights unchanged
    pretrain-bf16   bf16, lr 1e-3 from init: dense
    finetune-fp32   fp32, lr 1e-4 after warm-up, weight decay 0.01
    finetune-fp16   the same fine-tuning run saved in fp16

For every consecutive pair (parent -> child) and every tensor, the child is
coded against the parent by each method and decoded again, and the decoded
bytes are compared with the child's (any difference aborts the run).  Methods:

    ULPack            ulstore.encode(child, parent)
    ULPack w/o e_r    ulstore.encode(child, parent, econd=False): the ablation
                      without reference-exponent contexts
    zstd-19 BG-XOR    zstd level 19 on the byte-grouped XOR of child and parent
    ZipNN XOR         the zipnn package (Huffman, byte grouping) on that XOR

plus the ideal size under ULPack's own model (``ulstore.model_entropy_bits``)
and ULPack's overhead over it.  Table 1 gives the size of all pairs together
as % of the raw bytes and in bits per weight.

Table 1b codes the last checkpoint of each trajectory *intra* (no reference: an
anchor, a first step, a new tensor): ``ulstore.encode(x)`` against ZipNN and
zstd-19 on the byte-grouped raw values (the same peers with an all-zero parent),
beside the order-0 entropy of the exponent field (per tensor: what an ideal
coder of the exponent alone, each value independent, would spend) and the ideal
size under ULPack's intra model.

Table 1c splits ULPack's bytes over its model's ideal into parts (``inspect_blob``):
header and CRC, tables, rANS lane states and the coded data over the ideal,
for the deltas of Table 1 and the intra blobs of Table 1b, with issue 39's
goals (delta <= +1% over the ideal, intra <= ZipNN), the tensors ZipNN codes
smaller, and the ideal of an intra symbol with 7 mantissa bits (a format
change's floor).

Table 2 times encoding and decoding of all tensors of ONE step pair per
trajectory (the last one), as raw MB/s (1 MB = 1e6 bytes) of wall time
(``time.perf_counter``), best of ``--reps`` runs: ULPack via
``encode_many``/``decode_many`` with 1 thread and with all cores, each peer
single-threaded and with its own threads option (zstd ``threads=``, ZipNN
``threads=``), and intra coding of the child by ULPack and ZipNN.  The ratio
rows divide ULPack's MB/s by ZipNN's, both single-threaded, measured in the same
run.  These machines are shared: quote medians of several runs
(``--from-json a.json b.json c.json`` prints the medians of every number).  A measurement stops repeating once it has used
``--time-budget`` seconds (zstd-19 encodes at a few MB/s), so slow ones may be
best of fewer runs; the JSON records how many.  Peer times include their XOR
and byte grouping.

Table 2b times ULPack and ZipNN single-threaded on EVERY step pair of every
trajectory (all tensors of the pair, best of ``--reps``, the timings of both
interleaved), with their ratio per pair and the lowest ratio of each trajectory,
in wall time and in process CPU time (steadier on a shared machine).

Table 3 gives ULPack's size over its model's ideal per blob size: the last
pair's tensors are flattened, concatenated and cut into pieces of 0.3M elements
(up to 24 blobs) or repeated up to 16M elements (2**24, one blob), coded as a
delta and intra; % over ``model_entropy_bits`` and the bytes over it per blob.

Run
---
    python benchmarks/codec.py                    # preset "bench" (~13M params), a few minutes
    python benchmarks/codec.py --preset tiny      # quick smoke run (seconds)
    python benchmarks/codec.py --only rl-bf16 --markdown --json out.json
    python benchmarks/codec.py --from-json out.json --markdown   # re-print saved results
    python benchmarks/codec.py --from-json r1.json r2.json r3.json  # medians of several runs

Progress goes to stderr, the tables to stdout.  Exit status 2 on a round-trip
mismatch.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import sys
import threading
import time

import numpy as np

if __package__:
    from . import _bands, _data, _peers
else:  # run as a script: python benchmarks/codec.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _bands
    import _data
    import _peers

import ulstore

# Row order and labels of the size table (keys of the per-pair results).
METHODS = {
    "ulpack": "ULPack",
    "ulpack_noe": "ULPack w/o e_r",
    "zstd": "zstd-19 BG-XOR",
    "zipnn": "ZipNN XOR",
}
PEER_KEYS = ("zstd", "zipnn")


class RoundTripError(RuntimeError):
    """A method decoded to bytes other than the child's."""


# -- peers ----------------------------------------------------------------------


def make_peers(threads: int = 1) -> dict:
    """Peer instances by table key; a missing package drops that peer (with a warning)."""
    peers = {}
    for key, make in (
        ("zstd", lambda: _peers.ZstdByteGroupedXor(19, threads)),
        ("zipnn", lambda: _peers.ZipNNXor(threads)),
    ):
        try:
            peers[key] = make()
        except ImportError as exc:
            _log(f"warning: peer {key!r} unavailable ({exc}); skipped")
    return peers


_local = threading.local()


def _thread_peers() -> dict:
    """Single-threaded peers private to the calling thread (peers are not thread-safe)."""
    if not hasattr(_local, "peers"):
        _local.peers = make_peers(1)
    return _local.peers


# -- helpers --------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _raw(a: np.ndarray) -> np.ndarray:
    """The raw bytes of an array as a flat uint8 array (a view)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _check(decoded, child: np.ndarray, method: str, where: str) -> None:
    """Raise :class:`RoundTripError` unless ``decoded`` holds exactly the bytes of ``child``."""
    if isinstance(decoded, np.ndarray):
        if decoded.dtype != child.dtype or decoded.shape != child.shape:
            raise RoundTripError(
                f"{method} round trip FAILED at {where}: decoded {decoded.dtype}{list(decoded.shape)}, "
                f"expected {child.dtype}{list(child.shape)}"
            )
        got = _raw(decoded)
    else:
        got = np.frombuffer(decoded, dtype=np.uint8)
    want = _raw(child)
    if got.size != want.size or not np.array_equal(got, want):
        bad = "length differs" if got.size != want.size else f"{int(np.count_nonzero(got != want))} bytes differ"
        raise RoundTripError(f"{method} round trip FAILED at {where}: {bad}")


def _bits_view(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


def machine_info() -> dict:
    """CPU model, core counts, load and the versions that matter for the numbers."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ulstore": getattr(ulstore, "__version__", "?"),
        "ulstore_backend": ulstore.backend(),
    }
    for mod in ("zstandard", "zipnn"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod)
        except Exception:  # not installed
            info[mod] = None
    return info


# -- size pass ------------------------------------------------------------------


def measure_tensor(child: np.ndarray, parent: np.ndarray, dtype: str, where: str) -> dict:
    """Code one tensor with every method, check every round trip, return the sizes."""
    c_raw, p_raw = _raw(child), _raw(parent)
    out = {
        "elements": int(child.size),
        "raw": int(child.nbytes),
        "changed": int(np.count_nonzero(_bits_view(child) != _bits_view(parent))),
    }
    for key, econd in (("ulpack", True), ("ulpack_noe", False)):
        blob = ulstore.encode(child, parent, econd=econd)
        _check(ulstore.decode(blob, parent), child, METHODS[key], where)
        out[key] = len(blob)
        if econd:
            out.update(_blob_parts(blob))
    for key, peer in _thread_peers().items():
        blob = peer.encode(c_raw, p_raw, dtype)
        _check(peer.decode(blob, p_raw, dtype), child, METHODS[key], where)
        out[key] = len(blob)
    out["entropy_bits"] = ulstore.model_entropy_bits(child, parent)
    out["entropy_noe_bits"] = ulstore.model_entropy_bits(child, parent, econd=False)
    return out


#: Parts of a blob (``inspect_blob``) by the row of Table 1c they are counted in; the rest
#: (rANS words, or a RAW blob's payload) is the coded data.
_PART_ROWS = {
    "header": "part_fixed",
    "crc": "part_fixed",
    "params": "part_table",
    "table": "part_table",
    "lane states": "part_states",
}


def _blob_parts(blob: bytes) -> dict:
    """A blob's bytes by Table 1c's rows: fixed fields (header, CRC), tables, lane states, coded data."""
    out = dict.fromkeys(("part_fixed", "part_table", "part_states", "part_coded"), 0)
    for part, nbytes in ulstore.inspect_blob(blob)["parts"].items():
        out[_PART_ROWS.get(part, "part_coded")] += nbytes
    return out


def _wide_symbol_entropy_bits(x: np.ndarray, k: int = 7) -> float:
    """Ideal bits of an INTRA-like model whose symbol is the exponent and the top ``k`` mantissa
    bits (today's format allows k <= 3 and 256 symbols): what coding more mantissa bits would reach."""
    from ulstore.codec._dtypes import format_of

    fmt = format_of(x.dtype)
    k = min(k, fmt.mant_bits)
    w = _bits_view(x).astype(np.uint64)
    sym = (w >> np.uint64(fmt.mant_bits - k)) & np.uint64((1 << (fmt.exp_bits + k)) - 1)
    c = np.bincount(sym.astype(np.int64)).astype(np.float64)
    c = c[c > 0]
    return float(-(c * np.log2(c / c.sum())).sum()) + x.size * (fmt.mant_bits - k + 1)


def _exponent_entropy_bits(x: np.ndarray) -> float:
    """n * H0(exponent field) of one tensor: its exponents coded each on its own, ideally."""
    from ulstore.codec._dtypes import format_of

    fmt = format_of(x.dtype)
    e = (_bits_view(x).astype(np.uint64) >> np.uint64(fmt.mant_bits)) & np.uint64((1 << fmt.exp_bits) - 1)
    c = np.bincount(e.astype(np.int64)).astype(np.float64)
    c = c[c > 0]
    return float(-(c * np.log2(c / c.sum())).sum())


def measure_intra(child: np.ndarray, dtype: str, where: str) -> dict:
    """Code one tensor intra (no reference) with every method, check the round trips, return sizes."""
    c_raw = _raw(child)
    zeros = np.zeros_like(c_raw)  # the peers' XOR with an all-zero parent is the raw bytes
    out = {"elements": int(child.size), "raw": int(child.nbytes)}
    blob = ulstore.encode(child)
    _check(ulstore.decode(blob), child, "ULPack intra", where)
    out["ulpack"] = len(blob)
    out.update(_blob_parts(blob))
    for key, peer in _thread_peers().items():
        pblob = peer.encode(c_raw, zeros, dtype)
        _check(peer.decode(pblob, zeros, dtype), child, f"{METHODS[key]} intra", where)
        out[key] = len(pblob)
    if "zipnn" in out:  # the tensors ZipNN codes smaller, and by how many bytes
        out["zipnn_wins"] = int(out["zipnn"] < len(blob))
        out["zipnn_wins_bytes"] = max(0, len(blob) - out["zipnn"])
    out["exp_entropy_bits"] = _exponent_entropy_bits(child)
    out["entropy_k7_bits"] = _wide_symbol_entropy_bits(child)
    out["entropy_bits"] = ulstore.model_entropy_bits(child)
    return out


def _sum(rows: list[dict]) -> dict:
    total: dict = {}
    for r in rows:
        for k, v in r.items():
            total[k] = total.get(k, 0) + v
    return total


def size_pass(name: str, spec, states: list[dict], threads: int) -> dict:
    """Sizes of every (parent -> child) pair of one trajectory, per pair and in total."""
    names = list(states[0])
    jobs = [(s, k) for s in range(1, len(states)) for k in names]
    bar = _data.progress(total=len(jobs), desc=f"sizes {name}", unit="tensor")
    results: dict = {}
    # tensors are independent: spread them over the cores (every method's output
    # is a pure function of the tensor, so this changes no size)
    with cf.ThreadPoolExecutor(threads) as pool:
        futures = {
            pool.submit(
                measure_tensor, states[s][k], states[s - 1][k], spec.dtype, f"{name} step {s - 1}->{s} tensor {k!r}"
            ): (s, k)
            for s, k in jobs
        }
        try:
            for fut in cf.as_completed(futures):
                results[futures[fut]] = fut.result()
                bar.update(1)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        finally:
            bar.close()
    pairs = []
    for s in range(1, len(states)):
        pairs.append({"parent": s - 1, "child": s, **_sum([results[(s, k)] for k in names])})
    last = len(states) - 1  # the anchor a store would write: the last checkpoint, intra
    with cf.ThreadPoolExecutor(threads) as pool:
        intra = list(
            pool.map(lambda k: measure_intra(states[last][k], spec.dtype, f"{name} step {last} intra {k!r}"), names)
        )
    return {
        "pairs": pairs,
        "total": _sum([{k: v for k, v in p.items() if k not in ("parent", "child")} for p in pairs]),
        "intra": {"step": last, **_sum(intra)},
    }


# -- speed pass -----------------------------------------------------------------


def best_time(fn, reps: int, budget: float):
    """Best wall time of up to ``reps`` calls of ``fn`` (fewer once ``budget`` s are used; 0 = no limit).

    Returns ``(seconds, runs, result of the last call)``.
    """
    best, spent, result, runs = float("inf"), 0.0, None, 0
    for _ in range(max(1, reps)):
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
        if budget and spent >= budget:
            break
    return best, runs, result


def _speed_codec(key: str, n_threads: int, spec, pairs: list, raw_pairs: list):
    """``(encode, decode)`` of one method of the speed pass over all tensors of the pair, or None if not installed."""
    if key == "ulpack":
        return (
            lambda: ulstore.encode_many(pairs, threads=n_threads),
            lambda blobs: ulstore.decode_many([(b, p) for b, (_, p) in zip(blobs, pairs)], threads=n_threads),
        )
    if key == "ulpack_intra":
        return (
            lambda: ulstore.encode_many([c for c, _ in pairs], threads=1),
            lambda blobs: ulstore.decode_many(blobs, threads=1),
        )
    if key == "zipnn_intra":
        peer = make_peers(1).get("zipnn")
        if peer is None:
            return None
        zero = [np.zeros_like(c) for c, _ in raw_pairs]
        return (
            lambda: [peer.encode(c, z, spec.dtype) for (c, _), z in zip(raw_pairs, zero)],
            lambda blobs: [peer.decode(b, z, spec.dtype) for b, z in zip(blobs, zero)],
        )
    peer = make_peers(n_threads).get(key)
    if peer is None:
        return None
    return (
        lambda: [peer.encode(c, p, spec.dtype) for c, p in raw_pairs],
        lambda blobs: [peer.decode(b, p, spec.dtype) for b, (_, p) in zip(blobs, raw_pairs)],
    )


def _speed_run(codec, raw: int, reps: int, budget: float, check) -> dict:
    """Best encode and decode times of ``codec`` (``(encode, decode)``), the decoded tensors checked by ``check``."""
    enc, dec = codec
    t_enc, runs_enc, blobs = best_time(enc, reps, budget)
    t_dec, runs_dec, decoded = best_time(lambda: dec(blobs), reps, budget)
    check(decoded)
    return {
        "encode_MBps": raw / t_enc / 1e6,
        "decode_MBps": raw / t_dec / 1e6,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "encode_runs": runs_enc,
        "decode_runs": runs_dec,
        "bytes": sum(len(b) for b in blobs),
    }


def speed_pass(name: str, spec, parent: dict, child: dict, threads: int, reps: int, budget: float) -> dict:
    """Encode/decode MB/s of all tensors of one pair, per method and thread count."""
    names = list(child)
    raw = sum(child[k].nbytes for k in names)
    where = f"{name} (speed pass)"
    pairs = [(child[k], parent[k]) for k in names]
    raw_pairs = [(_raw(child[k]), _raw(parent[k])) for k in names]
    plans = [("ulpack", 1), ("ulpack", threads)]
    for key in PEER_KEYS:
        plans += [(key, 1), (key, threads)]
    plans += [("ulpack_intra", 1), ("zipnn_intra", 1)]
    out: dict = {"raw_bytes": raw, "threads": threads}
    bar = _data.progress(total=len(plans), desc=f"speed {name}", unit="run")
    try:
        for key, n_threads in plans:
            label = f"{key}_x{n_threads}"
            codec = None
            if label not in out and (n_threads == 1 or threads > 1):
                codec = _speed_codec(key, n_threads, spec, pairs, raw_pairs)
            if codec is not None:

                def check(decoded, what=f"{key} x{n_threads}"):
                    for k, d in zip(names, decoded):
                        _check(d, child[k], what, f"{where} tensor {k!r}")

                out[label] = _speed_run(codec, raw, reps, budget, check)
            bar.update(1)
    finally:
        bar.close()
    if "ulpack_x1" in out and f"ulpack_x{threads}" in out and threads > 1:
        one, many = out["ulpack_x1"], out[f"ulpack_x{threads}"]
        out["ulpack_scaling"] = {
            "encode": many["encode_MBps"] / one["encode_MBps"],
            "decode": many["decode_MBps"] / one["decode_MBps"],
        }
    return out


def pair_speed_pass(name: str, spec, states: list[dict], reps: int, budget: float) -> list[dict]:
    """Single-threaded encode/decode MB/s of ULPack and ZipNN on EVERY step pair, side by side.

    One row per pair: ``encode_many``/``decode_many(threads=1)`` against one ZipNN call per
    tensor (its XOR included).  The four timings are interleaved, one of each per round,
    and each keeps its best of ``reps`` rounds (fewer once ``budget`` s are used), so that
    both codecs see the same machine load.  Beside wall time, the process CPU time (best
    of the rounds too) is kept: on a shared machine it is the steadier of the two.
    """
    peer = make_peers(1).get("zipnn")
    rows = []
    bar = _data.progress(total=len(states) - 1, desc=f"pair speed {name}", unit="pair")
    try:
        for s in range(1, len(states)):
            names = list(states[s])
            pairs = [(states[s][k], states[s - 1][k]) for k in names]
            raw_pairs = [(_raw(c), _raw(p)) for c, p in pairs]
            raw = sum(c.nbytes for c, _ in pairs)
            where = f"{name} step {s - 1}->{s} (pair speed)"
            jobs = {"ulpack_encode": lambda: ulstore.encode_many(pairs, threads=1)}
            results = {k: fn() for k, fn in jobs.items()}
            jobs["ulpack_decode"] = lambda: ulstore.decode_many(
                [(b, p) for b, (_, p) in zip(results["ulpack_encode"], pairs)], threads=1
            )
            if peer is not None:
                jobs["zipnn_encode"] = lambda: [peer.encode(c, p, spec.dtype) for c, p in raw_pairs]
                results["zipnn_encode"] = jobs["zipnn_encode"]()
                jobs["zipnn_decode"] = lambda: [
                    peer.decode(b, p, spec.dtype) for b, (_, p) in zip(results["zipnn_encode"], raw_pairs)
                ]
            wall = {k: float("inf") for k in jobs}
            cpu = dict(wall)
            spent = 0.0
            for _ in range(max(1, reps)):
                for key, fn in jobs.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    results[key] = fn()
                    c1, w1 = time.process_time(), time.perf_counter()
                    wall[key], cpu[key] = min(wall[key], w1 - w0), min(cpu[key], c1 - c0)
                    spent += w1 - w0
                if budget and spent >= budget * len(jobs):
                    break
            for k, d in zip(names, results["ulpack_decode"]):
                _check(d, states[s][k], "ULPack", f"{where} tensor {k!r}")
            if "zipnn_decode" in results:
                for k, d in zip(names, results["zipnn_decode"]):
                    _check(d, states[s][k], "ZipNN XOR", f"{where} tensor {k!r}")
            row = {"parent": s - 1, "child": s, "raw_bytes": raw}
            for key in jobs:
                row[f"{key}_MBps"] = raw / wall[key] / 1e6
                row[f"{key}_cpu_MBps"] = raw / max(cpu[key], 1e-9) / 1e6
            rows.append(row)
            bar.update(1)
    finally:
        bar.close()
    return rows


#: Tensor sizes of the fixed-overhead table (issue 13: RL-regime tensors of ~0.3M elements, and 16M).
OVERHEAD_SIZES = (300_000, 1 << 24)
#: At most this many 0.3M-element pieces per trajectory (each is one blob).
OVERHEAD_PIECES = 24


def overhead_pass(name: str, parent: dict, child: dict) -> dict:
    """ULPack's bytes over its model's ideal at fixed tensor sizes, delta and intra.

    The last pair's tensors are flattened and concatenated (parent and child in the same
    order), repeated when shorter than the size; a size below the total is cut into
    consecutive pieces of that many elements, each coded as its own blob.
    """
    names = list(child)
    c_all = np.concatenate([child[k].reshape(-1) for k in names])
    p_all = np.concatenate([parent[k].reshape(-1) for k in names])
    out: dict = {}
    for size in OVERHEAD_SIZES:
        total = max(size, c_all.size)
        c, p = np.resize(c_all, total), np.resize(p_all, total)  # np.resize repeats the data
        pieces = min(OVERHEAD_PIECES, total // size)
        row = {"elements": size, "blobs": pieces, "repeated": bool(size > c_all.size)}
        for mode in ("delta", "intra"):
            nbytes, ideal = 0, 0.0
            for i in range(pieces):
                ci, pi = c[i * size : (i + 1) * size], p[i * size : (i + 1) * size]
                ref = pi if mode == "delta" else None
                blob = ulstore.encode(ci, ref)
                _check(ulstore.decode(blob, ref), ci, f"ULPack {mode}", f"{name} overhead {size} piece {i}")
                nbytes += len(blob)
                ideal += ulstore.model_entropy_bits(ci, ref)
            row[mode] = {"bytes": nbytes, "ideal_bits": ideal}
        out[str(size)] = row
    return out


# -- sparse pass (issue 39: one default encoding, smallest and fastest on sparse deltas) ---------

#: Trajectory kinds whose deltas are sparse (RL regime): the ones Table 4 measures.
SPARSE_KINDS = ("rl",)
#: Blob sizes (elements) of Table 4's size-by-blob rows: pieces of the concatenated tensors.
SPARSE_PIECES = (1 << 16, 1 << 20)
#: Exponent classes of the position floor rows: positions coded as ranks within K
#: contiguous bands of reference exponents (what a decoder can find with K - 1 compares).
POSITION_CLASSES = (2, 4, 8)
#: Table 4's rows for a blob's bytes: label -> inspect_blob parts summed into it.
BLOB_PARTS = {
    "headers, counts, CRCs": ("header", "count", "crc"),
    "positions": ("positions low", "positions high", "gaps"),
    "residual tokens (rANS words)": ("residual words",),
    "residual tails (raw bits)": ("residual tail",),
    "tables, lane states, lengths": (
        "residual table",
        "residual states",
        "residual fields",
        "params",
        "table",
        "lane states",
    ),
    # a default (RANS) blob's rANS words, or a RAW blob's values
    "payload (tokens of every element)": ("payload", "words"),
}


_binary_entropy_bits = _bands.binary_entropy_bits
_band_split = _bands.band_split


def _banded_bits(count: np.ndarray, changed: np.ndarray, classes: int) -> float:
    """Fewest ideal position bits over every split of the occupied exponents into ``classes`` bands."""
    return _band_split(count, changed, classes)[0]


def _token_bits(words: np.ndarray) -> float:
    """Ideal bits of ``words`` under ULPack's token model in one row: bit length and the two bits
    below the leading one coded (order-0 entropy of the token), the other low bits raw."""
    z = words.astype(np.int64)
    b = np.zeros_like(z)
    b[z > 0] = np.floor(np.log2(z[z > 0])).astype(np.int64) + 1
    q1 = np.where(b >= 2, (z >> np.maximum(b - 2, 0)) & 1, 0)
    q2 = np.where(b >= 3, (z >> np.maximum(b - 3, 0)) & 1, 0)
    counts = np.bincount(4 * b + 2 * q1 + q2).astype(np.float64)
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / counts.sum())).sum() + np.maximum(b - 3, 0).sum())


def _rank_gap_bits(mask: np.ndarray, band: np.ndarray) -> float:
    """Ideal bits of the changed positions ``mask`` coded as gaps between their ranks within their
    band (one token row per band): what a decoder that scans the reference's exponents can read."""
    bits = 0.0
    for b in np.unique(band[mask]):
        ranks = np.flatnonzero(mask[band == b])
        bits += _token_bits(np.diff(ranks, prepend=-1) - 1)
    return bits


def position_bits(child: np.ndarray, parent: np.ndarray) -> dict:
    """Ideal bits of where ``child`` differs from ``parent``: with no context, under the reference
    exponent (what the default encoding's b = 0 tokens cost ideally), under K bands of it, and as
    gaps between ranks within the best 8 bands, coded as tokens (a design's floor)."""
    from ulstore.codec import format_of

    fmt = format_of(child.dtype)
    changed_mask = _bits_view(child) != _bits_view(parent)
    m, n = int(np.count_nonzero(changed_mask)), int(child.size)
    e = ((_bits_view(parent) >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)).astype(np.int64)
    count = np.bincount(e, minlength=1 << fmt.exp_bits).astype(np.float64)
    changed = np.bincount(e[changed_mask], minlength=1 << fmt.exp_bits).astype(np.float64)
    out = {
        "changed": m,
        "elements": n,
        "uniform": float(_binary_entropy_bits(m, n)),
        "exponent": float(_binary_entropy_bits(changed, count).sum()),
        "rank_gaps": 0.0,
    }
    for k in POSITION_CLASSES:
        out[f"bands{k}"] = _banded_bits(count, changed, k) if m else 0.0
    if m:
        edges = _band_split(count, changed, max(POSITION_CLASSES))[1]
        out["rank_gaps"] = _rank_gap_bits(changed_mask, np.searchsorted(np.array(edges, dtype=np.int64), e, "right"))
    return out


def _part_bytes(blob: bytes) -> dict:
    parts = ulstore.inspect_blob(blob)["parts"]
    return {label: sum(parts.get(p, 0) for p in names) for label, names in BLOB_PARTS.items()}


def sparse_sizes(name: str, parent: dict, child: dict) -> dict:
    """Bytes of the default and the SPARSE blobs of the last pair, by part, against the ideal bits."""
    out: dict = {"raw": 0, "ideal_bits": 0.0}
    for key in ("default", "sparse", "sparse_noe"):
        out[key] = {label: 0 for label in BLOB_PARTS}
    pos: dict = {}
    for k in child:
        c, p = child[k], parent[k]
        out["raw"] += c.nbytes
        out["ideal_bits"] += ulstore.model_entropy_bits(c, p)
        for key, kw in (
            ("default", {}),
            ("sparse", {"sparse": True}),
            ("sparse_noe", {"sparse": True, "econd": False}),
        ):
            blob = ulstore.encode(c, p, **kw)
            _check(ulstore.decode(blob, p), c, f"ULPack {key}", f"{name} sparse pass tensor {k!r}")
            for label, v in _part_bytes(blob).items():
                out[key][label] += v
        for key, v in position_bits(c, p).items():
            pos[key] = pos.get(key, 0) + v
    out["positions"] = pos
    out["pieces"] = _piece_sizes(name, parent, child)
    return out


def _piece_sizes(name: str, parent: dict, child: dict) -> dict:
    """Default and SPARSE bytes and ideal bits with the tensors cut into blobs of SPARSE_PIECES elements."""
    c_all = np.concatenate([child[k].reshape(-1) for k in child])
    p_all = np.concatenate([parent[k].reshape(-1) for k in child])
    out = {}
    for size in SPARSE_PIECES:
        row = {"elements": size, "blobs": 0, "default": 0, "sparse": 0, "ideal_bits": 0.0}
        for start in range(0, c_all.size, size):
            ci, pi = c_all[start : start + size], p_all[start : start + size]
            row["blobs"] += 1
            row["ideal_bits"] += ulstore.model_entropy_bits(ci, pi)
            for key, sparse in (("default", False), ("sparse", True)):
                blob = ulstore.encode(ci, pi, sparse=sparse)
                _check(ulstore.decode(blob, pi), ci, f"ULPack {key}", f"{name} piece of {size} at {start}")
                row[key] += len(blob)
        out[str(size)] = row
    return out


def _sparse_jobs(spec, pairs: list) -> dict:
    """The timed calls of Table 4b, by name (each returns what it decoded, if it decodes)."""
    raw_pairs = [(_raw(c), _raw(p)) for c, p in pairs]
    copies = [np.empty_like(p) for _, p in pairs]
    peer = make_peers(1).get("zipnn")
    blobs = {key: ulstore.encode_many(pairs, threads=1, sparse=key == "sparse") for key in ("default", "sparse")}
    jobs = {"memcpy": lambda: [np.copyto(o, p) for o, (_, p) in zip(copies, pairs)]}
    for key in blobs:
        jobs[f"{key}_encode"] = lambda key=key: ulstore.encode_many(pairs, threads=1, sparse=key == "sparse")
        jobs[f"{key}_decode"] = lambda key=key: ulstore.decode_many(
            [(b, p) for b, (_, p) in zip(blobs[key], pairs)], threads=1
        )
    if peer is not None:
        zipped = [peer.encode(c, p, spec.dtype) for c, p in raw_pairs]
        jobs["zipnn_encode"] = lambda: [peer.encode(c, p, spec.dtype) for c, p in raw_pairs]
        jobs["zipnn_decode"] = lambda: [peer.decode(b, p, spec.dtype) for b, (_, p) in zip(zipped, raw_pairs)]
    return jobs


def _interleaved_best(jobs: dict, reps: int, budget: float) -> tuple[dict, dict, dict]:
    """Best wall and process CPU time of every job over up to ``reps`` rounds of one call each (fewer
    once ``budget`` s per job are used), and each job's last result."""
    best = {k: float("inf") for k in jobs}
    cpu = dict(best)
    results: dict = {}
    spent = 0.0
    for _ in range(max(1, reps)):
        for key, fn in jobs.items():
            start, c0 = time.perf_counter(), time.process_time()
            results[key] = fn()
            c1, elapsed = time.process_time(), time.perf_counter() - start
            best[key], cpu[key], spent = min(best[key], elapsed), min(cpu[key], c1 - c0), spent + elapsed
        if budget and spent >= budget * len(jobs):
            break
    return best, cpu, results


def sparse_speed(name: str, spec, parent: dict, child: dict, reps: int, budget: float) -> dict:
    """Single-thread MB/s of the last pair: default and SPARSE encode and decode, ZipNN's, and memcpy.

    The timings are interleaved, one of each per round, best of ``reps`` rounds (fewer once
    ``budget`` s per timing are used), so that all see the same machine load.
    """
    names = list(child)
    pairs = [(child[k], parent[k]) for k in names]
    best, cpu, results = _interleaved_best(_sparse_jobs(spec, pairs), reps, budget)
    for key in ("default_decode", "sparse_decode", "zipnn_decode"):
        for k, d in zip(names, results.get(key, ())):
            _check(d, child[k], key, f"{name} sparse speed tensor {k!r}")
    raw = sum(c.nbytes for c, _ in pairs)
    out = {"raw_bytes": raw, **{f"{k}_MBps": raw / t / 1e6 for k, t in best.items()}}
    return out | {f"{k}_cpu_MBps": raw / max(t, 1e-9) / 1e6 for k, t in cpu.items()}


def sparse_pass(name: str, spec, parent: dict, child: dict, reps: int, budget: float, speed: bool) -> dict:
    """Table 4's numbers for one sparse trajectory: sizes by part and by blob size, and (``speed``) MB/s."""
    out = {"sizes": sparse_sizes(name, parent, child)}
    if speed:
        out["speed"] = sparse_speed(name, spec, parent, child, reps, budget)
    return out


# -- tables ---------------------------------------------------------------------


def render(title: str, groups: list[str], sub: list[str], rows: list[list[str]], markdown: bool, notes=()) -> str:
    """A table whose columns come in ``groups`` of ``len(sub)`` (one group per trajectory)."""
    if markdown:
        header = ["method"] + [f"{g} {s}" for g in groups for s in sub]
        lines = [
            f"**{title}**",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += [""] + [f"{n}  " for n in notes]
        return "\n".join(lines).rstrip() + "\n"
    first = max([len("method")] + [len(r[0]) for r in rows])
    cell = max([len(s) for s in sub] + [len(c) for r in rows for c in r[1:]])
    group_w = max([len(g) for g in groups] + [len(sub) * (cell + 2) - 2])
    cell = -(-(group_w + 2) // len(sub)) - 2  # widen cells so a group is at least as wide as its name
    group_w = len(sub) * (cell + 2) - 2
    line1 = " " * first + "".join("  " + g.center(group_w) for g in groups)
    line2 = "method".ljust(first) + "".join("  " + "  ".join(s.rjust(cell) for s in sub) for _ in groups)
    rule = "-" * len(line2)
    lines = [title, rule, line1, line2, rule]
    lines += [r[0].ljust(first) + "".join("  " + c.rjust(cell) for c in r[1:]) for r in rows]
    lines += [rule] + list(notes)
    return "\n".join(lines) + "\n"


def size_table(results: dict, markdown: bool, steps: int) -> str:
    groups = list(results)
    rows = []

    def add(label, values):
        rows.append([label] + [v for pair in values for v in pair])

    tot = {n: r["sizes"]["total"] for n, r in results.items()}
    add("elements changed (%)", [(f"{100 * t['changed'] / t['elements']:.2f}", "") for t in tot.values()])
    for key, label in METHODS.items():
        add(
            label,
            [
                (f"{100 * t[key] / t['raw']:.2f}", f"{8 * t[key] / t['elements']:.3f}") if key in t else ("n/a", "n/a")
                for t in tot.values()
            ],
        )
    add(
        "ideal (ULPack model)",
        [
            (f"{100 * t['entropy_bits'] / 8 / t['raw']:.2f}", f"{t['entropy_bits'] / t['elements']:.3f}")
            for t in tot.values()
        ],
    )
    add(
        "ULPack over ideal (%)",
        [
            (f"{100 * (8 * t['ulpack'] / t['entropy_bits'] - 1):+.2f}" if t["entropy_bits"] else "n/a", "")
            for t in tot.values()
        ],
    )
    add("e_r saves (%)", [(f"{100 * (1 - t['ulpack'] / t['ulpack_noe']):.2f}", "") for t in tot.values()])

    def vs_best(t):
        peers = [t[k] for k in PEER_KEYS if k in t]
        return (f"{100 * (1 - t['ulpack'] / min(peers)):.2f}", "") if peers else ("n/a", "")

    add("ULPack smaller than best peer (%)", [vs_best(t) for t in tot.values()])
    first = next(iter(results.values()))
    notes = [
        f"Sizes over all {steps} step pairs x {first['tensors']} tensors of each trajectory; "
        "% of raw bytes and bits per weight. Every round trip verified bit-exact.",
        "ideal = sum of model_entropy_bits (ULPack's model with free tables and a perfect coder).",
    ]
    return render("Table 1. Compressed size", groups, ["% raw", "bits/w"], rows, markdown, notes)


INTRA_METHODS = {"ulpack": "ULPack intra", "zipnn": "ZipNN", "zstd": "zstd-19 byte-grouped"}


def intra_table(results: dict, markdown: bool) -> str:
    groups = [n for n, r in results.items() if "intra" in r["sizes"]]
    rows = []

    def add(label, values):
        rows.append([label] + [v for pair in values for v in pair])

    tot = {n: results[n]["sizes"]["intra"] for n in groups}
    for key, label in INTRA_METHODS.items():
        add(
            label,
            [
                (f"{100 * t[key] / t['raw']:.2f}", f"{8 * t[key] / t['elements']:.3f}") if key in t else ("n/a", "n/a")
                for t in tot.values()
            ],
        )
    add("exponent, order-0 entropy", [("", f"{t['exp_entropy_bits'] / t['elements']:.3f}") for t in tot.values()])
    add(
        "ideal (ULPack intra model)",
        [
            (f"{100 * t['entropy_bits'] / 8 / t['raw']:.2f}", f"{t['entropy_bits'] / t['elements']:.3f}")
            for t in tot.values()
        ],
    )
    add(
        "ULPack over ideal (%)", [(f"{100 * (8 * t['ulpack'] / t['entropy_bits'] - 1):+.2f}", "") for t in tot.values()]
    )

    def vs_best(t):
        peers = [t[k] for k in ("zipnn", "zstd") if k in t]
        return (f"{100 * (1 - t['ulpack'] / min(peers)):.2f}", "") if peers else ("n/a", "")

    add("ULPack intra smaller than best peer (%)", [vs_best(t) for t in tot.values()])
    first = results[groups[0]] if groups else None
    notes = [
        f"The last checkpoint of each trajectory coded without a reference ({first['tensors'] if first else 0} tensors); "
        "% of raw bytes and bits per weight. Every round trip verified bit-exact.",
        "exponent entropy: sum over tensors of n * H0(exponent field); the sign and mantissa bits come on top "
        "(bf16 8, fp16 11, fp32 24 bits).",
    ]
    return render("Table 1b. Intra (anchor) size", groups, ["% raw", "bits/w"], rows, markdown, notes)


def _over_cells(t: dict, key: str) -> str:
    """Bytes of row ``key`` of Table 1c (the coded data: over the ideal) as % of the ideal."""
    ideal = t["entropy_bits"] / 8
    if not ideal or "part_fixed" not in t:
        return "n/a"
    value = t[key] - ideal if key == "part_coded" else t[key]
    return f"{100 * value / ideal:+.2f}" if key in ("part_coded", "ulpack") else f"{100 * value / ideal:.2f}"


def excess_table(results: dict, markdown: bool) -> str:
    """Table 1c: where ULPack's bytes over its model's ideal go, delta and intra, and intra against ZipNN."""
    groups = [n for n, r in results.items() if "intra" in r["sizes"]]
    both = {n: (results[n]["sizes"]["total"], results[n]["sizes"]["intra"]) for n in groups}
    rows = []

    def add(label, cell, which=(0, 1)):
        rows.append([label] + [cell(t[i]) if i in which else "" for t in both.values() for i in (0, 1)])

    add("ULPack over ideal (%)", lambda t: f"{100 * (t['ulpack'] / (t['entropy_bits'] / 8) - 1):+.2f}")
    add("  header, CRC (% of ideal)", lambda t: _over_cells(t, "part_fixed"))
    add("  tables and params byte (% of ideal)", lambda t: _over_cells(t, "part_table"))
    add("  rANS lane states (% of ideal)", lambda t: _over_cells(t, "part_states"))
    add("  coded data over ideal (% of ideal)", lambda t: _over_cells(t, "part_coded"))
    add("delta goal: over ideal <= +1%", lambda t: _goal_cell(t["ulpack"] * 8 <= 1.01 * t["entropy_bits"]), (0,))
    add("ULPack intra (% raw)", lambda t: f"{100 * t['ulpack'] / t['raw']:.3f}", (1,))
    add("ZipNN (% raw)", lambda t: f"{100 * t['zipnn'] / t['raw']:.3f}" if "zipnn" in t else "n/a", (1,))
    add("intra goal: <= ZipNN", lambda t: _goal_cell(t["ulpack"] <= t["zipnn"]) if "zipnn" in t else "n/a", (1,))
    add("tensors ZipNN codes smaller", lambda t: f"{t.get('zipnn_wins', 0)}" if "zipnn" in t else "n/a", (1,))
    add("  bytes ZipNN saves on them", lambda t: f"{t.get('zipnn_wins_bytes', 0)}" if "zipnn" in t else "n/a", (1,))
    add(
        "ideal, symbol with 7 mantissa bits (% raw)", lambda t: f"{100 * t['entropy_k7_bits'] / 8 / t['raw']:.3f}", (1,)
    )
    add("ideal, today's model (% raw)", lambda t: f"{100 * t['entropy_bits'] / 8 / t['raw']:.3f}", (1,))
    notes = [
        "Parts from inspect_blob over all pairs (delta) and the last checkpoint (intra), as % of the ideal "
        "(model_entropy_bits); 'coded data' is the rANS words (symbols and raw bits together; a RAW blob's values) "
        "less the ideal: table quantisation and the coder's flush.",
        "7 mantissa bits: the ideal of an intra model whose symbol is the exponent and the top 7 mantissa bits "
        "(today's INTRA symbols carry at most 3): what a format change coding more of the mantissa would reach.",
    ]
    return render(
        "Table 1c. Over the ideal, part by part; intra against ZipNN", groups, ["delta", "intra"], rows, markdown, notes
    )


def _goal_cell(ok: bool) -> str:
    return "ok" if ok else "MISS"


def _mbps_cells(results: dict, label: str) -> list:
    """Encode and decode MB/s of run ``label`` (``ulpack_x1``...) in each group."""
    cells = []
    for r in results.values():
        m = r["speed"].get(label)
        cells += [f"{m['encode_MBps']:.1f}", f"{m['decode_MBps']:.1f}"] if m else ["n/a", "n/a"]
    return cells


def _ratio_cells(results: dict, a: str, b: str) -> list:
    """Run ``a``'s MB/s over run ``b``'s, encode and decode, in each group."""
    cells = []
    for r in results.values():
        x, y = r["speed"].get(a), r["speed"].get(b)
        cells += (
            [f"{x['encode_MBps'] / y['encode_MBps']:.2f}x", f"{x['decode_MBps'] / y['decode_MBps']:.2f}x"]
            if x and y
            else ["n/a", "n/a"]
        )
    return cells


def _speed_notes(results: dict, reps: int) -> list[str]:
    sizes = ", ".join(f"{n} {r['speed']['raw_bytes'] / 1e6:.1f} MB" for n, r in results.items())
    timings = [m for r in results.values() for m in r["speed"].values() if isinstance(m, dict)]
    runs = [x for m in timings for w in ("encode", "decode") if (x := m.get(f"{w}_runs", 0))]
    slow = f" (some slow measurements: {min(runs)})" if runs and min(runs) < reps else ""
    return [
        f"Raw MB/s (1e6 bytes/s) over all tensors of the last step pair ({sizes}); best of {reps} runs{slow}.",
        "ULPack: encode_many/decode_many(threads=N). Peers: one call per tensor, xN = the peer's own threads option.",
    ]


def speed_table(results: dict, markdown: bool, threads: int, reps: int) -> str:
    groups = list(results)
    labels = [("ulpack", "ULPack")] + [(k, METHODS[k]) for k in PEER_KEYS]
    counts = (1, threads) if threads > 1 else (1,)
    rows = [[f"{label} x{n}"] + _mbps_cells(results, f"{key}_x{n}") for key, label in labels for n in counts]
    for key, label in (("ulpack_intra", "ULPack intra"), ("zipnn_intra", "ZipNN intra")):
        rows.append([f"{label} x1"] + _mbps_cells(results, f"{key}_x1"))
    rows.append(["ULPack / ZipNN x1 (delta)"] + _ratio_cells(results, "ulpack_x1", "zipnn_x1"))
    rows.append(["ULPack / ZipNN x1 (intra)"] + _ratio_cells(results, "ulpack_intra_x1", "zipnn_intra_x1"))
    if threads > 1:
        cells = []
        for r in results.values():
            s = r["speed"].get("ulpack_scaling")
            cells += [f"{s['encode']:.2f}x", f"{s['decode']:.2f}x"] if s else ["n/a", "n/a"]
        rows.append([f"ULPack scaling x{threads}/x1"] + cells)
    title = f"Table 2. Speed (MB/s, encode / decode), {threads} threads = all cores"
    return render(title, groups, ["enc", "dec"], rows, markdown, _speed_notes(results, reps))


def pair_speed_table(results: dict, markdown: bool, reps: int) -> str:
    """Every step pair, single-threaded: ULPack and ZipNN MB/s and their ratio, decode and encode."""
    groups = [n for n, r in results.items() if r.get("pair_speed")]
    rows = []
    n_pairs = max(len(results[n]["pair_speed"]) for n in groups)

    def cells(row, what):
        u, z = row.get(f"ulpack_{what}_MBps"), row.get(f"zipnn_{what}_MBps")
        return [f"{u:.1f}", f"{z:.1f}" if z else "n/a", f"{u / z:.2f}x" if z else "n/a"]

    for what in ("decode", "encode"):
        for i in range(n_pairs):
            line = []
            label = None
            for n in groups:
                prs = results[n]["pair_speed"]
                if i < len(prs):
                    label = label or f"{what} {prs[i]['parent']}->{prs[i]['child']}"
                    line += cells(prs[i], what)
                else:
                    line += ["", "", ""]
            rows.append([label or f"{what} pair {i}"] + line)
        line = []
        for n in groups:
            ratios = [
                r[f"ulpack_{what}_MBps"] / r[f"zipnn_{what}_MBps"]
                for r in results[n]["pair_speed"]
                if r.get(f"zipnn_{what}_MBps")
            ]
            line += ["", "", f"{min(ratios):.2f}x" if ratios else "n/a"]
        rows.append([f"{what}: lowest ratio"] + line)
        line = []
        for n in groups:
            ratios = [
                r[f"ulpack_{what}_cpu_MBps"] / r[f"zipnn_{what}_cpu_MBps"]
                for r in results[n]["pair_speed"]
                if r.get(f"zipnn_{what}_cpu_MBps")
            ]
            line += ["", "", f"{min(ratios):.2f}x" if ratios else "n/a"]
        rows.append([f"{what}: lowest ratio, CPU time"] + line)
    notes = [
        f"Single thread, all tensors of each step pair, best of {reps} runs; raw MB/s (1e6 bytes/s). "
        "ULPack: encode_many/decode_many(threads=1); ZipNN XOR: one call per tensor, XOR included.",
        "ratio = ULPack / ZipNN on the same pair, timings interleaved; 'CPU time': the same ratio of process CPU "
        "times (steadier than wall time on a shared machine).",
    ]
    return render(
        "Table 2b. Every pair, single thread: ULPack vs ZipNN (MB/s)",
        groups,
        ["ULPack", "ZipNN", "ratio"],
        rows,
        markdown,
        notes,
    )


def overhead_table(results: dict, markdown: bool) -> str:
    """ULPack over its model's ideal at 0.3M and 16M elements per blob."""
    groups = [n for n, r in results.items() if r.get("overhead")]
    rows = []
    first = results[groups[0]]["overhead"]
    for size in first:
        for mode in ("delta", "intra"):
            line = []
            for n in groups:
                row = results[n]["overhead"][size]
                m = row[mode]
                over = 8 * m["bytes"] - m["ideal_bits"]
                line += [
                    f"{100 * over / m['ideal_bits']:+.2f}" if m["ideal_bits"] else "n/a",
                    f"{over / 8 / max(1, row['blobs']):.0f}",
                ]
            rows.append([f"{mode}, {int(size):,} elements"] + line)
    notes = [
        "ULPack's size over model_entropy_bits (its model with free tables and a perfect coder): % and bytes per blob "
        "(headers, tables, rANS states and flush, checksums).",
        f"The last pair's tensors flattened and concatenated, cut into pieces of the size (up to {OVERHEAD_PIECES} "
        "blobs), or repeated up to the size when the model is smaller (16M on every preset).",
    ]
    return render("Table 3. Over ideal by blob size", groups, ["%", "B/blob"], rows, markdown, notes)


def _per_change(bits: float, changed: int) -> str:
    return f"{bits / changed:.2f}" if changed else "n/a"


def sparse_size_table(results: dict, markdown: bool) -> str:
    """Table 4: where the bytes of the default and the SPARSE blob of an RL delta go, in bits per change."""
    groups = [n for n, r in results.items() if r.get("sparse")]
    rows: list[list[str]] = []

    def add(label, fn):
        rows.append([label] + [c for n in groups for c in fn(results[n]["sparse"]["sizes"])])

    def blob_cells(sz, fn):
        return [fn(sz[key]) for key in ("default", "sparse", "sparse_noe")] + [""]

    def total(part):
        return sum(part.values())

    add(
        "% of raw",
        lambda sz: (
            blob_cells(sz, lambda b: f"{100 * total(b) / sz['raw']:.3f}")[:3]
            + [f"{100 * sz['ideal_bits'] / 8 / sz['raw']:.3f}"]
        ),
    )
    add(
        "bits per changed element",
        lambda sz: (
            blob_cells(sz, lambda b: _per_change(8 * total(b), sz["positions"]["changed"]))[:3]
            + [_per_change(sz["ideal_bits"], sz["positions"]["changed"])]
        ),
    )
    add("over ideal (%)", lambda sz: blob_cells(sz, lambda b: f"{100 * (8 * total(b) / sz['ideal_bits'] - 1):+.1f}"))
    for label in BLOB_PARTS:
        add(
            f"  {label}",
            lambda sz, label=label: blob_cells(sz, lambda b: _per_change(8 * b[label], sz["positions"]["changed"])),
        )
    pos_rows = [("  positions ideal, under e_r", "exponent"), ("  positions ideal, no context", "uniform")]
    pos_rows += [(f"  positions ideal, {k} exponent bands", f"bands{k}") for k in POSITION_CLASSES]
    pos_rows += [(f"  positions as rank gaps in {max(POSITION_CLASSES)} bands, token model", "rank_gaps")]
    for label, key in pos_rows:
        add(label, lambda sz, key=key: ["", "", "", _per_change(sz["positions"][key], sz["positions"]["changed"])])
    add(
        "  residuals ideal (ideal - positions under e_r)",
        lambda sz: [
            "",
            "",
            "",
            _per_change(sz["ideal_bits"] - sz["positions"]["exponent"], sz["positions"]["changed"]),
        ],
    )
    first = results[groups[0]]["sparse"]["sizes"]["pieces"]
    for size in first:
        add(
            f"over ideal (%), blobs of {int(size):,} elements",
            lambda sz, size=size: (
                [
                    f"{100 * (8 * sz['pieces'][size][key] / sz['pieces'][size]['ideal_bits'] - 1):+.1f}"
                    for key in ("default", "sparse")
                ]
                + ["", ""]
            ),
        )
    notes = [
        "The last pair's tensors, one blob each (unless stated): default = ulstore.encode(child, parent); SPARSE = "
        "encode(..., sparse=True); SPARSE w/o e_r = encode(..., sparse=True, econd=False), what the store writes.",
        "Parts from inspect_blob, in bits per changed element. ideal = model_entropy_bits (the default's model, free "
        "tables, perfect coder); its positions = sum over exponents of n_e H(m_e / n_e): what the default's b = 0 "
        "tokens cost ideally; K bands: the best split of the exponents into K contiguous bands; rank gaps: the "
        "gaps between the ranks of the changed elements within each band, as bit-length tokens (+ 2 bits, the "
        "rest raw) in one row per band, order-0 ideal, no table cost.",
    ]
    sub = ["default", "SPARSE", "SP w/o e_r", "ideal"]
    return render(
        "Table 4. Sparse deltas: where the bytes go (bits per changed element)", groups, sub, rows, markdown, notes
    )


def _goal(value: float, target: float, text: str) -> str:
    return f"{text} {'ok' if value >= target else 'MISS'}"


def sparse_speed_table(results: dict, markdown: bool, reps: int) -> str:
    """Table 4b: issue 39's goals on sparse deltas, side by side in one run (single thread)."""
    groups = [n for n, r in results.items() if r.get("sparse", {}).get("speed")]
    rows: list[list[str]] = []

    def add(label, fn):
        rows.append([label] + [c for n in groups for c in fn(results[n]["sparse"])])

    def mbps(sp, what):
        sd = sp["speed"]
        return [
            f"{sd[f'{k}_{what}_MBps']:.0f}" if f"{k}_{what}_MBps" in sd else "n/a"
            for k in ("default", "sparse", "zipnn")
        ]

    for clock in ("", "_cpu"):
        label = " (CPU time)" if clock else ""
        add(f"encode MB/s{label}", lambda sp, clock=clock: mbps(sp, f"encode{clock}"))
        add(f"decode MB/s{label}", lambda sp, clock=clock: mbps(sp, f"decode{clock}"))
        add(
            f"memcpy MB/s{label} (the floor: a decode writes every byte)",
            lambda sp, clock=clock: ["", "", f"{sp['speed'][f'memcpy{clock}_MBps']:.0f}"],
        )

    def goals(sp, fn):
        return [fn(sp, k) for k in ("default", "sparse")] + [""]

    def over_ideal(sp, k):
        sz = sp["sizes"]
        over = 100 * (8 * sum(sz[k].values()) / sz["ideal_bits"] - 1)
        return f"{over:+.1f}% {'ok' if over <= 1.0 else 'MISS'}"

    def ratio(a, b, target):
        def cell(sp, k):
            sd = sp["speed"]
            if b not in sd:
                return "n/a"
            v = sd[a.format(k=k)] / sd[b]
            return _goal(v, target, f"{v:.2f}x")

        return cell

    add("size over ideal (goal <= +1%)", lambda sp: goals(sp, over_ideal))
    for clock in ("", "_cpu"):
        label = ", CPU time" if clock else ""
        add(
            f"decode / ZipNN's (goal >= 2x{label})",
            lambda sp, c=clock: goals(sp, ratio(f"{{k}}_decode{c}_MBps", f"zipnn_decode{c}_MBps", 2.0)),
        )
        add(
            f"decode / memcpy (goal >= 0.20{label})",
            lambda sp, c=clock: goals(sp, ratio(f"{{k}}_decode{c}_MBps", f"memcpy{c}_MBps", 0.2)),
        )
        add(
            f"encode / ZipNN's (goal >= 1x{label})",
            lambda sp, c=clock: goals(sp, ratio(f"{{k}}_encode{c}_MBps", f"zipnn_encode{c}_MBps", 1.0)),
        )
    notes = [
        f"One thread, all tensors of the last pair, raw MB/s (1e6 bytes/s), timings interleaved, best of {reps} rounds. "
        "ULPack: encode_many/decode_many(threads=1), default and sparse=True; ZipNN XOR: one call per tensor, XOR "
        "included; memcpy: numpy.copyto of every tensor into a preallocated one. 'CPU time': the same with "
        "process CPU time, steadier than wall time on a loaded machine.",
        "Goals of issue 39 for one default encoding; 'ok'/'MISS' per column. The size floor is the ideal of Table 4; "
        "the decode floor is memcpy (a decode into a new array writes every byte of it).",
    ]
    return render(
        "Table 4b. Sparse deltas, one thread: issue 39's goals",
        groups,
        ["default", "SPARSE", "ZipNN"],
        rows,
        markdown,
        notes,
    )


# -- main -----------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="ULPack vs zstd-19 and ZipNN on real toy-model checkpoint trajectories: size, entropy and speed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset", default="bench", choices=["tiny", "small", "bench"], help="toy model size (tiny: smoke run)"
    )
    _data.cache_options(p)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per trajectory (steps + 1 checkpoints)")
    p.add_argument(
        "--only",
        action="append",
        metavar="TRAJECTORY",
        help=f"run only these trajectories (repeat or comma-separate): {', '.join(_data.TRAJECTORIES)}",
    )
    p.add_argument("--json", metavar="FILE", help="also write every number to FILE as JSON")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the multi-threaded runs")
    p.add_argument("--reps", type=int, default=3, help="timing repetitions (best is kept)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=10.0,
        help="stop repeating a timing once it has used this many seconds (0: always --reps)",
    )
    p.add_argument("--no-speed", action="store_true", help="skip the speed table")
    p.add_argument(
        "--from-json",
        metavar="FILE",
        nargs="+",
        help="measure nothing: print the tables of earlier --json FILEs (several: the median of every number)",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads < 1 or args.reps < 1:
        p.error("--threads and --reps must be >= 1")
    names = [n.strip() for item in (args.only or []) for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in _data.TRAJECTORIES]
    if unknown:
        p.error(f"unknown trajectory {', '.join(unknown)}; choose from {', '.join(_data.TRAJECTORIES)}")
    args.trajectories = [n for n in _data.TRAJECTORIES if n in names] if names else list(_data.TRAJECTORIES)
    return args


def run(args) -> dict:
    t0 = time.perf_counter()
    info = machine_info()
    specs = {n: _data.TRAJECTORIES[n] for n in args.trajectories}
    if args.steps < 4:
        _log(f"note: --steps {args.steps} gives fewer than 5 checkpoints per trajectory")

    # train what is missing, one run per regime for all its dtypes
    by_kind: dict = {}
    for spec in specs.values():
        by_kind.setdefault(spec.kind, []).append(spec.dtype)
    for kind, dtypes in by_kind.items():
        _data.ensure_cached(kind, dtypes, args.preset, args.steps)
    t_data = time.perf_counter()

    results: dict = {}
    for name, spec in specs.items():
        states = _data.load_trajectory(spec.kind, spec.dtype, args.preset, args.steps)
        r = {
            "kind": spec.kind,
            "dtype": spec.dtype,
            "regime": spec.regime,
            "warmup_steps": _data.warmup_steps(spec.kind, args.preset),
            "checkpoints": len(states),
            "tensors": len(states[0]),
            "params": int(sum(a.size for a in states[0].values())),
        }
        r["sizes"] = size_pass(name, spec, states, args.threads)
        r["overhead"] = overhead_pass(name, states[-2], states[-1])
        if spec.kind in SPARSE_KINDS:
            r["sparse"] = sparse_pass(
                name, spec, states[-2], states[-1], args.reps, args.time_budget, not args.no_speed
            )
        if not args.no_speed:
            r["speed"] = speed_pass(name, spec, states[-2], states[-1], args.threads, args.reps, args.time_budget)
            r["pair_speed"] = pair_speed_pass(name, spec, states, args.reps, args.time_budget)
        results[name] = r
        del states
    t_end = time.perf_counter()
    return {
        "machine": info,
        "settings": {
            "preset": args.preset,
            "steps": args.steps,
            "threads": args.threads,
            "reps": args.reps,
            "time_budget_s": args.time_budget,
            "cache": str(_data.cache_dir()),
        },
        "trajectories": results,
        "runtime_s": {"data": t_data - t0, "measure": t_end - t_data, "total": t_end - t0},
    }


def report(out: dict, markdown: bool) -> str:
    m, s, results = out["machine"], out["settings"], out["trajectories"]
    first = next(iter(results.values()))
    head = [
        f"ULPack codec benchmark: preset {s['preset']!r} ({first['params'] / 1e6:.2f}M params, {first['tensors']} tensors), "
        f"{s['steps']} steps = {first['checkpoints']} checkpoints per trajectory",
        f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), load avg {m['load_avg_1m']}; "
        f"{m['platform']}",
        f"ulstore {m['ulstore']} backend {m['ulstore_backend']!r}; Python {m['python']}, numpy {m['numpy']}, "
        f"zstandard {m['zstandard']}, zipnn {m['zipnn']}",
    ]
    head += [f"  {n}: {r['regime']} (warm-up {r['warmup_steps']} steps)" for n, r in results.items()]
    sep = "\n" if markdown else ""
    parts = [("  \n" if markdown else "\n").join(head) + "\n", size_table(results, markdown, s["steps"])]
    if any("intra" in r["sizes"] for r in results.values()):
        parts.append(intra_table(results, markdown))
        parts.append(excess_table(results, markdown))
    if all("speed" in r for r in results.values()):
        parts.append(speed_table(results, markdown, s["threads"], s["reps"]))
    if any(r.get("pair_speed") for r in results.values()):
        parts.append(pair_speed_table(results, markdown, s["reps"]))
    if any(r.get("overhead") for r in results.values()):
        parts.append(overhead_table(results, markdown))
    if any(r.get("sparse") for r in results.values()):
        parts.append(sparse_size_table(results, markdown))
    if any(r.get("sparse", {}).get("speed") for r in results.values()):
        parts.append(sparse_speed_table(results, markdown, s["reps"]))
    t = out["runtime_s"]
    parts.append(f"runtime: {t['total']:.1f} s (training/cache {t['data']:.1f} s, measuring {t['measure']:.1f} s)\n")
    return (sep + "\n").join(parts)


def median_of(runs: list):
    """The element-wise median of several runs' results (same structure); other values from the first."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs if isinstance(r, dict) and k in r]) for k in first}
    if isinstance(first, list):
        return [median_of([r[i] for r in runs]) for i in range(len(first))]
    if isinstance(first, float) and all(isinstance(r, (int, float)) for r in runs):
        return float(np.median(runs))
    return first


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        runs = []
        for path in args.from_json:
            with open(path) as fh:
                runs.append(json.load(fh))
        out = median_of(runs)
        if len(runs) > 1:
            print(f"medians of {len(runs)} runs (sizes are the same in every run)")
        print(report(out, args.markdown), end="")
        return 0
    try:
        out = run(args)
    except RoundTripError as exc:
        _log(f"\nFATAL: {exc}\nAborting: a codec did not reproduce the checkpoint bit for bit.")
        return 2
    print(report(out, args.markdown), end="", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")
        _log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
