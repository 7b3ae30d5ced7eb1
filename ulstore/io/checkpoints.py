"""Exact import and export of checkpoints as ``dict[str, numpy.ndarray]``.

This layer turns checkpoint files into plain numpy arrays and back, bit for bit.
It knows nothing of the store or the codec.

Formats read by :func:`load` (chosen from the path):

* ``*.safetensors``: one safetensors file;
* a Hugging Face directory, or its ``model.safetensors.index.json``: every
  shard named in the index's ``weight_map`` (a directory holding a single
  ``model.safetensors`` works too);
* ``*.pt``, ``*.pth``, ``*.bin``: a flat torch state dict (needs PyTorch);
* ``*.npz``: numpy archives, with the bf16/fp8 convention below.

Dtypes: bool, int8/16/32/64, uint8/16/32/64, float16/32/64, and, as
``ml_dtypes`` dtypes, bfloat16, float8_e4m3fn and float8_e5m2 (never a bare
``uint16``). Arrays come back little-endian and C-contiguous.

bf16 and fp8 in ``.npz``
    npy has no code for these dtypes (numpy would store them as opaque
    ``|V2``). :func:`save_npz` therefore stores their raw bits as ``<u2``
    (bf16) or ``|u1`` (fp8) members and adds one extra member, ``__dtypes__``:
    a 0-d unicode array holding JSON ``{"name": "bfloat16" | "float8_e4m3fn" |
    "float8_e5m2"}``. :func:`load_npz` views those members back. Any other
    reader still gets the exact bits: ``arr.view(ml_dtypes.bfloat16)``.
    ``__dtypes__`` is thus a reserved name.

safetensors
    Files are written with the ``safetensors`` library (it writes bf16 and
    fp8 from numpy fine). Its numpy *reader* rejects bf16/fp8, so this module
    reads the format itself: 8-byte little-endian header length, a JSON
    header of ``{name: {dtype, shape, data_offsets}}`` plus optional
    ``__metadata__``, then the data. Headers are untrusted and checked
    strictly, as the safetensors spec asks (offsets must tile the data region
    with no hole or overlap); anything wrong raises
    :class:`~ulstore.errors.InvalidInputError` with one line naming the file.

Tied tensors
    Torch state dicts may hold one tensor under two names (e.g. ``lm_head``
    tied to ``embed_tokens``). :func:`load` keeps it once, under the first
    name, in ``Checkpoint.tensors`` and records the other names in
    ``Checkpoint.aliases`` (alias -> canonical); :func:`save_torch` and
    :func:`to_torch` restore the sharing. Only exact aliases (same storage,
    offset, shape, strides and dtype) are recorded; other overlapping views
    load as independent, exact copies.

Every writer is atomic: it writes a hidden temporary file in the target
directory and ``os.replace``-s it, so a crash never leaves a partial file
under the final name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..core.safetensors import first_line, no_duplicates
from ..errors import InvalidInputError, NotFoundError
from . import _safetensors
from ._files import SUPPORTED_DTYPES, Checkpoint, _bad, parse_size
from ._npz import load_npz, save_npz
from ._safetensors import check_shard_name, load_safetensors, save_safetensors
from ._torch import from_torch, load_torch, save_torch, to_torch

__all__ = [
    "Checkpoint",
    "load",
    "load_safetensors",
    "load_torch",
    "load_npz",
    "save_safetensors",
    "save_torch",
    "save_npz",
    "to_torch",
    "from_torch",
    "parse_size",
    "SUPPORTED_DTYPES",
]

_INDEX_NAME = _safetensors._INDEX_NAME
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def load(path, *, mmap: bool = False) -> Checkpoint:
    """Load a checkpoint, choosing the format from ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.safetensors`` file, a Hugging Face directory or its
        ``*.safetensors.index.json``, a torch ``.pt``/``.pth``/``.bin`` state
        dict, or an ``.npz`` archive.
    mmap : bool
        safetensors files (single or sharded): memory-map the tensors
        (read-only) instead of reading them (see :func:`load_safetensors`).

    Returns
    -------
    Checkpoint

    Raises
    ------
    NotFoundError
        ``path`` (or a shard it names) does not exist.
    InvalidInputError
        The format cannot be told from the name, or the file is malformed.

    Examples
    --------
    >>> import tempfile, numpy as np, ml_dtypes
    >>> p = Path(tempfile.mkdtemp()) / "m.safetensors"
    >>> save_safetensors({"w": np.ones(3, ml_dtypes.bfloat16)}, p, {"step": "7"})
    >>> ck = load(p)
    >>> ck.tensors["w"].dtype, ck.metadata
    (dtype(bfloat16), {'step': '7'})
    """
    p = Path(path)
    if p.is_dir():
        return _load_hf_dir(p, mmap)
    if not p.exists():
        raise NotFoundError(f"{p}: no such checkpoint file or directory")
    name = p.name.lower()
    if name.endswith(".index.json"):
        return _load_sharded(p, mmap)
    if name.endswith(".safetensors"):
        return load_safetensors(p, mmap=mmap)
    if name.endswith(_TORCH_SUFFIXES):
        return load_torch(p)
    if name.endswith(".npz"):
        return load_npz(p)
    raise InvalidInputError(
        f"{p}: cannot tell the checkpoint format from the name; expected "
        ".safetensors, *.safetensors.index.json, a directory, .pt/.pth/.bin or .npz"
    )


def _load_hf_dir(d: Path, mmap: bool = False) -> Checkpoint:
    """Pick the index or single file in a Hugging Face model directory."""
    if (d / _INDEX_NAME).is_file():
        return _load_sharded(d / _INDEX_NAME, mmap)
    if (d / "model.safetensors").is_file():
        return load_safetensors(d / "model.safetensors", mmap=mmap)
    # Other libraries use other prefixes (e.g. diffusion_pytorch_model): accept
    # a lone index, else a lone file.
    for pattern, sharded in (("*.safetensors.index.json", True), ("*.safetensors", False)):
        found = sorted(d.glob(pattern))
        if len(found) == 1:
            return _load_sharded(found[0], mmap) if sharded else load_safetensors(found[0], mmap=mmap)
    raise InvalidInputError(f"{d}: directory holds neither {_INDEX_NAME} nor a single *.safetensors file")


def _load_sharded(index_path: Path, mmap: bool = False) -> Checkpoint:
    """Load every shard of an index, checking each tensor is where the index says.

    ``metadata`` is the shards' ``__metadata__`` (equal in every shard); the
    index itself, with its own ``metadata`` of any JSON type, is kept verbatim
    in ``index_text``.
    """
    try:
        text = index_path.read_bytes().decode("utf-8")
        index = json.loads(text, object_pairs_hook=no_duplicates)
    except FileNotFoundError:
        raise NotFoundError(f"{index_path}: no such index file") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(index_path, f"not valid JSON: {first_line(e)}", kind="index") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise _bad(index_path, "needs a weight_map object of tensor name -> shard file", kind="index")
    index_meta = index.get("metadata") or {}
    if not isinstance(index_meta, dict):
        raise _bad(index_path, "metadata is not an object", kind="index")

    by_shard: dict[str, list[str]] = {}
    for name, shard in wmap.items():
        # Untrusted names must not reach outside the model directory.
        try:
            check_shard_name(shard)
        except InvalidInputError:
            raise _bad(index_path, f"shard name {shard!r} leaves the model directory", kind="index") from None
        by_shard.setdefault(shard, []).append(name)

    tensors: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {}
    for shard, names in by_shard.items():
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise NotFoundError(f"{index_path}: shard {shard!r} named in weight_map is missing")
        ck = load_safetensors(shard_path, mmap=mmap)
        for name in names:
            if name not in ck.tensors:
                raise _bad(index_path, f"tensor {name!r} is mapped to {shard} but is not in it", kind="index")
        for name in ck.tensors:
            if wmap.get(name) != shard:
                raise _bad(
                    index_path, f"{shard} holds tensor {name!r}, which weight_map does not map to it", kind="index"
                )
        tensors.update(ck.tensors)
        _merge_metadata(metadata, ck.metadata, index_path, shard)
    return Checkpoint({name: tensors[name] for name in wmap}, metadata, index_text=text)


def _merge_metadata(into: dict, new: dict, index_path: Path, where: str) -> None:
    # Dropping either value of a clash would lose information, so refuse.
    for k, v in new.items():
        if into.setdefault(k, v) != v:
            raise _bad(index_path, f"metadata {k!r} is {into[k]!r} in one shard but {v!r} in {where}", kind="index")
