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
learning rate 1e-3, the second half at 1e-4 (one run: Adam moments and
minibatches carry over).  The second phase changes fewer bf16 weights per
step, and the table shows what that does to the size.

Examples
--------
>>> import tempfile
>>> summary = run(tempfile.mkdtemp() + "/demo", steps=4, preset="tiny", echo=lambda *a: None)
>>> summary["steps"], summary["slice_equal"], summary["verified"]
(5, True, True)
"""

from __future__ import annotations

import contextlib
import os
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
LR_HIGH, LR_LOW = 1e-3, 1e-4
_LR_TEXT = {LR_HIGH: "1e-3", LR_LOW: "1e-4"}
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
    from safetensors.numpy import save as st_bytes

    t_start = time.perf_counter()
    phase = activity or (lambda desc: contextlib.nullcontext())
    cfg = toytrain.ToyConfig.preset(preset)
    path = Path(directory).expanduser()
    _prepare_dir(path)
    with phase(f"preparing {path}" + (" (removing the earlier demo)" if path.exists() else "")):
        traj = _open(str(path), mode="w", chunk_bytes=DEMO_CHUNK_BYTES)
    n1 = steps // 2
    old_step = max(1, steps // 12)
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

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps + 1, desc="training", unit="step", leave=False, dynamic_ncols=True)
    raw = {}  # step -> bytes of its safetensors file
    zst = {}  # step -> zstd bytes of that file
    losses = {}
    kept: dict = {}
    t_train = t_store = t_zstd = 0.0

    def runs():
        # one run whose rate drops after step n1: checkpoint s comes from the optimizer step at rate(s - 1)
        def rate(k):
            return LR_HIGH if k < n1 else LR_LOW

        for s, st, loss in toytrain.train(cfg, steps, lr=rate):
            yield s, st, loss, rate(max(s - 1, 0))

    t0 = time.perf_counter()
    for step, state, loss, lr in runs():
        t1 = time.perf_counter()
        t_train += t1 - t0
        traj.commit(step, state, metadata={"loss": round(float(loss), 5), "lr": lr, "demo": True})
        t2 = time.perf_counter()
        t_store += t2 - t1
        blob = st_bytes(state)
        raw[step] = len(blob)
        zst[step] = zstd_size(blob)
        t_zstd += time.perf_counter() - t2
        losses[step] = float(loss)
        if step == old_step:
            kept = {k: v.copy() for k, v in state.items()}
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)
        t0 = time.perf_counter()
    if bar is not None:
        bar.close()
    n_ckpt = len(raw)
    echo(
        f"Trained {steps} steps in {t_train:.1f} s: loss {losses[0]:.3f} -> {losses[steps]:.3f}; "
        f"committed {n_ckpt} checkpoints in {t_store:.1f} s ({1e3 * t_store / n_ckpt:.0f} ms each)"
    )
    echo("")

    # -- sizes ----------------------------------------------------------------
    with phase(f"adding up the sizes of {n_ckpt} steps"):
        report = _io.storage_report(traj)
    stored = {r["step"]: r["stored_bytes"] for r in report["steps"]}
    anchors = [s for s in range(n_ckpt) if traj.info(s).anchor_distance == 0]

    def raw_of(ss):
        return sum(raw[s] for s in ss)

    def row(label, nbytes, ss):
        bpw = 8 * nbytes / (n_params * len(ss))
        return f"  {label:<40}{human_bytes(nbytes):>10}{raw_of(ss) / nbytes:>8.1f}x{bpw:>13.2f}"

    all_steps = sorted(raw)
    sizes = {"raw": raw_of(all_steps), "zstd": sum(zst.values()), "ulstore": sum(stored.values())}
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
                "zstd_bytes": sum(zst[s] for s in ss),
                "stored_bytes": nbytes,
            }
        )
    which = (
        f"Steps {', '.join(map(str, anchors))} are anchors" if len(anchors) > 1 else f"Step {anchors[0]} is an anchor"
    )
    echo(f"  {which} (coded without a reference, so that no read")
    echo(f"  walks back more than {traj.anchor_every} steps); all others are deltas against their parent.")
    echo("")

    # -- lazy slice of an old step, from a fresh read-only handle ---------------
    name = _SLICE_TENSOR if _SLICE_TENSOR in kept else next(k for k, v in kept.items() if v.ndim == 2)
    reader = _open(str(path), mode="r")
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

    # -- verify ---------------------------------------------------------------
    t0 = time.perf_counter()
    with phase(f"verifying {n_ckpt} steps: re-reading and decoding every blob"):
        vr = reader.verify(raise_on_error=False)
    echo(
        f"Verify: re-read and checked {vr.steps} steps, {vr.chunks} chunks, {vr.blobs} blobs in "
        f"{time.perf_counter() - t0:.1f} s: {'OK' if vr.ok else f'{len(vr.errors)} PROBLEM(S)'}"
    )
    echo("")

    # -- where it lives -------------------------------------------------------
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
    seconds = time.perf_counter() - t_start
    echo(f"Done in {seconds:.0f} s.")
    return {
        "path": str(path.resolve()),
        "steps": n_ckpt,
        "params": n_params,
        "preset": preset,
        "sizes": sizes,
        "disk_bytes": on_disk,
        "phases": phase_rows,
        "anchors": anchors,
        "loss": {"first": losses[0], "last": losses[steps]},
        "slice": {"step": old_step, "tensor": name, "values": got.astype(np.float32).tolist()},
        "slice_equal": bool(equal),
        "verified": vr.ok,
        "seconds": {"total": seconds, "train": t_train, "store": t_store, "zstd": t_zstd},
    }
