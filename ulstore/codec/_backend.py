"""Which kernel implementation runs: the compiled Cython kernels or the NumPy reference.

All give byte-identical blobs.  Backends:

- ``cython``: the compiled kernels, built for any CPU of the platform;
- ``cython-v3``: the same source built for x86-64-v3 (AVX2, BMI2), present on x86-64
  builds and usable when the CPU has those features;
- ``numpy``: the pure-NumPy reference (the executable specification; slow).

``ULSTORE_BACKEND`` (one of those names, or ``auto``, the default: the fastest the
CPU runs) picks one at import; :func:`set_backend` changes it later.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from types import ModuleType

from ..errors import InvalidInputError
from . import reference

__all__ = ["kernels", "backend", "set_backend", "available_backends"]

_BACKENDS: dict[str, ModuleType] = {"numpy": reference}
try:
    _BACKENDS["cython"] = importlib.import_module("._kernels", __package__)
except ImportError:  # a source tree that was never built: the reference still works
    pass


def _cpu_has_x86_64_v3() -> bool:
    try:
        umath = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # numpy 1.x
        umath = importlib.import_module("numpy.core._multiarray_umath")
    features = umath.__cpu_features__
    return all(features.get(f, False) for f in ("AVX", "AVX2", "BMI", "BMI2", "FMA3", "F16C", "LZCNT", "MOVBE"))


if _cpu_has_x86_64_v3():
    try:
        _BACKENDS["cython-v3"] = importlib.import_module("._kernels_x86_64_v3", __package__)
    except ImportError:  # not an x86-64 build
        pass

_active: ModuleType = reference
_TREE = Path(__file__).resolve().parents[2]  # the source tree these modules run from (built in place)
_NOT_BUILT = (
    "ulstore: the compiled ULPack kernels are not built (a source tree used without `pip install -e .`?), "
    f'so the NumPy reference kernels run: same bytes, over 100x slower.  Build them with `pip install -e "{_TREE}"`, '
    "or set ULSTORE_BACKEND=numpy to choose the reference and silence this warning."
)


def available_backends() -> tuple[str, ...]:
    """Names of the importable backends."""
    return tuple(_BACKENDS)


def kernels(name: str | None = None) -> ModuleType:
    """The kernel module called ``name``, or the active one."""
    if name is None:
        return _active
    try:
        return _BACKENDS[name]
    except KeyError:
        raise InvalidInputError(
            f"unknown or unavailable ULPack backend {name!r}; available: {', '.join(_BACKENDS)}"
        ) from None


def backend() -> str:
    """Name of the active backend: ``"cython-v3"``, ``"cython"`` or ``"numpy"``."""
    return next(name for name, module in _BACKENDS.items() if module is _active)


def set_backend(name: str) -> None:
    """Select the backend (``"auto"``: the fastest one this CPU runs)."""
    global _active
    if name == "auto":
        _active = _BACKENDS.get("cython-v3", _BACKENDS.get("cython", reference))
        if _active is reference:  # not chosen, fallen back to: say so once (Python shows a warning once per place)
            warnings.warn(_NOT_BUILT, UserWarning, stacklevel=2)
    else:
        _active = kernels(name)


set_backend(os.environ.get("ULSTORE_BACKEND", "auto"))
