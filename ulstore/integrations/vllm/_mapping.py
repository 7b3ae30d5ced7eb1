"""Where each checkpoint tensor lands in a running model: learned by watching the model's own ``load_weights``.

vLLM fuses (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``),
slices for tensor parallelism, pads vocabularies and ties embeddings, each model
class in its own ``load_weights``.  Rather than a table per architecture,
:func:`observe` runs that ``load_weights`` once on placeholder tensors of the
published shapes under a :class:`~torch.overrides.TorchFunctionMode` that
*records* every ``copy_`` from a view of a checkpoint tensor into a view of a
parameter (storage offset, strides, shape of both sides) and performs none of
them: the model's values stay as they are.  Each record is an affine map from
the checkpoint tensor's flat indices to the parameter's storage: a
:class:`Landing`.

The loader must move checkpoint values by views only (narrow, slice, view,
transpose, ``copy_``, which may cast).  A value it computes (a concatenation,
an arithmetic op, a permutation copied to a temporary) cannot be followed
element by element: :class:`MappingError` names the tensor, and nothing is
guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...errors import InvalidInputError

__all__ = ["Landing", "LoadMap", "MappingError", "observe"]


class MappingError(InvalidInputError):
    """The model's loader moves a checkpoint tensor in a way that cannot be followed element by element."""


@dataclass(frozen=True)
class Landing:
    """One ``copy_`` of the loader: the checkpoint elements ``src`` written into the elements ``dst`` of ``target``.

    Both sides are strided views of ``shape``: ``dst_offset``/``dst_strides``
    in the target's storage, ``src_offset``/``src_strides`` in the checkpoint
    tensor's flat (C-order) elements (a stride 0 where ``copy_`` broadcast).
    """

    target: str
    shape: tuple
    dst_offset: int
    dst_strides: tuple
    src_offset: int
    src_strides: tuple
    cast: bool

    def dst(self, target: torch.Tensor) -> torch.Tensor:
        return target.as_strided(self.shape, self.dst_strides, self.dst_offset)

    def src(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.src_strides, self.src_offset)


def _c_strides(shape) -> tuple:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


@dataclass
class LoadMap:
    """The landings of every checkpoint tensor (``landings[name]``), and the model's tensors they write."""

    landings: dict[str, list[Landing]]
    targets: dict[str, torch.Tensor]
    ignored: list[str]  # checkpoint tensors the loader read but wrote nowhere (e.g. lm_head.weight when tied)

    def direct(self, name: str, shape, dtype) -> torch.Tensor | None:
        """A contiguous view of the model's memory that *is* checkpoint tensor ``name`` (same shape, dtype and
        element order), or None if it lands elsewhere in pieces, cast, or more than once (TP slices, casts)."""
        got = self.landings.get(name, [])
        if len(got) != 1:
            return None
        a = got[0]
        target = self.targets[a.target]
        n = math.prod(shape)
        if a.cast or target.dtype != dtype or math.prod(a.shape) != n or a.src_offset != 0:
            return None
        if a.src_strides != _c_strides(a.shape) or a.dst_strides != _c_strides(a.shape):
            return None
        return target.as_strided(tuple(shape), _c_strides(shape), a.dst_offset)


def _targets(model: torch.nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        if t.numel():
            out.setdefault(t.untyped_storage().data_ptr(), (name, t.data))
    return out


#: in-place methods that write no element
_HARMLESS = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})


def _is_tensor(args) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor)


