"""Benchmark the trajectory store on a real toy-model trajectory, on local disk and on moto S3.

Prints, per backend:

- stored bytes (blobs + manifests) vs raw, vs one zstd-compressed safetensors
  per step (python-zstandard, level 3 and 19), vs the ULPack codec alone on
  whole tensors along the chain (the store's overhead: chunking, anchors,
  manifests);
- commit time per step;
- cold and warm read of a one-chunk slice at chain depth 0..N;
- full-step read throughput (cold);
- manifest bytes per chunk, and the manifest size per step it implies for a
  1T-parameter bf16 model at the default 4 MiB chunks.

Usage::

    python benchmarks/store.py [--preset small] [--steps 20] [--kind finetune]
                               [--dtype bfloat16] [--chunk-bytes 262144] [--anchor-every 8]
                               [--no-s3]

moto is a single-process Python server on localhost: its S3 timings measure
request counts and the store's concurrency, not real S3 latency.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import uuid

import numpy as np

import ulstore
from ulstore import toytrain


def _safetensors_zstd(states, level: int) -> int:
    import zstandard
    from safetensors.numpy import save

    c = zstandard.ZstdCompressor(level=level)
    return sum(len(c.compress(save({k: np.ascontiguousarray(v) for k, v in s.items()}))) for s in states)


def _codec_alone(states, anchor_every: int = 0) -> int:
    """ULPack on whole tensors along the chain, intra at step 0 and every ``anchor_every``."""
    total = 0
    for i, s in enumerate(states):
        intra = i == 0 or (anchor_every and i % anchor_every == 0)
        for k, v in s.items():
            total += len(ulstore.encode(v, None if intra else states[i - 1][k]))
    return total


def _mb(n: float) -> str:
    return f"{n / 1e6:9.2f} MB"


def run_backend(label, url, so, states, args, reference_sizes):
    raw = sum(v.nbytes for s in states for v in s.values())
    traj = ulstore.open(url, mode="w", storage_options=so, chunk_bytes=args.chunk_bytes, anchor_every=args.anchor_every)
    t0 = time.perf_counter()
    times = []
    for i, s in enumerate(states):
        t = time.perf_counter()
        traj.commit(i, s)
        times.append(time.perf_counter() - t)
    total_commit = time.perf_counter() - t0
    st = traj.stats()
    print(
        f"\n== {label}: {len(states)} steps, {args.preset} ({sum(v.size for v in states[0].values()):,} params), "
        f"{args.dtype}, chunk_bytes={args.chunk_bytes}, anchor_every={args.anchor_every}"
    )
    print(f"raw                         {_mb(raw)}")
    print(
        f"store (blobs + manifests)   {_mb(st['stored_bytes'])}   ratio {raw / st['stored_bytes']:.2f}x"
        f"   (blobs {_mb(st['blob_bytes'])}, manifests {_mb(st['manifest_bytes'])})"
    )
    for name, size in reference_sizes.items():
        print(f"{name:27s} {_mb(size)}   ratio {raw / size:.2f}x   store/this = {st['stored_bytes'] / size:.3f}")
    print(
        f"commit: {np.mean(times) * 1e3:.1f} ms/step mean, {np.median(times) * 1e3:.1f} ms median "
        f"({raw / len(states) / np.mean(times) / 1e6:.1f} MB/s of raw state); total {total_commit:.2f} s"
    )

    # one-chunk slice at each depth along the first anchor segment
    name = max(states[0], key=lambda k: states[0][k].size)
    print(f"one-element read of {name!r} (one chunk + its chain):")
    print("  depth   cold ms   warm ms   blobs fetched")
    for step in range(min(len(states), args.anchor_every)):
        ro = ulstore.open(url, mode="r", storage_options=so)
        depth = ro.info(step).anchor_distance
        reads = []
        orig = ro._io.fs.cat_file

        def counting(path, *a, _orig=orig, **kw):
            reads.append(path)
            return _orig(path, *a, **kw)

        ro._io.fs.cat_file = counting
        t = time.perf_counter()
        ro[step][name][0, 0]
        cold = time.perf_counter() - t
        nblobs = sum("/blobs/" in str(p) for p in reads)
        t = time.perf_counter()
        ro[step][name][0, 1]
        warm = time.perf_counter() - t
        print(f"  {depth:5d}   {cold * 1e3:7.2f}   {warm * 1e3:7.2f}   {nblobs}")

    last = len(states) - 1
    step_bytes = sum(v.nbytes for v in states[last].values())
    ro = ulstore.open(url, mode="r", storage_options=so)
    t = time.perf_counter()
    ro.read(last)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    ro.read(last)
    warm = time.perf_counter() - t
    print(
        f"full-step read (step {last}, depth {ro.info(last).anchor_distance}): cold {step_bytes / cold / 1e6:.1f} MB/s, "
        f"warm {step_bytes / warm / 1e6:.1f} MB/s ({step_bytes / 1e6:.1f} MB)"
    )
    per_chunk = st["manifest_bytes_per_chunk"]
    chunks_1t = 1e12 * 2 / (4 << 20)
    print(
        f"manifest: {per_chunk:.0f} bytes/chunk -> 1T-param bf16 model at 4 MiB chunks: "
        f"{chunks_1t:,.0f} chunks, ~{chunks_1t * per_chunk / 1e6:.0f} MB of manifest per step"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kind", default="finetune")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-bytes", type=int, default=256 << 10)
    p.add_argument("--anchor-every", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--no-s3", action="store_true")
    args = p.parse_args(argv)

    t = time.perf_counter()
    states = toytrain.trajectory(
        args.kind, args.steps, preset=args.preset, dtype=args.dtype, warmup_steps=args.warmup_steps
    )
    print(f"trained {len(states)} checkpoints in {time.perf_counter() - t:.1f} s")
    refs = {
        "safetensors + zstd-3": _safetensors_zstd(states, 3),
        "safetensors + zstd-19": _safetensors_zstd(states, 19),
        "ULPack alone (no anchors)": _codec_alone(states),
        f"ULPack alone (anchor/{args.anchor_every})": _codec_alone(states, args.anchor_every),
    }
    with tempfile.TemporaryDirectory() as d:
        run_backend("local disk", f"{d}/traj", None, states, args, refs)
    if not args.no_s3:
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
            so = {
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            }
            run_backend("moto S3", f"s3://bench/{uuid.uuid4().hex}", so, states, args, refs)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
