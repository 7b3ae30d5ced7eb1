"""Decoding a delta as the elements it changes: :func:`decode_changes`, :class:`Changes`.

A caller that keeps an array in step with a chain of deltas (a weight-sync
replica, the store's change feed) applies each one in place, in time
proportional to the changed elements for SPARSE blobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInputError, ReferenceMismatchError
from . import _format as F
from ._api import _open, _sparse_changes, decode
from ._backend import kernels
from ._dtypes import as_bits, from_bits

__all__ = ["Changes", "content_sum", "decode_changes"]


@dataclass(frozen=True)
class Changes:
    """What a delta blob changes in its reference: ``reference.flat[positions] = values`` is the target.

    Attributes
    ----------
    positions : numpy.ndarray
        int64 flat (C-order) indices of the elements that change, ascending.
    values : numpy.ndarray
        Their new values (1-d, the blob's dtype).
    content_sum : int
        :func:`content_sum` of the target, for the next :func:`decode_changes`.
    """

    positions: np.ndarray
    values: np.ndarray
    content_sum: int

    def apply_to(self, out, *, backend: str | None = None) -> None:
        """Write the changed values into ``out``, in place (``out.flat[positions] = values``).

        ``out`` holds the reference (or a copy of it): a writeable C-contiguous
        array of the blob's dtype, any shape, with every position inside it.
        Nothing is written unless the positions ascend inside ``out``, one
        value each.
        """
        if not isinstance(out, np.ndarray) or out.dtype != self.values.dtype:
            raise InvalidInputError(
                f"changes of {self.values.dtype} values cannot be applied to "
                f"{getattr(out, 'dtype', type(out).__name__)}"
            )
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise InvalidInputError("changes are applied in place: pass a writeable C-contiguous array")
        word = f"<u{out.dtype.itemsize}"
        positions = np.ascontiguousarray(self.positions, dtype=np.int64)
        values = np.ascontiguousarray(self.values).reshape(-1)
        if kernels(backend).scatter(out.reshape(-1).view(word), positions, values.view(word)):
            raise InvalidInputError(
                f"changes do not fit an array of {out.size}: positions must ascend inside it, one value each"
            )


def content_sum(array, *, backend: str | None = None) -> int:
    """The 64-bit word sum behind ULPack's checksums, of ``array``'s bytes (C order).

    A caller that keeps it for an array it updates with :func:`decode_changes`
    (which returns the next one) lets SPARSE blobs check their reference in O(1).
    """
    _, x = as_bits(array)
    return kernels(backend).hash_sum64(x.reshape(-1))


def decode_changes(blob, reference, *, reference_sum: int | None = None, backend: str | None = None) -> Changes:
    """Decode a delta blob into the elements it changes in ``reference``.

    For a SPARSE blob (``encode(..., sparse=True)``) with ``reference_sum`` given,
    this costs time in proportion to the changed elements, not the tensor: the
    reference is checked through its sum, the target through the sum's update.
    Other blobs are decoded whole and compared with ``reference``.

    Parameters
    ----------
    blob : bytes-like
        A delta blob from :func:`encode`.
    reference : array-like
        The reference it was coded against.  Not modified.
    reference_sum : int, optional
        ``content_sum(reference)``, if the caller keeps it (else it is computed).

    Returns
    -------
    Changes

    Raises
    ------
    ReferenceMismatchError
        ``reference`` (or ``reference_sum``) is not the blob's reference, or the blob is intra.
    CorruptBlobError, UnsupportedVersionError
        As :func:`decode`.
    """
    header, rd, rf = _open(blob, reference)
    if rf is None:
        raise ReferenceMismatchError("decode_changes needs a delta blob; this one is intra-coded")
    k = kernels(backend)
    if header.mode == F.MODE_SPARSE:
        ref_sum = k.hash_sum64(rf) if reference_sum is None else int(reference_sum)
        pos, values, target_sum = _sparse_changes(k, header, rd, rf, ref_sum)
    else:
        _, out = as_bits(decode(blob, reference, backend=backend))
        out = out.reshape(-1)
        pos = np.flatnonzero(out != rf)
        values, target_sum = out[pos], k.hash_sum64(out)
    return Changes(pos, from_bits(header.fmt, values), target_sum)
