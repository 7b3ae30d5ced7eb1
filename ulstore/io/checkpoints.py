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

import contextlib
import json
import os
import re
import secrets
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes  # noqa: F401  (the doctests use it)
import numpy as np
from safetensors import numpy as _st_numpy

from .core.dtypes import ML_DTYPES, RAW_BITS, STORABLE
from .core.safetensors import MAX_HEADER, first_line as _first_line, no_duplicates as _no_duplicates, parse_header
from .core.torch import dtype_table as _torch_table, from_tensor, import_torch as _import_torch, to_tensor
from .errors import DtypeError, InvalidInputError, NotFoundError

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
    "SUPPORTED_DTYPES",
]

#: Every dtype this module reads and writes (little-endian forms).
SUPPORTED_DTYPES: frozenset[np.dtype] = STORABLE
_RAW_BITS = RAW_BITS
_ML_BY_NAME = ML_DTYPES
_MAX_HEADER = MAX_HEADER
_NPZ_DTYPES_KEY = "__dtypes__"
_INDEX_NAME = "model.safetensors.index.json"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class Checkpoint:
    """One checkpoint as numpy arrays.

    Attributes
    ----------
    tensors : dict[str, numpy.ndarray]
        Every distinct tensor, in file order; tied names are not repeated.
    metadata : dict[str, str]
        File-level metadata (safetensors ``__metadata__``, index ``metadata``).
    aliases : dict[str, str]
        Tied names: alias -> the canonical name it shares storage with.

    Examples
    --------
    >>> ck = Checkpoint({"w": np.zeros(2, np.float32)}, aliases={"w2": "w"})
    >>> sorted(ck.all_tensors())
    ['w', 'w2']
    """

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def all_tensors(self) -> dict[str, np.ndarray]:
        """Return ``tensors`` plus every alias, mapped to the same array object."""
        out = dict(self.tensors)
        out.update((a, self.tensors[c]) for a, c in self.aliases.items())
        return out


# --------------------------------------------------------------------------- load


def load(path) -> Checkpoint:
    """Load a checkpoint, choosing the format from ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.safetensors`` file, a Hugging Face directory or its
        ``*.safetensors.index.json``, a torch ``.pt``/``.pth``/``.bin`` state
        dict, or an ``.npz`` archive.

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
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "m.safetensors"
    >>> save_safetensors({"w": np.ones(3, ml_dtypes.bfloat16)}, p, {"step": "7"})
    >>> ck = load(p)
    >>> ck.tensors["w"].dtype, ck.metadata
    (dtype(bfloat16), {'step': '7'})
    """
    p = Path(path)
    if p.is_dir():
        return _load_hf_dir(p)
    if not p.exists():
        raise NotFoundError(f"{p}: no such checkpoint file or directory")
    name = p.name.lower()
    if name.endswith(".index.json"):
        return _load_sharded(p)
    if name.endswith(".safetensors"):
        return load_safetensors(p)
    if name.endswith(_TORCH_SUFFIXES):
        return load_torch(p)
    if name.endswith(".npz"):
        return load_npz(p)
    raise InvalidInputError(
        f"{p}: cannot tell the checkpoint format from the name; expected "
        ".safetensors, *.safetensors.index.json, a directory, .pt/.pth/.bin or .npz"
    )


