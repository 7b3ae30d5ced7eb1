"""``ulstore demo``: train a small model for real, store every step, show what it costs.

The demo trains the numpy language model of :mod:`ulstore.toytrain` on the CPU
(AdamW on a real next-byte loss; no download, no GPU), commits a bf16
checkpoint after every optimizer step to a local trajectory, and then:

1. compares the trajectory's size with the same checkpoints as raw
   safetensors files and as zstd-compressed files;
2. reads a 4x4 slice of an old step back lazily (only the chunks it touches)
   and checks it against the weights kept in memory, bit for bit;
3. verifies every blob and manifest, and says where the data lives.

The run has two phases, as real runs do: the first half of the steps at
learning rate 1e-3 (pretraining-like: nearly every bf16 weight changes each
step), the second half at 3e-6 (fine-tuning or RL-like: ~1-2 % change; one
run: Adam moments and minibatches carry over).  The table shows what each
phase costs, and the anchor line why the first phase is stored whole.

Examples
--------
>>> import tempfile
>>> summary = run(tempfile.mkdtemp() + "/demo", steps=4, preset="tiny", echo=lambda *a: None)
>>> summary["steps"], summary["slice_equal"], summary["verified"]
(5, True, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import textwrap
import time
from pathlib import Path

import numpy as np

from .. import io as _io
from .. import toytrain
from ..core.formatting import human_bytes
from ..core.install import install_command
from ..errors import InvalidInputError, UlstoreError
from ..store import open as _open
from ._plot import has_matplotlib

__all__ = ["run", "DEFAULT_DIR", "DEFAULT_STEPS", "DEFAULT_PRESET", "zstd_size"]

#: Where ``ulstore demo`` stores its trajectory when no directory is given.
DEFAULT_DIR = "ulstore-demo"
#: Optimizer steps trained and stored (plus the initial weights as step 0).
DEFAULT_STEPS = 60
#: toytrain preset: ~1.8M parameters, a few hundredths of a second per training step.
DEFAULT_PRESET = "small"

#: Learning rates of the two phases, and how the report writes them.
LR_HIGH, LR_LOW = 1e-3, 3e-6
_LR_TEXT = {LR_HIGH: "1e-3", LR_LOW: "3e-6"}
#: Chunk size of the demo trajectory: small, so that a slice touches one chunk of several.
DEMO_CHUNK_BYTES = 64 << 10
_SLICE_TENSOR = "model.layers.0.mlp.up_proj.weight"


def zstd_size(data: bytes, level: int = 3) -> int:
    """Size of ``data`` compressed with zstd (``zstandard`` if installed, else numcodecs).

    Examples
    --------
    >>> zstd_size(bytes(100_000)) < 100
    True
    """
    try:
        import zstandard
    except ImportError:
        import numcodecs

        return len(numcodecs.Zstd(level=level).encode(data))
    return len(zstandard.ZstdCompressor(level=level).compress(data))


def _prepare_dir(path: Path) -> None:
    """Refuse to replace anything but an empty directory or an earlier demo."""
    if not path.exists():
        return
    if not path.is_dir():
        raise InvalidInputError(f"{path}: exists and is not a directory; pass another DIR")
    if not any(path.iterdir()):
        return
    try:
        traj = _open(str(path), mode="r")
        first = traj.steps[:1]
        is_demo = bool(first) and traj.info(first[0]).metadata.get("demo") is True
    except (UlstoreError, OSError):
        is_demo = False
    if not is_demo:
        raise InvalidInputError(
            f"{path}: exists and is not an earlier ulstore demo; pass another DIR (the demo only replaces its own)"
        )


def run(
    directory=DEFAULT_DIR,
    *,
    steps: int = DEFAULT_STEPS,
    preset: str = DEFAULT_PRESET,
    echo=print,
    progress: bool = False,
    activity=None,
) -> dict:
    """Run the demo; print as it goes through ``echo``; return a summary dict.

    Parameters
    ----------
    directory : str or os.PathLike
        Local directory for the trajectory; an earlier demo there is replaced,
        anything else is refused.
    steps : int
        Optimizer steps to train and store (at least 2); ``steps + 1``
        checkpoints including the initial weights.
    preset : {"tiny", "small", "bench"}
        Model size (:meth:`ulstore.toytrain.ToyConfig.preset`).
    echo : callable
        Receives each line of the report (``print`` by default).
    progress : bool
        Show a tqdm progress bar (on stderr) while training.
    activity : callable, optional
        ``activity(description)`` -> a context manager shown while a phase
        without a step count runs (clearing an earlier demo, adding up sizes,
        verifying); the CLI passes its elapsed-time bar.  Default: nothing shown.

    Returns
    -------
    dict
        ``path``, ``steps`` (checkpoints stored), ``params``, ``sizes``
        (``raw``, ``zstd``, ``ulstore`` bytes), ``phases``, ``slice_equal``,
        ``verified``, ``seconds``.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise InvalidInputError(f"the demo needs at least 2 steps, got {steps!r}")
    t_start = time.perf_counter()
    phase = activity or (lambda desc: contextlib.nullcontext())
    cfg = toytrain.ToyConfig.preset(preset)
    path = Path(directory).expanduser()
    _prepare_dir(path)
    with phase(f"preparing {path}" + (" (removing the earlier demo)" if path.exists() else "")):
        traj = _open(str(path), mode="w", chunk_bytes=DEMO_CHUNK_BYTES)
    n1 = steps // 2
    old_step = max(1, steps // 12)
    _introduce(echo, cfg, preset, steps, n1, path)
    trained = _train_and_store(traj, cfg, steps, n1, old_step, progress)
    n_ckpt = len(trained.raw)
    echo(
        f"Trained {steps} steps in {trained.t_train:.1f} s: loss {trained.losses[0]:.3f} -> {trained.losses[steps]:.3f}; "
        f"committed {n_ckpt} checkpoints in {trained.t_store:.1f} s ({1e3 * trained.t_store / n_ckpt:.0f} ms each)"
    )
    echo("")
    with phase(f"adding up the sizes of {n_ckpt} steps"):
        report = _io.storage_report(traj)
    sizes, phase_rows, anchors = _compare_sizes(traj, report, trained, cfg.num_params, n1, steps, echo)
    reader = _open(str(path), mode="r")
    name, got, equal = _read_old_slice(reader, old_step, trained.kept, echo)
    t0 = time.perf_counter()
    with phase(f"verifying {n_ckpt} steps: re-reading and decoding every blob"):
        vr = reader.verify(raise_on_error=False)
    echo(
        f"Verify: re-read and checked {vr.steps} steps, {vr.chunks} chunks, {vr.blobs} blobs in "
        f"{time.perf_counter() - t0:.1f} s: {'OK' if vr.ok else f'{len(vr.errors)} PROBLEM(S)'}"
    )
    echo("")
    on_disk = _where_it_lives(traj, path, steps, name, echo)
    seconds = time.perf_counter() - t_start
    echo(f"Done in {seconds:.0f} s.")
    return {
        "path": str(path.resolve()),
        "steps": n_ckpt,
        "params": cfg.num_params,
        "preset": preset,
        "sizes": sizes,
        "disk_bytes": on_disk,
        "phases": phase_rows,
        "anchors": anchors,
        "loss": {"first": trained.losses[0], "last": trained.losses[steps]},
        "slice": {"step": old_step, "tensor": name, "values": got.astype(np.float32).tolist()},
        "slice_equal": bool(equal),
        "verified": vr.ok,
        "seconds": {"total": seconds, "train": trained.t_train, "store": trained.t_store, "zstd": trained.t_zstd},
    }


def _introduce(echo, cfg, preset: str, steps: int, n1: int, path: Path) -> None:
    """What the demo is about to do: the model, the run, where it stores."""
    n_params = cfg.num_params
    size = f"{n_params / 1e6:.2f}M" if n_params >= 1e6 else f"{n_params / 1e3:.0f}K"
    echo(f"ulstore demo: train a {size}-parameter language model on this CPU and store every step")
    echo(
        f"  model   toytrain {preset!r}: byte-level MLP LM, {len(cfg.shapes())} tensors, "
        f"bf16 checkpoints of {human_bytes(2 * n_params)}"
    )
    echo(
        f"  run     steps 1-{n1} at lr {_LR_TEXT[LR_HIGH]}, then {n1 + 1}-{steps} at lr {_LR_TEXT[LR_LOW]} "
        "(AdamW on a real next-byte loss)"
    )
    echo(f"  store   {path}")
    echo("")


@dataclasses.dataclass
class _Run:
    """What training and storing left to report: per step, the safetensors file's size, its zstd size, the loss."""

    raw: dict[int, int] = dataclasses.field(default_factory=dict)
    zst: dict[int, int] = dataclasses.field(default_factory=dict)
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    kept: dict = dataclasses.field(default_factory=dict)  # the weights of the old step read back later
    t_train: float = 0.0
    t_store: float = 0.0
    t_zstd: float = 0.0


def _train_and_store(traj, cfg, steps: int, n1: int, old_step: int, progress: bool) -> _Run:
    """Train ``steps`` steps, committing every checkpoint; one run whose rate drops after step ``n1``."""
    from safetensors.numpy import save as st_bytes

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps + 1, desc="training", unit="step", leave=False, dynamic_ncols=True)
    trained = _Run()

    def rate(k):  # checkpoint s comes from the optimizer step at rate(s - 1)
        return LR_HIGH if k < n1 else LR_LOW

    t0 = time.perf_counter()
    for step, state, loss in toytrain.train(cfg, steps, lr=rate):
        t1 = time.perf_counter()
        trained.t_train += t1 - t0
        meta = {"loss": round(float(loss), 5), "lr": rate(max(step - 1, 0)), "demo": True}
        traj.commit(step, state, metadata=meta)
        t2 = time.perf_counter()
        trained.t_store += t2 - t1
        blob = st_bytes(state)
        trained.raw[step] = len(blob)
        trained.zst[step] = zstd_size(blob)
        trained.t_zstd += time.perf_counter() - t2
        trained.losses[step] = float(loss)
        if step == old_step:
            trained.kept = {k: v.copy() for k, v in state.items()}
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)
        t0 = time.perf_counter()
    if bar is not None:
        bar.close()
    return trained


