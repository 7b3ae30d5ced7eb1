"""Weight sync for async RL over a bucket, with the control plane as one tiny HTTP POST.

A trainer trains a small model for real (ulstore.toytrain, bf16, RL-like lr 3e-6
after a short warm-up) and publishes its weights after every optimizer step to
a store (a local directory here; an ``s3://`` URL works the same) without
waiting for it: ``Publisher.submit`` copies the weights and returns, and the
version is encoded and committed in the background while the next step trains.
An inference replica runs as a separate process with an HTTP server on
localhost.  Once a version is committed (its future resolved) the trainer POSTs
one small JSON message::

    {"url": "<store URL>", "version": 7, "document": "<version 7's step document>"}

The step document (a few hundred bytes of JSON text, ``PublishInfo.document``)
spares the replica reading it from the bucket: a replica one version behind
makes one request per version, a range of the version's pack, as a TRL
replica reads the one delta file named in its message.  The replica follows
the store up to that version (applying the ULPack deltas in place), and answers with the version it now holds and a sha256 of its
weights, which the trainer compares with its own.  The trainer never sends
weights to the replica and the replica never talks to the trainer except to
answer: the bucket is the data plane.

Run::

    python examples/weight_sync_http.py                 # trainer + replica on localhost
    python examples/weight_sync_http.py --steps 20 --url s3://my-bucket/run-1

Only the standard library (http.server, urllib) carries the control messages.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np

from ulstore import toytrain
from ulstore.sync import Follower, Publisher


def digest(state: dict) -> str:
    """sha256 of the weights' bits, names sorted: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        a = np.ascontiguousarray(state[name])
        h.update(name.encode() + a.reshape(-1).view(f"<u{a.dtype.itemsize}").tobytes())
    return h.hexdigest()


# -- the replica: an HTTP server that follows the store when told to -------------------


class Replica(BaseHTTPRequestHandler):
    follower: Follower | None = None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/shutdown":
            self._reply({"ok": True})
            raise KeyboardInterrupt
        if self.path != "/update":
            return self.send_error(404)
        cls = type(self)
        if cls.follower is None:  # the first message names the store
            cls.follower = Follower(body["url"], storage_options=body.get("storage_options"))
        f = cls.follower
        # the version exists: the trainer publishes before it posts.  poll(to=) catches up with
        # everything published since the last message (one version or several) up to exactly
        # that version, without reading the branch head (the message names it) or the version's
        # step document (the message carries it; checked as if read from the bucket)
        f.poll(to=body["version"], document=body.get("document"))
        self._reply(
            {
                "version": f.version,
                "sha256": digest(f.state),
                "events": [e.kind for e in f.events if e.kind not in ("apply",)][-3:],
            }
        )

    def _reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep the demo output readable
        pass


def run_replica(port: int) -> None:
    server = HTTPServer(("127.0.0.1", port), Replica)
    print(server.server_address[1], flush=True)  # tell the parent which port we got
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


# -- the trainer -------------------------------------------------------------------------


def post(port: int, path: str, message: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(message).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def run_trainer(url: str, steps: int, anchor_every: int, port: int) -> bool:
    config = toytrain.ToyConfig.preset("tiny", hidden_size=128, intermediate_size=384)
    print(f"trainer: {config.num_params:,} bf16 params, publishing every step to {url}")
    results = []
    pending = None  # the version submitted last: (future, digest of its weights, loss, seconds the trainer waited)
    with Publisher(url, anchor_every=anchor_every) as pub:
        for step, state, loss in toytrain.train(config, steps, lr=3e-6, warmup_steps=40):
            t0 = time.perf_counter()
            future = pub.submit(step, state, metadata={"model_version": step, "loss": loss})  # a copy, then back
            blocked = time.perf_counter() - t0
            if pending is not None:  # the previous version, committed by now (or soon): tell the replica
                results.append(announce(port, url, *pending))
            pending = (future, digest(state), loss, blocked)
        results.append(announce(port, url, *pending))
    print(f"all versions exact: {all(results)}")
    return all(results)


def announce(port: int, url: str, future, want: str, loss: float, blocked: float) -> bool:
    """Once the version of ``future`` is committed, the whole control plane: one POST; True if the replica's
    weights are the trainer's."""
    info = future.result()  # acknowledged: on the branch, durable
    step = info.version
    answer = post(port, "/update", {"url": url, "version": step, "document": info.document.decode()})
    exact = answer["version"] == step and answer["sha256"] == want
    what = info.kind + (" + anchor" if info.anchor else "")
    print(
        f"  step {step:3d}  loss {loss:.3f}  {what:<15} {info.delta_bytes:>7,} B delta  "
        f"trainer blocked {blocked * 1e3:4.1f} ms, commit {info.seconds * 1e3:5.1f} ms  "
        f"replica at {answer['version']}: {'exact' if exact else 'DIFFERENT'}"
    )
    return exact


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["demo", "replica"], default="demo")
    p.add_argument("--url", default=None, help="store URL (default: a temporary directory, removed at the end)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--anchor-every", type=int, default=5)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    if args.role == "replica":
        run_replica(args.port)
        return 0
    if args.url is None:  # a temporary store, removed at the end
        with tempfile.TemporaryDirectory(prefix="weight-sync-") as scratch:
            return demo(args, f"{scratch}/store")
    return demo(args, args.url)


def demo(args, url: str) -> int:
    """The trainer here, the replica in a subprocess, until every version is checked."""
    replica = subprocess.Popen(
        [sys.executable, __file__, "--role", "replica", "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(replica.stdout.readline())
        print(f"replica: listening on http://127.0.0.1:{port}/update")
        ok = run_trainer(url, args.steps, args.anchor_every, port)
        post(port, "/shutdown", {})
        replica.wait(timeout=30)
    finally:
        if replica.poll() is None:  # the trainer failed: do not leave the replica behind
            replica.kill()
            replica.wait()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
