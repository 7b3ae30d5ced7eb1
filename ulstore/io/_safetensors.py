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
from ._files import Checkpoint, _atomic_path, _bad, _check_metadata, _parse_size, _prepare, _read_into

__all__ = ["load_safetensors", "save_safetensors"]

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
    index = {"metadata": {**meta, "total_size": sum(a.nbytes for a in arrays.values())}, "weight_map": weight_map}
    with _atomic_path(p / _INDEX_NAME) as tmp:
        Path(tmp).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _write_safetensors_file(arrays: dict, path: str, metadata: dict) -> None:
    """Write one safetensors file with the library (the test suite patches this)."""
    try:
        _st_numpy.save_file(arrays, path, metadata=metadata or None)
    except Exception as e:  # SafetensorError has no stable import path across versions
        raise InvalidInputError(f"{path}: safetensors could not write: {first_line(e)}") from e
