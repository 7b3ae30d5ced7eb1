"""tests/helpers/bits.py: assert_bits_equal is the one bit-identity check, so it must fail on every kind of
difference a float comparison would miss (a NaN payload, a signed zero), and on dtype or shape alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.helpers.bits import assert_bit_identical, assert_bits_equal, from_bits

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_equal_bits_pass_whatever_the_layout():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert_bits_equal(a, a.copy())
    assert_bits_equal(a.T, np.ascontiguousarray(a.T))  # a strided view and its copy
    assert_bits_equal(np.float32(1.5), np.array(1.5, np.float32))  # 0-d
    nan = from_bits(np.array([0x7FC00123], np.uint32), np.float32)
    assert_bits_equal(nan, nan.copy())  # NaN equals itself bit for bit (it never does as a float)


def test_a_nan_payload_flip_fails_and_is_named():
    want = from_bits(np.array([0x3F80, 0x7FC1, 0x0000], np.uint16), BF16)  # 1.0, NaN with payload 1, +0
    got = from_bits(np.array([0x3F80, 0x7FC0, 0x0000], np.uint16), BF16)  # the payload bit cleared
    with pytest.raises(
        AssertionError, match=r"^w: 1 of 3 elements differ; the first at \(1,\): got 0x7fc0 .* expected 0x7fc1"
    ):
        assert_bits_equal(got, want, "w")


def test_minus_zero_is_not_zero():
    with pytest.raises(
        AssertionError, match=r"the first at \(0, 1\): got 0x80000000 \(np.float32\(-0.0\)\), expected 0x0"
    ):
        assert_bits_equal(np.array([[1.0, -0.0]], np.float32), np.array([[1.0, 0.0]], np.float32))


def test_dtype_and_shape_count_even_with_the_same_bytes():
    a = np.arange(4, dtype=np.uint16)
    with pytest.raises(AssertionError, match="dtype bfloat16, expected uint16"):
        assert_bits_equal(a.view(BF16), a)
    with pytest.raises(AssertionError, match=r"shape \(2, 2\), expected \(4,\)"):
        assert_bits_equal(a.reshape(2, 2), a)
    with pytest.raises(AssertionError, match="dtype >u2, expected uint16"):
        assert_bits_equal(a.astype(">u2"), a)  # same values, other byte order: other bytes


def test_fp8_and_torch_tensors():
    torch = pytest.importorskip("torch")
    f8 = from_bits(np.array([0x00, 0x80, 0x7F], np.uint8), ml_dtypes.float8_e4m3fn)  # +0, -0, NaN
    t = torch.from_numpy(f8.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    assert_bits_equal(t, f8)  # a tensor against an array: same dtype name, same bytes
    assert_bits_equal(t, t.clone())
    flipped = t.clone()
    flipped.view(torch.uint8)[1] = 0x00  # -0 -> +0
    with pytest.raises(AssertionError, match=r"the first at \(1,\): got 0x00 .* expected 0x80"):
        assert_bits_equal(flipped, t)
    with pytest.raises(AssertionError, match="dtype float32, expected bfloat16"):
        assert_bits_equal(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))


def test_assert_bit_identical_compares_through_it():
    swapped = np.array([1.0, -0.0], ">f4")
    assert_bit_identical(np.array([1.0, -0.0], np.float32), swapped)  # expected may be byte-swapped
    with pytest.raises(AssertionError, match="1 of 2 elements differ"):
        assert_bit_identical(np.array([1.0, 0.0], np.float32), swapped)
