"""Small states for the state machine and the crash and stress scripts: a few tensors of several chunks each
(float32 and bfloat16), children that change a few elements, and exact comparison (bits, never floats)."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

from .bits import assert_bits_equal, bits_of

__all__ = ["fresh_state", "mutate", "assert_same", "digest", "BF16", "SMALL_STORE"]

BF16 = np.dtype(ml_dtypes.bfloat16)

#: Settings of a store for these states: chunks of a few rows, so every tensor has several.
SMALL_STORE = {"chunk_bytes": 128, "anchor_every": 4}


def _random(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Values of a trained model's scale, with now and then an arbitrary bit pattern (NaN payloads, -0.0...)."""
    a = (rng.standard_normal(shape) * 0.05).astype(np.float32).astype(dtype)
    words = a.reshape(-1).view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)
    for i in rng.integers(0, max(words.size, 1), size=int(rng.integers(0, 3))):
        if words.size:
            words[i] = rng.integers(0, 1 << (8 * a.dtype.itemsize))
    return a


def fresh_state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": _random(rng, (12, 10), np.float32), "e": _random(rng, (16, 12), BF16)}


def mutate(state: dict, seed: int, how: str) -> dict:
    """A child of ``state``: a few elements changed (the usual training step), many, none, or the tensors change."""
    rng = np.random.default_rng(seed)
    out = {k: v.copy() for k, v in state.items()}
    if how in ("few", "many"):
        for name, a in out.items():
            if not a.size or (how == "few" and rng.random() < 0.3):
                continue  # this tensor did not change
            words = a.reshape(-1).view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)
            n = int(rng.integers(1, 4)) if how == "few" else words.size // 2
            at = rng.choice(words.size, size=min(n, words.size), replace=False)
            words[at] ^= rng.integers(1, 1 << 7, size=len(at)).astype(words.dtype)  # low mantissa bits
    elif how == "add":
        out[f"x{int(rng.integers(0, 4))}"] = _random(rng, (int(rng.integers(1, 40)),), np.float32)
    elif how == "drop" and len(out) > 1:
        del out[sorted(out)[int(rng.integers(0, len(out)))]]
    elif how == "reshape":
        out["w"] = _random(rng, (int(rng.integers(6, 16)), 10), np.float32)
    return out


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for k in want:
        assert_bits_equal(got[k], want[k], f"{what}: tensor {k!r}")


def digest(state: dict) -> str:
    """sha256 of a state: every tensor's name, dtype, shape and bits (sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(state):
        a = np.asarray(state[name])
        h.update(f"{name}\0{a.dtype.name}\0{tuple(a.shape)}\0".encode())
        h.update(bits_of(a).tobytes())
    return h.hexdigest()
