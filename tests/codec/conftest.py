"""Fixtures of the codec tests: the bit helpers of :mod:`tests.helpers.bits`, as session fixtures."""

from __future__ import annotations

import pytest

from tests.helpers import bits


@pytest.fixture(scope="session")
def float_formats():
    """name -> (dtype, width, exponent bits, mantissa bits) of the six ULPack formats."""
    return bits.FLOAT_FORMATS


@pytest.fixture(name="awkward_bits", scope="session")
def _awkward_bits_fixture():
    """Function ``awkward_bits(dtype, n_random=16, seed=0)`` -> unsigned words."""
    return bits.awkward_bits


@pytest.fixture(name="awkward_floats", scope="session")
def _awkward_floats_fixture():
    """Function ``awkward_floats(dtype, n_random=16, seed=0)`` -> array of ``dtype``."""
    return bits.awkward_floats


@pytest.fixture(name="random_floats", scope="session")
def _random_floats_fixture():
    """Function ``random_floats(dtype, shape, seed=0)`` -> uniformly random bit patterns."""
    return bits.random_floats


@pytest.fixture(name="bits_of", scope="session")
def _bits_of_fixture():
    """Function ``bits_of(array)`` -> native unsigned-word copy."""
    return bits.bits_of


@pytest.fixture(name="from_bits", scope="session")
def _from_bits_fixture():
    """Function ``from_bits(words, dtype)`` -> float view."""
    return bits.from_bits


@pytest.fixture(name="assert_bit_identical", scope="session")
def _assert_bit_identical_fixture():
    """Function ``assert_bit_identical(out, expected, dtype=None)``."""
    return bits.assert_bit_identical
