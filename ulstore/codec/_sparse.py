"""The SPARSE payload: where the changed elements are, and their residuals.

A delta in which few elements change (async RL: ~1% per step in bf16) can be
applied in time proportional to the changes instead of the tensor, if the blob
says *where* they are instead of coding a zero residual for every element:

    version 4:  m (varint) | Elias-Fano positions | residual section
    version 2:  m (varint) | gap section          | residual section

- positions (version 4, written today): the ascending changed positions as an
  Elias-Fano sequence (``_elias_fano``): no entropy coder, so that the in-place
  apply finds each one in a few instructions;
- gaps (version 2, still read): ``g_k = p_k - p_{k-1} - 1`` (``p_{-1} = -1``), as
  32-bit words in one context: tokens and raw tails exactly like residuals (see
  ``_section``);
- residuals: the non-zero residuals of the changed elements, each in the context
  of its reference exponent, as in the dense mode but over the changed elements
  only (the decoder gathers the ``m`` reference words, so table rows come from
  their per-context counts).

The price: the dense mode learns P(unchanged | reference exponent), which the
positions cannot (the decoder would have to visit every element to use it).  On
RL deltas that makes SPARSE blobs about 40% larger; it is the encoder's caller
who chooses (``encode(..., sparse=True)``).

Checksums stay those of the header, and stay cheap: ``hash64`` is a finished
*sum* over 8-byte words (:func:`reference.hash_sum64`), so a caller that knows
its reference's sum can check the reference in O(1) and the target in O(m)
from the changed words alone (``sum_update``).
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptBlobError
from . import _format as F
from ._dtypes import FloatFormat, format_of
from ._elias_fano import sizes
from ._rans_tables import POOL_BELOW
from ._section import encode_section, read_fields, status_error

__all__ = ["SPARSE_MAX_FRACTION", "SPARSE_ALWAYS_UP_TO", "encode_sparse", "decode_sparse"]

#: SPARSE is used when at most 1/SPARSE_MAX_FRACTION of the elements change; above
#: that, applying by position saves little over decoding every element.
SPARSE_MAX_FRACTION = 8
#: ... and for tensors of at most this many elements whatever changes (a norm's weights, a bias): a
#: holder of the parent applies SPARSE deltas in place, a whole version's in one compiled call, but
#: decodes a dense one on its own, at a fixed cost (0.2 ms) far above the few bytes it would save.
SPARSE_ALWAYS_UP_TO = 4096

GAPS: FloatFormat = format_of("float32")  # version 2's gaps are coded as 32-bit words, one context


def _histogram(k, sym: np.ndarray, size: int) -> np.ndarray:
    counts = np.zeros((1, size), dtype=np.uint32)
    k.histogram(sym, counts)
    return counts[0]


def encode_sparse(k, fmt: FloatFormat, z: np.ndarray, sym: np.ndarray, emask: int, m: int) -> list:
    """The version-4 SPARSE payload of residuals ``z`` (``m`` of them non-zero) with symbols ``sym``."""
    gaps, gsym = np.empty(m, dtype=np.uint32), np.empty(m, dtype=GAPS.symbol)
    tz, tsym = np.empty(m, dtype=z.dtype), np.empty(m, dtype=sym.dtype)
    if k.sparse_split(z, sym, gaps, gsym, tz, tsym) != m:
        raise RuntimeError("internal error: sparse_split disagrees with the residual histogram")
    head = bytearray()
    F.write_varint(head, m)
    positions = np.cumsum(gaps, dtype=np.int64) + np.arange(m, dtype=np.int64)  # p_k = sum of gaps to k, plus k
    coded = np.empty(sum(sizes(len(z), m)), dtype=np.uint8)
    if k.ef_encode(positions, len(z), coded):
        raise RuntimeError("internal error: ef_encode refused the changed positions")
    counts = _histogram(k, tsym, (emask + 1) << fmt.token_bits)
    return [head, coded, *encode_section(k, fmt, tz, tsym, counts, emask)]


def decode_sparse(
    k, fmt: FloatFormat, rd: F.Reader, rf: np.ndarray, emask: int, version: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Read a SPARSE payload of format ``version`` (2 or 4) against reference words ``rf``.

    Returns the ascending positions, their new words, and how ``hash_sum64`` of
    ``rf`` changes when they are written (mod 2**64).
    """
    m = rd.varint("changed element count", limit=len(rf))
    if m == 0:
        raise CorruptBlobError("ULPack blob is corrupt: a sparse payload with no changed element")
    pos, values, delta = np.empty(m, dtype=np.int64), np.empty(m, dtype=rf.dtype), np.zeros(1, dtype=np.uint64)
    if version == 4:
        lo_len, hi_len = sizes(len(rf), m)
        lo = np.frombuffer(rd.take(lo_len, "low position bits"), dtype=np.uint8)
        hi = np.frombuffer(rd.take(hi_len, "high position bits"), dtype=np.uint8)
        residuals = read_fields(rd, m, fmt)
        status = k.sparse_decode_ef(
            rf, fmt.mant_bits, emask, POOL_BELOW, lo, hi, *residuals, fmt.alphabet, pos, values, delta
        )
    else:
        gaps, residuals = read_fields(rd, m, GAPS), read_fields(rd, m, fmt)
        status = k.sparse_decode(
            rf, fmt.mant_bits, emask, POOL_BELOW, *gaps, GAPS.alphabet, *residuals, fmt.alphabet, pos, values, delta
        )
    if status:
        raise status_error(status)
    return pos, values, int(delta[0])
