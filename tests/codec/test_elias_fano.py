"""Elias-Fano positions (SPARSE blobs of format version 4): exact, canonical, and checked alike everywhere.

The kernel ``ef_positions`` (compiled) and its NumPy twin must decode every
coding to the same positions and refuse every malformed one with the same
status; version-2 SPARSE blobs (entropy-coded gaps) must still apply in place.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from ulstore import content_sum
from ulstore.codec._apply_plan import ApplyPlan
from ulstore.codec._backend import kernels
from ulstore.codec._dtypes import FORMATS, format_of
from ulstore.codec._elias_fano import encode_positions, low_bits, sizes
from ulstore.codec._sparse_apply import is_sparse_blob

BACKENDS = ulstore.available_backends()
GOLDEN_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "ulpack_v1"  # versions 1 and 2, frozen

# (n, m): one position, every position, L = 0, word and byte edges, the RL regime (~1%), the very sparse
SHAPES = [
    (1, 1),
    (2, 1),
    (2, 2),
    (7, 3),
    (64, 64),
    (65, 1),
    (1000, 1),
    (1000, 13),
    (1000, 1000),
    (4096, 64),
    (300_000, 3_700),
    (1 << 20, 5),
]


def decode(backend, lo, hi, n, m):
    out = np.full(m, -1, dtype=np.int64)
    status = kernels(backend).ef_positions(np.frombuffer(lo, np.uint8), np.frombuffer(hi, np.uint8), n, out)
    return status, out


def split(coded: bytes, n: int, m: int) -> tuple[bytearray, bytearray]:
    lo_len, _ = sizes(n, m)
    return bytearray(coded[:lo_len]), bytearray(coded[lo_len:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n", "m"), SHAPES)
def test_positions_round_trip_in_the_bytes_they_are_given(n, m, backend):
    rng = np.random.default_rng(n + m)
    pos = np.sort(rng.choice(n, m, replace=False))
    coded = encode_positions(pos, n)
    L = low_bits(n, m)
    assert len(coded) == sum(sizes(n, m)) <= (m * (L + 3) + 7) // 8 + 1  # at most L + 3 bits per position
    assert 2**L <= n / m < 2 ** (L + 1)
    status, out = decode(backend, *split(coded, n, m), n, m)
    assert status == 0 and np.array_equal(out, pos)
    written = np.full(len(coded), 0xA5, dtype=np.uint8)  # the kernel writes every byte, padding included
    assert kernels(backend).ef_encode(pos, n, written) == 0 and written.tobytes() == coded
    if m > 1:
        twice = pos.copy()
        twice[1] = twice[0]
        assert kernels(backend).ef_encode(twice, n, written) == -9  # positions must ascend
    assert kernels(backend).ef_encode(pos, n, written[:-1]) == -9


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_bits_near_the_end_of_their_bytes_decode_exactly(backend):
    """Every count of positions around where the low part's last unchecked 8-byte load falls (the decoder
    switches loads there), for L from 0 to 41 bits."""
    rng = np.random.default_rng(7)
    for m in range(1, 40):
        for n in (m, 3 * m + 1, 17 * m, 1000 * m + 7, (1 << 35) + 3, (1 << 41) + 5):
            pos = np.unique(rng.integers(0, n, m, dtype=np.int64)) if n > 2 * m else np.arange(n - m, n)
            k = len(pos)
            status, out = decode(backend, *split(encode_positions(pos, n), n, k), n, k)
            assert status == 0 and np.array_equal(out, pos), (n, k, low_bits(n, k))


def malformed(n: int, m: int, rng) -> dict[str, tuple[bytes, bytes, int]]:
    """Codings that no ascending position set has, with the status every backend must give."""
    pos = np.sort(rng.choice(n, m, replace=False))
    lo, hi = split(encode_positions(pos, n), n, m)
    L = low_bits(n, m)
    bits = np.unpackbits(np.frombuffer(bytes(hi), np.uint8), bitorder="little")
    ones, zeros = np.flatnonzero(bits), np.flatnonzero(bits == 0)
    out = {}
    extra = bits.copy()
    extra[zeros[len(zeros) // 2]] = 1
    out["an extra set bit"] = (bytes(lo), np.packbits(extra, bitorder="little").tobytes(), -10)
    missing = bits.copy()
    missing[ones[len(ones) // 2]] = 0
    out["a missing set bit"] = (bytes(lo), np.packbits(missing, bitorder="little").tobytes(), -10)
    if (m * L) % 8:
        padded = bytearray(lo)
        padded[-1] |= 0x80
        out["a low padding bit"] = (bytes(padded), bytes(hi), -10)
    if m > 1:
        dup = pos.copy()
        dup[1] = dup[0]  # a coding of two equal positions (its bits are distinct: the high part adds k)
        out["two equal positions"] = (*map(bytes, split(encode_positions(dup, n), n, m)), -10)
    # the last set bit moved past every valid high part: a position at or past n
    H = m + ((n - 1) >> L) + 1
    if H % 8:
        past = bits.copy()
        past[ones[-1]] = 0
        past[len(bits) - 1] = 1
        out["a position past the end"] = (bytes(lo), np.packbits(past, bitorder="little").tobytes(), -6)
    out["a byte short"] = (bytes(lo), bytes(hi[:-1]), -9)
    return out


@pytest.mark.parametrize(("n", "m"), [(1000, 13), (300_000, 3_700), (4096, 64), (7, 3)])
def test_malformed_positions_are_refused_with_one_status_everywhere(n, m):
    cases = malformed(n, m, np.random.default_rng(m))
    assert {"an extra set bit", "a missing set bit", "two equal positions", "a byte short"} <= set(cases)
    for label, (lo, hi, want) in cases.items():
        for backend in BACKENDS:
            status, _ = decode(backend, lo, hi, n, m)
            assert status == want, (label, backend, status)


@pytest.mark.parametrize(("n", "pos"), [(1 << 62, [(1 << 61) - 1, (1 << 62) - 1]), ((1 << 63) - 1, [(1 << 63) - 2])])
def test_a_length_no_array_has_is_refused_not_misread(n, pos):
    """Past 2**58 the kernel's L low bits (L > 57) no longer fit one 64-bit window and its shifts overflow: it
    returned wrong positions with status 0.  Every backend refuses such an ``n`` as a bad argument."""
    pos = np.array(pos, dtype=np.int64)
    lo, hi = split(encode_positions(pos, n), n, len(pos))
    for backend in BACKENDS:
        assert decode(backend, lo, hi, n, len(pos))[0] == -9, backend
    n, pos = (1 << 58) - 1, np.array([5, (1 << 57) + 3, (1 << 58) - 2], dtype=np.int64)  # the longest still read
    for backend in BACKENDS:
        status, out = decode(backend, *split(encode_positions(pos, n), n, len(pos)), n, len(pos))
        assert status == 0 and np.array_equal(out, pos), backend


def test_a_tampered_position_in_a_blob_is_a_clear_error():
    rng = np.random.default_rng(4)
    r = rng.standard_normal(5000).astype(np.float32)
    t = r.copy()
    t[[7, 2000, 4999]] += 1
    blob = ulstore.encode(t, r, sparse=True)
    assert blob[4] == 4
    from tests.helpers.blobs import reseal
    from ulstore.codec._format import open_blob

    at = open_blob(blob)[1].pos + 1  # the payload: m (one byte), then the low bits
    body = bytearray(blob[:-4])
    body[at] ^= 0x01  # the first position's lowest bit
    bad = reseal(body)
    for backend in BACKENDS:
        with pytest.raises(ulstore.IntegrityError):
            ulstore.decode(bad, r, backend=backend)


def _golden_v2_sparse():
    cases = json.loads((GOLDEN_V1 / "manifest.json").read_text())["cases"]
    return [c for c in cases if c["mode"] == "sparse"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _golden_v2_sparse(), ids=lambda c: c["name"])
def test_version_2_blobs_still_apply_in_place(case, backend):
    """The frozen SPARSE blobs of version 2 (gap sections) go through the in-place job as today's do."""
    dtype = {f.name: f.dtype for f in FORMATS}[case["dtype"]]
    fmt = format_of(dtype)
    word = fmt.word

    def load(role):
        return np.frombuffer((GOLDEN_V1 / case[role]).read_bytes(), dtype=word).view(dtype).reshape(case["shape"])

    blob, ref, target = (GOLDEN_V1 / case["blob"]).read_bytes(), load("reference"), load("target")
    assert blob[4] == 2 and is_sparse_blob(blob)
    today = ulstore.encode(target, ref, econd=case["econd"], sparse=True)
    for b in (blob, today):
        state = ref.copy()
        plan = ApplyPlan.of(
            dtype, [b], [state.reshape(-1).view(word)], np.array([content_sum(ref)], np.uint64), shapes=[case["shape"]]
        )
        out = kernels(backend).sparse_apply(plan, True)
        assert out[0] == 0, out[0]
        assert_bits_equal(state, target)
        assert int(out[6][0]) == content_sum(target)
