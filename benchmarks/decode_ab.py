"""The decode kernels alone: two builds against each other in one process, ZipNN beside (issue 39).

The last step pair of each trajectory (preset ``bench``; ``--preset``, ``--steps``) is
concatenated and its first ``--elements`` values (default 2**20) coded twice: intra, and
as a delta on the parent (the bytes do not depend on the build).  Each build's
``rans_decode3`` then decodes both, the blob parsed and its tables built once beforehand
(the kernel alone: its loops, the hashes of the values and of the reference, its own
tables), the builds taking turns call by call so that the machine's drift lands on both
alike; each figure is the fastest of ``--rounds`` calls.  In the same rounds: the whole
``decode_into`` of the build in use (parse, CRC, tables, checks), ZipNN's decompress of
the same values (of their XOR with the parent, then the XOR onto it, for a delta; one
thread) and ``memcpy`` (``numpy.copyto``).

``--per-blob 4096,16384,65536`` adds a table of whole ``decode_into`` calls per blob, in
microseconds, at those element counts, each build made the active backend in turn (a build
without ``decode3`` takes the step-by-step path): a small blob's fixed cost (parse, CRC,
tables, Python and call overhead) beside its kernel.

Usage::

    cp ulstore/codec/_kernels_x86_64_v3*.so /tmp/a.so      # the build before a change
    python setup.py build_ext --inplace -q
    python benchmarks/decode_ab.py /tmp/a.so ulstore/codec/_kernels_x86_64_v3*.so
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._builds import load_build  # noqa: E402
from benchmarks._data import load_trajectory  # noqa: E402
from ulstore.codec import _api, decode_into, encode  # noqa: E402
from ulstore.codec import _format as F  # noqa: E402
from ulstore.codec._backend import backend  # noqa: E402
from ulstore.codec._one_stream import section3_args  # noqa: E402

CASES = {
    "pretrain-bf16": ("pretrain", "bfloat16"),
    "rl-bf16": ("rl", "bfloat16"),
    "finetune-fp32": ("finetune", "float32"),
}


def kernel_call(k, blob: bytes, ref):
    """A no-argument call of build ``k``'s ``rans_decode3`` on ``blob`` (parsed, tables built: the kernel alone)."""
    header, rd, rf = _api._open(blob, ref)
    emask = _api._econd_mask(header.fmt, rf is not None, not header.flags & F.FLAG_NO_ECOND)
    args = list(section3_args(k, header.fmt, header, rd, rf, emask))
    args[7] = args[7].copy()  # the slot table: a per-thread scratch buffer the next blob's tables would reuse

    def call():
        if k.rans_decode3(*args):
            raise RuntimeError("the kernel refused a valid blob")

    return call, args[-2]


def pair_data(case: str, preset: str, steps: int, elements: int):
    kind, dtype = CASES[case]
    states = load_trajectory(kind, dtype, preset, steps=steps)
    a, b = (np.concatenate([np.asarray(v).reshape(-1) for v in s.values()])[:elements] for s in states[-2:])
    return a, b


def zipnn_calls(dtype: str, a: np.ndarray, b: np.ndarray, out: np.ndarray):
    import zipnn

    z = zipnn.ZipNN(method="HUFFMAN", input_format="byte", bytearray_dtype=dtype, threads=1)
    intra = z.compress(b.view(np.uint8).tobytes())
    av = a.view(np.uint8)
    delta = z.compress(np.bitwise_xor(av, b.view(np.uint8)).tobytes())

    def dec_delta():
        np.bitwise_xor(np.frombuffer(z.decompress(delta), dtype=np.uint8), av, out=out.view(np.uint8))

    return (lambda: z.decompress(intra)), dec_delta


