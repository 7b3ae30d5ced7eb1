"""Host views of numpy arrays and torch tensors, chunk hashes, and in-place writes.

The codec works on host numpy arrays.  The publisher copies device tensors to
host (only the ones it needs); the follower keeps a host *mirror* of every
tensor it serves as the reference for the next delta and, when the caller's
tensor lives on a device, pushes each changed chunk to it.  For numpy arrays
and CPU torch tensors the mirror *is* the caller's memory (a zero-copy view),
so nothing is stored twice.  Also: the Specs of a step's tensors, and where a
chunk's box lies in a tensor's flat memory (:func:`geometry`).
"""

from __future__ import annotations

import functools
import math
import mmap
from typing import NamedTuple

import numpy as np

from ..core.dtypes import dtype_name
from ..core.torch import as_numpy, from_tensor, is_tensor, signed_int, to_tensor
from ..errors import InvalidInputError

__all__ = ["host_array", "words", "Binding", "Spec", "bind", "allocate", "geometry", "specs_of"]


def host_array(name: str, value) -> np.ndarray:
    """A C-contiguous, little-endian host numpy array with ``value``'s bits.

    Zero-copy for contiguous numpy arrays and CPU tensors; device tensors are
    copied to host (that copy is the publisher's job: the codec reads host memory).
    """
    arr = as_numpy(value)
    if arr is None:
        raise InvalidInputError(
            f"state values must be numpy arrays or torch tensors, got {type(value).__name__}", tensor=name
        )
    dtype_name(arr.dtype)  # raises DtypeError for unstorable dtypes
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)


def host_copy(name: str, value) -> np.ndarray:
    """A host array with ``value``'s bits that the caller cannot change: one contiguous copy (a word copy, at
    memory speed; no other conversion), or the host copy a device tensor gets anyway."""
    arr = host_array(name, value)
    if is_tensor(value) and value.device.type != "cpu":
        return arr
    if np.may_share_memory(arr, as_numpy(value)):
        arr = arr.copy()
    return arr


def words(arr: np.ndarray) -> np.ndarray:
    """The flat unsigned-integer view of ``arr``'s bits (for exact comparison and hashing)."""
    return arr.reshape(-1).view(f"<u{arr.dtype.itemsize}")


class Spec(NamedTuple):
    """A published tensor: name, shape and (little-endian) dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


class Binding:
    """One tensor a follower keeps current.

    ``mirror`` is a flat host array that always holds the tensor's bits: a view
    of the caller's own memory (numpy, CPU torch) or a private copy when the
    caller's tensor is on a device (``device`` is then its flat view).
    """

    __slots__ = ("name", "mirror", "device", "source", "ptr")

    def __init__(self, name: str, mirror: np.ndarray, device=None, source=None):
        self.name = name
        self.mirror = mirror
        self.device = device
        self.source = source  # the caller's object bound (None: not checked)
        self.ptr = source.data_ptr() if is_tensor(source) else None  # torch: set_() or .data= swap the storage

    def current(self, value) -> bool:
        """Whether ``value`` (what the state dict now holds under this name) is still the memory written."""
        if self.source is None:
            return True
        return value is self.source and (self.ptr is None or value.data_ptr() == self.ptr)

    def write(self, start: int, values: np.ndarray) -> None:
        """Overwrite elements ``[start, start + len(values))`` with ``values``."""
        stop = start + values.size
        words(self.mirror)[start:stop] = words(values)
        if self.device is not None:
            self.device[start:stop].copy_(to_tensor(np.ascontiguousarray(values.reshape(-1))))

    def write_box(self, shape: tuple, region: tuple, values: np.ndarray) -> None:
        """Overwrite the box ``region`` (a tuple of slices) of the tensor of ``shape`` with ``values``."""
        words(self.mirror).reshape(shape)[region] = words(values).reshape(values.shape)
        if self.device is not None:
            self.device.view(shape)[region].copy_(to_tensor(np.ascontiguousarray(values)))

    def apply(self, start: int, stop: int, changes) -> None:
        """Write the :class:`~ulstore.codec.Changes` of chunk ``[start, stop)`` (positions relative to ``start``)."""
        changes.apply_to(self.mirror[start:stop])  # checks every position lies inside the chunk
        self.push(start, changes.positions, words(changes.values))

    def push(self, start: int, positions: np.ndarray, values: np.ndarray) -> None:
        """Device tensors: copy the changed elements (``positions`` from ``start``, ``values`` as words) from the mirror."""
        if self.device is not None:
            import torch

            # through same-width integer views: index_copy_ has no float8 kernels, and bits are bits
            signed = signed_int(torch, self.mirror.dtype.itemsize)
            dev = self.device.device
            index = torch.from_numpy(positions + start).to(dev)
            new = torch.from_numpy(values.view(f"<i{self.mirror.dtype.itemsize}")).to(dev)
            self.device.view(signed).index_copy_(0, index, new)


def bind(spec: Spec, value) -> Binding:
    """Bind the caller's ``value`` as the in-place target of tensor ``spec``.

    Raises
    ------
    InvalidInputError
        ``value`` has another shape or dtype, is read-only, or is not contiguous.
    """
    if is_tensor(value):
        t = value.detach()
        if tuple(t.shape) != spec.shape:
            raise InvalidInputError(
                f"shape is {tuple(t.shape)} but the published tensor is {spec.shape}", tensor=spec.name
            )
        if not t.is_contiguous():
            raise InvalidInputError(
                "tensor is not contiguous; pass a contiguous tensor (.contiguous())", tensor=spec.name
            )
        if t.device.type == "cpu":
            mirror = from_tensor(t)
            if mirror.size and mirror.__array_interface__["data"][0] != t.data_ptr():
                raise InvalidInputError("cannot write into this tensor in place", tensor=spec.name)
            _check_dtype(spec, mirror.dtype)
            return Binding(spec.name, mirror.reshape(-1), source=value)
        probe = from_tensor(t.reshape(-1)[:0])  # dtype only, no copy of the data
        _check_dtype(spec, probe.dtype)
        mirror = from_tensor(t).reshape(-1).copy()
        return Binding(spec.name, mirror, t.reshape(-1), source=value)
    if not isinstance(value, np.ndarray):
        raise InvalidInputError(
            f"state values must be numpy arrays or torch tensors, got {type(value).__name__}", tensor=spec.name
        )
    if value.shape != spec.shape:
        raise InvalidInputError(f"shape is {value.shape} but the published tensor is {spec.shape}", tensor=spec.name)
    _check_dtype(spec, value.dtype)
    if not value.flags.c_contiguous or not value.flags.writeable or value.dtype.byteorder == ">":
        raise InvalidInputError("array must be C-contiguous, writeable and little-endian", tensor=spec.name)
    return Binding(spec.name, value.reshape(-1), source=value)


#: Linux's transparent huge pages: 2 MiB
HUGE_PAGE = 1 << 21
_ALIGN = 64  # each tensor starts on a cache line of its own


def allocate(specs: list[Spec]) -> dict[str, tuple[np.ndarray, Binding]]:
    """Fresh zeroed arrays for ``specs`` (follower-owned state) and their bindings: ``{name: (array, binding)}``.

    All of them are views of one :func:`arena`: a version's changes land at
    random positions across the whole state, and on 4 KiB pages nearly every
    one first misses the TLB (on 2 MiB pages a 13M-parameter state is 13 pages).
    The arena lives while any of its arrays does.
    """
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += -(-math.prod(spec.shape) * spec.dtype.itemsize // _ALIGN) * _ALIGN
    memory = arena(total)
    out = {}
    for spec, start in zip(specs, offsets):
        n = math.prod(spec.shape)
        arr = memory[start : start + n * spec.dtype.itemsize].view(spec.dtype).reshape(spec.shape)
        out[spec.name] = arr, Binding(spec.name, arr.reshape(-1), source=arr)
    return out


def arena(nbytes: int) -> np.ndarray:
    """``nbytes`` zeroed, writeable bytes from a cache line's start; from ``HUGE_PAGE`` up, on huge pages where
    the OS offers them.

    Linux backs an anonymous private mapping advised ``MADV_HUGEPAGE`` with
    2 MiB pages (``transparent_hugepage`` set to ``madvise`` or ``always``);
    elsewhere, or below a huge page, this is ``np.zeros``.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        whole = np.zeros(nbytes + _ALIGN, np.uint8)
        skip = -whole.ctypes.data % _ALIGN
        return whole[skip : skip + nbytes]
    # a huge page more than asked, to start on a 2 MiB boundary (the unused rest is never touched: no memory)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # huge pages disabled for this process or kernel: ordinary pages
        pass
    whole = np.frombuffer(region, np.uint8)  # keeps the mapping alive
    skip = -whole.ctypes.data % HUGE_PAGE
    return whole[skip : skip + nbytes]


