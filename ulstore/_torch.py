"""Zero-copy bridges between torch tensors and numpy arrays (torch is optional)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["tensor_to_numpy", "numpy_to_tensor"]

# torch dtypes numpy cannot hold natively travel as same-width integers and are
# re-viewed on the other side: the bits never change.
_VIA_INT = {
    "torch.bfloat16": ("int16", ml_dtypes.bfloat16),
    "torch.float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
    "torch.float8_e5m2": ("uint8", ml_dtypes.float8_e5m2),
}


def tensor_to_numpy(tensor) -> np.ndarray:
    """A numpy view of a torch tensor's bits (copied to host / made contiguous if needed)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    via = _VIA_INT.get(str(t.dtype))
    if via is not None:
        return t.view(getattr(torch, via[0])).numpy().view(via[1])
    return t.numpy()


def numpy_to_tensor(array: np.ndarray):
    """A torch tensor sharing memory with ``array`` (bf16/fp8 included)."""
    import torch

    array = np.ascontiguousarray(array)
    for torch_name, (int_name, np_type) in _VIA_INT.items():
        if array.dtype == np.dtype(np_type):
            t = torch.from_numpy(array.view(int_name))
            return t.view(getattr(torch, torch_name.split(".")[1]))
    return torch.from_numpy(array)
