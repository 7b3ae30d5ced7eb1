"""Zero-copy bridges between torch tensors and numpy arrays (torch is optional)."""
from __future__ import annotations

import numpy as np

from .codec._dtypes import TORCH_VIA_INT, tensor_to_numpy

__all__ = ["tensor_to_numpy", "numpy_to_tensor"]

_VIA_INT = TORCH_VIA_INT


def numpy_to_tensor(array: np.ndarray):
    """A torch tensor sharing memory with ``array`` (bf16/fp8 included)."""
    import torch

    array = np.ascontiguousarray(array)
    for torch_name, (int_name, np_type) in _VIA_INT.items():
        if array.dtype == np.dtype(np_type):
            t = torch.from_numpy(array.view(int_name))
            return t.view(getattr(torch, torch_name.split(".")[1]))
    return torch.from_numpy(array)