def load_safetensors(path) -> Checkpoint:
    """Read one ``.safetensors`` file exactly, bf16 and fp8 included.

    Examples
    --------
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "m.safetensors"
    >>> save_safetensors({"b": np.array([True, False])}, p)
    >>> load_safetensors(p).tensors["b"]
    array([ True, False])
    """
    p = Path(path)
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"{p}: no such safetensors file") from None
    except IsADirectoryError:
        raise InvalidInputError(f"{p}: is a directory, not a safetensors file") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise _bad(p, f"only {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise _bad(p, f"header length {n} runs past the end of the {size}-byte file (truncated?)")
        if n > _MAX_HEADER:
            raise _bad(p, f"header length {n} exceeds the {_MAX_HEADER}-byte limit")
        entries, metadata = _parse_header(p, f.read(n), size - 8 - n)
        tensors = {}
        # Read in file order so the disk access is sequential.
        for name, (dtype, shape, begin, end) in sorted(entries.items(), key=lambda e: e[1][2]):
            try:  # fresh, aligned and owned; its size is bounded by the file's
                arr = np.empty(shape, dtype)
            except (ValueError, MemoryError) as e:
                raise _bad(p, f"tensor {name!r}: cannot allocate shape {list(shape)}: {_first_line(e)}") from None
            f.seek(8 + n + begin)
            _read_into(f, arr, p, name)
            tensors[name] = arr
    # Hand tensors back in header order, as the file lists them.
    return Checkpoint({name: tensors[name] for name in entries}, metadata)


def load_torch(path) -> Checkpoint:
    """Read a flat torch state dict (``torch.load(weights_only=True)``).

    Tensors become numpy arrays sharing the loaded memory where possible;
    tied names go to ``aliases``. Requires PyTorch.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "m.pt"
    >>> save_torch({"emb": np.ones((2, 2), np.float32)}, p, aliases={"head": "emb"})
    >>> load_torch(p).aliases
    {'head': 'emb'}
    """
    torch = _import_torch()
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(f"{p}: no such torch checkpoint file")
    try:
        obj = torch.load(p, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises a zoo of types (UnpicklingError, RuntimeError, EOFError...)
        raise _bad(p, f"cannot read as a torch checkpoint: {_first_line(e)}", kind="torch") from e
    if not isinstance(obj, Mapping):
        raise _bad(p, f"holds a {type(obj).__name__}, not a state dict", kind="torch")
    try:
        return from_torch(obj)
    except InvalidInputError as e:
        raise type(e)(f"{p}: {e.message}") from e


def load_npz(path) -> Checkpoint:
    """Read an ``.npz`` archive, restoring bf16/fp8 listed in ``__dtypes__``.

    Examples
    --------
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "m.npz"
    >>> save_npz({"w": np.ones(2, ml_dtypes.float8_e5m2)}, p)
    >>> load_npz(p).tensors["w"].dtype
    dtype(float8_e5m2)
    """
    p = Path(path)
    try:
        archive = np.load(p, allow_pickle=False)
    except FileNotFoundError:
        raise NotFoundError(f"{p}: no such npz file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise _bad(p, f"cannot read: {_first_line(e)}", kind="npz") from e
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise _bad(p, "is a single .npy array, not an .npz archive", kind="npz")
    with archive:
        try:
            special = _npz_dtypes(p, archive)
            tensors = {}
            for name in archive.files:
                if name == _NPZ_DTYPES_KEY:
                    continue
                arr = _le_contiguous(name, archive[name])
                if name in special:
                    want = special.pop(name)
                    if arr.dtype != _RAW_BITS[want]:
                        raise _bad(p, f"member {name!r} is {arr.dtype}, but {want.name} needs {_RAW_BITS[want]}",
                                   kind="npz")
                    arr = arr.view(want)
                tensors[name] = arr
        except InvalidInputError as e:
            if str(p) in e.message:
                raise
            raise type(e)(f"{p}: {e.message}") from None  # e.g. a DtypeError: name the file
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise _bad(p, f"cannot read: {_first_line(e)}", kind="npz") from e
    if special:
        raise _bad(p, f"{_NPZ_DTYPES_KEY} names missing member {next(iter(special))!r}", kind="npz")
    return Checkpoint(tensors)


# -------------------------------------------------------------------------- save


def save_safetensors(tensors, path, metadata=None, *, max_shard_size=None) -> None:
    """Write tensors as safetensors, atomically.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray]
        Big-endian or non-contiguous arrays are converted (exactly).
    path : str or os.PathLike
        The file to write; with ``max_shard_size``, the directory to write
        ``model-00001-of-0000N.safetensors`` shards and
        ``model.safetensors.index.json`` into (created if needed).
    metadata : dict[str, str], optional
        Written as ``__metadata__`` (in every shard, and in the index's
        ``metadata`` next to the recomputed ``total_size``).
    max_shard_size : int or str, optional
        Shard limit in bytes of tensor data, or a string such as ``"5GB"`` or
        ``"500MiB"``. Tensors are packed greedily in order, as Hugging Face
        does; a tensor larger than the limit gets a shard of its own.

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()) / "model"
    >>> t = {"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32)}
    >>> save_safetensors(t, d, max_shard_size=400)
    >>> sorted(f.name for f in d.iterdir())
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
    """
    arrays = _prepare(tensors, reserved=("__metadata__",))
    meta = _check_metadata(metadata)
    p = Path(path)
    if max_shard_size is None:
        if p.is_dir():
            raise InvalidInputError(f"{p}: is a directory; pass max_shard_size to write shards there")
        with _atomic_path(p) as tmp:
            _write_safetensors_file(arrays, tmp, meta)
        return

    limit = _parse_size(max_shard_size)
    if p.exists() and not p.is_dir():
        raise InvalidInputError(f"{p}: is a file; with max_shard_size the path names a directory")
    shards: list[dict[str, np.ndarray]] = [{}]
    used = 0
    for name, arr in arrays.items():
        if shards[-1] and used + arr.nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = arr
        used += arr.nbytes
    # total_size is derived from the tensors, so a stale value must not travel on.
    meta.pop("total_size", None)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        with _atomic_path(p / fname) as tmp:
            _write_safetensors_file(shard, tmp, meta)
        weight_map.update(dict.fromkeys(shard, fname))
    # The index goes last: until it lands, the directory does not claim the new shards.
    index = {"metadata": {**meta, "total_size": sum(a.nbytes for a in arrays.values())},
             "weight_map": weight_map}
    with _atomic_path(p / _INDEX_NAME) as tmp:
        Path(tmp).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def save_torch(tensors, path, aliases=None) -> None:
    """Write a torch state dict atomically, restoring tied storage.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray]
    path : str or os.PathLike
    aliases : dict[str, str], optional
        alias -> canonical name; each alias is saved as the very same tensor
        as its canonical name, so ``torch.load`` gives them shared storage.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "m.pt"
    >>> save_torch({"emb": np.ones(4, np.float32)}, p, aliases={"head": "emb"})
    >>> sd = torch.load(p, weights_only=True)
    >>> sd["head"].data_ptr() == sd["emb"].data_ptr()
    True
    """
    torch = _import_torch()
    state = to_torch(tensors, aliases)
    with _atomic_path(Path(path)) as tmp:
        torch.save(state, tmp)


def save_npz(tensors, path) -> None:
    """Write an uncompressed ``.npz`` atomically (bf16/fp8 per the module convention).

    Examples
    --------
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "m.npz"
    >>> save_npz({"w": np.ones(2, ml_dtypes.bfloat16)}, p)
    >>> with np.load(p) as z:
    ...     z["w"].dtype, str(z["__dtypes__"])
    (dtype('uint16'), '{"w": "bfloat16"}')
    """
    arrays = _prepare(tensors, reserved=(_NPZ_DTYPES_KEY,))
    special = {}
    for name, arr in arrays.items():
        if arr.dtype in _RAW_BITS:
            special[name] = arr.dtype.name
            arrays[name] = arr.view(_RAW_BITS[arr.dtype])
    if special:
        arrays[_NPZ_DTYPES_KEY] = np.array(json.dumps(special))
    with _atomic_path(Path(path)) as tmp:
        # What np.savez does, minus its keyword arguments: a tensor named
        # "file" or "allow_pickle" would collide with them.
        with zipfile.ZipFile(tmp, "x", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in arrays.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, arr, allow_pickle=False)


# ------------------------------------------------------------------------- torch


def to_torch(tensors, aliases=None) -> dict:
    """Convert numpy arrays to a torch state dict, sharing memory where possible.

    bf16/fp8 are reinterpreted bit for bit. Read-only arrays are copied (torch
    tensors are writable). Each alias maps to the same tensor as its
    canonical name, in the alias's position if ``tensors`` also lists it,
    else at the end.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> sd = to_torch({"w": np.ones(2, ml_dtypes.bfloat16)}, aliases={"v": "w"})
    >>> sd["w"].dtype, sd["v"] is sd["w"]
    (torch.bfloat16, True)
    """
    _import_torch()
    aliases = dict(aliases or {})
    arrays = _prepare(tensors)
    _check_aliases(arrays, aliases)
    converted = {}
    for name, arr in arrays.items():
        if name in aliases:
            continue
        if not arr.flags.writeable:
            arr = arr.copy()
        converted[name] = to_tensor(arr)
    out = {name: converted[aliases.get(name, name)] for name in arrays}
    out.update((a, converted[c]) for a, c in aliases.items() if a not in out)
    return out


def from_torch(state_dict) -> Checkpoint:
    """Convert a flat torch state dict to a :class:`Checkpoint` (no file I/O).

    Arrays share memory with CPU tensors where possible; non-contiguous
    tensors are made contiguous. A name whose tensor is exactly another
    name's tensor (same storage, offset, shape, strides, dtype) becomes an
    alias of the first such name.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> w = torch.arange(4, dtype=torch.bfloat16)
    >>> ck = from_torch({"emb": w, "head": w})
    >>> ck.tensors["emb"].dtype, ck.aliases
    (dtype(bfloat16), {'head': 'emb'})
    """
    torch = _import_torch()
    table = {t: n for n, t in _torch_table(torch).items()}
    tensors, aliases, seen = {}, {}, {}
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"state dict key {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"entry {name!r} is a {type(t).__name__}, not a tensor; only flat "
                "state dicts are supported (pass e.g. ckpt['state_dict'])"
            )
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise InvalidInputError(f"tensor {name!r} is not a dense, materialized tensor ({t.layout}, {t.device})")
        if t.dtype not in table:
            raise DtypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        # Zero-size tensors may all report storage pointer 0: never tie them.
        if t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
        tensors[name] = from_tensor(t)  # no copy for plain CPU tensors
    return Checkpoint(tensors, {}, aliases)


# ------------------------------------------------------------------- safetensors


def _parse_header(p: Path, raw: bytes, data_len: int):
    """Validate a safetensors header; return ``({name: (dtype, shape, begin, end)}, metadata)``."""
    return parse_header(raw, data_len, lambda why: _bad(p, why))


def _write_safetensors_file(arrays: dict, path: str, metadata: dict) -> None:
    """Write one safetensors file with the library (the test suite patches this)."""
    try:
        _st_numpy.save_file(arrays, path, metadata=metadata or None)
    except Exception as e:  # SafetensorError has no stable import path across versions
        raise InvalidInputError(f"{path}: safetensors could not write: {_first_line(e)}") from e


def _load_hf_dir(d: Path) -> Checkpoint:
    """Pick the index or single file in a Hugging Face model directory."""
    if (d / _INDEX_NAME).is_file():
        return _load_sharded(d / _INDEX_NAME)
    if (d / "model.safetensors").is_file():
        return load_safetensors(d / "model.safetensors")
    # Other libraries use other prefixes (e.g. diffusion_pytorch_model): accept
    # a lone index, else a lone file.
    for pattern, loader in (("*.safetensors.index.json", _load_sharded), ("*.safetensors", load_safetensors)):
        found = sorted(d.glob(pattern))
        if len(found) == 1:
            return loader(found[0])
    raise InvalidInputError(f"{d}: directory holds neither {_INDEX_NAME} nor a single *.safetensors file")


def _load_sharded(index_path: Path) -> Checkpoint:
    """Load every shard of an index, checking each tensor is where the index says."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise NotFoundError(f"{index_path}: no such index file") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(index_path, f"not valid JSON: {_first_line(e)}", kind="index") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise _bad(index_path, "needs a weight_map object of tensor name -> shard file", kind="index")
    index_meta = index.get("metadata") or {}
    if not isinstance(index_meta, dict):
        raise _bad(index_path, "metadata is not an object", kind="index")

    by_shard: dict[str, list[str]] = {}
    for name, shard in wmap.items():
        # Untrusted names must not reach outside the model directory.
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise _bad(index_path, f"shard name {shard!r} leaves the model directory", kind="index")
        by_shard.setdefault(shard, []).append(name)

    tensors: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {}
    for shard, names in by_shard.items():
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise NotFoundError(f"{index_path}: shard {shard!r} named in weight_map is missing")
        ck = load_safetensors(shard_path)
        for name in names:
            if name not in ck.tensors:
                raise _bad(index_path, f"tensor {name!r} is mapped to {shard} but is not in it", kind="index")
        for name in ck.tensors:
            if wmap.get(name) != shard:
                raise _bad(index_path, f"{shard} holds tensor {name!r}, which weight_map does not map to it",
                           kind="index")
        tensors.update(ck.tensors)
        _merge_metadata(metadata, ck.metadata, index_path, shard)
    # Index metadata is JSON of any type (HF's total_size is an int); keep it as JSON text.
    _merge_metadata(metadata, {k: v if isinstance(v, str) else json.dumps(v) for k, v in index_meta.items()},
                    index_path, "the index")
    return Checkpoint({name: tensors[name] for name in wmap}, metadata)


def _merge_metadata(into: dict, new: dict, index_path: Path, where: str) -> None:
    # Dropping either value of a clash would lose information, so refuse.
    for k, v in new.items():
        if into.setdefault(k, v) != v:
            raise _bad(index_path, f"metadata {k!r} is {into[k]!r} in one shard but {v!r} in {where}",
                       kind="index")


# ----------------------------------------------------------------------- helpers


def _prepare(tensors, reserved=()) -> dict[str, np.ndarray]:
    """Validate names and arrays; return little-endian C-contiguous arrays."""
    if not isinstance(tensors, Mapping):
        raise InvalidInputError(f"tensors must be a mapping of name -> numpy array, not {type(tensors).__name__}")
    out = {}
    for name, arr in tensors.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"tensor name {name!r} is not a string")
        if name in reserved:
            raise InvalidInputError(f"tensor name {name!r} is reserved by the file format")
        if not isinstance(arr, np.ndarray):
            raise InvalidInputError(f"value is a {type(arr).__name__}, not a numpy array", tensor=name)
        out[name] = _le_contiguous(name, arr)
    return out


def _le_contiguous(name: str, arr: np.ndarray) -> np.ndarray:
    dt = arr.dtype
    if dt.itemsize > 1 and (dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big")):
        arr = arr.astype(dt.newbyteorder("<"))  # a value-exact byte swap
    if arr.dtype not in SUPPORTED_DTYPES:
        raise DtypeError(f"unsupported dtype {arr.dtype}", tensor=name)
    # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _check_metadata(metadata) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidInputError("metadata must map strings to strings")
    return dict(metadata)


def _check_aliases(arrays: dict, aliases: dict) -> None:
    for alias, canon in aliases.items():
        if canon not in arrays or canon in aliases:
            raise InvalidInputError(f"alias {alias!r} points to {canon!r}, which is not a tensor of its own")
        if alias in arrays:
            a, c = arrays[alias], arrays[canon]
            if a.dtype != c.dtype or a.shape != c.shape or a.tobytes() != c.tobytes():
                raise InvalidInputError(f"alias {alias!r} is also given as a tensor that differs from {canon!r}")


def _npz_dtypes(p: Path, archive) -> dict[str, np.dtype]:
    if _NPZ_DTYPES_KEY not in archive.files:
        return {}
    raw = archive[_NPZ_DTYPES_KEY]
    try:
        spec = json.loads(str(raw[()])) if raw.dtype.kind == "U" and raw.ndim == 0 else None
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or not all(v in _ML_BY_NAME for v in spec.values()):
        raise _bad(p, f"{_NPZ_DTYPES_KEY} is not JSON of name -> one of {sorted(_ML_BY_NAME)}", kind="npz")
    return {k: _ML_BY_NAME[v] for k, v in spec.items()}


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; restored at once (import time)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


@contextlib.contextmanager
def _atomic_path(path: Path):
    """Yield a temporary path beside ``path``; move it into place only on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: it creates 0600 files, and the final file should get the
    # usual umask permissions.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        yield str(tmp)
        # fsync before the rename, else a power loss can leave an empty file
        # under the final name on some filesystems.
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # some writers (the safetensors library among them) create 0600 files
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # persist the rename itself; not possible everywhere
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _parse_size(size) -> int:
    """``5000``, ``"5GB"`` (10**9) or ``"5GiB"`` (2**30) -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise InvalidInputError(f"max_shard_size {size!r} is not a byte count such as 5000, '5GB' or '500MiB'")
        unit = (m.group(2) or "b").lower()
        scale = 1 if unit == "b" else (1024 if "i" in unit else 1000) ** ("kmgt".index(unit[0]) + 1)
        n = int(float(m.group(1)) * scale)
    if n <= 0:
        raise InvalidInputError(f"max_shard_size must be positive, got {size!r}")
    return n


def _read_into(f, arr: np.ndarray, p: Path, name: str) -> None:
    view = memoryview(arr.reshape(-1).view(np.uint8))  # arr is fresh and contiguous: a view, no copy
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise _bad(p, f"tensor {name!r}: file ended mid-tensor (truncated?)")
        got += n


def _bad(p, what: str, kind: str = "safetensors") -> InvalidInputError:
    return InvalidInputError(f"{p}: invalid {kind} file: {what}")
