"""safetensors files on disk: exact reads (bf16 and fp8 included) and atomic, optionally sharded, writes.

The header is parsed by :func:`ulstore.core.safetensors.parse_header`, the
one strict parser ulstore has; this module reads and writes files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import numpy as _st_numpy

from ..core.safetensors import MAX_HEADER, first_line, parse_header
from ..errors import InvalidInputError, NotFoundError
from ._files import Checkpoint, _atomic_path, _bad, _check_metadata, _prepare, _read_into, parse_size

__all__ = ["load_safetensors", "save_safetensors", "check_shard_name"]

_INDEX_NAME = "model.safetensors.index.json"


def load_safetensors(path, *, mmap: bool = False) -> Checkpoint:
    """Read one ``.safetensors`` file exactly, bf16 and fp8 included.

    With ``mmap=True`` the tensors are read-only memory maps of the file:
    nothing is read until used, so committing them streams the file through a
    bounded window (the file must not change meanwhile).

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
        if n > MAX_HEADER:
            raise _bad(p, f"header length {n} exceeds the {MAX_HEADER}-byte limit")
        entries, metadata = parse_header(f.read(n), size - 8 - n, lambda why: _bad(p, why))
        tensors: dict[str, np.ndarray] = {}
        if mmap:
            for name, (dtype, shape, begin, end) in entries.items():
                if end > begin:
                    tensors[name] = np.memmap(p, dtype=dtype, mode="r", offset=8 + n + begin, shape=shape)
                else:
                    tensors[name] = np.empty(shape, dtype)
            return Checkpoint({name: tensors[name] for name in entries}, metadata)
        # Read in file order so the disk access is sequential.
        for name, (dtype, shape, begin, _end) in sorted(entries.items(), key=lambda e: e[1][2]):
            try:  # fresh, aligned and owned; its size is bounded by the file's
                arr = np.empty(shape, dtype)
            except (ValueError, MemoryError) as e:
                raise _bad(p, f"tensor {name!r}: cannot allocate shape {list(shape)}: {first_line(e)}") from None
            f.seek(8 + n + begin)
            _read_into(f, arr, p, name)
            tensors[name] = arr
    # Hand tensors back in header order, as the file lists them.
    return Checkpoint({name: tensors[name] for name in entries}, metadata)


def save_safetensors(
    tensors, path, metadata=None, *, max_shard_size=None, weight_map=None, index_metadata=None, index_text=None
) -> None:
    """Write tensors as safetensors, atomically.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray]
        Big-endian or non-contiguous arrays are converted (exactly).
    path : str or os.PathLike
        The file to write; with ``max_shard_size`` or ``weight_map``, the
        directory to write the shards and ``model.safetensors.index.json``
        into (created if needed).
    metadata : dict[str, str], optional
        Written as ``__metadata__`` (in every shard).
    max_shard_size : int or str, optional
        Shard limit in bytes of tensor data, or a string such as ``"5GB"`` or
        ``"500MiB"``. Tensors are packed greedily in order, as Hugging Face
        does; a tensor larger than the limit gets a shard of its own; shards
        are named ``model-00001-of-0000N.safetensors``.
    weight_map : Mapping[str, str], optional
        Instead of ``max_shard_size``: tensor name -> shard file name, as in
        an index's ``weight_map`` (every tensor, and only those).  Reproduces
        a given layout: the same files holding the same tensors.
    index_metadata : dict, optional
        The index's ``metadata`` (any JSON values: HF's ``total_parameters``
        stays a number); ``total_size`` is recomputed from the tensors.
        Default: ``metadata`` (strings).
    index_text : str, optional
        The index file's exact text, written verbatim; its ``weight_map`` must
        be ``weight_map``.  For an export that gives back an imported index
        byte for byte.

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
    if max_shard_size is None and weight_map is None:
        if p.is_dir():
            raise InvalidInputError(f"{p}: is a directory; pass max_shard_size to write shards there")
        with _atomic_path(p) as tmp:
            _write_safetensors_file(arrays, tmp, meta)
        return
    if p.exists() and not p.is_dir():
        raise InvalidInputError(f"{p}: is a file; a sharded checkpoint is a directory")
    if weight_map is not None:
        shards = _shards_from_map(arrays, weight_map)
    else:
        shards = _greedy_shards(arrays, parse_size(max_shard_size))
    if index_text is not None:
        doc = _parse_index_text(index_text)
        if doc.get("weight_map") != {name: fname for fname, shard in shards for name in shard}:
            raise InvalidInputError("index_text names another weight_map than the shards being written")
    # total_size is derived from the tensors, so a stale value must not travel on.
    if index_metadata is None:
        index_metadata = {k: v for k, v in meta.items() if k != "total_size"}
    index = {
        "metadata": {**index_metadata, "total_size": sum(a.nbytes for a in arrays.values())},
        "weight_map": {name: fname for fname, shard in shards for name in shard},
    }
    for fname, shard in shards:
        with _atomic_path(p / fname) as tmp:
            _write_safetensors_file(shard, tmp, meta)
    # The index goes last: until it lands, the directory does not claim the new shards.
    with _atomic_path(p / _INDEX_NAME) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(index_text if index_text is not None else json.dumps(index, indent=2) + "\n")


def _greedy_shards(arrays: dict, limit: int) -> list[tuple[str, dict]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    used = 0
    for name, arr in arrays.items():
        if shards[-1] and used + arr.nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = arr
        used += arr.nbytes
    n = len(shards)
    return [(f"model-{i:05d}-of-{n:05d}.safetensors", shard) for i, shard in enumerate(shards, 1)]


def _shards_from_map(arrays: dict, weight_map) -> list[tuple[str, dict]]:
    """Shards in order of first appearance in ``weight_map``; each holds its tensors in ``weight_map`` order."""
    if not isinstance(weight_map, dict) or set(weight_map) != set(arrays):
        missing = sorted(set(arrays) - set(weight_map or {}))[:3]
        extra = sorted(set(weight_map or {}) - set(arrays))[:3]
        raise InvalidInputError(f"weight_map does not name exactly the tensors (missing {missing}, extra {extra})")
    shards: dict[str, dict[str, np.ndarray]] = {}
    for name, fname in weight_map.items():
        check_shard_name(fname)
        shards.setdefault(fname, {})[name] = arrays[name]
    return list(shards.items())


def check_shard_name(fname) -> None:
    """A shard file name from an index (untrusted): a plain relative path inside the model directory."""
    if not isinstance(fname, str) or not fname or Path(fname).is_absolute() or ".." in Path(fname).parts:
        raise InvalidInputError(f"shard name {fname!r} leaves the model directory")


def _parse_index_text(text: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InvalidInputError(f"index_text is not JSON: {first_line(e)}") from None
    if not isinstance(doc, dict):
        raise InvalidInputError("index_text is not a JSON object")
    return doc


def _write_safetensors_file(arrays: dict, path: str, metadata: dict) -> None:
    """Write one safetensors file with the library (the test suite patches this)."""
    try:
        _st_numpy.save_file(arrays, path, metadata=metadata or None)
    except Exception as e:  # SafetensorError has no stable import path across versions
        raise InvalidInputError(f"{path}: safetensors could not write: {first_line(e)}") from e
