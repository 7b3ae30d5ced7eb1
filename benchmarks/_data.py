"""Real checkpoint trajectories for the benchmarks, trained once and cached as safetensors.

Every benchmark that needs checkpoints should get them from here, so that they
all measure the same bytes.  A trajectory is produced by actually training the
toy language model of :mod:`ulstore.toytrain` (AdamW on a real next-byte loss),
writing every checkpoint as a ``.safetensors`` file, and reading those files
back: what a benchmark codes is exactly what a real checkpoint loader returns.

Cache layout (``$ULSTORE_BENCH_CACHE``, default ``$XDG_CACHE_HOME/ulstore/benchmarks``, that is
``~/.cache/ulstore/benchmarks``: never inside the repository; every benchmark's ``--clean`` removes it)::

    <cache>/<preset>/<kind>-w<warmup>/<dtype>/meta.json
    <cache>/<preset>/<kind>-w<warmup>/<dtype>/step-0000.safetensors ...

A directory is reused when its ``meta.json`` matches the requested run (preset
configuration, regime, warm-up, Python version, which selects the training text)
and holds at least the requested number of checkpoints; otherwise it is rebuilt.
Training runs in fp32 master weights and every dtype is a round-to-nearest cast
of them (exactly what :func:`ulstore.toytrain.train` yields for that dtype), so
one training run fills the cache of all its dtypes.

Example
-------
>>> from benchmarks._data import load_trajectory
>>> states = load_trajectory("rl", "bfloat16", "tiny", steps=5)   # 6 checkpoints
>>> len(states)
6
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ulstore import toytrain

__all__ = [
    "TRAJECTORIES",
    "TrajectorySpec",
    "DTYPE_SHORT",
    "cache_dir",
    "cache_options",
    "clean_cache",
    "announce_cache",
    "warmup_steps",
    "ensure_cached",
    "load_trajectory",
    "iter_trajectory",
    "load_spec",
    "progress",
]

#: Short names used in trajectory names and tables.
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}

#: Warm-up steps (at lr 1e-3) before the recorded steps of the "rl" and "finetune"
#: regimes.  toytrain's default is 100; on the ~13M-parameter "bench" preset that is
#: ~1 min of training per run, and 20 steps already put the run past the large,
#: atypical first Adam updates (the recorded steps of an RL run stay ~99% identical
#: in bf16: a 3e-6 step is far below half a bf16 ULP of almost every weight).
WARMUP_STEPS = {"tiny": 100, "small": 50, "bench": 20}


@dataclass(frozen=True)
class TrajectorySpec:
    """One benchmark trajectory: a training regime saved in one dtype."""

    name: str
    kind: str  # toytrain regime: "rl", "pretrain", "finetune"
    dtype: str  # "bfloat16", "float16", "float32"
    regime: str  # one-line description for tables and docs


#: The standard benchmark trajectories, by name.
TRAJECTORIES = {
    spec.name: spec
    for spec in (
        TrajectorySpec(
            "rl-bf16", "rl", "bfloat16", "RL-like, lr 3e-6 after warm-up: sparse (~99% of weights unchanged)"
        ),
        TrajectorySpec("pretrain-bf16", "pretrain", "bfloat16", "pretraining from init, lr 1e-3: dense"),
        TrajectorySpec("finetune-fp32", "finetune", "float32", "fine-tuning, lr 1e-4 after warm-up, weight decay 0.01"),
        TrajectorySpec("finetune-fp16", "finetune", "float16", "the same fine-tuning run saved in float16"),
    )
}


#: Names the cache directory (the Cache Directory Tagging convention: backup tools skip it); ``--clean``
#: removes only a directory that carries it.
_TAG = "CACHEDIR.TAG"
_TAG_TEXT = "Signature: 8a477f597d28d172789f06886806bc55\n# ulstore benchmark cache: trajectories trained on demand\n"


def cache_dir() -> Path:
    """Root of the trajectory cache: ``$ULSTORE_BENCH_CACHE``, else ``$XDG_CACHE_HOME/ulstore/benchmarks``
    (``~/.cache/ulstore/benchmarks``): the user's cache directory, never the repository (it grows to GBs)."""
    env = os.environ.get("ULSTORE_BENCH_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "ulstore" / "benchmarks"


def _legacy_cache_dir() -> Path:
    """Where earlier versions kept the cache: ``benchmarks/.cache`` in the repository (no longer used)."""
    return Path(__file__).resolve().parent / ".cache"


def _size(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


_announced = False


def announce_cache() -> None:
    """Say (once, on stderr) where the cache is and how to remove it; and that an old in-repository one is unused."""
    global _announced
    if _announced:
        return
    _announced = True
    _log(f"benchmark cache: {cache_dir()} (set $ULSTORE_BENCH_CACHE to move it; --clean removes it)")
    legacy = _legacy_cache_dir()
    if legacy.is_dir() and legacy != cache_dir():
        _log(f"  {legacy} is an old cache, no longer used ({_size(legacy) / 1e9:.1f} GB): rm -rf {legacy}")


def clean_cache() -> list[str]:
    """Remove the benchmark cache; returns what was done, one line each.

    Only a directory marked as this cache (``CACHEDIR.TAG``, or the old cache's ``.gitignore``) is removed:
    ``$ULSTORE_BENCH_CACHE`` pointing at anything else is left alone, and said so.  An old cache in the
    repository (``benchmarks/.cache``) is named with the command that removes it.
    """
    root = cache_dir()
    if not root.exists():
        said = [f"no benchmark cache at {root}"]
    elif not _is_cache(root):
        said = [f"left {root}: it is not marked as the benchmark cache ({_TAG}); remove it yourself"]
    else:
        size = _size(root)
        shutil.rmtree(root)
        said = [f"removed {root} ({size / 1e9:.2f} GB)"]
    legacy = _legacy_cache_dir()
    if legacy.is_dir() and legacy != root:
        said.append(f"{legacy} is an old cache, no longer used ({_size(legacy) / 1e9:.1f} GB): rm -rf {legacy}")
    return said


def _is_cache(root: Path) -> bool:
    if (root / _TAG).is_file():
        return True
    try:  # the old cache in the repository carried only this
        return (root / ".gitignore").read_text(errors="replace").startswith("# benchmark trajectory cache")
    except OSError:
        return False


class _Clean(argparse.Action):
    """``--clean``: remove the cache and exit (before any other argument is checked, like ``--help``)."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        for line in clean_cache():
            print(line)
        parser.exit()


def cache_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--clean`` (remove the benchmark cache and exit) to a benchmark's parser."""
    parser.add_argument(
        "--clean", action=_Clean, help=f"remove the benchmark cache ({cache_dir()}, $ULSTORE_BENCH_CACHE) and exit"
    )


def warmup_steps(kind: str, preset: str) -> int:
    """Warm-up steps used for ``kind`` on ``preset`` (0 for pretraining, which starts at init)."""
    if kind == "pretrain":
        return 0
    return WARMUP_STEPS.get(preset, 100)


def _run_dir(kind: str, preset: str) -> Path:
    return cache_dir() / preset / f"{kind}-w{warmup_steps(kind, preset)}"


def _meta(kind: str, dtype: str, preset: str) -> dict:
    # everything that determines the checkpoint bytes (the training text is the
    # stdlib of this Python version, see toytrain.corpus)
    return {
        "format": 1,
        "kind": kind,
        "dtype": dtype,
        "preset": preset,
        "config": asdict(toytrain.ToyConfig.preset(preset)),
        "warmup_steps": warmup_steps(kind, preset),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "toytrain_sha256": _toytrain_digest(),
    }


def _toytrain_digest() -> str:
    """Digest of toytrain's source: any change to the trainer invalidates the cache."""
    try:
        return hashlib.sha256(Path(toytrain.__file__).read_bytes()).hexdigest()[:16]
    except OSError:
        return "unknown"


def _cached_steps(path: Path, meta: dict) -> int:
    """Number of usable checkpoints in ``path`` (0 if absent or built differently)."""
    try:
        stored = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return 0
    n = stored.pop("checkpoints", 0)
    if stored != meta:
        return 0
    if not all((path / _step_file(i)).is_file() for i in range(n)):
        return 0
    return n


def _dtype_name(dtype) -> str:
    """Canonical name ("bfloat16", "float32", ...) of a checkpoint dtype."""
    for name, dt in toytrain.CHECKPOINT_DTYPES.items():
        if (dtype == name) if isinstance(dtype, str) else (np.dtype(dtype) == dt):
            return name
    raise ValueError(f"dtype must be one of {list(toytrain.CHECKPOINT_DTYPES)}, got {dtype!r}")


def _step_file(i: int) -> str:
    return f"step-{i:04d}.safetensors"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_cached(kind: str, dtypes, preset: str = "bench", steps: int = 5) -> None:
    """Make sure ``steps + 1`` checkpoints of ``kind`` are cached in each of ``dtypes``.

    Trains at most once for all the dtypes that are missing, and resumes: the
    run directory keeps the fp32 master weights, the Adam moments and the
    minibatch sampler's state (``resume.npz``, saved every
    :data:`RESUME_EVERY` checkpoints and at the end), so a longer run, or one
    interrupted, continues where the cache stops instead of training again
    from init.  The checkpoints are byte-identical to those of one
    uninterrupted :func:`ulstore.toytrain.train` run.  Each file is written
    under a temporary name and renamed, and ``meta.json`` (which says how many
    checkpoints are usable) moves only after its files are in place, so a
    concurrent reader never sees a half-written trajectory.
    """
    announce_cache()
    dtypes = [_dtype_name(d) for d in ([dtypes] if isinstance(dtypes, str) else dtypes)]
    have = {d: _cached_steps(_run_dir(kind, preset) / d, _meta(kind, d, preset)) for d in dict.fromkeys(dtypes)}
    missing = {d: n for d, n in have.items() if n < steps + 1}
    if not missing:
        return
    config = toytrain.ToyConfig.preset(preset)
    run = _run_dir(kind, preset)
    trainer = _ResumableRun(kind, config, warmup_steps(kind, preset), run)
    first = trainer.start(min(missing.values()))
    _log(
        f"training {kind!r} on preset {preset!r} ({config.num_params / 1e6:.1f}M params, checkpoints "
        f"{first}..{steps}{' resumed' if first else ''}) for {', '.join(missing)} ..."
    )
    t0 = time.perf_counter()
    for d in missing:
        (run / d).mkdir(parents=True, exist_ok=True)
    bar = progress(total=steps + 1 - first, desc=f"train {kind}")
    for step, master in trainer.checkpoints(steps):
        for d, n in missing.items():
            if step >= n:  # the files below n are cached (and identical)
                state = {k: np.ascontiguousarray(v.astype(toytrain.CHECKPOINT_DTYPES[d])) for k, v in master.items()}
                _write_atomic(run / d / _step_file(step), lambda tmp, s=state: toytrain.save_safetensors(s, tmp))
        if step == steps or (step + 1) % RESUME_EVERY == 0:  # the trainer saves its state after this
            for d in missing:
                meta = {**_meta(kind, d, preset), "checkpoints": step + 1}
                _write_atomic(
                    run / d / "meta.json", lambda tmp, m=meta: Path(tmp).write_text(json.dumps(m, indent=1) + "\n")
                )
        bar.update(1)
    bar.close()
    _mark_ignored(cache_dir())
    _log(f"trained {kind!r} in {time.perf_counter() - t0:.1f} s -> {run}")


#: Checkpoints between two saves of a run's resume state (fp32 weights and Adam moments: 12 bytes a parameter).
RESUME_EVERY = 25


def _write_atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``: readers see the old file or the new, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class _ResumableRun:
    """One toytrain run, step by step, that can stop and continue (``resume.npz`` in the run directory).

    The loop is :func:`ulstore.toytrain.train`'s (same sampler, same AdamW,
    same order of draws), kept here so its state can be saved: the saved
    state sits after the optimizer step that leads to checkpoint ``next``.
    """

    def __init__(self, kind: str, config, n_warm: int, run: Path):
        regimes = toytrain._REGIMES  # (warm-up, warm-up lr, lr, weight decay) by kind
        _, self.warm_lr, self.lr, wd = regimes[kind]
        self.config, self.n_warm, self.path = config, n_warm, run / "resume.npz"
        self.key = json.dumps(
            {
                "kind": kind,
                "config": asdict(config),
                "warmup": n_warm,
                "digest": _toytrain_digest(),
                "python": platform.python_version(),
                "numpy": np.__version__,
            },
            sort_keys=True,
        )
        self.data = toytrain.corpus()
        self.rng = np.random.default_rng([config.seed, 1])
        self.params = toytrain.init_params(config)
        self.opt = toytrain._AdamW(self.params, wd)
        self.next = 0

    def _batch(self):
        c = self.config
        starts = self.rng.integers(0, self.data.size - c.context, size=c.batch_size)
        return self.data[starts[:, None] + np.arange(c.context + 1)].astype(np.intp)

    def start(self, wanted: int) -> int:
        """Load the saved state if it stands at or before checkpoint ``wanted``; the checkpoint training starts at."""
        try:
            with np.load(self.path, allow_pickle=False) as z:
                if str(z["key"]) != self.key or int(z["next"]) > wanted:
                    raise ValueError("another run, or past what is cached")
                for k in self.params:
                    self.params[k][...] = z["p/" + k]
                    self.opt.m[k][...] = z["m/" + k]
                    self.opt.v[k][...] = z["v/" + k]
                self.opt.t = int(z["t"])
                self.rng.bit_generator.state = json.loads(str(z["rng"]))
                self.next = int(z["next"])
        except (OSError, ValueError, KeyError):
            for _ in range(self.n_warm):
                _, grads = toytrain.loss_and_grads(self.params, self._batch(), self.config)
                self.opt.step(self.params, grads, self.warm_lr)
        return self.next

    def checkpoints(self, last: int):
        """Yield ``(step, fp32 master weights)`` for checkpoints ``next..last`` (the arrays change after the yield)."""
        while self.next <= last:
            _, grads = toytrain.loss_and_grads(self.params, self._batch(), self.config)
            yield self.next, self.params
            # one step past the last checkpoint too: the saved state then continues the run exactly
            self.opt.step(self.params, grads, self.lr)
            self.next += 1
            if self.next % RESUME_EVERY == 0 or self.next > last:  # after the caller's meta.json: never ahead of it
                self.save()

    def save(self) -> None:
        """Write the state (checkpoint ``next`` is the one the run would yield next)."""
        arrays = {
            "key": np.array(self.key),
            "next": np.array(self.next),
            "t": np.array(self.opt.t),
            "rng": np.array(json.dumps(self.rng.bit_generator.state)),
        }
        for k in self.params:
            arrays["p/" + k], arrays["m/" + k], arrays["v/" + k] = self.params[k], self.opt.m[k], self.opt.v[k]

        def write(tmp):
            with open(tmp, "wb") as fh:
                np.savez(fh, **arrays)

        _write_atomic(self.path, write)


def _mark_ignored(root: Path) -> None:
    """Mark the cache as one (``CACHEDIR.TAG``: what ``--clean`` removes) and keep it out of git, should
    ``$ULSTORE_BENCH_CACHE`` put it in a repository."""
    for name, text in ((_TAG, _TAG_TEXT), (".gitignore", "# benchmark trajectory cache (rebuilt on demand)\n*\n")):
        marker = root / name
        if not marker.exists():
            try:
                marker.write_text(text)
            except OSError:
                pass


def load_trajectory(
    kind: str, dtype: str = "bfloat16", preset: str = "bench", steps: int = 5
) -> list[dict[str, np.ndarray]]:
    """``steps + 1`` consecutive checkpoints of a toy training run, read from safetensors files.

    Parameters
    ----------
    kind : {"rl", "pretrain", "finetune"}
        toytrain regime (see :func:`ulstore.toytrain.trajectory`).
    dtype : {"bfloat16", "float16", "float32", "float64"}
    preset : {"tiny", "small", "bench"}
    steps : int
        Optimizer steps; ``steps + 1`` checkpoints are returned.

    Returns
    -------
    list of dict of str to numpy.ndarray
        One ``{tensor name: array}`` per checkpoint, in step order, as
        :func:`safetensors.numpy.load_file` returns them (bf16 as ml_dtypes).
    """
    from safetensors.numpy import load_file

    if steps < 1:
        raise ValueError("steps must be >= 1 (a trajectory needs at least one step pair)")
    ensure_cached(kind, [dtype], preset, steps)
    dtype = _dtype_name(dtype)
    path = _run_dir(kind, preset) / dtype
    return [load_file(str(path / _step_file(i))) for i in range(steps + 1)]


def iter_trajectory(kind: str, dtype: str = "bfloat16", preset: str = "bench", steps: int = 5):
    """:func:`load_trajectory` one checkpoint at a time (a long bench-size run does not fit in memory at once)."""
    from safetensors.numpy import load_file

    if steps < 1:
        raise ValueError("steps must be >= 1 (a trajectory needs at least one step pair)")
    ensure_cached(kind, [dtype], preset, steps)
    path = _run_dir(kind, preset) / _dtype_name(dtype)
    for i in range(steps + 1):
        yield load_file(str(path / _step_file(i)))


def load_spec(spec: TrajectorySpec | str, preset: str = "bench", steps: int = 5) -> list[dict[str, np.ndarray]]:
    """:func:`load_trajectory` for a :data:`TRAJECTORIES` entry (or its name)."""
    spec = TRAJECTORIES[spec] if isinstance(spec, str) else spec
    return load_trajectory(spec.kind, spec.dtype, preset, steps)


class _NoProgress:
    """Stand-in for tqdm when it is not installed: prints a line when done."""

    def __init__(self, total=None, desc="", **_):
        self.desc, self.total, self.n, self.start = desc, total, 0, time.perf_counter()

    def update(self, n=1):
        self.n += n

    def set_postfix(self, **_):
        pass

    def set_description(self, desc):
        self.desc = desc

    def close(self):
        _log(f"{self.desc}: {self.n}/{self.total} in {time.perf_counter() - self.start:.1f} s")


def progress(**kwargs):
    """A tqdm progress bar on stderr, or a plain fallback."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress(**kwargs)
    return tqdm(file=sys.stderr, leave=False, dynamic_ncols=True, **kwargs)
