"""Zarr data types for the ml_dtypes formats zarr-python does not know: bfloat16 and fp8.

zarr 3.1 has no bfloat16 or fp8 data type.  Rather than hand users ``uint16``
words (a silent reinterpretation), this module registers three small
:class:`zarr.core.dtype.ZDType` classes backed by ``ml_dtypes``.  Arrays
opened through the logical store, and plain zarr arrays written with the
ULPack serializer (:mod:`ulstore.codec.zarr3`), then have their real dtype,
and slices come back as ``ml_dtypes`` arrays.

Names (the ``data_type`` of a zarr v3 array), as the zarr-extensions registry
(``data-types/``) has them:

=================  ==========================  ==========================================
ml_dtypes          zarr v3 name                "NaN" fill value means
=================  ==========================  ==========================================
``bfloat16``       ``bfloat16``                ``0x7fc0``
``float8_e5m2``    ``float8_e5m2``             ``0x7e``
``float8_e4m3fn``  ``ulstore.float8_e4m3fn``   ``0x7f`` (no infinities in this format)
=================  ==========================  ==========================================

``float8_e4m3fn`` (PyTorch's and OCP's FP8 E4M3: no infinities, NaN is
``S.1111.111``, largest finite 448) is *not* registered.  The registry's
``float8_e4m3`` is a different format: IEEE-like, with infinities, so that the
byte ``0x78`` is +inf there and 256 in ``float8_e4m3fn``.  Naming one after the
other would silently change values for every other zarr reader, so the
unregistered type carries a namespaced name (the registry's rule for names
that are not registered) until ``float8_e4m3fn`` is registered.

Fill values (zarr v3 core spec, "fill_value" of floating-point types): a JSON
number, ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, or ``"0x"`` followed by
exactly two hex digits per byte giving the value's bits (``"0x7fc1"`` for a
bfloat16 NaN with a payload, ``"0x7f"`` for an fp8 byte).  Writing a fill
value keeps its bits: a NaN other than the canonical one above (another
payload, or the sign bit set) is written in hex, never as ``"NaN"``.

The classes are module-level dataclasses, so arrays that carry them pickle
(dask's process scheduler, ``distributed``).  They are registered when this
module is imported, which ``import ulstore`` does; zarr 3.1 collects the
``zarr.data_type`` entry-point group but never loads it, so a fresh
interpreter must ``import ulstore`` (any of its modules) before it opens a
bfloat16 or fp8 zarr array.  A name zarr already registers, or a dtype zarr
already understands (a future zarr with native bfloat16), is left alone.

Examples
--------
>>> import ml_dtypes, numpy as np
>>> z = zarr_dtype(np.dtype(ml_dtypes.bfloat16))
>>> z.to_json(zarr_format=3)
'bfloat16'
>>> nan = np.array([0x7FC1], np.uint16).view(ml_dtypes.bfloat16)[0]   # a NaN with a payload
>>> z.to_json_scalar(nan, zarr_format=3)
'0x7fc1'
>>> hex(int(np.asarray(z.from_json_scalar("0x7fc1", zarr_format=3)).view(np.uint16)))
'0x7fc1'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype.npy.float import BaseFloat

__all__ = ["ZARR_NAMES", "Bfloat16", "Float8E5M2", "Float8E4M3FN", "zarr_dtype", "register"]

_HEX = re.compile(r"0x[0-9a-fA-F]+")


@dataclass(frozen=True, kw_only=True)
class _MLFloat(BaseFloat):
    """An ``ml_dtypes`` float as a zarr v3 data type (v3 only: these types have no zarr v2 name)."""

    _native: ClassVar[np.dtype]  # a subclass names these three; dtype_cls and _bits follow
    _nan_bits: ClassVar[int]  # what the fill value "NaN" means (zarr-extensions)
    _has_inf: ClassVar[bool]
    _bits: ClassVar[np.dtype]  # the unsigned integer of the same width
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_native" in cls.__dict__:
            cls.dtype_cls = type(cls._native)
            cls._bits = np.dtype(f"<u{cls._native.itemsize}")

    @classmethod
    def _check_native_dtype(cls, dtype) -> bool:  # type: ignore[override]  # zarr: a TypeGuard
        return isinstance(dtype, np.dtype) and dtype == cls._native

    def to_native_dtype(self) -> np.dtype:
        return self._native

    @property
    def item_size(self) -> int:
        return self._native.itemsize

    @classmethod
    def _check_json_v3(cls, data) -> bool:  # type: ignore[override]  # zarr: a TypeGuard
        # the short form "bfloat16", or {"name": "bfloat16"} with an empty configuration (zarr-extensions schema)
        if isinstance(data, dict):
            extra = set(data) - {"name", "configuration"}
            return data.get("name") == cls._zarr_v3_name and not data.get("configuration") and not extra
        return data == cls._zarr_v3_name

    def to_json(self, zarr_format):
        if zarr_format != 3:
            raise ValueError(f"{self._zarr_v3_name} is a zarr v3 data type only")
        return self._zarr_v3_name

    # -- scalars --------------------------------------------------------------------------

    def _check_scalar(self, data) -> bool:  # type: ignore[override]  # zarr: a TypeGuard
        return isinstance(data, (float, int, np.floating, np.integer, self._native.type)) and not isinstance(data, bool)

    def _cast_scalar_unchecked(self, data):
        if isinstance(data, self._native.type):
            return data  # keep its bits (a NaN's payload): no round trip through float
        return np.asarray(data).astype(self._native)[()]

    def from_json_scalar(self, data, *, zarr_format):
        """A fill value from JSON: a number, "NaN", "Infinity", "-Infinity" or the value's bits in hex."""
        if isinstance(data, str):
            if _HEX.fullmatch(data):
                digits = 2 * self.item_size
                if len(data) != 2 + digits:
                    raise ValueError(
                        f"fill value {data!r} of a {self._zarr_v3_name} array must be '0x' and {digits} hex digits"
                    )
                return np.array([int(data, 16)], self._bits).view(self._native)[0]
            if data == "NaN":
                return np.array([self._nan_bits], self._bits).view(self._native)[0]
            if data in ("Infinity", "-Infinity"):
                if not self._has_inf:
                    raise ValueError(f"{self._zarr_v3_name} has no infinities; fill value {data!r} is not a value")
                return self._cast_scalar_unchecked(float(data.replace("inity", "")))
            try:
                return self._cast_scalar_unchecked(float(data))
            except ValueError:
                raise ValueError(f"fill value {data!r} is not a {self._zarr_v3_name} value") from None
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return self._cast_scalar_unchecked(data)
        raise TypeError(f"fill value {data!r} is not a {self._zarr_v3_name} value")

    def to_json_scalar(self, data, *, zarr_format):
        """A fill value as JSON; a NaN other than the canonical one keeps its bits (hex)."""
        value = self.cast_scalar(data)
        bits = int(np.asarray(value).reshape(1).view(self._bits)[0])
        as_float = float(value)
        if math.isnan(as_float):
            return "NaN" if bits == self._nan_bits else f"0x{bits:0{2 * self.item_size}x}"
        if math.isinf(as_float):
            return "Infinity" if as_float > 0 else "-Infinity"
        return as_float  # exact: every value of these formats is a float64


