"""Import: a checkpoint file or directory committed as one step, with what the file held besides tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.caller import warn_at_caller
from ..core.torch import from_tensor, is_tensor
from ..errors import InvalidInputError, StepExistsError
from ..store import HEAD
from . import checkpoints as _ck
from ._dirstate import directory_extras
from ._names import _GENERIC_NAMES, CHECKPOINT_KEY, checkpoint_format, step_from_path
from ._rename import (
    MIN_SHARED,
    FewSharedNamesWarning,
    name_overlap,
    rename_prefixes,
    retyped,
    suggest_prefixes,
)

__all__ = ["import_checkpoint"]


def import_checkpoint(
    traj, path, step=None, *, parent=HEAD, branch=None, metadata=None, anchor=None, rename_prefix=None
) -> int:
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
    rename_prefix : Mapping[str, str], optional
        OLD -> NEW name prefixes: a tensor whose name starts with OLD is stored
        as NEW + the rest (the longest matching OLD wins), so that it lines up
        with its parent's tensor and is delta-coded against it.  Exports give
        the names of the file back.  E.g. ``{"bert.": ""}`` stores a
        fine-tune's ``bert.encoder...`` as its base model's ``encoder...``.

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

    Warns
    -----
    FewSharedNamesWarning
        The checkpoint (weights and training state together) matches less than
        half of its parent's bytes by tensor name (and shape and dtype), and
        less than half of its own bytes match a parent tensor, so most of it
        cannot be delta-coded; the warning suggests a ``rename_prefix`` when one
        would line the names up.  Tensors the parent holds under the same name
        with another dtype or shape are named by the commit's warning
        (:meth:`Trajectory.commit`), whatever their share.

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
    metadata = dict(metadata or {})
    step = _new_step(traj, path, step, metadata)
    # safetensors are memory-mapped: the commit streams them through a bounded window of chunks
    ck = _ck.load(path, mmap=fmt in ("safetensors", "sharded"))
    names = list(ck.tensors) + list(ck.aliases)
    if ck.aliases and fmt == "torch":
        names = _torch_key_order(path, names)
    renamed = rename_prefixes(names, rename_prefix) if rename_prefix else {}
    tensors = {renamed.get(n, n): a for n, a in ck.tensors.items()}
    aliases = {renamed.get(a, a): renamed.get(c, c) for a, c in ck.aliases.items()}
    names = [renamed.get(n, n) for n in names]
    info: dict[str, object] = {
        "format": fmt,
        "source": _source_name(path),
        "metadata": dict(ck.metadata),
        "aliases": aliases,
    }
    if names != sorted(names):
        info["order"] = names
    if renamed:
        info["renamed"] = {stored: original for original, stored in renamed.items()}  # export restores these
    if ck.index_text is not None:
        info["index"] = ck.index_text  # the shard layout and the index's own metadata, exactly
    files = _add_directory_rest(path, names, tensors, info) if Path(path).is_dir() else None
    # every tensor the step will hold, training state included, is weighed against the parent's
    few = _few_shared_names(traj, path, tensors, parent, branch)
    metadata[CHECKPOINT_KEY] = info
    step = traj.commit(step, tensors, parent=parent, branch=branch, metadata=metadata, anchor=anchor, files=files)
    if few is not None:  # once the step exists (a failed import stored nothing), at the caller's line
        warn_at_caller(few)
    return step


def _new_step(traj, path, step, metadata: dict) -> int:
    """The step to import into (``step``, or told from the name), checked before the file is read."""
    if step is None:
        step = step_from_path(path)
        if step is None:
            raise InvalidInputError(f"{path}: cannot tell the step from the name; pass step= (CLI: --step N)")
    if CHECKPOINT_KEY in metadata:
        raise InvalidInputError(f"the step metadata key {CHECKPOINT_KEY!r} is reserved for the file's own metadata")
    if step in traj:  # before reading a possibly large file
        raise StepExistsError("step already exists; steps are immutable (rm it first to replace it)", step=step)
    return step


def _add_directory_rest(path, names: list[str], tensors: dict, info: dict) -> dict:
    """The rest of a checkpoint directory (``_dirstate.py``): its training state joins ``tensors``, what
    is kept of it is noted in ``info``; returns its small files (step files)."""
    state, files, kept = directory_extras(path, names)
    tensors.update(state)
    info.update({k: v for k, v in kept.items() if v})
    if kept["not_kept"]:
        sizes = ", ".join(f"{n} ({s} bytes)" for n, s in sorted(kept["not_kept"].items()))
        warn_at_caller(UserWarning(f"{path}: not kept (too large for a step file, and not weights): {sizes}"))
    return files


def _few_shared_names(traj, path, tensors: dict, parent, branch) -> FewSharedNamesWarning | None:
    """The warning to give (FewSharedNamesWarning) when most of the step would be stored whole for want of
    matching names, else None.

    That is when the tensors match under half of the parent's bytes by name (shape and dtype) *and* under
    half of their own bytes match a parent tensor: a step that keeps fewer tensors than its parent (weights
    without the optimizer state) or adds some (a new head) is still delta-coded where it matters, and says
    nothing.  ``tensors`` are all the step will hold, training state included.
    """
    if parent is None:
        return None
    if parent is HEAD:
        parent_step = traj.head(branch) if branch is not None else traj.head()
    else:
        parent_step = traj.info(parent).step
    if parent_step is None:
        return None
    theirs = traj.tensors(parent_step)
    ours = {n: (tuple(a.shape), _np_dtype(a)) for n, a in tensors.items()}
    shared = name_overlap(theirs, ours)
    if shared >= MIN_SHARED or name_overlap(ours, theirs) >= MIN_SHARED:
        return None
    changed = retyped(theirs, ours)
    if changed and name_overlap(theirs, ours | {n: theirs[n] for n in changed}) >= MIN_SHARED:
        # the names line up; the dtype or shape moved (bf16 weights saved as fp32): renaming would not help, and
        # the commit says so itself (as any commit does: one warning, in the same words)
        return None
    hint = suggest_prefixes(theirs, ours)
    after = shared
    if hint:
        old, new = next(iter(hint.items()))
        after = name_overlap(theirs, {(new + n[len(old) :] if n.startswith(old) else n): v for n, v in ours.items()})
    text = (
        f"{path}: its tensor names match {shared:.0%} of parent step {parent_step}'s bytes, so the rest is "
        "stored whole instead of as a delta"
    )
    if hint and after > shared:
        text += (
            f"; renaming prefix {old!r} to {new!r} would match {after:.0%}: pass rename_prefix={hint!r} "
            f"(exports keep the file's names)"
        )
    else:
        text += "; if the tensors were renamed, pass rename_prefix={OLD: NEW}"
    return FewSharedNamesWarning(
        text, shared=shared, parent=parent_step, suggestion=hint if after > shared else {}, suggested_shared=after
    )


def _np_dtype(a) -> np.dtype:
    """The numpy dtype of an array or a torch tensor (training state is loaded as torch tensors)."""
    return from_tensor(a[:0] if a.ndim else a).dtype if is_tensor(a) else np.dtype(a.dtype)


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
