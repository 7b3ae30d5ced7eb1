"""What the peers of ulstore's vLLM backend do, trainer side and engine side, for ``benchmarks/vllm.py``.

Trainer side (the state is a dict of bf16 torch tensors):

- :func:`save_safetensors`: a full checkpoint, ``safetensors.torch.save_file``;
- :func:`write_trl_int32`: a TRL-style sparse patch file (see its docstring).

Engine side (``model`` is vLLM's module in the worker; each reads its bytes
from a local file, standing for the download):

- :func:`full_load`: read the safetensors file, ``model.load_weights`` of all of it;
- :func:`lcwp_load`: read the TRL file, vLLM's ``load_checkpoint_weight_patches``
  with its changes (sparse patches in checkpoint coordinates, NaN-masked dense
  tensors through the model's loader);
- :func:`trl_load`: read the TRL file, ``index_copy_`` its values into flat
  views of the runtime parameters, found once through a checkpoint->runtime
  mapping.  That is how TRL's delta-sync branch (huggingface/trl#5937) applies a
  patch in vLLM: with vLLM's ``SparseWeightPatch`` of the ``sparse_nccl`` backend
  (vllm-project/vllm#40096), ``index_copy_`` into runtime parameters by runtime
  name, not through ``load_checkpoint_weight_patches``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["save_safetensors", "write_trl_int32", "read_trl", "full_load", "lcwp_load", "trl_load", "same_bits"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, flat (compares bits: NaN payloads and -0.0 included)."""
    return t.reshape(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def save_safetensors(state: dict, path) -> None:
    from safetensors.torch import save_file

    save_file(state, str(path))


def write_trl_int32(prev: dict, cur: dict, path) -> int:
    """Write the changes from ``prev`` to ``cur`` as a TRL-style sparse patch: returns the changed elements.

    The format of TRL's first sparse-patch branch: one safetensors file holding,
    for every tensor with a changed element, ``<name>.indices`` (int32 flat
    positions, C order, ascending) and ``<name>.values`` (the new values, the
    tensor's dtype); metadata ``format=sparse_weight_patch``, ``version=1`` and
    counts.  An element is changed when its bits differ.  The trainer keeps
    ``prev`` (the last version sent) to find the changes: that diff is part of
    the trainer's cost, as it is TRL's.
    """
    from safetensors.torch import save_file

    tensors, total, changed = {}, 0, 0
    for name, t in cur.items():
        total += t.numel()
        idx = np.flatnonzero(_bits(t).numpy() != _bits(prev[name]).numpy())  # numpy: the fastest on CPU here
        if idx.size:
            tensors[name + ".indices"] = torch.from_numpy(idx.astype(np.int32))
            tensors[name + ".values"] = t.reshape(-1)[torch.from_numpy(idx)]
            changed += idx.size
    meta = {
        "format": "sparse_weight_patch",
        "version": "1",
        "num_changed_params": str(len(tensors) // 2),
        "total_changed_elements": str(changed),
        "total_elements": str(total),
    }
    save_file(tensors, str(path), metadata=meta)
    return changed


def read_trl(path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A TRL int32 patch file: ``{name: (int32 indices, values)}``."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return {
        k[: -len(".indices")]: (v, tensors[k[: -len(".indices")] + ".values"])
        for k, v in tensors.items()
        if k.endswith(".indices")
    }


def full_load(model, path) -> None:
    """vLLM's full update: read a whole checkpoint and run it through ``model.load_weights``."""
    from safetensors.torch import load_file

    with torch.inference_mode():
        model.load_weights(iter(load_file(str(path)).items()))


def lcwp_load(model, path, specs: dict) -> None:
    """vLLM's sparse path: the TRL file's changes as ``CheckpointWeightPatch``es (``specs``: name -> (shape, dtype))."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    patches = [
        CheckpointWeightPatch(name, tuple(specs[name][0]), specs[name][1], values, idx)
        for name, (idx, values) in read_trl(path).items()
    ]
    load_checkpoint_weight_patches(model, patches)


def trl_load(views: dict, path) -> None:
    """TRL's sparse apply: ``index_copy_`` of the file's values into ``views`` (name -> flat runtime view)."""
    with torch.inference_mode():
        for name, (idx, values) in read_trl(path).items():
            views[name].index_copy_(0, idx.long(), values)


def same_bits(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit (empty: identical)."""
    bad = [n for n in a if n not in b or a[n].shape != b[n].shape or a[n].dtype != b[n].dtype]
    bad += [n for n in a if n not in bad and not torch.equal(_bits(a[n]), _bits(b[n]))]
    return bad + [n for n in b if n not in a]
