"""Zarr data types for the ml_dtypes formats zarr-python does not know.

zarr 3.1 has no bfloat16 or fp8 data type.  Rather than hand users ``uint16``
words (a silent reinterpretation), this module registers three small
:class:`zarr.core.dtype.ZDType` classes under the names the zarr-extensions
registry uses (``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``), backed by
``ml_dtypes``.  Arrays opened through the logical store then have their real
dtype, and slices come back as ``ml_dtypes.bfloat16`` arrays.

These types only ever appear in metadata the *logical* store synthesizes; the
physical manifests record dtypes by name.  A name zarr already registers (a
future zarr with native bfloat16) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.dtypes import ML_DTYPES

__all__ = ["zarr_dtype", "register"]


def _make_zdtype(name: str, native: np.dtype):
    from zarr.core.dtype.npy.float import BaseFloat

    @dataclass(frozen=True, kw_only=True)
    class MLFloat(BaseFloat):
        dtype_cls = type(native)
        _zarr_v3_name = name
        _zarr_v2_names = ()

        @classmethod
        def _check_native_dtype(cls, dtype) -> bool:  # type: ignore[override]  # zarr: a TypeGuard
            return isinstance(dtype, np.dtype) and dtype == native

        def to_native_dtype(self) -> np.dtype:
            return native

        @property
        def item_size(self) -> int:
            return native.itemsize

        def _check_scalar(self, data) -> bool:  # type: ignore[override]  # zarr: a TypeGuard
            return isinstance(data, (float, int, np.floating, np.integer, native.type))

        def _cast_scalar_unchecked(self, data):
            return np.asarray(data).astype(native)[()]

    MLFloat.__name__ = MLFloat.__qualname__ = "".join(p.capitalize() for p in name.split("_"))
    globals()[MLFloat.__name__] = MLFloat  # pickles by reference (dask workers, distributed)
    return MLFloat


_registered = False


def register() -> None:
    """Register the ml_dtypes data types with zarr (idempotent)."""
    global _registered
    if _registered:
        return
    from zarr.core.dtype import data_type_registry

    for name, native in ML_DTYPES.items():
        if name not in data_type_registry.contents:
            try:
                data_type_registry.match_dtype(native)
                continue  # zarr already understands it under another name
            except ValueError:
                pass
            data_type_registry.register(name, _make_zdtype(name, native))
    _registered = True


def __getattr__(name: str):
    # unpickling looks the classes up here, maybe in a process that registered nothing yet
    if not _registered:
        register()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def zarr_dtype(dtype: np.dtype):
    """The registered zarr ZDType instance for numpy ``dtype``."""
    register()
    from zarr.core.dtype import get_data_type_from_native_dtype

    return get_data_type_from_native_dtype(dtype)
