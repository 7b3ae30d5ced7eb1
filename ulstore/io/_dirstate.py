"""The rest of a checkpoint directory, kept with its step: small files byte for byte, torch training state flattened.

A Hugging Face model directory or a Trainer ``checkpoint-N/`` holds more than
weights (:func:`~ulstore.io._hfdir.sort_directory` sorts it).  On import:

* every small file (``config.json``, tokenizer files, ``trainer_state.json``,
  ``training_args.bin``, ``rng_state.pth``...) becomes a **file** of the step,
  byte for byte (content-addressed by the store: an unchanged ``config.json``
  costs nothing the next step);
* each torch state file (``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``) is
  loaded safely and flattened: its tensors join the step under ``_state/``
  (``_state/optimizer.state.0.exp_avg``: Adam's fp32 moments are delta-coded
  against the previous step's, like weights) and its skeleton (everything
  else, exact types) becomes the file ``_state/optimizer.json``;
* files too large to keep (not weights, over ``MAX_FILE_BYTES``) are listed.

What was kept is recorded in the step's ``checkpoint`` metadata (``files``,
``state``, ``not_kept``).  Exporting the step to a directory writes the files
back and rebuilds each torch state file with ``torch.save``: what ``torch.load``
returns equals the original (values, dtypes, types, structure); the zip bytes
are torch's business.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.sealed import canonical_json
from ..errors import CorruptManifestError, InvalidInputError
from ._hfdir import MAX_FILE_BYTES, load_torch_state, sort_directory
from ._nested import unflatten_state

__all__ = ["STATE_DIR", "directory_extras", "is_state_tensor", "restore_extras"]

#: Tensors and files of torch training state live under this name prefix (never a weight's).
STATE_DIR = "_state/"


def is_state_tensor(name: str) -> bool:
    """Whether a step's tensor belongs to flattened training state (not a weight)."""
    return name.startswith(STATE_DIR)


def directory_extras(directory, weight_names, *, max_file_bytes: int | None = None) -> tuple[dict, dict, dict]:
    """``(state tensors, files, info)``: what a checkpoint directory holds besides its weights.

    ``info`` goes into the step's ``checkpoint`` metadata: ``files`` (names kept),
    ``state`` (``{"optimizer.pt": {"skeleton": "_state/optimizer.json", "tensors": N}}``)
    and ``not_kept`` (``{name: size}``).

    Raises
    ------
    InvalidInputError
        A weight or a file of the directory uses the reserved prefix ``_state/``, or
        a torch state file holds what cannot be kept exactly.
    """
    clash = sorted(n for n in weight_names if is_state_tensor(n))
    if clash:
        raise InvalidInputError(f"{directory}: tensor names starting with {STATE_DIR!r} are reserved: {clash[:3]}")
    root = Path(directory)
    parts = sort_directory(root, max_file_bytes=MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes)
    reserved = sorted(n for n in parts.files if n.startswith(STATE_DIR))
    if reserved:
        raise InvalidInputError(f"{directory}: file names starting with {STATE_DIR!r} are reserved: {reserved[:3]}")
    tensors: dict = {}
    files = dict(parts.files)
    state: dict[str, dict] = {}
    for rel in parts.torch_state:
        stem = rel.rsplit(".", 1)[0]
        flat = load_torch_state(root / rel, prefix=stem)
        tensors.update({STATE_DIR + name: t for name, t in flat.tensors.items()})
        skeleton = f"{STATE_DIR}{stem}.json"
        files[skeleton] = canonical_json(flat.skeleton)
        state[rel] = {"skeleton": skeleton, "tensors": len(flat.tensors)}
    info = {"files": sorted(parts.files), "state": state, "not_kept": dict(parts.too_large)}
    return tensors, files, info


def restore_extras(traj, step: int, meta: dict, out: Path) -> list[str]:
    """Write a step's kept files and rebuilt torch state files into directory ``out``; returns the names written."""
    written = []
    kept = meta.get("files") or []
    for name in kept:
        _write(out, name, traj.read_file(step, name))
        written.append(name)
    state = meta.get("state") or {}
    if state:
        from ..core.torch import import_torch
        from . import checkpoints as _ck

        torch = import_torch()
        for rel, entry in state.items():
            try:
                skeleton = json.loads(traj.read_file(step, entry["skeleton"]))
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptManifestError(f"training state {rel!r}: bad skeleton: {e}", step=step) from e
            names = _tensor_names(skeleton.get("root"))
            stored = _ck.to_torch(traj.read(step, [STATE_DIR + n for n in names])) if names else {}
            obj = unflatten_state({n[len(STATE_DIR) :]: t for n, t in stored.items()}, skeleton)
            path = _target(out, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, path)
            written.append(rel)
    return written


def _tensor_names(node) -> list[str]:
    """Names of the tensors a skeleton refers to, in order (iterative: skeletons can be deep)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict) and len(n) == 1:
            ((tag, body),) = n.items()
            if tag == "tensor" and isinstance(body, str):
                out.append(body)
            elif tag == "dict" and isinstance(body, list):
                stack.extend(v for pair in reversed(body) if isinstance(pair, list) and len(pair) == 2 for v in pair)
            elif tag in ("list", "tuple") and isinstance(body, list):
                stack.extend(reversed(body))
    return out


def _target(out: Path, name: str) -> Path:
    path = (out / name).resolve()
    if out.resolve() not in path.parents:
        raise CorruptManifestError(f"file name {name!r} leaves the export directory")
    return path


def _write(out: Path, name: str, data: bytes) -> None:
    path = _target(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
