"""vLLM's CPU linear layers that multiply by a packed copy of their weight, and rebuilding those copies.

After loading, vLLM may hand a linear layer's weight to a prepacked kernel
(oneDNN; SGL on AMX; zentorch on Zen) and replace ``layer.weight`` by an empty
tensor (``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``);
the tied ``lm_head`` keeps its weight but packs a copy.  A write into the
weight then misses what the kernel multiplies by.  :class:`PackedKernels`
finds these layers by what they do (a kernel that does not read the weight it
is passed), gives the ones without a weight a real one again (the follower
writes it: the memory of those weights, once more), and repacks each from its
weight after a version is written.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PackedKernels"]


def _ignores_weight(m: Any) -> bool:  # (a vLLM layer: its attributes are vLLM's)
    """Whether ``m.cpu_linear`` multiplies by something other than the weight it is passed (a packed copy)."""
    w = m.weight
    if w.numel() == 0:
        return True  # the weight was handed over and removed
    if w.ndim != 2 or w.is_meta:
        return False
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.inference_mode():
        y = m.cpu_linear(x, torch.zeros_like(w), None)
    return bool(y.ne(0).any())  # a kernel that read the zeros it was passed returns zeros


def _restore_weight(m: Any) -> None:
    """Register a fresh, real weight on a linear layer whose weight vLLM removed (as its quant method made it)."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    method = m.quant_method
    v2 = type(method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and hasattr(m, "weight_loader_v2")
    del m.weight
    method.create_weights(
        layer=m,
        input_size_per_partition=getattr(m, "input_size_per_partition", m.input_size),
        output_partition_sizes=m.output_partition_sizes,
        input_size=m.input_size,
        output_size=m.output_size,
        params_dtype=m.params_dtype,
        weight_loader=m.weight_loader_v2 if v2 else m.weight_loader,
    )


class PackedKernels:
    """The layers of ``model`` whose kernel holds a packed copy of the weight."""

    def __init__(self, model: torch.nn.Module):
        linear: list[Any] = [m for m in model.modules() if callable(getattr(m, "cpu_linear", None))]
        self.modules = [m for m in linear if hasattr(m, "weight") and _ignores_weight(m)]
        for m in self.modules:
            if m.weight.numel() == 0:
                _restore_weight(m)

    def __len__(self) -> int:
        return len(self.modules)

    def rebuild(self) -> None:
        """Repack every such layer from its (updated) weight, keeping the weight for the next version."""
        if not self.modules:
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        with torch.inference_mode():
            for m in self.modules:
                dispatch_cpu_unquantized_gemm(m, remove_weight=False)
