"""Checkpoint names: the format of a path, the step a name carries, the format of an output path."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import InvalidInputError, NotFoundError

__all__ = ["CHECKPOINT_KEY", "FORMATS", "checkpoint_format", "step_from_path", "output_format"]

#: Step-metadata key under which :func:`import_checkpoint` keeps what the file held besides tensors.
CHECKPOINT_KEY = "checkpoint"

#: Export formats: name -> what is written.
FORMATS = {
    "safetensors": "one .safetensors file",
    "sharded": "a directory of safetensors shards plus model.safetensors.index.json",
    "torch": "a torch state dict (.pt/.pth/.bin), tied tensors sharing storage",
    "npz": "an uncompressed .npz (bf16/fp8 as raw bits, see ulstore.io.checkpoints)",
}

_INDEX_NAME = "model.safetensors.index.json"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# File names that say nothing about the step: the step is in the directory name.
_GENERIC_NAMES = re.compile(
    r"^(model|pytorch_model|diffusion_pytorch_model|adapter_model|consolidated|weights?|checkpoint|state_dict)"
    r"(\.safetensors\.index\.json|\.bin\.index\.json|\.safetensors|\.bin|\.pt|\.pth|\.npz)$",
    re.IGNORECASE,
)
_STEP_WORD = re.compile(r"(?:global[-_]?step|step|checkpoint|ckpt|iteration|iter|it)[-_.]?(\d+)(?!.*\d)", re.IGNORECASE)
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def checkpoint_format(path) -> str:
    """The format of a checkpoint path: ``"safetensors"``, ``"sharded"``, ``"torch"`` or ``"npz"``.

    Parameters
    ----------
    path : str or os.PathLike
        A file or a Hugging Face model directory (which need not be sharded).

    Returns
    -------
    str

    Raises
    ------
    NotFoundError
        ``path`` does not exist.
    InvalidInputError
        The format cannot be told from the name.

    Examples
    --------
    >>> import tempfile
    >>> import numpy as np
    >>> from ulstore.io import checkpoints
    >>> d = tempfile.mkdtemp()
    >>> checkpoints.save_npz({"w": np.ones(2, np.float32)}, f"{d}/step_10.npz")
    >>> checkpoint_format(f"{d}/step_10.npz")
    'npz'
    """
    p = Path(path)
    if p.is_dir():
        return "sharded" if (p / _INDEX_NAME).is_file() or any(p.glob("*.safetensors.index.json")) else "safetensors"
    if not p.exists():
        raise NotFoundError(f"{p}: no such checkpoint file or directory")
    name = p.name.lower()
    if name.endswith(".index.json"):
        return "sharded"
    kind = _file_kind(name)
    if kind:
        return kind
    raise InvalidInputError(
        f"{p}: cannot tell the checkpoint format from the name; expected .safetensors, "
        "a Hugging Face directory or its *.safetensors.index.json, .pt/.pth/.bin or .npz"
    )


def _file_kind(name: str) -> str | None:
    """The single-file checkpoint format a (lower-case) file name names, if any."""
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(_TORCH_SUFFIXES):
        return "torch"
    if name.endswith(".npz"):
        return "npz"
    return None


def step_from_path(path) -> int | None:
    """The training step a checkpoint's name carries, or None.

    The number after ``step``, ``checkpoint``, ``ckpt``, ``iter`` or
    ``global_step`` wins; otherwise a number that ends the name.  Generic
    file names (``model.safetensors``, ``pytorch_model.bin``, an index) take
    the step from their directory.

    Examples
    --------
    >>> step_from_path("runs/step_001200.safetensors")
    1200
    >>> step_from_path("out/checkpoint-1200/")
    1200
    >>> step_from_path("out/checkpoint-1200/model.safetensors.index.json")
    1200
    >>> step_from_path("llama-7b-ckpt3000.pt"), step_from_path("model.safetensors")
    (3000, None)
    """
    p = Path(path)
    name = p.name
    if _GENERIC_NAMES.match(name) or re.match(r"^model-\d+-of-\d+\.safetensors$", name):
        name = p.parent.name
    stem = re.sub(
        r"(\.safetensors\.index\.json|\.index\.json|\.safetensors|\.pth?|\.bin|\.npz)$", "", name, flags=re.IGNORECASE
    )
    for pattern in (_STEP_WORD, _TRAILING_NUMBER):
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None


def output_format(out, *, format: str | None = None, max_shard_size=None) -> str:
    """The export format for output path ``out`` (see :data:`FORMATS`).

    ``.safetensors`` -> ``"safetensors"``; ``.pt``/``.pth``/``.bin`` ->
    ``"torch"``; ``.npz`` -> ``"npz"``; an existing directory, a path ending
    in ``/`` or a name without a suffix -> ``"sharded"`` (a Hugging Face
    directory).  ``max_shard_size`` also means ``"sharded"``.

    Examples
    --------
    >>> output_format("m.safetensors"), output_format("export/checkpoint-7"), output_format("sd.pt")
    ('safetensors', 'sharded', 'torch')
    """
    if format is not None:
        if format not in FORMATS:
            raise InvalidInputError(f"unknown export format {format!r}; expected one of {sorted(FORMATS)}")
        if max_shard_size is not None and format != "sharded":
            raise InvalidInputError(f"a shard size only applies to sharded output, not {format!r}")
        return format
    text = os.fspath(out)
    p = Path(text)
    name = p.name.lower()
    if p.is_dir() or text.endswith(("/", os.sep)) or not p.suffix:
        return "sharded"
    if max_shard_size is not None:
        raise InvalidInputError(f"{p}: sharded output is a directory; give a directory name (no suffix)")
    kind = _file_kind(name)
    if kind:
        return kind
    raise InvalidInputError(
        f"{p}: cannot tell the export format from the suffix {p.suffix!r}; use .safetensors, .pt/.pth/.bin, "
        ".npz or a directory name"
    )