def _compare_sizes(traj, report: dict, trained: _Run, n_params: int, n1: int, steps: int, echo):
    """The size table: raw files, zstd, the trajectory, and its phases; returns (sizes, phase rows, anchors)."""
    n_ckpt = len(trained.raw)
    stored = {r["step"]: r["stored_bytes"] for r in report["steps"]}
    anchors = [s for s in range(n_ckpt) if traj.info(s).anchor_distance == 0]

    def raw_of(ss):
        return sum(trained.raw[s] for s in ss)

    def row(label, nbytes, ss):
        bpw = 8 * nbytes / (n_params * len(ss))
        return f"  {label:<40}{human_bytes(nbytes):>10}{raw_of(ss) / nbytes:>8.1f}x{bpw:>13.2f}"

    all_steps = sorted(trained.raw)
    sizes = {"raw": raw_of(all_steps), "zstd": sum(trained.zst.values()), "ulstore": sum(stored.values())}
    echo(f"  {f'{n_ckpt} checkpoints of {n_params:,} weights':<40}{'size':>10}{'smaller':>9}{'bits/weight':>13}")
    raw_bpw = 8 * sizes["raw"] / (n_params * n_ckpt)
    echo(f"  {'raw safetensors files':<40}{human_bytes(sizes['raw']):>10}{'1.0x':>9}{raw_bpw:>13.2f}")
    echo(row("zstd -3 of each file", sizes["zstd"], all_steps))
    echo(row("ulstore trajectory", sizes["ulstore"], all_steps))
    phases = [
        ("step 0 (initial weights)", [0]),
        (f"steps 1-{n1} (lr {_LR_TEXT[LR_HIGH]})", list(range(1, n1 + 1))),
        (f"steps {n1 + 1}-{steps} (lr {_LR_TEXT[LR_LOW]})", list(range(n1 + 1, steps + 1))),
    ]
    phase_rows = []
    for label, ss in phases:
        nbytes = sum(stored[s] for s in ss)
        echo(row("  " + label, nbytes, ss))
        phase_rows.append(
            {
                "label": label,
                "steps": ss,
                "raw_bytes": raw_of(ss),
                "zstd_bytes": sum(trained.zst[s] for s in ss),
                "stored_bytes": nbytes,
            }
        )
    _say_anchors(traj, anchors, n_ckpt, echo)
    echo("")
    return sizes, phase_rows, anchors


