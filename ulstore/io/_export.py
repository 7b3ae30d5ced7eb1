"""Export: a step back as a checkpoint file or directory (atomically), or in memory as numpy or torch."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
from pathlib import Path

import numpy as np

from ..errors import CorruptManifestError, InvalidInputError
from . import checkpoints as _ck
from ._dirstate import is_state_tensor, restore_extras
from ._names import CHECKPOINT_KEY, output_format

__all__ = ["read_checkpoint", "to_numpy", "to_torch", "export_checkpoint"]


def read_checkpoint(traj, step) -> _ck.Checkpoint:
    """A step as a :class:`~ulstore.io.checkpoints.Checkpoint`: tensors in file order, metadata, aliases.

    Steps committed directly (not imported) have no file metadata or aliases,
    and their tensors come in name order.

    Examples
    --------
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-read-checkpoint", mode="w")
    >>> traj.commit(0, {"b": np.zeros(2, np.float32), "a": np.ones(2, np.float32)})
    0
    >>> list(read_checkpoint(traj, 0).tensors)
    ['a', 'b']
    """
    return _read(traj, step)[0]


def _read(traj, step, progress=None) -> tuple[_ck.Checkpoint, dict, dict[str, np.ndarray]]:
    """The step's Checkpoint, its ``"checkpoint"`` metadata, and every name (aliases too) in file order.

    ``progress(nbytes)``, if given, is called as groups of tensors are decoded.
    """
    info = traj.info(step)
    meta = info.metadata.get(CHECKPOINT_KEY) or {}
    if not isinstance(meta, dict):
        raise CorruptManifestError(f"step metadata {CHECKPOINT_KEY!r} is not an object", step=info.step)
    tensors = _read_weights(traj, info.step, progress)
    aliases = dict(meta.get("aliases") or {})
    for alias, canon in aliases.items():
        if canon not in tensors:
            raise CorruptManifestError(
                f"alias {alias!r} names tensor {canon!r}, which the step does not hold", step=info.step
            )
    every = _in_file_order(meta, tensors, aliases)
    renamed = meta.get("renamed") or {}  # stored name -> the file's name (import_checkpoint(rename_prefix=))
    if renamed:
        every = {renamed.get(n, n): a for n, a in every.items()}
        aliases = {renamed.get(a, a): renamed.get(c, c) for a, c in aliases.items()}
    index = meta.get("index")
    ck = _ck.Checkpoint(
        {n: a for n, a in every.items() if n not in aliases},
        {str(k): str(v) for k, v in (meta.get("metadata") or {}).items()},
        aliases,
        index_text=index if isinstance(index, str) else None,
    )
    return ck, meta, every


def _read_weights(traj, step: int, progress) -> dict[str, np.ndarray]:
    """The step's weights (not its training state), read at once or in groups reported to ``progress``."""
    shapes = {n: v for n, v in traj.tensors(step).items() if not is_state_tensor(n)}
    if progress is None:
        return traj.read(step, list(shapes))
    tensors: dict[str, np.ndarray] = {}
    for group in _groups(shapes, _PROGRESS_BYTES):
        tensors.update(traj.read(step, group))
        progress(sum(tensors[n].nbytes for n in group))
    return tensors


def _in_file_order(meta: dict, tensors: dict[str, np.ndarray], aliases: dict) -> dict[str, np.ndarray]:
    """Every name, aliases too, in the file's order (the import's ``order``; names it misses after, by name)."""
    order = list(meta.get("order") or sorted(list(tensors) + list(aliases)))
    order += sorted(set(tensors).union(aliases) - set(order))
    return {n: tensors[aliases.get(n, n)] for n in order if n in tensors or n in aliases}


_PROGRESS_BYTES = 256 << 20  # decode this much between progress reports (big enough to keep threads busy)


def _groups(shapes: dict, budget: int) -> list[list[str]]:
    """Tensor names in groups of about ``budget`` raw bytes, in name order."""
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, (shape, dtype) in shapes.items():
        n = math.prod(shape) * dtype.itemsize
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        groups.append(current)
    return groups


