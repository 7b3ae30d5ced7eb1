"""Which kernel implementation runs: the compiled Cython kernels or the NumPy reference.

Both give byte-identical blobs.  ``ULSTORE_BACKEND`` (``cython``, ``numpy`` or
``auto``, the default) picks one at import; :func:`set_backend` changes it later.
"""
from __future__ import annotations

import os
from types import ModuleType

from . import _reference
from .errors import InvalidInputError

__all__ = ["kernels", "backend", "set_backend", "available_backends"]

try:
    from . import _kernels as _compiled
except ImportError:  # a source tree that was never built: the reference still works
    _compiled = None

_BACKENDS: dict[str, ModuleType] = {"numpy": _reference}
if _compiled is not None:
    _BACKENDS["cython"] = _compiled

_active: ModuleType = _reference


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
    """Name of the active backend: ``"cython"`` or ``"numpy"``."""
    return _active.BACKEND


def set_backend(name: str) -> None:
    """Select the backend (``"auto"`` picks the compiled one when it is built)."""
    global _active
    if name == "auto":
        _active = _BACKENDS.get("cython", _reference)
    else:
        _active = kernels(name)


set_backend(os.environ.get("ULSTORE_BACKEND", "auto"))
