"""The one table of dtypes ulstore stores, by name and by safetensors code.

Floating-point formats (ULPack's six) come from :mod:`ulstore.codec`; this
module adds the integer and boolean dtypes that travel uncompressed, the
``ml_dtypes`` names, the safetensors dtype codes, and the same-width integer
that carries the bits of each ``ml_dtypes`` dtype where npy or torch have no
code for it.  Names are numpy's (``bfloat16``, ``float32``, ``int64``, ``bool``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..codec import format_of
from ..errors import DtypeError

__all__ = ["ML_DTYPES", "RAW_BITS", "SAFETENSORS_CODES", "STORABLE", "dtype_name", "dtype_from_name", "numpy_dtype"]

#: The dtypes numpy has no name for: name -> ml_dtypes dtype.
ML_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

#: ml_dtypes dtype -> the unsigned integer of the same width that carries its bits
#: (npy and torch<->numpy have no code for them).
RAW_BITS: dict[np.dtype, np.dtype] = {
    ML_DTYPES["bfloat16"]: np.dtype("<u2"),
    ML_DTYPES["float8_e4m3fn"]: np.dtype("u1"),
    ML_DTYPES["float8_e5m2"]: np.dtype("u1"),
}

#: safetensors dtype codes -> little-endian numpy dtypes.
SAFETENSORS_CODES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": ML_DTYPES["bfloat16"],
    "F8_E4M3": ML_DTYPES["float8_e4m3fn"],
    "F8_E5M2": ML_DTYPES["float8_e5m2"],
    "C64": np.dtype("<c8"),  # safetensors >= 0.6 (torch.complex64)
}

#: Every dtype ulstore reads and writes (little-endian forms).
STORABLE: frozenset[np.dtype] = frozenset(SAFETENSORS_CODES.values())


def dtype_name(dtype, *, what: str = "ulstore stores") -> str:
    """Name of a storable float, integer or boolean dtype (``bfloat16``, ``float32``, ``int64``, ``bool``...).

    Raises
    ------
    DtypeError
        Any other dtype; the message starts with ``what``.
    """
    dtype = np.dtype(dtype)
    try:
        return format_of(dtype).name
    except DtypeError:
        pass
    if dtype.kind in "biu":
        return dtype.newbyteorder("=").name
    raise DtypeError(f"{what} floating-point, integer and boolean tensors; got dtype {dtype}")


def dtype_from_name(name: str) -> np.dtype:
    """Inverse of :func:`dtype_name` (little-endian); DtypeError for any other name."""
    try:
        return format_of(name).dtype
    except DtypeError:
        pass
    try:
        dt = np.dtype(name)
    except TypeError:
        raise DtypeError(f"unknown dtype name {name!r}") from None
    if dt.kind not in "biu" or dt.name != name:
        raise DtypeError(f"unknown dtype name {name!r}")
    return dt.newbyteorder("<")


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a store manifest names (ml_dtypes names included); ValueError otherwise."""
    if name in ML_DTYPES:
        return ML_DTYPES[name]
    dt = np.dtype(name)
    if dt.kind not in "biufc":
        raise ValueError(f"not a stored dtype: {name!r}")
    return dt
