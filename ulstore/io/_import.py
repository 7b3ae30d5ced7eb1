"""Import: a checkpoint file or directory committed as one step, with what the file held besides tensors."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidInputError, StepExistsError
from ..store import HEAD
from . import checkpoints as _ck
from ._names import _GENERIC_NAMES, _INDEX_NAME, CHECKPOINT_KEY, checkpoint_format, step_from_path

__all__ = ["import_checkpoint"]


def import_checkpoint(traj, path, step=None, *, parent=HEAD, branch=None, metadata=None, anchor=None) -> int:
    """Load a checkpoint file (or directory) and commit it as a new step.

    Parameters
    ----------
    traj : Trajectory
        Opened for writing.
    path : str or os.PathLike
        ``.safetensors``, a Hugging Face directory or its index, ``.pt``/``.pth``/``.bin``
        (needs PyTorch) or ``.npz``.
    step : int, optional
        Default: from the name (:func:`step_from_path`).
    parent, branch, anchor
        As for :meth:`Trajectory.commit`.
    metadata : dict, optional
        Extra step metadata; the key ``"checkpoint"`` is taken by this function.

    Returns
    -------
    int
        The step committed.

    Raises
    ------
    NotFoundError
        ``path`` does not exist.
    InvalidInputError
        The file is malformed or of an unknown format, the step cannot be told
        from the name, or ``metadata`` uses the key ``"checkpoint"``.
    DtypeError
        A tensor's dtype cannot be stored.
    StepExistsError
        ``step`` exists already (checked before the file is read).

    Examples
    --------
    >>> import tempfile, numpy as np, ulstore
    >>> from ulstore.io import checkpoints
    >>> d = tempfile.mkdtemp()
    >>> checkpoints.save_npz({"w": np.ones(3, np.float16)}, f"{d}/ckpt_5.npz")
    >>> traj = ulstore.open(f"{d}/traj", mode="w")
    >>> import_checkpoint(traj, f"{d}/ckpt_5.npz"), traj.info(5).metadata["checkpoint"]["format"]
    (5, 'npz')
    """
    fmt = checkpoint_format(path)
    if step is None:
        step = step_from_path(path)
        if step is None:
            raise InvalidInputError(f"{path}: cannot tell the step from the name; pass step= (CLI: --step N)")
    metadata = dict(metadata or {})
    if CHECKPOINT_KEY in metadata:
        raise InvalidInputError(f"the step metadata key {CHECKPOINT_KEY!r} is reserved for the file's own metadata")
    if step in traj:  # before reading a possibly large file
        raise StepExistsError("step already exists; steps are immutable (rm it first to replace it)", step=step)
    # safetensors are memory-mapped: the commit streams them through a bounded window of chunks
    ck = _ck.load(path, mmap=fmt in ("safetensors", "sharded"))
    info: dict[str, object] = {
        "format": fmt,
        "source": _source_name(path),
        "metadata": dict(ck.metadata),
        "aliases": dict(ck.aliases),
    }
    names = list(ck.tensors) + list(ck.aliases)
    if ck.aliases and fmt == "torch":
        names = _torch_key_order(path, names)
    if names != sorted(names):
        info["order"] = names
    if fmt == "sharded":
        shard = _max_shard_bytes(path, ck)
        if shard:
            info["max_shard_bytes"] = shard
    metadata[CHECKPOINT_KEY] = info
    return traj.commit(step, ck.tensors, parent=parent, branch=branch, metadata=metadata, anchor=anchor)


def _torch_key_order(path, fallback: list[str]) -> list[str]:
    """The state dict's own key order (where tied names sit), read again memory-mapped: no data is copied."""
    try:
        import torch

        keys = list(torch.load(path, weights_only=True, mmap=True, map_location="cpu"))
    except Exception:  # noqa: BLE001 -- the order is a nicety; the tensors were read already
        return fallback
    return keys if sorted(keys) == sorted(fallback) else fallback


def _source_name(path) -> str:
    """What ``ulstore log`` shows: the file or directory name, with its directory if the name is generic."""
    p = Path(path)
    if p.name.lower().endswith(".index.json"):
        p = p.parent
    if _GENERIC_NAMES.match(p.name) and p.parent.name:
        return f"{p.parent.name}/{p.name}"
    return p.name or str(p)


def _max_shard_bytes(path, ck) -> int | None:
    """Tensor bytes of the largest shard named by the index (to shard the same way on export)."""
    p = Path(path)
    index = p if p.is_file() else (p / _INDEX_NAME if (p / _INDEX_NAME).is_file() else None)
    if index is None:
        found = sorted(p.glob("*.safetensors.index.json")) if p.is_dir() else []
        index = found[0] if len(found) == 1 else None
    if index is None:
        return None
    try:
        wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    sizes: dict[str, int] = {}
    for name, shard in wmap.items():
        if name in ck.tensors:
            sizes[shard] = sizes.get(shard, 0) + ck.tensors[name].nbytes
    return max(sizes.values()) if len(sizes) > 1 else None
