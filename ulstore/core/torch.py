"""The torch bridge: numpy arrays <-> torch tensors, zero-copy and bit-exact (torch is optional).

numpy cannot hold torch's bfloat16 and float8 natively and torch cannot read
``ml_dtypes`` arrays, so those travel as same-width integers and are re-viewed
on the other side: the bits never change.  :func:`ulstore.io.to_torch` is the
user-facing door (a slice, an array, a dict of arrays or a step); underneath:

>>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
>>> import numpy as np, ml_dtypes
>>> from ulstore.core.torch import from_tensor, to_tensor
>>> w = np.array([1.5, -0.0, np.nan], ml_dtypes.bfloat16)   # e.g. traj[50]["weight"][:3]
>>> t = to_tensor(w)
>>> t.dtype, bool((t.view(torch.int16).numpy() == w.view(np.int16)).all())
(torch.bfloat16, True)
>>> from_tensor(t).dtype
dtype(bfloat16)
"""

from __future__ import annotations

import numpy as np

from ..codec import TORCH_VIA_INT, tensor_to_numpy

__all__ = ["from_tensor", "to_tensor", "as_numpy", "is_tensor", "import_torch", "dtype_table", "signed_int"]


def is_tensor(value) -> bool:
    """Whether ``value`` is a torch tensor (without importing torch)."""
    return type(value).__module__.startswith("torch")


def import_torch():
    """``torch``, or InvalidInputError saying how to install it."""
    from ..errors import InvalidInputError
    from .install import install_command

    try:
        import torch
    except ImportError:
        raise InvalidInputError(
            f"torch checkpoints need PyTorch, which is not installed: {install_command('torch')}"
        ) from None
    return torch


def from_tensor(tensor) -> np.ndarray:
    """A numpy view of a torch tensor's bits (copied to host / made contiguous if needed).

    bf16 and fp8 come back as ``ml_dtypes`` arrays, never as bare integers.
    """
    return tensor_to_numpy(tensor)


def as_numpy(value, *, array_like: bool = False) -> np.ndarray | None:
    """``value`` as a numpy array: arrays as they are, numpy scalars as 0-d arrays, torch tensors
    through :func:`from_tensor`; with ``array_like``, also other objects with ``__array__``,
    ``dtype`` and ``shape``.  None for anything else (lists, Python numbers): callers say why.
    """
    if isinstance(value, np.ndarray):
        return value if type(value) is np.ndarray else np.asarray(value)  # np.matrix & co: the plain array
    if isinstance(value, np.generic):
        return np.asarray(value)
    if is_tensor(value):
        return from_tensor(value)
    if array_like and hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape"):
        return np.asarray(value)
    return None


def to_tensor(array: np.ndarray):
    """A torch tensor sharing memory with ``array`` (bf16/fp8 included, bit for bit)."""
    import torch

    array = np.asarray(array)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
    for torch_name, (int_name, np_type) in TORCH_VIA_INT.items():
        if array.dtype == np.dtype(np_type):
            t = torch.from_numpy(array.view(int_name))
            return t.view(getattr(torch, torch_name.split(".")[1]))
    return torch.from_numpy(array)


def dtype_table(torch) -> dict:
    """numpy dtype -> torch dtype, for the dtypes this torch build has."""
    from .dtypes import RAW_BITS

    pairs = {
        "?": "bool",
        "u1": "uint8",
        "i1": "int8",
        "<i2": "int16",
        "<i4": "int32",
        "<i8": "int64",
        "<u2": "uint16",
        "<u4": "uint32",
        "<u8": "uint64",  # torch >= 2.3
        "<f2": "float16",
        "<f4": "float32",
        "<f8": "float64",
        "<c8": "complex64",
    }
    table = {np.dtype(n): getattr(torch, t) for n, t in pairs.items() if hasattr(torch, t)}
    for dt in RAW_BITS:
        table[dt] = getattr(torch, dt.name)
    return table


def signed_int(torch, itemsize: int):
    """The signed torch integer dtype of ``itemsize`` bytes (bits are bits: kernels exist for all of them)."""
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