def to_numpy(traj, step) -> dict[str, np.ndarray]:
    """A step as ``{name: numpy array}``, tied names included (the very same array object).

    Examples
    --------
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-to-numpy", mode="w")
    >>> traj.commit(3, {"w": np.arange(4, dtype=np.float32)})
    3
    >>> to_numpy(traj, 3)["w"]
    array([0., 1., 2., 3.], dtype=float32)
    """
    return _read(traj, step)[2]


def to_torch(traj, step=None):
    """Hand a step, a lazy slice or arrays to torch, bit for bit (needs PyTorch).

    ``torch.from_numpy`` cannot read the ``ml_dtypes`` arrays that bf16 and fp8
    tensors and slices are (``traj[50]["w"][:2]``); this can: their bits travel
    as a same-width integer view and are re-viewed as ``torch.bfloat16`` /
    ``torch.float8_*``, never converted.

    Parameters
    ----------
    traj : Trajectory, numpy.ndarray, zarr.Array or Mapping
        - a Trajectory, with ``step``: the step as a torch state dict, tied
          names sharing one tensor again (as the model's own state dict);
        - an array (a lazy slice, a 0-d value, any numpy/``ml_dtypes`` array, or
          a lazy ``zarr.Array`` such as ``traj[50]["w"]``, read whole): one tensor;
        - a mapping of names to arrays (``traj.read(50)``): a dict of tensors.
    step : int or str, optional
        A step or a ref name; only (and always) with a Trajectory.

    Returns
    -------
    dict or torch.Tensor
        Tensors share memory with the arrays where they can; a read-only
        array is copied (torch tensors are writable).

    Raises
    ------
    InvalidInputError
        A Trajectory without ``step``, an array with one, or anything else
        (a list, a number).
    DtypeError
        A dtype torch has no equivalent for.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-to-torch", mode="w")
    >>> traj.commit(0, {"w": torch.ones(2, 2, dtype=torch.bfloat16)})
    0
    >>> to_torch(traj, 0)["w"].dtype
    torch.bfloat16
    >>> piece = traj[0]["w"][:1]            # a lazy slice: an ml_dtypes.bfloat16 array
    >>> to_torch(piece)
    tensor([[1., 1.]], dtype=torch.bfloat16)
    """
    from collections.abc import Mapping

    if hasattr(traj, "read") and hasattr(traj, "info"):  # a Trajectory (io sees it through its methods)
        if step is None:
            raise InvalidInputError("to_torch(traj, step): name the step (or ref) to convert")
        ck, _, every = _read(traj, step)
        return _ck.to_torch(every, ck.aliases)
    if step is not None:
        raise InvalidInputError(f"to_torch: step={step!r} goes with a Trajectory, not with a {type(traj).__name__}")
    if isinstance(traj, Mapping):
        return _ck.to_torch(traj)
    arr = _array(traj)
    return _ck.to_torch({"tensor": arr})["tensor"]


def _array(value) -> np.ndarray:
    """``value`` as a numpy array: arrays, numpy scalars, and lazy arrays (``__array__`` with dtype and shape)."""
    if isinstance(value, np.ndarray | np.generic):
        return np.asarray(value)
    if hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape"):
        return np.asarray(value[...]) if hasattr(value, "__getitem__") else np.asarray(value)
    raise InvalidInputError(
        f"to_torch takes a Trajectory and a step, an array or a mapping of arrays, not a {type(value).__name__}; "
        "wrap Python numbers and lists with np.asarray and an explicit dtype"
    )