def _runs(steps: list[int]) -> str:
    """``0-36, 49``: sorted step numbers, runs of three or more as ranges."""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts += [f"{steps[i]}-{steps[j]}"] if j - i >= 2 else [str(s) for s in steps[i : j + 1]]
        i = j + 1
    return ", ".join(parts)


def _say_anchors(traj, anchors: list[int], n_ckpt: int, echo) -> None:
    """Which steps are anchors and why; under the cost policy, why a small model gets so many."""
    if len(anchors) == n_ckpt and n_ckpt > 1:
        which = "Every step is an anchor"
    elif len(anchors) > 1:
        which = f"Steps {_runs(anchors)} are anchors"
    else:
        which = f"Step {anchors[0]} is an anchor"
    if traj.anchor_cost is None:
        why = f"so that no read walks back more than {traj.anchor_every} steps"
    else:
        why = f"where reading the next delta would cost more than {traj.anchor_cost:g}x reading an anchor"
    rest = "; all others are deltas against their parent" if len(anchors) < n_ckpt else ""
    text = f"{which} (coded without a reference, {why}){rest}."
    if traj.anchor_cost is not None and 4 * len(anchors) > n_ckpt:
        # a surprise to explain, not a policy to change: a dense delta of a small model decodes slower than its step
        text += (
            " Why so many: anchors are chosen by read cost. Where nearly every weight changes each step (a high "
            "learning rate), decoding the delta costs more than reading the whole step, so such steps are stored "
            "whole; where few weights change (fine-tuning, RL), deltas are small and cheap to apply, and anchors "
            "are rare. After a run of anchors, each step's changes are sampled, so the first step after the "
            "learning rate drops is a delta again."
        )
    echo(textwrap.fill(text, 88, initial_indent="  ", subsequent_indent="  "))


