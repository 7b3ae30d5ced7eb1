"""Exact bit views and awkward floats: the one place tests look at the bits of a value.

Nothing here compares floats as floats: every check goes through the unsigned
integer view of the bits, so NaN payloads, signed zeros and subnormals count.
Torch tensors are viewed with torch's own integer views, not through
ulstore's bridge, so the code under test is not its own oracle.

Bit identity is asserted one way: :func:`assert_bits_equal` (dtype, shape, raw
bytes; numpy arrays and torch tensors alike), which names the first element that
differs.  ``tests/codec/conftest.py`` also hands these out as fixtures.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "FLOAT_FORMATS",
    "uint",
    "bits_of",
    "flat_bits",
    "from_bits",
    "awkward_bits",
    "awkward_floats",
    "random_floats",
    "assert_bits_equal",
    "assert_bit_identical",
    "words_view",
]

#: name -> (dtype, width in bits, exponent bits, mantissa bits)
FLOAT_FORMATS: dict[str, tuple[np.dtype, int, int, int]] = {
    "float16": (np.dtype(np.float16), 16, 5, 10),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), 16, 8, 7),
    "float32": (np.dtype(np.float32), 32, 8, 23),
    "float64": (np.dtype(np.float64), 64, 11, 52),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), 8, 4, 3),
    "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), 8, 5, 2),
}


def uint(dtype_or_itemsize) -> np.dtype:
    """The unsigned little-endian integer dtype as wide as a dtype (or of ``itemsize`` bytes)."""
    n = dtype_or_itemsize if isinstance(dtype_or_itemsize, int) else np.dtype(dtype_or_itemsize).itemsize
    return np.dtype(f"<u{n}")


_uint = uint


def _layout(dtype) -> tuple[np.dtype, int, int, int]:
    name = np.dtype(dtype).newbyteorder("=").name
    return FLOAT_FORMATS[name]


def bits_of(array) -> np.ndarray:
    """The values of ``array`` (numpy or torch) as native little-endian unsigned words, same shape (0-d kept).

    Byte order is normalised first, so a big-endian input and its little-endian
    copy give the same words.  A copy: never a view of the input.
    """
    if type(array).__module__.startswith("torch"):
        return _torch_bits(array)
    a = np.asarray(array)
    if not a.dtype.isnative and a.dtype.itemsize > 1:
        a = a.astype(a.dtype.newbyteorder("="))
    a = np.array(a, copy=True, order="C")  # keeps 0-d, unlike ascontiguousarray
    return a.view(_uint(a.dtype.itemsize))


def flat_bits(array) -> np.ndarray:
    """:func:`bits_of`, flattened (C order)."""
    return bits_of(array).reshape(-1)


def words_view(array: np.ndarray) -> np.ndarray:
    """A flat unsigned-word *view* of a C-contiguous numpy array: writing to it writes the array's bits."""
    assert array.flags.c_contiguous
    return array.reshape(-1).view(uint(array.dtype))


def _torch_bits(t) -> np.ndarray:
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    t = t.detach().cpu().contiguous()
    return t.view(ints[t.element_size()]).numpy().view(uint(t.element_size())).copy()


def from_bits(words: np.ndarray, dtype) -> np.ndarray:
    """View unsigned words as ``dtype`` (native byte order)."""
    dt = np.dtype(dtype).newbyteorder("=")
    return np.asarray(words, dtype=_uint(dt.itemsize)).view(dt)


