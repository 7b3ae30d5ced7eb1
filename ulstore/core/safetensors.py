"""safetensors: the one header parser of ulstore, and files as bytes in memory.

Writing uses the ``safetensors`` library (it writes bf16/fp8 from numpy).  Its
numpy *reader* rejects bf16 and fp8, so reading is done here: 8-byte
little-endian header length, a JSON header of ``{name: {dtype, shape,
data_offsets}}`` plus optional ``__metadata__`` (str -> str), then the data.
Headers are untrusted and checked strictly, as the safetensors spec asks:
exactly those three fields, no duplicate keys, and offsets that tile the data
region with no hole or overlap.

Callers name what is being read through ``bad``: a function from the reason
to the exception to raise (a file path for :mod:`ulstore.io`, a bucket key for
:mod:`ulstore.sync`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
from safetensors import numpy as _st_numpy

from .dtypes import SAFETENSORS_CODES

__all__ = ["MAX_HEADER", "parse_header", "dumps", "loads", "first_line", "no_duplicates"]

MAX_HEADER = 100_000_000  # the safetensors library's own cap on header size

#: ``bad(reason)`` -> the exception to raise for a malformed file.
Bad = Callable[[str], Exception]
#: name -> (dtype, shape, begin, end), begin/end relative to the data region
Entries = dict[str, tuple[np.dtype, tuple[int, ...], int, int]]


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name if empty)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def no_duplicates(pairs):
    """``object_pairs_hook`` refusing duplicate keys."""
    # json.loads would silently keep the last of two equal keys, hiding a tensor.
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def parse_header(raw: bytes, data_len: int, bad: Bad) -> tuple[Entries, dict[str, str]]:
    """Validate a safetensors header (the JSON after the length); return ``(entries, metadata)``."""
    header, metadata = _header_json(raw, bad)
    entries: Entries = {name: _entry(name, info, bad) for name, info in header.items()}
    _check_tiling(entries, data_len, bad)
    return entries, metadata


def _header_json(raw: bytes, bad: Bad) -> tuple[dict, dict[str, str]]:
    """The header's JSON object (without ``__metadata__``) and its string metadata."""
    try:
        header = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"header is not valid JSON: {first_line(e)}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ must map strings to strings")
    return header, dict(metadata)


def _entry(name: str, info, bad: Bad) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """One tensor's header entry, checked: exactly its three fields, and offsets spanning its bytes."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"tensor {name!r}: entry must have exactly dtype, shape and data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in SAFETENSORS_CODES:
        raise bad(f"tensor {name!r}: unknown dtype {code!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets)) and offsets[0] <= offsets[1]
    ):
        raise bad(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
    dtype = SAFETENSORS_CODES[code]
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise bad(
            f"tensor {name!r}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes "
            f"but {code}{shape} needs {nbytes}"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_tiling(entries: Entries, data_len: int, bad: Bad) -> None:
    """The spec asks that offsets tile the data region exactly: no overlap
    (two tensors reading the same bytes), no hole, no trailing bytes."""
    pos, prev = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: (e[1][2], e[1][3])):
        if begin < pos:
            raise bad(f"tensor {name!r}: data_offsets [{begin}, {end}] overlap tensor {prev!r}")
        if begin > pos:
            raise bad(f"tensor {name!r}: data_offsets leave a hole at bytes [{pos}, {begin})")
        pos, prev = end, name
    if pos > data_len:
        raise bad(f"tensor {prev!r} ends at data byte {pos} but the file holds only {data_len} (truncated?)")
    if pos < data_len:
        raise bad(f"{data_len - pos} bytes after the last tensor belong to no tensor")


def dumps(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` and string ``metadata``."""
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    return bytes(_st_numpy.save(arrays, metadata={k: str(v) for k, v in (metadata or {}).items()} or None))


def loads(raw, bad: Bad) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a whole safetensors file held in memory; arrays are read-only views of ``raw``."""
    raw = memoryview(raw)
    if len(raw) < 8:
        raise bad(f"only {len(raw)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise bad(f"header length {n} runs past the end of the {len(raw)}-byte file (truncated?)")
    if n > MAX_HEADER:
        raise bad(f"header length {n} exceeds the {MAX_HEADER}-byte limit")
    data = raw[8 + n :]
    entries, metadata = parse_header(raw[8 : 8 + n], len(data), bad)
    arrays = {name: np.frombuffer(data[b:e], dtype=dt).reshape(shape) for name, (dt, shape, b, e) in entries.items()}
    return arrays, metadata
