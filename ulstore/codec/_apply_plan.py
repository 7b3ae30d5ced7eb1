"""What an in-place apply job is given: :class:`ApplyPlan`, one dtype's SPARSE blobs and the arrays they apply to.

The kernels' ``sparse_apply`` and ``SparseApply`` (compiled, ``codec_ext/_apply.pxi``, and
NumPy, :mod:`.reference._apply_job`) read the plan's fields; :func:`~._sparse_apply.apply_sparse`
runs one.  A plan is made once per dtype and version applied, so making one is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import _format as F
from ._dtypes import format_of
from ._rans_tables import POOL_BELOW
from ._sparse import GAPS

__all__ = ["ApplyPlan", "target_meta"]


@dataclass(frozen=True)
class ApplyPlan:
    """SPARSE ``blobs[i]`` to apply to ``arrays[i]``, and the numbers of their format the kernels need.

    Make one with :meth:`of`; the fields after ``metas`` come from the dtype.
    """

    blobs: list  # bytes-like SPARSE blobs (format version 2 or 4)
    arrays: (
        list  # what blob i was coded against: 1-d, C-contiguous unsigned words of ``width`` bits, no two overlapping
    )
    sums: Sequence[int]  # content_sum of each array as it is now (checked against the blob's reference hash)
    metas: list  # target_meta of each blob: the dtype and shape its target checksum binds
    code: int  # the dtype's code in a blob header
    width: int  # bits per word
    mant_bits: int
    emask: int  # the dtype's context mask (a blob flagged without exponent contexts uses 0)
    g_alphabet: int  # token alphabet of a version-2 blob's gap section
    t_alphabet: int  # token alphabet of the values' residuals
    pool_below: int = POOL_BELOW  # contexts with fewer elements share the pooled table row

    @classmethod
    def of(
        cls,
        dtype,
        blobs: list,
        arrays: list,
        sums: Sequence[int],
        *,
        metas: list | None = None,
        shapes: list | None = None,
    ) -> ApplyPlan:
        """The plan of ``blobs`` of ``dtype`` applied to ``arrays`` (of ``dtype`` or of its unsigned words), whose
        :func:`content_sum` are ``sums``; ``metas`` (their :func:`target_meta`, made beforehand) or ``shapes`` (the
        shapes the blobs were coded as)."""
        fmt = format_of(np.dtype(dtype))
        word = fmt.word
        if metas is None:
            metas = [_meta(fmt.code, tuple(s)) for s in shapes or ()]
        views = [a if a.dtype == word else a.view(word) for a in arrays]
        return cls(
            blobs,
            views,
            sums,
            metas,
            fmt.code,
            fmt.width,
            fmt.mant_bits,
            fmt.n_contexts - 1,
            GAPS.alphabet,
            fmt.alphabet,
        )

    @property
    def word(self) -> np.dtype:
        """The arrays' word dtype."""
        return np.dtype(f"<u{self.width // 8}")


_metas: dict[tuple, bytes] = {}


def _meta(code: int, shape: tuple) -> bytes:
    """The dtype-and-shape bytes a blob's target checksum binds (``_api._target_hash``)."""
    key = (code, shape)
    out = _metas.get(key)
    if out is None:
        buf = bytearray((code,))
        for d in shape:
            F.write_varint(buf, d)
        out = _metas[key] = bytes(buf)
        if len(_metas) > 4096:
            _metas.clear()
    return out


def target_meta(dtype, shape: tuple) -> bytes:
    """What an apply checks a blob of ``dtype`` coded as ``shape`` against (an :class:`ApplyPlan`'s ``metas``): a
    caller that applies the same chunks at every version makes these once."""
    return _meta(format_of(np.dtype(dtype)).code, tuple(shape))
