"""safetensors files as bytes in memory (bucket objects need no temporary files).

Writing uses the ``safetensors`` library (it writes bf16/fp8 from numpy).  Its
numpy *reader* rejects bf16, so reading is done here: 8-byte little-endian
header length, JSON header ``{name: {dtype, shape, data_offsets}}`` plus
optional ``__metadata__`` (str -> str), then the data.  Headers are untrusted:
offsets must tile the data region exactly, as the format asks.
"""
from __future__ import annotations

import json
import math
import struct

import ml_dtypes
import numpy as np
from safetensors import numpy as _st_numpy

from ..errors import InvalidInputError

__all__ = ["dumps", "loads"]

_CODES = {
    "BOOL": np.dtype("?"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_MAX_HEADER = 100_000_000


def dumps(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` and string ``metadata``."""
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    return bytes(_st_numpy.save(arrays, metadata={k: str(v) for k, v in (metadata or {}).items()} or None))


def loads(raw, key: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a safetensors file; arrays are read-only views of ``raw``.

    Raises
    ------
    InvalidInputError
        The bytes are not a valid safetensors file (message names ``key``).
    """
    raw = memoryview(raw)

    def bad(why):
        return InvalidInputError(f"not a valid safetensors file: {why}", key=key)

    if len(raw) < 8:
        raise bad("shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER or 8 + n > len(raw):
        raise bad(f"header length {n} exceeds the file")
    try:
        header = json.loads(bytes(raw[8 : 8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ must map strings to strings")
    data = raw[8 + n :]
    spans, out = [], {}
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in _CODES:
            raise bad(f"tensor {name!r}: unknown or missing dtype")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise bad(f"tensor {name!r}: bad data_offsets {offs!r}")
        dtype = _CODES[info["dtype"]]
        if offs[1] - offs[0] != math.prod(shape) * dtype.itemsize:
            raise bad(f"tensor {name!r}: data_offsets do not match {info['dtype']}{shape}")
        spans.append((offs[0], offs[1], name))
        out[name] = (dtype, tuple(shape), offs)
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise bad(f"tensor {name!r}: data_offsets overlap or leave a hole")
        pos = end
    if pos != len(data):
        raise bad(f"data region holds {len(data)} bytes but the tensors cover {pos}")
    arrays = {name: np.frombuffer(data[o[0] : o[1]], dtype=dt).reshape(shape) for name, (dt, shape, o) in out.items()}
    return arrays, dict(metadata)