def export_checkpoint(
    traj, step, out, *, format: str | None = None, max_shard_size=None, overwrite: bool = False, progress=None
) -> dict:
    """Write a step as a checkpoint file or directory, atomically.

    Parameters
    ----------
    traj : Trajectory
    step : int or str
        A step or a ref name.
    out : str or os.PathLike
        Output path; the format follows from it (see :func:`output_format`).
    format : {"safetensors", "sharded", "torch", "npz"}, optional
        Overrides the suffix.
    max_shard_size : int or str, optional
        Shard limit for ``"sharded"`` (e.g. ``"5GB"``).  Default: the imported
        checkpoint's own layout if it was sharded (the same shard files holding
        the same tensors, the index byte for byte); otherwise one
        ``model.safetensors`` in the directory.
    overwrite : bool, default False
        Replace an existing ``out`` (only once the new one is complete).
    progress : callable, optional
        Called with a byte count as groups of tensors are decoded (e.g. ``tqdm.update``).

    Returns
    -------
    dict
        ``format``, ``path`` and ``files`` (paths written), ``bytes`` (their total size),
        ``tensors`` (names written, aliases included).

    Raises
    ------
    StepNotFoundError
        No such step.
    InvalidInputError
        ``out`` exists (without ``overwrite``) or has an unknown suffix.
    """
    fmt = output_format(out, format=format, max_shard_size=max_shard_size)
    out = Path(out)
    if out.exists() and not overwrite and not (out.is_dir() and fmt == "sharded" and not any(out.iterdir())):
        raise InvalidInputError(
            f"{out}: already exists; choose another name, or pass overwrite=True (CLI: --force) to replace it"
        )
    ck, meta, tensors = _read(traj, step, progress)
    file_meta = dict(ck.metadata)
    if meta.get("format") == "sharded" and ck.index_text is None and fmt != "sharded":
        file_meta.pop("total_size", None)  # steps imported before the index was kept: the index's, not a file's
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        _replace_file(out, lambda p: _ck.save_safetensors(tensors, p, file_meta))
    elif fmt == "torch":
        _replace_file(out, lambda p: _ck.save_torch(tensors, p, aliases=ck.aliases))
    elif fmt == "npz":
        _replace_file(out, lambda p: _ck.save_npz(tensors, p))
    else:
        with _staging_dir(out, overwrite) as tmp:
            _write_directory(tensors, tmp, file_meta, ck.index_text, max_shard_size, meta.get("max_shard_bytes"))
            restore_extras(traj, traj.info(step).step, meta, tmp)  # config, tokenizer, optimizer.pt...
    files = sorted(str(f) for f in out.rglob("*") if f.is_file()) if out.is_dir() else [str(out)]
    return {
        "format": fmt,
        "path": str(out),
        "files": files,
        "bytes": sum(os.path.getsize(f) for f in files),
        "tensors": list(tensors),
    }


def _write_directory(tensors, tmp: Path, file_meta: dict, index_text, max_shard_size, old_max_shard) -> None:
    """A Hugging Face directory: the imported shard layout and index exactly, or resharded, or one file."""
    if index_text is not None and max_shard_size is None:
        index = json.loads(index_text)
        if isinstance(index, dict) and index.get("weight_map") and set(index["weight_map"]) == set(tensors):
            _ck.save_safetensors(tensors, tmp, file_meta, weight_map=index["weight_map"], index_text=index_text)
            return
    if index_text is not None:  # resharded: the index's own metadata keeps its JSON types
        index_meta = json.loads(index_text).get("metadata") or {}
        _ck.save_safetensors(tensors, tmp, file_meta, max_shard_size=max_shard_size, index_metadata=index_meta)
    elif max_shard_size is not None or old_max_shard is not None:
        shard = max_shard_size if max_shard_size is not None else old_max_shard
        _ck.save_safetensors(tensors, tmp, file_meta, max_shard_size=shard)
    else:
        _ck.save_safetensors(tensors, tmp / "model.safetensors", file_meta)


def _replace_file(out: Path, write) -> None:
    if out.is_dir():
        raise InvalidInputError(f"{out}: is a directory; give a file name")
    # checkpoints' writers are atomic themselves (hidden temporary + os.replace)
    write(out)


@contextlib.contextmanager
def _staging_dir(out: Path, overwrite: bool):
    """Yield a hidden sibling directory; move it to ``out`` only once everything is written."""
    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            elif overwrite:
                old = out.parent / f".{out.name}.{secrets.token_hex(6)}.old"
                os.rename(out, old)
                os.rename(tmp, out)
                shutil.rmtree(old) if old.is_dir() else old.unlink()
                return
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
