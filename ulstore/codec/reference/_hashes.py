"""Pure-NumPy twins of the checksum kernels: ``hash64``, its word sum, and a constant fill's hash.

Part of the NumPy backend (re-exported by ``reference``); the compiled twins are in
``_kernels.pyx`` and ``_one_stream.pxi``.
"""

from __future__ import annotations

import numpy as np

from .._checksum import GOLDEN, MASK64, finish_sum

__all__ = ["hash_sum64", "hash64", "hash_fill", "mix_words"]

_M64 = MASK64
_GOLDEN = np.uint64(GOLDEN)


def mix_words(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, a bijection on 64-bit words (the final avalanche)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_sum64(data) -> int:
    """The word sum :func:`hash64` finishes.

    Words are the little-endian u64s of the bytes zero-padded to a multiple of 8;
    the sum is ``sum_j mix(word_j + (j+1) * golden) mod 2**64``.  Being a sum, it
    can be updated word by word when a few elements change.
    """
    b = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    pad = (-len(b)) % 8
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    words = b.view("<u8").astype(np.uint64)
    with np.errstate(over="ignore"):
        salt = (np.arange(1, len(words) + 1, dtype=np.uint64)) * _GOLDEN
        return int(mix_words(words + salt).sum(dtype=np.uint64))


def hash64(data) -> int:
    """64-bit checksum of a byte buffer: ``mix(hash_sum64(data) + nbytes * golden)``.

    A sum of full-avalanche bijections of position-salted words: any single
    changed word changes it, flips do not cancel in pairs, and it has no serial
    chain.
    """
    return finish_sum(hash_sum64(data), memoryview(data).cast("B").nbytes)


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def hash_fill(value: int, count: int, itemsize: int) -> int:
    """``hash64`` of ``count`` copies of the ``itemsize``-byte little-endian ``value``.

    Constant memory (chunks of 2**16 words): lets a decoder check a blob that declares
    a huge constant tensor before it allocates one.
    """
    nbytes = count * itemsize
    per = 8 // itemsize
    word = 0
    for k in range(per):
        word |= value << (8 * itemsize * k)
    full = nbytes // 8
    total = np.uint64(0)
    gold = np.uint64(GOLDEN)
    with np.errstate(over="ignore"):
        for lo in range(0, full, 1 << 16):  # every full word is the same; only its salt changes
            j = np.arange(lo + 1, min(full, lo + (1 << 16)) + 1, dtype=np.uint64)
            z = np.uint64(word) + j * gold
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            total += (z ^ (z >> np.uint64(31))).sum(dtype=np.uint64)
    acc = int(total)
    rest = nbytes - 8 * full
    if rest:
        last = word & ((1 << (8 * rest)) - 1)
        acc = (acc + _mix((last + (full + 1) * GOLDEN) & _M64)) & _M64
    return _mix((acc + nbytes * GOLDEN) & _M64)
