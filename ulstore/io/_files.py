"""What every checkpoint file format shares: :class:`Checkpoint`, input checks, atomic writes.

The formats themselves live in ``_safetensors.py``, ``_npz.py`` and
``_torch.py``; :mod:`ulstore.io.checkpoints` is their public face.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.dtypes import STORABLE
from ..errors import DtypeError, InvalidInputError

__all__ = ["Checkpoint", "SUPPORTED_DTYPES", "parse_size"]

#: Every dtype this module reads and writes (little-endian forms).
SUPPORTED_DTYPES: frozenset[np.dtype] = STORABLE


@dataclass
class Checkpoint:
    """One checkpoint as numpy arrays.

    Attributes
    ----------
    tensors : dict[str, numpy.ndarray]
        Every distinct tensor, in file order; tied names are not repeated.
    metadata : dict[str, str]
        File-level metadata (safetensors ``__metadata__``, index ``metadata``).
    aliases : dict[str, str]
        Tied names: alias -> the canonical name it shares storage with.
    index_text : str or None
        For a sharded checkpoint, the exact text of its ``*.safetensors.index.json``
        (its ``metadata`` and ``weight_map``: which shard holds which tensor);
        ``metadata`` then holds the shards' ``__metadata__``.

    Examples
    --------
    >>> ck = Checkpoint({"w": np.zeros(2, np.float32)}, aliases={"w2": "w"})
    >>> sorted(ck.all_tensors())
    ['w', 'w2']
    """

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    index_text: str | None = None

    def all_tensors(self) -> dict[str, np.ndarray]:
        """Return ``tensors`` plus every alias, mapped to the same array object."""
        out = dict(self.tensors)
        out.update((a, self.tensors[c]) for a, c in self.aliases.items())
        return out


def _prepare(tensors, reserved=()) -> dict[str, np.ndarray]:
    """Validate names and arrays; return little-endian C-contiguous arrays."""
    if not isinstance(tensors, Mapping):
        raise InvalidInputError(f"tensors must be a mapping of name -> numpy array, not {type(tensors).__name__}")
    out = {}
    for name, arr in tensors.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"tensor name {name!r} is not a string")
        if name in reserved:
            raise InvalidInputError(f"tensor name {name!r} is reserved by the file format")
        if not isinstance(arr, np.ndarray):
            raise InvalidInputError(f"value is a {type(arr).__name__}, not a numpy array", tensor=name)
        out[name] = _le_contiguous(name, arr)
    return out


def _le_contiguous(name: str, arr: np.ndarray) -> np.ndarray:
    dt = arr.dtype
    if dt.itemsize > 1 and (dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big")):
        arr = arr.astype(dt.newbyteorder("<"))  # a value-exact byte swap
    if arr.dtype not in SUPPORTED_DTYPES:
        raise DtypeError(f"unsupported dtype {arr.dtype}", tensor=name)
    # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _check_metadata(metadata) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidInputError("metadata must map strings to strings")
    return dict(metadata)


def _check_aliases(arrays: dict, aliases: dict) -> None:
    for alias, canon in aliases.items():
        if canon not in arrays or canon in aliases:
            raise InvalidInputError(f"alias {alias!r} points to {canon!r}, which is not a tensor of its own")
        if alias in arrays:
            a, c = arrays[alias], arrays[canon]
            if a.dtype != c.dtype or a.shape != c.shape or a.tobytes() != c.tobytes():
                raise InvalidInputError(f"alias {alias!r} is also given as a tensor that differs from {canon!r}")


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; restored at once (import time)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


@contextlib.contextmanager
def _atomic_path(path: Path):
    """Yield a temporary path beside ``path``; move it into place only on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: it creates 0600 files, and the final file should get the
    # usual umask permissions.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        yield str(tmp)
        # fsync before the rename, else a power loss can leave an empty file
        # under the final name on some filesystems.
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # some writers (the safetensors library among them) create 0600 files
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # persist the rename itself; not possible everywhere
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def parse_size(size) -> int:
    """``5000``, ``"5GB"`` (10**9) or ``"5GiB"`` (2**30) -> bytes.

    >>> parse_size("5GB"), parse_size("500MiB"), parse_size(4096)
    (5000000000, 524288000, 4096)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise InvalidInputError(f"max_shard_size {size!r} is not a byte count such as 5000, '5GB' or '500MiB'")
        unit = (m.group(2) or "b").lower()
        scale = 1 if unit == "b" else (1024 if "i" in unit else 1000) ** ("kmgt".index(unit[0]) + 1)
        n = int(float(m.group(1)) * scale)
    if n <= 0:
        raise InvalidInputError(f"max_shard_size must be positive, got {size!r}")
    return n


def _read_into(f, arr: np.ndarray, p: Path, name: str) -> None:
    view = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers  # arr is fresh and contiguous: a view, no copy
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise _bad(p, f"tensor {name!r}: file ended mid-tensor (truncated?)")
        got += n


def _bad(p, what: str, kind: str = "safetensors") -> InvalidInputError:
    return InvalidInputError(f"{p}: invalid {kind} file: {what}")
