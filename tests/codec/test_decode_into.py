"""``decode_into``: the same values as ``decode``, written into the caller's buffer (store reads use it)."""

import ml_dtypes
import numpy as np
import pytest

from tests.helpers.bits import assert_bits_equal
from ulstore.codec import decode, encode
from ulstore.codec._api import decode_into
from ulstore.errors import InvalidInputError


def _pairs():
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    ref = rng.standard_normal((64, 33)).astype(np.float32)
    moved = ref.copy()
    moved[3, 4] += 1e-3  # a few changes: SPARSE
    yield ref.astype(bf16), None, {}  # intra (rANS)
    yield (ref + 1e-3).astype(bf16), ref.astype(bf16), {}  # delta
    yield moved, ref, {"sparse": True}
    yield ref, ref, {}  # SAME
    yield rng.integers(0, 2**16, (5, 7), dtype=np.uint16).view(np.float16), None, {}  # noise: RAW
    yield np.zeros((0, 4), np.float32), None, {}


@pytest.mark.parametrize("k", range(6))
def test_decode_into_matches_decode(k):
    target, ref, kw = list(_pairs())[k]
    blob = encode(target, ref, **kw)
    out = np.full(target.shape, 7, target.dtype)
    got = decode_into(blob, ref, out)
    assert got is out
    assert_bits_equal(out, decode(blob, ref))
    assert_bits_equal(out, target)


def test_decode_into_refuses_a_buffer_that_does_not_fit():
    x = np.ones((8, 8), np.float32)
    blob = encode(x)
    for bad in (np.empty((8, 9), np.float32), np.empty((8, 8), np.float64), np.empty((8, 16), np.float32)[:, ::2]):
        with pytest.raises(InvalidInputError):
            decode_into(blob, None, bad)
    ro = np.empty((8, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidInputError):
        decode_into(blob, None, ro)


def test_a_dense_delta_decoded_over_its_own_reference_names_the_overlap():
    """``out`` is the reference (or a view of it): the decode overwrites what it reads and fails its checks, and
    the error says why (the overlap), not that the blob or the reference is wrong."""
    target, ref, kw = list(_pairs())[1]
    blob = encode(target, ref, **kw)
    for make_out in (lambda r: r, lambda r: r[:, :]):
        r = ref.copy()
        with pytest.raises(InvalidInputError, match="out overlaps reference"):
            decode_into(blob, r, make_out(r))
    assert_bits_equal(decode_into(blob, ref.copy(), np.empty_like(ref)), target)  # apart: decodes
