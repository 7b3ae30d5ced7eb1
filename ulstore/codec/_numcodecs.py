"""The numcodecs codec ``{"id": "ulpack"}``: :class:`ULPack`, a thin shell over :func:`encode`/:func:`decode`."""

from __future__ import annotations

import numcodecs
import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ensure_ndarray_like, ndarray_copy

from ..errors import InvalidInputError
from ._api import decode, encode
from ._dtypes import format_of

__all__ = ["ULPack"]


class ULPack(Codec):
    """numcodecs codec for ULPack (``{"id": "ulpack"}``).

    A pure codec: no I/O.  ``encode``/``decode`` take an optional ``reference=``
    array; without one they code intra (against +0.0).  Decoding returns the
    original dtype and shape; with ``out=`` the values are copied into it.

    Parameters
    ----------
    econd : bool, default True
        Condition the models on the reference exponent (False: ablation).
    dtype : str, optional
        How to read buffers that carry no float dtype (bytes, uint8 arrays...):
        e.g. ``"bfloat16"``.  Arrays of a float dtype are always read as such.
    sparse : bool, default False
        Code sparse deltas by position (see :func:`encode`).

    Notes
    -----
    numcodecs codecs round-trip a buffer's bytes in memory order.  A Fortran-ordered
    array is therefore coded as its C-ordered transpose (same bytes, reversed
    shape), so ``decode(encode(a))`` has ``a``'s memory bytes.

    Examples
    --------
    >>> import numcodecs, numpy as np
    >>> codec = numcodecs.get_codec({"id": "ulpack"})
    >>> codec
    ULPack(econd=True)
    >>> x = np.arange(6, dtype=np.float16).reshape(2, 3)
    >>> codec.decode(codec.encode(x)).tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """

    codec_id = "ulpack"
    __module__ = "ulstore.codec"  # its public home (entry point ``ulstore.codec:ULPack``, pickles)

    def __init__(self, econd: bool = True, dtype: str | None = None, sparse: bool = False):
        self.econd = bool(econd)
        self.sparse = bool(sparse)
        self.dtype = None if dtype is None else format_of(dtype).name

    def _as_array(self, buf):
        arr = buf if isinstance(buf, np.ndarray) else ensure_ndarray_like(buf)
        if arr.dtype.kind in "biuV" and self.dtype is not None:
            fmt = format_of(self.dtype)
            if arr.nbytes % fmt.dtype.itemsize:
                raise InvalidInputError(
                    f"a buffer of {arr.nbytes} bytes is not a multiple of the {fmt.dtype.itemsize}-byte "
                    f"elements of {self.dtype}: pass whole elements"
                )
            arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).view(fmt.dtype)
        if arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous:
            arr = arr.T  # memory order, see Notes
        return arr

    def encode(self, buf, reference=None):
        ref = None if reference is None else self._as_array(reference)
        return encode(self._as_array(buf), ref, econd=self.econd, sparse=self.sparse)

    def decode(self, buf, out=None, reference=None):
        ref = None if reference is None else self._as_array(reference)
        arr = decode(ensure_contiguous_ndarray(buf), ref)
        if out is None:
            return arr
        return ndarray_copy(arr, out)

    def get_config(self) -> dict:
        config = {"id": self.codec_id, "econd": self.econd}
        if self.dtype is not None:  # omitted when unset, so plain configs stay {"id", "econd"}
            config["dtype"] = self.dtype
        if self.sparse:
            config["sparse"] = True
        return config

    def __repr__(self) -> str:
        dtype = "" if self.dtype is None else f", dtype={self.dtype!r}"
        sparse = ", sparse=True" if self.sparse else ""
        return f"ULPack(econd={self.econd!r}{dtype}{sparse})"


numcodecs.register_codec(ULPack)
