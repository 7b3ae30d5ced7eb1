"""Nested training state (an optimizer's ``state_dict()``, a trainer checkpoint) as flat tensors plus a skeleton.

A store step holds named tensors.  Training state is a tree: ``optimizer.state_dict()``
is ``{"state": {0: {"step": tensor, "exp_avg": tensor, ...}, ...}, "param_groups":
[{"lr": 0.001, "betas": (0.9, 0.999), "params": [0, 1], ...}]}``.
:func:`flatten_state` splits such a tree into

* ``tensors``: every tensor leaf (torch tensors and numpy arrays of a storable
  dtype), under a dotted path name (``optimizer.state.0.exp_avg``), so that the
  store codes them (Adam moments are fp32 tensors that ULPack codes like weights);
* ``skeleton``: everything else, as JSON that records each value's exact type:
  dict keys that are ints stay ints, tuples stay tuples, ``True`` is not ``1``,
  floats keep every bit (``float.hex``: NaN, -0.0 and infinities included), and
  each tensor leaf is a reference to its name.

:func:`unflatten_state` rebuilds the tree, equal in every value and type.  The
skeleton is what a step's metadata (or a per-step file) keeps; it is small:
hyper-parameters and structure, never tensor data.

Examples
--------
>>> import numpy as np
>>> state = {"state": {0: {"step": 3, "m": np.ones(2, np.float32)}}, "groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}
>>> flat = flatten_state(state, prefix="optimizer")
>>> list(flat.tensors)
['optimizer.state.0.m']
>>> back = unflatten_state(flat.tensors, flat.skeleton)
>>> back["groups"][0]["betas"], type(list(back["state"])[0])
((0.9, 0.99), <class 'int'>)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np

from ..core.dtypes import STORABLE
from ..errors import InvalidInputError

__all__ = ["FlatState", "flatten_state", "unflatten_state", "SKELETON_VERSION"]

#: Version of the skeleton's JSON encoding (stored with it; readers refuse newer ones).
SKELETON_VERSION = 1


@dataclass
class FlatState:
    """A nested state split in two: ``tensors`` (name -> tensor or array) and ``skeleton`` (JSON-able)."""

    tensors: dict
    skeleton: dict


def flatten_state(state, *, prefix: str = "") -> FlatState:
    """Split a nested state into named tensor leaves and a JSON skeleton of everything else.

    Parameters
    ----------
    state : dict, list or tuple
        Containers of dicts (str, int or bool keys; any order), lists and tuples;
        leaves are torch tensors, numpy arrays (of a storable dtype), Python
        ``int``/``float``/``bool``/``str``/``None``, and numpy scalars.
    prefix : str, optional
        Put in front of every tensor name (``prefix.path``), e.g. ``"optimizer"``.

    Returns
    -------
    FlatState

    Raises
    ------
    InvalidInputError
        A leaf of another type (a custom object, bytes...), a dict key of
        another type, or two paths that would give one tensor name.
    """
    tensors: dict = {}

    def name_of(path: list[str]) -> str:
        name = ".".join([prefix, *path] if prefix else path) or "_"
        if name in tensors:
            raise InvalidInputError(f"two entries of the state flatten to the tensor name {name!r}")
        return name

    def encode(value, path: list[str]):
        if _is_tensor(value):
            name = name_of(path)
            tensors[name] = value
            return {"tensor": name}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):  # after bool, which is an int too
            return value
        if isinstance(value, float):  # float.hex is exact for -0.0 and infinities; a NaN keeps its bits
            return {"float": value.hex()} if value == value else {"float_bits": hex(_double_bits(value))}
        if isinstance(value, np.bool_):
            return {"np.bool": bool(value)}
        if isinstance(value, np.integer):
            return {f"np.{value.dtype.name}": str(int(value))}
        if isinstance(value, np.floating):
            return {f"np.{value.dtype.name}": _np_float_bits(value)}
        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise InvalidInputError(f"state key {k!r} at {'.'.join(path) or 'the top'} is not a str or int")
                items.append([k if isinstance(k, str) else {"int": str(k)}, encode(v, [*path, str(k)])])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [encode(v, [*path, str(i)]) for i, v in enumerate(value)]}
        raise InvalidInputError(
            f"state entry {'.'.join(path) or 'at the top'} is a {type(value).__name__}; only tensors, numbers, "
            "strings, None and dicts/lists/tuples of them can be stored"
        )

    root = encode(state, [])
    return FlatState(tensors, {"version": SKELETON_VERSION, "root": root})


def unflatten_state(tensors, skeleton: dict):
    """Rebuild the state :func:`flatten_state` split; tensors are taken from ``tensors`` by name (as given).

    Raises
    ------
    InvalidInputError
        The skeleton is malformed or of a newer version, or names a tensor ``tensors`` lacks.
    """
    if not isinstance(skeleton, dict) or "root" not in skeleton:
        raise InvalidInputError("not a state skeleton (no 'root')")
    if skeleton.get("version") != SKELETON_VERSION:
        raise InvalidInputError(f"state skeleton version {skeleton.get('version')!r} is not {SKELETON_VERSION}")

    def decode(node):
        if node is None or isinstance(node, (bool, str, int)):
            return node
        if isinstance(node, float):  # not written by flatten_state, but JSON readers may give one
            return node
        if not isinstance(node, dict) or len(node) != 1:
            raise InvalidInputError(f"malformed state skeleton node {json.dumps(node)[:80]}")
        ((tag, body),) = node.items()
        if tag == "tensor":
            if body not in tensors:
                raise InvalidInputError(f"the state skeleton names tensor {body!r}, which is missing")
            return tensors[body]
        if tag == "dict":
            return {(decode(k) if isinstance(k, dict) else k): decode(v) for k, v in body}
        if tag == "list":
            return [decode(v) for v in body]
        if tag == "tuple":
            return tuple(decode(v) for v in body)
        return _decode_number(tag, body)

    return decode(skeleton["root"])


def _decode_number(tag: str, body):
    """A skeleton leaf that is a number: a big int, a float by its hex or bits, a numpy scalar."""
    if tag == "int":
        return int(body)
    if tag == "float":
        return float.fromhex(body)
    if tag == "float_bits":
        return struct.unpack("<d", struct.pack("<Q", int(body, 16)))[0]
    if tag == "np.bool":
        return np.bool_(body)
    if tag.startswith("np."):
        dtype = np.dtype(tag[3:])
        if dtype.kind in "iu":
            return dtype.type(int(body))
        return np.array([int(body, 16)], f"<u{dtype.itemsize}").view(dtype.newbyteorder("<"))[0]
    raise InvalidInputError(f"unknown state skeleton tag {tag!r}")


def _is_tensor(value) -> bool:
    if isinstance(value, np.ndarray):
        if value.dtype.newbyteorder("<") not in STORABLE and value.dtype not in STORABLE:
            raise InvalidInputError(f"numpy array of dtype {value.dtype} cannot be stored")
        return True
    return type(value).__module__.startswith("torch") and type(value).__name__ in ("Tensor", "Parameter")


def _double_bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def _np_float_bits(value) -> str:
    """A numpy float scalar's bits in hex (float16/32/64 and friends), so NaN payloads survive."""
    arr = np.asarray(value)
    return hex(int(arr.reshape(1).view(f"<u{arr.dtype.itemsize}")[0]))
