"""``codec.decode_blobs``: many blobs into the caller's buffers, exact, with each value's word sum."""

from __future__ import annotations

import random

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from ulstore.codec import content_sum, decode_blobs
from ulstore.codec._checksum import finish_sum
from ulstore.codec._decode_blobs import word_sum_of
from ulstore.errors import CorruptBlobError, ReferenceMismatchError


def test_the_word_sum_comes_back_from_its_finished_hash():
    rng = random.Random(0)
    for _ in range(2000):
        acc, n = rng.getrandbits(64), rng.randrange(0, 1 << 40)
        assert word_sum_of(finish_sum(acc, n), n) == acc


def _pair(dtype, n=6000, seed=0):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(n).astype(dtype)
    ref[:4] = np.array([np.nan, -0.0, np.inf, -np.inf]).astype(dtype)
    x = ref.copy()
    idx = rng.choice(n, n // 3, replace=False)
    x[idx] = rng.standard_normal(len(idx)).astype(dtype)
    return ref, x


@pytest.mark.parametrize("backend", ulstore.available_backends())
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_intra_dense_and_sparse_blobs_decode_exactly_into_the_buffers_given(dtype, backend):
    ref, x = _pair(dtype)
    small = x.copy()
    small[7] = dtype(3.0)  # one change from x: a SPARSE blob (decoded by decode_into, no free sum)
    blobs = [ulstore.encode(ref), ulstore.encode(x, ref), ulstore.encode(small, x, sparse=True)]
    outs = [np.empty_like(ref) for _ in blobs]
    sums = decode_blobs(blobs, [None, ref, x], outs, [ref.shape] * 3, backend=backend)
    for got, want in zip(outs, (ref, x, small)):
        assert_bits_equal(got, want)
    assert sums[:2] == [content_sum(ref), content_sum(x)] and sums[2] is None


def test_a_wrong_reference_a_damaged_blob_and_another_shape_are_refused():
    ref, x = _pair(np.float32)
    blob = ulstore.encode(x, ref)
    other = ref.copy()
    other[5] = np.float32(9.0)
    with pytest.raises(ReferenceMismatchError):
        decode_blobs([blob], [other], [np.empty_like(x)], [x.shape])
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x20
    with pytest.raises(CorruptBlobError):
        decode_blobs([bytes(bad)], [ref], [np.empty_like(x)], [x.shape])
    with pytest.raises(CorruptBlobError, match="declares shape"):
        decode_blobs([blob], [ref], [np.empty_like(x)], [(2, 3000)])


def test_the_door_opens_each_blob_once(monkeypatch):
    """A blob's opening (its CRC: a pass over all its bytes) is made once by ``decode_blobs``: the one-call
    path and the step-by-step one share it, and a blob handed to ``decode_into`` (a SPARSE delta) is opened
    there once more, not a third time."""
    from ulstore.codec import _format as F

    ref, x = _pair(np.float32)
    small = x.copy()
    small[7] = np.float32(3.0)
    real, opened = F.open_blob, []
    monkeypatch.setattr(F, "open_blob", lambda blob: opened.append(1) or real(blob))
    for blob, against, want, times in (
        (ulstore.encode(x, ref), ref, x, 1),
        (ulstore.encode(small, x, sparse=True), x, small, 2),
    ):
        opened.clear()
        out = np.empty_like(want)
        decode_blobs([blob], [against], [out], [want.shape])
        assert_bits_equal(out, want)
        assert len(opened) == times
