"""A checkpoint directory (Hugging Face model or Trainer ``checkpoint-N/``) sorted into what a step keeps.

A directory holds three kinds of files:

* **weights**: ``model.safetensors``, its shards and index, ``pytorch_model*.bin``:
  imported as the step's tensors (:func:`ulstore.io.checkpoints.load`);
* **torch state**: ``optimizer.pt``, ``scheduler.pt``: nested dicts of tensors and
  numbers, loaded safely (``torch.load(weights_only=True)``) and flattened
  (:func:`ulstore.io._nested.flatten_state`) so that their tensors (Adam's fp32
  moments) are delta-coded like weights and the rest is kept exactly;
* **small files**: ``config.json``, ``generation_config.json``, tokenizer files,
  ``trainer_state.json``, ``training_args.bin``, ``rng_state.pth``... kept byte
  for byte as the step's files (content-addressed: an unchanged ``config.json``
  costs nothing the second time).

:func:`sort_directory` does the sorting and reads the small files; it decides
nothing about storage.  Files larger than ``max_file_bytes`` that are neither
weights nor torch state are listed in ``too_large``, for the caller to report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidInputError, NotFoundError
from ._nested import FlatState, flatten_state

__all__ = ["DirectoryParts", "sort_directory", "load_torch_state", "MAX_FILE_BYTES", "TORCH_STATE_FILES"]

#: Small files above this size are not kept (reported in ``too_large``): tokenizer.json files reach a few MB.
MAX_FILE_BYTES = 64 << 20
#: File names holding torch training state (nested dicts of tensors) rather than weights or opaque pickles.
TORCH_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")
_WEIGHTS = re.compile(
    r"(.*\.safetensors|.*\.safetensors\.index\.json|pytorch_model.*\.bin|pytorch_model\.bin\.index\.json)$"
)


@dataclass
class DirectoryParts:
    """What :func:`sort_directory` found, by relative POSIX path.

    ``weights``: paths of weight files; ``torch_state``: paths of torch state files;
    ``files``: path -> bytes of every other file; ``too_large``: path -> size of
    files not kept because they exceed the limit.
    """

    weights: list[str] = field(default_factory=list)
    torch_state: list[str] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    too_large: dict[str, int] = field(default_factory=dict)


def sort_directory(directory, *, max_file_bytes: int = MAX_FILE_BYTES) -> DirectoryParts:
    """Sort a checkpoint directory's files into weights, torch state and small files (read).

    Hidden files (``.name``) and symbolic links that leave the directory are skipped;
    subdirectories are walked (their paths keep the ``sub/`` prefix).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text("{}")
    >>> _ = (d / "model.safetensors").write_bytes(b"")
    >>> parts = sort_directory(d)
    >>> parts.weights, sorted(parts.files)
    (['model.safetensors'], ['config.json'])
    """
    root = Path(directory)
    if not root.is_dir():
        raise NotFoundError(f"{root}: no such checkpoint directory")
    real_root = root.resolve()
    parts = DirectoryParts()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if any(p.startswith(".") for p in rel.split("/")) or not path.is_file():
            continue
        if real_root not in path.resolve().parents:
            continue  # a link out of the directory: not part of the checkpoint
        name = path.name
        if _WEIGHTS.fullmatch(name):
            parts.weights.append(rel)
        elif name in TORCH_STATE_FILES:
            parts.torch_state.append(rel)
        else:
            size = path.stat().st_size
            if size > max_file_bytes:
                parts.too_large[rel] = size
            else:
                parts.files[rel] = path.read_bytes()
    return parts


def load_torch_state(path, *, prefix: str | None = None) -> FlatState:
    """A torch state file (``optimizer.pt``...) loaded safely and flattened into tensors and a skeleton.

    Tensor names start with ``prefix`` (default: the file's stem, ``optimizer``).

    Raises
    ------
    InvalidInputError
        The file holds objects a weights-only load refuses, or leaves
        :func:`~ulstore.io._nested.flatten_state` cannot keep.
    """
    from ._torch import safe_load

    p = Path(path)
    obj = safe_load(p)
    try:
        return flatten_state(obj, prefix=p.stem if prefix is None else prefix)
    except InvalidInputError as e:
        raise InvalidInputError(f"{p}: {e.message}") from e