class _Observer(TorchFunctionMode):
    """Records the loader's writes into the model instead of doing them."""

    def __init__(self, targets: dict, sources: dict, landings: dict, current: list):
        super().__init__()
        self.targets, self.sources, self.landings, self.current = targets, sources, landings, current

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            return self._copy(args[0], args[1] if len(args) > 1 else kwargs["src"])
        if func is torch.Tensor.__setitem__ and self._target(args[0]) is not None:
            value, dst = args[2], args[0][args[1]]
            if not isinstance(value, torch.Tensor):
                raise self._error("sets elements of {} to a Python value")
            if self._target(dst) is None:  # advanced indexing: the elements written are not a strided view
                raise self._error("writes {} through an index that is not a slice")
            self._copy(dst, value)
            return None
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and name not in _HARMLESS and _is_tensor(args):
            if self._target(args[0]) is not None:  # an in-place op on a parameter other than copy_
                raise self._error(f"writes {{}} with {name}")
        return func(*args, **kwargs)

    def _target(self, t: torch.Tensor):
        return self.targets.get(t.untyped_storage().data_ptr()) if t.numel() else None

    def _error(self, what: str) -> MappingError:
        name = self.current[0]
        return MappingError(
            f"the model's load_weights {what.format('a parameter')} while loading this tensor: its values cannot "
            "be followed element by element (only views of checkpoint tensors copied into views of parameters can)",
            tensor=name,
        )

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        target = self._target(dst)
        if target is None or not dst.numel():
            if isinstance(src, torch.Tensor) and src.numel() and src.untyped_storage().data_ptr() in self.sources:
                return dst  # a checkpoint tensor copied into a temporary: an error only if that reaches a parameter
            return torch.Tensor.copy_(dst, src)  # the loader's own scratch work
        tname, ttensor = target
        if not isinstance(src, torch.Tensor) or src.untyped_storage().data_ptr() not in self.sources:
            raise self._error("writes {} from a computed value, not a view of the checkpoint tensor,")
        sname = self.sources[src.untyped_storage().data_ptr()]
        if dst.dtype != ttensor.dtype or src.dtype != self.sources_dtype(sname):
            raise self._error("reinterprets {} as another dtype")
        b = torch.broadcast_to(src, dst.shape)
        self.landings[sname].append(
            Landing(
                tname,
                tuple(dst.shape),
                int(dst.storage_offset()),
                tuple(dst.stride()),
                int(b.storage_offset()),
                tuple(b.stride()),
                src.dtype != dst.dtype,
            )
        )
        return dst

    def sources_dtype(self, name: str):
        return self.current[1][name][1]


def observe(model: Any, specs: dict) -> LoadMap:
    """Learn where ``model.load_weights`` puts each tensor of ``specs`` (``{name: (shape, torch dtype)}``).

    The model's values are left untouched.  Raises :class:`MappingError` if
    the loader computes a value, or if two checkpoint elements land on the
    same parameter element.
    """
    targets = _targets(model)
    sources: dict[int, str] = {}
    landings: dict[str, list[Landing]] = {n: [] for n in specs}
    current: list = [None, specs]

    def feed():
        for name, (shape, dtype) in specs.items():
            t = torch.empty(tuple(shape), dtype=dtype)  # real memory: the loader's views behave as in a real load
            if t.numel():
                sources[t.untyped_storage().data_ptr()] = name  # (a freed tensor's address may be reused: replaced)
            current[0] = name
            yield name, t

    with _Observer(targets, sources, landings, current):
        model.load_weights(feed())
    named = {name: t for name, t in targets.values()}
    _check_overlaps(named, landings)
    ignored = [n for n, got in landings.items() if not got]
    return LoadMap({n: got for n, got in landings.items() if got}, named, ignored)


def _check_overlaps(targets: dict, landings: dict) -> None:
    """Two checkpoint elements writing one parameter element would make the result depend on their order."""
    counts: dict[str, torch.Tensor] = {}
    for name, got in landings.items():
        for a in got:
            t = targets[a.target]
            c = counts.get(a.target)
            if c is None:
                c = counts[a.target] = torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=torch.int16)
            view = c.as_strided(a.shape, a.dst_strides, a.dst_offset)
            view += 1
            if int(view.max()) > 1:
                raise MappingError(f"the loader writes elements of {a.target!r} twice", tensor=name)
