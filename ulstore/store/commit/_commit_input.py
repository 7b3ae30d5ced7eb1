"""What a commit is given, checked before anything is written: arrays, metadata, files; ``HEAD``.

:meth:`Trajectory.commit` and :meth:`Trajectory.finalize` take user values:
tensors as numpy arrays, torch tensors or other ``__array__`` objects,
metadata as JSON-serializable mappings, files as bytes.  Each is checked here
(and turned into what the store writes) so that a bad value raises
:class:`InvalidInputError` or :class:`DtypeError`, naming the tensor, before
any blob exists.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from ...core.sealed import canonical_json, plain_json
from ...core.torch import as_numpy
from ...errors import DtypeError, InvalidInputError
from ..format._chunkcodec import check_committable
from ..format._layout import check_file_names

__all__ = ["HEAD", "as_array", "check_metadata", "check_files"]


class _Head:
    def __repr__(self) -> str:
        return "HEAD"

    def __reduce__(self) -> str:
        return "HEAD"  # unpickles as the one HEAD (``parent is HEAD`` holds in another process)


#: ``parent=HEAD`` (the default of :meth:`Trajectory.commit`): the head of the branch.
HEAD = _Head()


def as_array(name: str, value) -> np.ndarray:
    """Accept numpy arrays/scalars, torch tensors and other ``__array__`` objects; never lists."""
    try:
        arr = as_numpy(value, array_like=True)
    except InvalidInputError as e:  # a torch tensor with no plain data (meta, sparse)
        raise type(e)(e.message, tensor=name) from None
    if arr is None:
        raise InvalidInputError(
            f"tensor values must be arrays (numpy, torch, ...), got {type(value).__name__}; "
            "wrap Python numbers and lists with np.asarray and an explicit dtype",
            tensor=name,
        )
    try:
        check_committable(arr.dtype)
    except DtypeError as e:
        raise DtypeError(e.message, tensor=name) from None
    return arr


def check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    metadata = plain_json(dict(metadata))  # NumPy scalars as numbers; what JSON would change: refused, named
    if "ulstore" in metadata:
        raise InvalidInputError("the metadata key 'ulstore' is reserved")
    try:
        return json.loads(canonical_json(metadata))
    except RecursionError:
        raise InvalidInputError("metadata is nested too deeply to store as JSON") from None
    except (TypeError, ValueError) as e:
        raise InvalidInputError(
            f"metadata must be JSON-serializable (finite numbers, str, lists, dicts): {e}"
        ) from None


def check_files(files) -> dict[str, bytes]:
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise InvalidInputError(f"files must map file names to bytes, got {type(files).__name__}")
    check_file_names(files)
    out = {}
    for name, data in files.items():
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInputError(f"file {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out
