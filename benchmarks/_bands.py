"""Exponent bands of a sparse delta: the ideal bits of its changed positions under K bands of
reference exponents, and the best split (shared by ``codec.py``'s Table 4 and ``band_floor.py``)."""

from __future__ import annotations

import numpy as np

__all__ = ["binary_entropy_bits", "band_split"]


def binary_entropy_bits(k, n) -> np.ndarray:
    """n * H(k / n) elementwise."""
    k, n = np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)
    q = k / np.maximum(n, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(q > 0, q * np.log2(q), 0.0) + np.where(q < 1, (1 - q) * np.log2(1 - q), 0.0))
    return n * h


def band_split(count: np.ndarray, changed: np.ndarray, bands: int) -> tuple[float, list[int]]:
    """Ideal position bits and thresholds of the best split of the exponents into at most ``bands``
    contiguous bands (dynamic programming over the occupied exponents)."""
    occupied = np.flatnonzero(count)
    c = np.concatenate([[0.0], np.cumsum(count[occupied])])
    g = np.concatenate([[0.0], np.cumsum(changed[occupied])])
    size = len(occupied)
    cost = binary_entropy_bits(g[None, :] - g[:, None], c[None, :] - c[:, None])
    best = np.full((bands + 1, size + 1), np.inf)
    back = np.zeros((bands + 1, size + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, bands + 1):
        for j in range(1, size + 1):
            v = best[k - 1, :j] + cost[:j, j]
            back[k, j] = int(np.argmin(v))
            best[k, j] = v[back[k, j]]
    k = int(np.argmin(best[1:, size])) + 1
    bits, cuts, j = float(best[k, size]), [], size
    while k:
        j = back[k, j]
        cuts.append(j)
        k -= 1
    return bits, [int(occupied[i]) for i in sorted(cuts)[1:]]