def _read_old_slice(reader, old_step: int, kept: dict, echo):
    """Read a 4x4 slice of an old step lazily and check its bits; returns (tensor name, slice, bit-exact)."""
    name = _SLICE_TENSOR if _SLICE_TENSOR in kept else next(k for k, v in kept.items() if v.ndim == 2)
    t0 = time.perf_counter()
    arr = reader[old_step][name]
    got = arr[0:4, 0:4]
    t_slice = time.perf_counter() - t0
    want = kept[name][0:4, 0:4]
    equal = got.dtype == want.dtype and np.array_equal(got.view(np.uint16), want.view(np.uint16))
    dist = reader.info(old_step).anchor_distance
    echo(f"Lazy read of an old step: traj[{old_step}][{name!r}][0:4, 0:4]")
    echo(
        f"  {arr.dtype} {arr.shape}; touches 1 of its {arr.nchunks} chunk(s), decoded against "
        f"{dist} earlier step(s) back to an anchor, in {1e3 * t_slice:.0f} ms"
    )
    for line in np.array2string(got.astype(np.float32), precision=5, suppress_small=False).splitlines():
        echo("    " + line)
    echo(f"  bit-exact against the step-{old_step} weights kept in memory: {'yes' if equal else 'NO'}")
    echo("")
    return name, got, equal


def _where_it_lives(traj, path: Path, steps: int, name: str, echo) -> int:
    """Where the data lives and what to try next; returns the bytes on disk."""
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    here = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
    echo(f"The data lives in {path.resolve()} ({human_bytes(on_disk)} on disk):")
    echo("  steps/<n>/zarr.json   one sealed step document per step (written last: a step exists once it lands)")
    echo("  packs/                ULPack blobs and table blocks, appended a commit at a time, shared between steps")
    echo(f"  refs/main/            the branch head (step {traj.head()}), one sealed entry per move")
    echo("Next:")
    echo(f"  ulstore log {here}")
    echo(f"  ulstore ls {here} {steps}")
    echo(f"  ulstore export {here} {steps} model.safetensors")
    if has_matplotlib():
        echo(f"  ulstore stats {here} --plot sizes.png")
    else:
        echo(
            f"  ulstore stats {here}                  (for a plot: {install_command('plot')}, then add --plot sizes.png)"
        )
    echo(f'  python -c "import ulstore; print(ulstore.open({here!r})[{steps}][{name!r}][:2, :4])"')
    return on_disk