@dataclass(frozen=True, kw_only=True)
class Bfloat16(_MLFloat):
    """``bfloat16`` (zarr-extensions ``data-types/bfloat16``)."""

    _zarr_v3_name = "bfloat16"
    _native = np.dtype(ml_dtypes.bfloat16)
    _nan_bits = 0x7FC0
    _has_inf = True


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``float8_e5m2`` (zarr-extensions ``data-types/float8_e5m2``: IEEE-like, with infinities)."""

    _zarr_v3_name = "float8_e5m2"
    _native = np.dtype(ml_dtypes.float8_e5m2)
    _nan_bits = 0x7E
    _has_inf = True


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn``: not in the zarr-extensions registry, hence a namespaced name (module docstring)."""

    _zarr_v3_name = "ulstore.float8_e4m3fn"
    _native = np.dtype(ml_dtypes.float8_e4m3fn)
    _nan_bits = 0x7F
    _has_inf = False


_CLASSES: dict[str, type[_MLFloat]] = {"bfloat16": Bfloat16, "float8_e5m2": Float8E5M2, "float8_e4m3fn": Float8E4M3FN}

#: ml_dtypes name -> zarr v3 data type name.
ZARR_NAMES: dict[str, str] = {name: cls._zarr_v3_name for name, cls in _CLASSES.items()}

_registered = False


def register() -> None:
    """Register the ml_dtypes data types with zarr (idempotent; done when this module is imported)."""
    global _registered
    if _registered:
        return
    from zarr.core.dtype import data_type_registry

    for cls in _CLASSES.values():
        if cls._zarr_v3_name in data_type_registry.contents:
            continue
        try:
            data_type_registry.match_dtype(cls._native)
            continue  # zarr already understands it under another name
        except ValueError:
            pass
        data_type_registry.register(cls._zarr_v3_name, cls)
    _registered = True


def zarr_dtype(dtype: np.dtype):
    """The registered zarr ZDType instance for numpy ``dtype``."""
    register()
    from zarr.core.dtype import get_data_type_from_native_dtype

    return get_data_type_from_native_dtype(dtype)


register()
