"""The pure-Python end of ULPack's checksums, shared by the codec and the NumPy twin.

``hash64(data) = mix(hash_sum64(data) + nbytes * GOLDEN)``: the kernels (either
backend) compute the word sum ``hash_sum64``; finishing a sum the caller
already holds (SPARSE blobs update it word by word) needs only this module, so
production code never imports the test oracle ``reference`` for it.
"""

from __future__ import annotations

__all__ = ["GOLDEN", "MASK64", "finish_sum", "fold32"]

GOLDEN = 0x9E3779B97F4A7C15  # the position salt: word j adds (j + 1) * GOLDEN
MASK64 = (1 << 64) - 1


def finish_sum(acc: int, nbytes: int) -> int:
    """``hash64`` of ``nbytes`` bytes whose word sum is ``acc``: ``mix(acc + nbytes * golden)``."""
    z = (acc + nbytes * GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def fold32(h: int) -> int:
    """The 32-bit checksum a blob header stores for a 64-bit ``hash64``."""
    return (h ^ (h >> 32)) & 0xFFFFFFFF
