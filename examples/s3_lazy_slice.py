"""Read a slice of a trajectory on S3 without downloading it.

``traj[step]`` is a lazy Zarr group: indexing one of its arrays fetches the
step's document, one table block, and byte ranges of packs holding only the
blobs of the chunks the slice touches (plus their reference chain back to an
anchor), never the whole checkpoint::

    traj = ulstore.open("s3://bucket/runs/llama-ft", mode="r")
    traj[1200]["model.layers.3.mlp.up_proj.weight"][0:4, 0:8]

This script writes a small trajectory to S3 (if the prefix is empty), then
opens it read-only, reads a 4x8 slice of an old step, checks it against the
full tensor, and reports which objects travelled.  It counts the S3 GET
requests through s3fs's debug log, so it needs nothing but s3fs.

Any S3-compatible endpoint works (AWS, MinIO, a local moto server)::

    python examples/s3_lazy_slice.py s3://my-bucket/runs/demo
    python examples/s3_lazy_slice.py s3://test/run --endpoint-url http://127.0.0.1:5000 --create-bucket

Credentials come from the usual places (environment, ~/.aws); a local moto
server takes any, but s3fs needs some (``AWS_ACCESS_KEY_ID=test
AWS_SECRET_ACCESS_KEY=test``: without them, ``NoCredentialsError``).
``--endpoint-url`` is passed to s3fs as ``endpoint_url``.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

import ulstore
from ulstore import toytrain
from ulstore.core.formatting import human_bytes

TENSOR = "model.layers.0.mlp.up_proj.weight"


class GetCounter(logging.Handler):
    """Collects the keys of the S3 GET requests s3fs makes (from its debug log)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.keys: list[str] = []

    def emit(self, record):
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 3 and args[0] == "get_object" and isinstance(args[2], dict):
            self.keys.append(args[2].get("Key", "?"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="s3://bucket/prefix of the trajectory")
    ap.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, moto, ...)")
    ap.add_argument("--create-bucket", action="store_true", help="create the bucket if it does not exist")
    ap.add_argument("--steps", type=int, default=12, help="steps to write if the trajectory is empty")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small", "bench"])
    args = ap.parse_args(argv)
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}

    if args.create_bucket:
        import s3fs

        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        bucket = args.url.removeprefix("s3://").split("/", 1)[0]
        if not fs.exists(bucket):
            fs.mkdir(bucket)

    # small chunks: a slice touches one of several
    traj = ulstore.open(args.url, mode="a", storage_options=options, chunk_bytes=4096)
    if not traj.steps:
        cfg = toytrain.ToyConfig.preset(args.preset)
        for step, state, loss in toytrain.train(cfg, args.steps, lr=1e-4, warmup_steps=20):
            traj.commit(step, state, metadata={"loss": round(loss, 4)})
        print(f"wrote {args.steps + 1} steps to {args.url}")
    stats = traj.stats()
    step = traj.steps[len(traj.steps) // 2]

    # A fresh read-only handle, as another machine would open it: nothing cached.
    counter = GetCounter()
    log = logging.getLogger("s3fs")
    log.addHandler(counter)
    log.setLevel(logging.DEBUG)
    try:
        reader = ulstore.open(args.url, mode="r", storage_options=options)
        t0 = time.perf_counter()
        arr = reader[step][TENSOR]
        values = arr[0:4, 0:8]
        elapsed = time.perf_counter() - t0
    finally:
        log.removeHandler(counter)
    packs = [k for k in counter.keys if "/packs/" in k]
    docs = [k for k in counter.keys if "/steps/" in k]
    depth = reader.info(step).anchor_distance

    full = traj.read(step, [TENSOR])[TENSOR]
    exact = np.array_equal(values.view(np.uint16), full[0:4, 0:8].view(np.uint16))
    print(f"traj[{step}][{TENSOR!r}][0:4, 0:8] from {args.url} in {1e3 * elapsed:.0f} ms:")
    for line in np.array2string(values.astype(np.float32), precision=4).splitlines():
        print("  " + line)
    print(
        f"the tensor is {arr.dtype} {arr.shape} in {arr.nchunks} chunks; the trajectory holds "
        f"{stats['steps']} steps, {stats['blobs']} blobs in {stats['packs']} packs, {human_bytes(stats['stored_bytes'])}"
    )
    print(
        f"GET requests: {len(counter.keys)} ({len(docs)} step documents, {len(packs)} byte ranges of packs: "
        f"per step of the chunk's reference chain back to an anchor ({depth} steps), a table block and a blob)"
    )
    print(f"equal to the same slice of the fully decoded tensor: {exact}")
    lazy = 0 < len(packs) <= 2 * (depth + 1) < stats["blobs"]
    print(f"fetched only what the slice needs: {lazy}")
    return 0 if exact and lazy else 1


if __name__ == "__main__":
    raise SystemExit(main())