def _check_dtype(spec: Spec, dtype: np.dtype) -> None:
    if np.dtype(dtype).newbyteorder("<") != spec.dtype:
        raise InvalidInputError(
            f"dtype is {dtype} but the published tensor is {dtype_name(spec.dtype)}", tensor=spec.name
        )


@functools.lru_cache(maxsize=1 << 16)  # the chunks of a version are the chunks of the last one
def geometry(shape: tuple, start: tuple, stop: tuple) -> tuple[int, int | None, tuple]:
    """(flat start, flat stop or None if the box is not one contiguous C-order run, box shape)."""
    box = tuple(b - a for a, b in zip(start, stop))
    n = math.prod(box)
    stride, first, last = 1, 0, 0
    for a, b, d in zip(reversed(start), reversed(stop), reversed(shape)):
        first += a * stride
        last += (b - 1) * stride
        stride *= d
    contiguous = n == 0 or last - first + 1 == n
    return first, (first + n if contiguous else None), box


@functools.lru_cache(maxsize=1 << 14)  # a version's tensors are mostly the last one's
def _spec(name: str, shape: tuple, dtype: np.dtype) -> Spec:
    """The (shared, immutable) Spec of a published tensor: built once, compared by identity first."""
    return Spec(name, tuple(shape), np.dtype(dtype))


#: per set of names followed (None: all), the tensors of the step fetched last and their specs
_last_specs: dict[frozenset | None, tuple] = {}


def specs_of(tensors: dict, names: frozenset | None = None) -> dict[str, Spec]:
    """The Specs of ``{name: (shape, dtype)}`` (only those of ``names``, if given): the same dict object as the
    last call's with these names when the tensors are the same (mostly: consecutive steps share their tensors;
    :meth:`Replica.apply` then skips comparing them one by one).  Treat as read-only."""
    last, specs = _last_specs.get(names, ({}, {}))
    if tensors != last:
        items = tensors.items() if names is None else ((n, t) for n, t in tensors.items() if n in names)
        specs = {n: _spec(n, shape, dtype) for n, (shape, dtype) in items}
        if len(_last_specs) >= 8 and names not in _last_specs:  # (a process follows a few parts of models)
            _last_specs.clear()
        _last_specs[names] = (tensors, specs)  # one assignment: a thread sees the old or the new pair
    return specs
