"""The floating-point formats ULPack codes, and exact bit views of arrays in them.

Every supported dtype is described by its bit width ``w`` and the position of its
exponent field; the codec itself only ever sees unsigned ``w``-bit words
(little-endian, C order).  bfloat16 and fp8 come from ``ml_dtypes`` so that values
handed back to users keep their real dtype, never a silent ``uint16``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ..errors import DtypeError, InvalidInputError

__all__ = ["FloatFormat", "FORMATS", "format_of", "format_by_code", "as_bits", "from_bits", "tensor_to_numpy"]


@dataclass(frozen=True)
class FloatFormat:
    """One floating-point format: its wire code and bit layout."""

    code: int  # stored in the blob header; never renumber
    name: str
    dtype: np.dtype
    width: int  # w, bits per element
    mant_bits: int  # the exponent field sits just above the mantissa
    exp_bits: int

    def __post_init__(self):
        # derived constants, computed once: the codec reads them on every call
        alphabet = 4 * self.width - 4  # tokens for this width (see docs/format.md)
        token_bits = (alphabet - 1).bit_length()
        derived = {
            "word": np.dtype(f"<u{self.width // 8}"),
            "n_contexts": 1 << self.exp_bits,
            "alphabet": alphabet,
            "token_bits": token_bits,
            "symbol": np.dtype(np.uint16 if self.exp_bits + token_bits <= 16 else np.uint32),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    #: unsigned little-endian integer dtype of the same width
    word: np.dtype = field(init=False, repr=False, compare=False)
    #: number of possible reference-exponent contexts (2**exp_bits)
    n_contexts: int = field(init=False, repr=False, compare=False)
    #: number of ULPack tokens: 4w - 4
    alphabet: int = field(init=False, repr=False, compare=False)
    #: bits that hold a token inside a symbol ``context << token_bits | token``
    token_bits: int = field(init=False, repr=False, compare=False)
    #: smallest unsigned dtype that holds every symbol
    symbol: np.dtype = field(init=False, repr=False, compare=False)


FORMATS: tuple[FloatFormat, ...] = (
    FloatFormat(1, "float16", np.dtype(np.float16), 16, 10, 5),
    FloatFormat(2, "bfloat16", np.dtype(ml_dtypes.bfloat16), 16, 7, 8),
    FloatFormat(3, "float32", np.dtype(np.float32), 32, 23, 8),
    FloatFormat(4, "float64", np.dtype(np.float64), 64, 52, 11),
    FloatFormat(5, "float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), 8, 3, 4),
    FloatFormat(6, "float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), 8, 2, 5),
)
_BY_NAME = {f.name: f for f in FORMATS}
_BY_CODE = {f.code: f for f in FORMATS}
#: The formats by their native little-endian dtypes: the common case, one dict lookup.
_BY_DTYPE = {f.dtype.newbyteorder("<"): f for f in FORMATS}


def format_of(dtype) -> FloatFormat:
    """The :class:`FloatFormat` of a numpy/ml_dtypes dtype (any byte order) or dtype name.

    Raises
    ------
    DtypeError
        If the dtype is not one of the six supported floating-point formats.
    """
    if isinstance(dtype, np.dtype) and dtype.byteorder != ">":
        fmt = _BY_DTYPE.get(dtype)  # (equal dtypes hash equal: "=" and "<" alike on little-endian hosts)
        if fmt is not None and np.little_endian:
            return fmt
    try:
        name = np.dtype(dtype).newbyteorder("=").name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = str(dtype)
    fmt = _BY_NAME.get(str(name))
    if fmt is None:
        raise DtypeError(f"ULPack codes floating-point tensors only ({', '.join(_BY_NAME)}); got dtype {dtype!s}")
    return fmt


def format_by_code(code: int) -> FloatFormat | None:
    """The format with wire code ``code``, or None if unknown."""
    return _BY_CODE.get(code)


# torch dtypes numpy cannot hold natively travel as same-width integers and are
# re-viewed on the other side: the bits never change.
TORCH_VIA_INT = {
    "torch.bfloat16": ("int16", ml_dtypes.bfloat16),
    "torch.float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
    "torch.float8_e5m2": ("uint8", ml_dtypes.float8_e5m2),
}


def tensor_to_numpy(tensor) -> np.ndarray:
    """A numpy view of a torch tensor's bits (copied to host / made contiguous if needed).

    The codec's half of the torch bridge (:mod:`ulstore.core.torch` is the
    public one): the codec accepts torch tensors, and reads their bits here.
    """
    import torch

    t = tensor.detach()
    if t.device.type == "meta":
        raise InvalidInputError(
            "a meta tensor has a shape but no data: materialize it first (e.g. load the weights, "
            "or model.to_empty(device='cpu') and initialize)"
        )
    if t.layout != torch.strided:
        raise InvalidInputError(f"{t.layout} tensors are not supported: convert with .to_dense() first")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    via = TORCH_VIA_INT.get(str(t.dtype))
    if via is not None:
        return t.view(getattr(torch, via[0])).numpy().view(via[1])
    return t.numpy()


def _to_numpy(array) -> np.ndarray:
    """Accept numpy arrays and torch tensors (zero-copy where the layout allows)."""
    if isinstance(array, np.ndarray):
        return array if type(array) is np.ndarray else np.asarray(array)  # np.matrix & co: their plain array
    module = type(array).__module__
    if module.startswith("torch"):
        return tensor_to_numpy(array)
    if isinstance(array, (np.generic, float)):
        return np.asarray(array)
    raise DtypeError(f"expected a numpy array or torch tensor, got {type(array).__name__}")


def as_bits(array) -> tuple[FloatFormat, np.ndarray]:
    """Return the format and a C-contiguous little-endian unsigned-word view of ``array``.

    A copy is made only when the input is non-contiguous or big-endian; the
    values are never changed.
    """
    arr = _to_numpy(array)
    dtype = arr.dtype
    fmt = format_of(dtype)
    if np.little_endian and dtype.byteorder != ">" and arr.flags.c_contiguous:  # the common case: a view
        return fmt, arr.view(fmt.word)
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
    return fmt, arr.view(fmt.word)


def from_bits(fmt: FloatFormat, words: np.ndarray) -> np.ndarray:
    """View unsigned words as the format's (native little-endian) float dtype."""
    return words.view(fmt.dtype)
