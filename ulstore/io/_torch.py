"""torch state dicts: files (``.pt``/``.pth``/``.bin``) and in-memory conversion, tied tensors kept tied.

Tensors cross over through the :mod:`ulstore.core.torch` bridge (bit-exact,
zero-copy where the layout allows).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from ..core.formatting import strip_ansi
from ..core.torch import dtype_table, from_tensor, import_torch, to_tensor
from ..errors import DtypeError, InvalidInputError, NotFoundError
from ._files import Checkpoint, _atomic_path, _bad, _check_aliases, _prepare

__all__ = ["load_torch", "save_torch", "to_torch", "from_torch"]


def load_torch(path) -> Checkpoint:
    """Read a flat torch state dict (``torch.load(weights_only=True)``).

    Tensors become numpy arrays sharing the loaded memory where possible;
    tied names go to ``aliases``. Requires PyTorch.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> import tempfile, numpy as np, ml_dtypes
    >>> p = Path(tempfile.mkdtemp()) / "m.pt"
    >>> save_torch({"emb": np.ones((2, 2), np.float32)}, p, aliases={"head": "emb"})
    >>> load_torch(p).aliases
    {'head': 'emb'}
    """
    p = Path(path)
    obj = safe_load(p)
    if not isinstance(obj, Mapping):
        raise _bad(p, f"holds a {type(obj).__name__}, not a state dict", kind="torch")
    try:
        return from_torch(obj)
    except InvalidInputError as e:
        raise type(e)(f"{p}: {e.message}") from e


def safe_load(p: Path):
    """``torch.load(p, weights_only=True)`` on the CPU: tensors and plain containers, never code from the file.

    Raises NotFoundError for a missing file and InvalidInputError (one plain line) for anything torch refuses.
    """
    torch = import_torch()
    if not p.is_file():
        raise NotFoundError(f"{p}: no such torch checkpoint file")
    try:
        return torch.load(p, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises a zoo of types (UnpicklingError, RuntimeError, EOFError...)
        raise _bad(p, _load_failure(e), kind="torch") from e


_UNSAFE = re.compile(r"WeightsUnpickler error: (.*?)(?: was not an allowed global by default\b.*)?$", re.MULTILINE)


def _load_failure(e: BaseException) -> str:
    """torch.load's error in one plain line (torch colours its weights-only message with terminal escapes).

    >>> _load_failure(RuntimeError("Weights only load failed. \\x1b[1mbold\\x1b[0m.\\n\\tWeightsUnpickler error: "
    ...                            "Unsupported global: GLOBAL a.B was not an allowed global by default. Please..."))
    'it holds objects other than tensors (Unsupported global: GLOBAL a.B), which a safe load refuses: ulstore loads \
torch files with torch.load(weights_only=True), which never runs code from the file; save the tensors alone \
(torch.save(model.state_dict(), path)) or convert the file to safetensors'
    """
    text = strip_ansi(str(e))
    if "Weights only load failed" in text:
        m = _UNSAFE.search(text)
        what = f" ({m.group(1).strip().rstrip('.')})" if m else ""
        return (
            f"it holds objects other than tensors{what}, which a safe load refuses: ulstore loads torch files "
            "with torch.load(weights_only=True), which never runs code from the file; save the tensors alone "
            "(torch.save(model.state_dict(), path)) or convert the file to safetensors"
        )
    lines = text.strip().splitlines()
    return f"cannot read as a torch checkpoint: {lines[0] if lines else type(e).__name__}"


def save_torch(tensors, path, aliases=None) -> None:
    """Write a torch state dict atomically, restoring tied storage.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray]
    path : str or os.PathLike
    aliases : dict[str, str], optional
        alias -> canonical name; each alias is saved as the very same tensor
        as its canonical name, so ``torch.load`` gives them shared storage.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> import tempfile, numpy as np, ml_dtypes
    >>> p = Path(tempfile.mkdtemp()) / "m.pt"
    >>> save_torch({"emb": np.ones(4, np.float32)}, p, aliases={"head": "emb"})
    >>> sd = torch.load(p, weights_only=True)
    >>> sd["head"].data_ptr() == sd["emb"].data_ptr()
    True
    """
    torch = import_torch()
    state = to_torch(tensors, aliases)
    with _atomic_path(Path(path)) as tmp:
        torch.save(state, tmp)


def to_torch(tensors, aliases=None) -> dict:
    """Convert numpy arrays to a torch state dict, sharing memory where possible.

    bf16/fp8 are reinterpreted bit for bit. Read-only arrays are copied (torch
    tensors are writable). Each alias maps to the same tensor as its
    canonical name, in the alias's position if ``tensors`` also lists it,
    else at the end.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> import numpy as np, ml_dtypes
    >>> sd = to_torch({"w": np.ones(2, ml_dtypes.bfloat16)}, aliases={"v": "w"})
    >>> sd["w"].dtype, sd["v"] is sd["w"]
    (torch.bfloat16, True)
    """
    import_torch()
    aliases = dict(aliases or {})
    arrays = _prepare(tensors)
    _check_aliases(arrays, aliases)
    converted = {}
    for name, arr in arrays.items():
        if name in aliases:
            continue
        if not arr.flags.writeable:
            arr = arr.copy()
        converted[name] = to_tensor(arr)
    out = {name: converted[aliases.get(name, name)] for name in arrays}
    out.update((a, converted[c]) for a, c in aliases.items() if a not in out)
    return out


def from_torch(state_dict) -> Checkpoint:
    """Convert a flat torch state dict to a :class:`Checkpoint` (no file I/O).

    Arrays share memory with CPU tensors where possible; non-contiguous
    tensors are made contiguous. A name whose tensor is exactly another
    name's tensor (same storage, offset, shape, strides, dtype) becomes an
    alias of the first such name.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")  # examples need PyTorch
    >>> w = torch.arange(4, dtype=torch.bfloat16)
    >>> ck = from_torch({"emb": w, "head": w})
    >>> ck.tensors["emb"].dtype, ck.aliases
    (dtype(bfloat16), {'head': 'emb'})
    """
    torch = import_torch()
    table = {t: n for n, t in dtype_table(torch).items()}
    tensors: dict = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"state dict key {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"entry {name!r} is a {type(t).__name__}, not a tensor; only flat "
                "state dicts are supported (pass e.g. ckpt['state_dict'])"
            )
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise InvalidInputError(f"tensor {name!r} is not a dense, materialized tensor ({t.layout}, {t.device})")
        if t.dtype not in table:
            raise DtypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        # Zero-size tensors may all report storage pointer 0: never tie them.
        if t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
        tensors[name] = from_tensor(t)  # no copy for plain CPU tensors
    return Checkpoint(tensors, {}, aliases)