def awkward_bits(dtype, n_random: int = 16, seed: int = 0) -> np.ndarray:
    """Unique awkward bit patterns of ``dtype`` as unsigned words (1-d).

    +-0, +-inf (or the exponent-all-ones normals of e4m3fn), quiet and signalling
    NaNs with several payloads and both signs, smallest/largest subnormals,
    smallest/largest normals, +-1 and its neighbours, the all-ones pattern, then
    ``n_random`` seeded random patterns.
    """
    _, w, e, m = _layout(dtype)
    sign = 1 << (w - 1)
    expmask = ((1 << e) - 1) << m
    mant = (1 << m) - 1
    top = 1 << (m - 1)
    one = ((1 << (e - 1)) - 1) << m
    base = [
        0,  # +0
        expmask,  # +inf (e4m3fn: 256.0)
        expmask | mant,  # NaN, all-ones payload
        expmask | 1,  # signalling NaN, payload 1 (e4m3fn: a normal)
        expmask | top,  # canonical quiet NaN
        expmask | top | 1,  # quiet NaN with payload
        expmask | (mant >> 1),  # NaN with the other payload bits
        expmask | (mant - 1),  # largest finite of e4m3fn, a NaN elsewhere
        1,  # smallest subnormal
        mant,  # largest subnormal
        1 << m,  # smallest normal
        (expmask - (1 << m)) | mant,  # largest finite normal (IEEE formats)
        one,  # 1.0
        one + 1,  # next after 1.0
        one - 1,  # previous before 1.0
        (one + (1 << m)) | top,  # 3.0
    ]
    pats = base + [p | sign for p in base] + [(1 << w) - 1]
    rng = np.random.default_rng(seed + w)
    pats += [int(v) for v in rng.integers(0, 1 << w, size=n_random, dtype=np.uint64)]
    pats = list(dict.fromkeys(p & ((1 << w) - 1) for p in pats))
    return np.array(pats, dtype=_uint(w // 8))


def awkward_floats(dtype, n_random: int = 16, seed: int = 0) -> np.ndarray:
    """:func:`awkward_bits` viewed as ``dtype``."""
    return from_bits(awkward_bits(dtype, n_random, seed), dtype)


def random_floats(dtype, shape, seed: int = 0) -> np.ndarray:
    """Uniformly random bit patterns of ``dtype`` (every NaN payload possible)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(seed)
    return np.frombuffer(rng.bytes(n * dt.itemsize), dtype=dt).reshape(shape).copy()


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _dtype_name(x) -> str:
    """``x``'s dtype as one spelling for numpy and torch (``float32``, ``bfloat16``, ``float8_e4m3fn``, ``>f4``)."""
    if _is_torch(x):
        return str(x.dtype).removeprefix("torch.")
    dt = np.asarray(x).dtype
    if dt.hasobject:
        raise TypeError(f"bits of an object array mean nothing (dtype {dt})")
    native = dt.isnative or dt.itemsize == 1 or dt.byteorder == "|"
    return dt.name if native and dt.fields is None else dt.str  # a byte-swapped dtype stays distinct


def _element_bytes(x) -> np.ndarray:
    """The raw bytes of ``x`` in C order, one row of ``itemsize`` bytes per element (shape ``(size, itemsize)``)."""
    if _is_torch(x):
        import torch

        t = x.detach().cpu().contiguous().reshape(-1)
        size, itemsize = t.numel(), t.element_size()
        flat = t.view(torch.uint8).numpy()  # torch's own byte view: no trip through ulstore's bridge
    else:
        a = np.asarray(x)
        size, itemsize = a.size, a.dtype.itemsize
        flat = np.ascontiguousarray(a.reshape(-1)).view(np.uint8)
    return flat.reshape(size, itemsize)


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if _is_torch(x) else np.shape(x)


def assert_bits_equal(actual, expected, what: str = "") -> None:
    """``actual`` has ``expected``'s dtype, shape and bytes, element for element: bit identity.

    Either side may be a numpy array (any layout) or a torch tensor (any device); a numpy
    array and a tensor match when their dtypes have the same name (``bfloat16``) and bytes.
    Floats are never compared as floats: NaN payloads and signed zeros count.  On a
    difference the message names ``what``, the count of differing elements and the first
    one (index, got and wanted bytes as a little-endian hex word, and the values).
    """
    where = f"{what}: " if what else ""
    got_dtype, want_dtype = _dtype_name(actual), _dtype_name(expected)
    if got_dtype != want_dtype:
        raise AssertionError(f"{where}dtype {got_dtype}, expected {want_dtype}")
    got_shape, want_shape = _shape(actual), _shape(expected)
    if got_shape != want_shape:
        raise AssertionError(f"{where}shape {got_shape}, expected {want_shape}")
    got, want = _element_bytes(actual), _element_bytes(expected)
    differ = np.flatnonzero((got != want).any(axis=1))
    if differ.size:
        i = int(differ[0])
        index = tuple(int(j) for j in np.unravel_index(i, want_shape)) if want_shape else ()
        raise AssertionError(
            f"{where}{differ.size} of {want.shape[0]} elements differ; the first at {index}: "
            f"got {_hex(got[i])} ({_value(actual, index)}), expected {_hex(want[i])} ({_value(expected, index)})"
        )


def _hex(row: np.ndarray) -> str:
    return "0x" + row[::-1].tobytes().hex()  # little-endian bytes, most significant first


def _value(x, index: tuple[int, ...]) -> str:
    try:
        return repr(x[index].item()) if _is_torch(x) else repr(np.asarray(x)[index])
    except Exception as e:  # noqa: BLE001 -- a value that has no repr still has bytes, shown beside
        return f"<{type(e).__name__}>"


def assert_bit_identical(out, expected, *, dtype=None) -> None:
    """``out`` is a native C-contiguous ndarray with ``expected``'s dtype, shape and bits (:func:`assert_bits_equal`).

    ``expected`` may be byte-swapped (its bits are compared in native order) or, with ``dtype``, of
    another dtype of the same width (its bits are read as ``dtype``).
    """
    exp = np.asarray(expected)
    want_dtype = np.dtype(dtype) if dtype is not None else exp.dtype.newbyteorder("=")
    assert isinstance(out, np.ndarray), type(out)
    assert out.dtype == want_dtype, (out.dtype, want_dtype)
    assert out.dtype.isnative or out.dtype.itemsize == 1, out.dtype
    assert out.dtype.byteorder in ("=", "|", "<"), out.dtype.byteorder
    assert out.shape == exp.shape, (out.shape, exp.shape)
    assert out.flags.c_contiguous
    assert_bits_equal(out, bits_of(exp).view(want_dtype))  # expected's bits, in native order, as the wanted dtype
