"""The blob checksums computed by the compiled kernels equal their definitions.

CRC-32: the compiled ``crc32`` (PCLMULQDQ folding where the CPU has it) is
``zlib.crc32``.  hash64: every backend, including the AVX2 word sums of the
x86-64-v3 build, gives the NumPy twin's value for every length and alignment.
"""

from __future__ import annotations

import platform
import zlib

import numpy as np
import pytest

from ulstore.codec import _format as F
from ulstore.codec._backend import available_backends, kernels

COMPILED = [name for name in available_backends() if name != "numpy"]
LENGTHS = [*range(0, 140), 255, 256, 257, 1023, 1024, 4095, 4096, 4097, 65536 + 13, 300_001]


@pytest.mark.skipif(not COMPILED, reason="the kernels are not built")
@pytest.mark.parametrize("name", COMPILED)
def test_crc32_is_zlibs(name):
    k = kernels(name)
    rng = np.random.default_rng(7)
    data = rng.bytes(max(LENGTHS) + 16)
    for n in LENGTHS:
        for offset in (0, 1, 7):
            piece = memoryview(data)[offset : offset + n]
            for start in (0, 0xFFFFFFFF, int(rng.integers(0, 1 << 32))):
                assert k.crc32(piece, start) == zlib.crc32(piece, start), (n, offset, start)
    # chained over parts, as seal() does
    crc = 0
    for part in (data[:100], data[100:5000], data[5000:5001], data[5001:]):
        crc = k.crc32(part, crc)
    assert crc == zlib.crc32(data)


def test_blob_crc_is_the_compiled_one_when_built():
    assert F._crc32(b"ulstore") == zlib.crc32(b"ulstore")
    if COMPILED and platform.machine().lower() in ("x86_64", "amd64"):
        assert F._crc32 is not zlib.crc32


@pytest.mark.parametrize("name", COMPILED)
def test_hash64_matches_the_twin_at_every_length_and_alignment(name):
    k, ref = kernels(name), kernels("numpy")
    rng = np.random.default_rng(8)
    data = rng.bytes(max(LENGTHS) + 16)
    for n in LENGTHS:
        for offset in (0, 3):
            piece = memoryview(data)[offset : offset + n]
            assert k.hash_sum64(piece) == ref.hash_sum64(piece), (n, offset)
            assert k.hash64(piece) == ref.hash64(piece), (n, offset)


@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("dtype", ["<u2", "<u4", "<u1", "<u8"])
def test_residual_hashes_match_the_twin(name, dtype):
    """The encoder hashes target and reference in one pass (the pair word sums)."""
    k, ref = kernels(name), kernels("numpy")
    rng = np.random.default_rng(9)
    width = np.dtype(dtype).itemsize * 8
    for n in (0, 1, 31, 32, 33, 4096 + 5, 20_000):
        r = rng.integers(0, 1 << min(width, 63), n, dtype=np.uint64).astype(dtype)
        x = r.copy()
        x[rng.random(n) < 0.3] ^= 1  # some words change, some do not
        z, sym = np.empty(n, dtype=dtype), np.empty(n, dtype=np.uint16 if width <= 32 else np.uint32)
        got = k.residuals(x, r, 0, 0, 8, z, sym)
        assert tuple(got) == (ref.hash64(x), ref.hash64(r)), (n, dtype)