def measure(calls: dict, rounds: int) -> dict:
    """The fastest of ``rounds`` runs of each call, the calls taking turns."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def run_case(case: str, builds: dict, args) -> dict:
    a, b = pair_data(case, args.preset, args.steps, args.elements)
    out = np.empty_like(b)
    blobs = {"intra": (encode(b), None), "delta": (encode(b, a), a)}
    calls = {}
    for kind, (blob, ref) in blobs.items():
        for label, k in builds.items():
            call, words = kernel_call(k, blob, ref)
            call()
            if words.tobytes() != b.tobytes():
                raise RuntimeError(f"build {label} decodes {case} {kind} wrongly")
            calls[f"{label} {kind}"] = call
        calls[f"decode_into {kind}"] = lambda blob=blob, ref=ref: decode_into(blob, ref, out)
    calls["ZipNN intra"], calls["ZipNN delta"] = zipnn_calls(CASES[case][1], a, b, out)
    calls["memcpy"] = lambda: np.copyto(out, b)
    return {name: 1e9 * t / b.nbytes for name, t in measure(calls, args.rounds).items()}


def per_blob(builds: dict, sizes: list[int], args) -> None:
    """Whole ``decode_into`` per blob (us, fastest of the rounds) of each build as the active backend."""
    from ulstore.codec import _backend

    in_use = _backend._active
    print(
        "\n| decode_into per blob, us | "
        + " | ".join(f"{label} {kind}" for kind in ("intra", "delta") for label in builds)
        + " |"
    )
    print("|---|" + "---:|" * (2 * len(builds)))
    try:
        for case in args.only.split(",") if args.only else CASES:
            a, b = pair_data(case, args.preset, args.steps, max(sizes))
            for n in sizes:
                ref, tgt, out = a[:n], b[:n], np.empty_like(b[:n])
                blobs = {"intra": (encode(tgt), None), "delta": (encode(tgt, ref), ref)}
                calls = {}
                for kind, (blob, r) in blobs.items():
                    for label, k in builds.items():

                        def call(k=k, blob=blob, r=r):
                            _backend._active = k
                            decode_into(blob, r, out)

                        call()
                        if out.tobytes() != tgt.tobytes():
                            raise RuntimeError(f"build {label} decodes {case} {kind} wrongly")
                        calls[f"{label} {kind}"] = call
                best = measure(calls, max(args.rounds, 20000 // max(1, n // 1024)))
                print(f"| {case} {n} | " + " | ".join(f"{1e6 * t:.1f}" for t in best.values()) + " |", flush=True)
    finally:
        _backend._active = in_use


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "a", help="a build of the kernel module in use (e.g. a copy of ulstore/codec/_kernels_x86_64_v3*.so)"
    )
    p.add_argument("b", help="another build of the same module")
    p.add_argument("--preset", default="bench")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--elements", type=int, default=1 << 20, help="values of each pair decoded (one blob each)")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--only", help="comma-separated cases: " + ", ".join(CASES))
    p.add_argument("--per-blob", help="comma-separated element counts: whole decode_into calls per blob (us)")
    args = p.parse_args(argv)
    where = tempfile.mkdtemp(prefix="ulstore-decode-ab-")
    try:
        name = "ulstore.codec." + (
            "_kernels_x86_64_v3" if backend() == "cython-v3" else "_kernels"
        )  # the builds' module
        builds = {
            label: load_build(path, os.path.join(where, label), name) for label, path in (("A", args.a), ("B", args.b))
        }
        print(f"A = {args.a}\nB = {args.b}\ndecode_into: backend {backend()!r}; load average {os.getloadavg()[0]:.1f}")
        print(
            "\n| ns per raw byte, one thread | A intra | B intra | A delta | B delta | decode_into intra | "
            "decode_into delta | ZipNN intra | ZipNN delta + XOR | memcpy |"
        )
        print("|---|" + "---:|" * 9)
        for case in args.only.split(",") if args.only else CASES:
            r = run_case(case, builds, args)
            cols = (
                "A intra",
                "B intra",
                "A delta",
                "B delta",
                "decode_into intra",
                "decode_into delta",
                "ZipNN intra",
                "ZipNN delta",
                "memcpy",
            )
            print(f"| {case} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |", flush=True)
        if args.per_blob:
            per_blob(builds, [int(x) for x in args.per_blob.split(",")], args)
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
