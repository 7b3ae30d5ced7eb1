"""The other side of a forced interleaving: one whole store operation in a child process.

Run as ``python -m tests.helpers.sides '<json spec>'`` (or through :func:`run_side`), or keep one process that
runs an operation per line it is sent (:class:`Side`: no interpreter start per operation); the spec names the
operation and its arguments::

    {"op": "gc", "url": ..., "storage_options": ..., "kwargs": {"older_than": 0, "repack_below": 1.0}}
    {"op": "delete", "url": ..., "step": 7}
    {"op": "commit", "url": ..., "step": 9, "state": "/tmp/x.npz", "parent": 7 | null | "HEAD", "branch": "b"}
    {"op": "set_ref" | "delete_ref", "url": ..., "name": "b", "step": 7, "expected": ...}
    {"op": "publish", "url": ..., "version": 3, "state": "/tmp/x.npz", "branch": "main", "anchor_every": 4}
    {"op": "verify", "url": ...}

The child prints one JSON line: ``{"ok": true, "result": ...}``, or ``{"ok": false, "error": <class name>,
"classes": <its class and bases>, "named": <a ulstore error?>, "message": ...}`` when the operation raised (an
outcome, not a failure of the child: it exits 0).  A child that crashes otherwise exits non-zero.
``ULSTORE_KILL_AT`` in its environment kills it at its Nth write (:func:`tests.helpers.interleave.kill_at_env`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

__all__ = ["run_side", "Side", "save_state", "load_state", "main"]


def save_state(state: dict, directory: str | None = None) -> str:
    """Write ``state`` (name -> array, any dtype: kept as raw bits) to an .npz file a child loads; its path."""
    fd, path = tempfile.mkstemp(suffix=".npz", dir=directory)
    os.close(fd)
    arrays, meta = {}, {}
    for i, (name, a) in enumerate(state.items()):
        a = np.asarray(a)
        arrays[f"a{i}"] = np.ascontiguousarray(a).view(np.uint8).reshape(-1) if a.size else np.zeros(0, np.uint8)
        meta[f"a{i}"] = [name, a.dtype.name, list(a.shape)]
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return path


def load_state(path: str) -> dict:
    """The state :func:`save_state` wrote, with its dtypes (bfloat16 included) and exact bits."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)

    with np.load(path) as z:
        meta = json.loads(z["__meta__"].tobytes())
        out = {}
        for k, (name, dtype, shape) in meta.items():
            dt = np.dtype(getattr(ml_dtypes, dtype)) if hasattr(ml_dtypes, dtype) else np.dtype(dtype)
            out[name] = z[k].view(dt).reshape(shape).copy()
        return out


def _parent(spec: dict):
    from ulstore.store.commit._commit_input import HEAD

    p = spec.get("parent", "HEAD")
    return HEAD if p == "HEAD" else p


def _do(spec: dict) -> Any:
    import ulstore

    op, url, so = spec["op"], spec["url"], spec.get("storage_options")
    if op == "publish":
        from ulstore.sync import Publisher

        pub = Publisher(
            url,
            anchor_every=spec.get("anchor_every", 4),
            storage_options=so,
            branch=spec.get("branch", "main"),
            chunk_elems=spec.get("chunk_elems", 256),
            threads=1,
        )
        info = pub.publish(spec["version"], load_state(spec["state"]))
        pub.close()
        return {"version": info.version, "kind": info.kind}
    traj = ulstore.open(url, mode="a", storage_options=so, threads=1)
    if op == "gc":
        return traj.gc(**spec.get("kwargs", {}))
    if op == "delete":
        traj.delete(spec["step"])
        return None
    if op == "commit":
        kw = dict(spec.get("kwargs", {}))
        if spec.get("branch") is not None:
            kw["branch"] = spec["branch"]
        return traj.commit(spec["step"], load_state(spec["state"]), parent=_parent(spec), **kw)
    if op in ("set_ref", "delete_ref"):
        kw = {"expected": spec["expected"]} if "expected" in spec else {}
        if op == "set_ref":
            traj.set_ref(spec["name"], spec["step"], **kw)
        else:
            traj.delete_ref(spec["name"], **kw)
        return None
    if op == "verify":
        report = traj.verify(raise_on_error=False)
        return {"ok": report.ok, "steps": report.steps, "errors": report.errors}
    raise ValueError(f"unknown operation {op!r}")


def _answer(spec: dict) -> dict:
    from ulstore.errors import UlstoreError

    try:
        return {"ok": True, "result": _do(spec), "pid": os.getpid()}
    except Exception as e:
        return {
            "ok": False,
            "error": type(e).__name__,
            "classes": [c.__name__ for c in type(e).__mro__],
            "named": isinstance(e, UlstoreError),
            "message": str(e),
            "pid": os.getpid(),
        }


def main(argv: list[str]) -> None:
    from .interleave import interleave, is_write, kill_at_env

    if argv == ["--serve"]:  # one operation per line of stdin, one answer per line of stdout
        for line in sys.stdin:
            print(json.dumps(_answer(json.loads(line)), default=str), flush=True)
        return
    killer = kill_at_env()
    with interleave(on=is_write, record=False, times=0) as every, interleave(on=_stored, record=False, times=0) as docs:
        out = _answer(json.loads(argv[0]))
    # writes the kill counted; every write; every write but the bytes streamed into packs
    out.update(writes=len(killer.matched), all_writes=len(every.matched), documents=len(docs.matched))
    print(json.dumps(out, default=str))


def _stored(call) -> bool:
    from .interleave import is_write

    return is_write(call) and call.method != "writer.write"


def run_side(op: str, url: str, storage_options=None, *, env=None, timeout: float = 300, **spec) -> dict:
    """Run one operation in a child process (see the module docstring); its JSON answer."""
    from .interleave import run_python

    body = json.dumps({"op": op, "url": url, "storage_options": storage_options, **spec})
    return run_python("import sys; from tests.helpers.sides import main; main(sys.argv[1:])", body, env=env,
                      timeout=timeout)  # fmt: skip


class Side:
    """A process that runs operations when told (``python -m tests.helpers.sides --serve``): the other side of
    many interleavings without starting an interpreter for each.  Every operation opens the trajectory afresh
    (nothing is cached between operations).  Use as a context manager, or :meth:`close` it."""

    def __init__(self):
        from .interleave import REPO

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.sides", "--serve"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid

    def run(self, op: str, url: str, storage_options=None, **spec) -> dict:
        """Run one operation there and wait for its answer (as :func:`run_side`)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "url": url, "storage_options": storage_options, **spec}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the side process exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def __enter__(self) -> Side:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    main(sys.argv[1:])
