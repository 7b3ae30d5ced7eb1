"""ULPack codec acceptance tests: exact round trips, determinism, bad input, small tensors.

Every value comparison is on the bits (``assert_bits_equal``,
``assert_bit_identical`` in conftest.py): there is no tolerance anywhere, and NaN
payloads, signed zeros and subnormals count.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ulstore
from tests.helpers.bits import assert_bits_equal, uint
from tests.helpers.blobs import reseal
from tests.helpers.lanes import examples
from ulstore import (
    CorruptBlobError,
    DtypeError,
    IntegrityError,
    InvalidInputError,
    ReferenceMismatchError,
    UlstoreError,
    UnsupportedVersionError,
)
from ulstore.codec._dtypes import FORMATS

DTYPES = {f.name: f.dtype for f in FORMATS}  # the six formats ULPack codes, by name
SMALL = ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]  # exhaustively enumerable
WIDE = ["float32", "float64"]
ALL = list(DTYPES)
#: name -> (exponent bits, mantissa bits)
LAYOUT = {
    "float16": (5, 10),
    "bfloat16": (8, 7),
    "float32": (8, 23),
    "float64": (11, 52),
    "float8_e4m3fn": (4, 3),
    "float8_e5m2": (5, 2),
}

BACKENDS = ulstore.available_backends()
COMPILED = [b for b in BACKENDS if b.startswith("cython")]  # every compiled build this CPU runs
needs_cython = pytest.mark.skipif(not COMPILED, reason="compiled kernels not built")


def W(dtype) -> int:
    return np.dtype(dtype).itemsize * 8


def normal(dtype, shape, rng, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def ulp_steps(ref, rng, frac, max_step) -> np.ndarray:
    """Move a fraction of the elements of ``ref`` by a few bit steps (wrapping)."""
    u = np.array(ref, copy=True).view(uint(ref.dtype))
    flat = u.reshape(-1)
    moved = rng.random(flat.size) < frac
    steps = rng.integers(-max_step, max_step + 1, size=flat.size)
    flat[moved] = (flat[moved].astype(np.int64) + steps[moved]).astype(flat.dtype)
    return u.view(ref.dtype)


def roundtrip(assert_bit_identical, target, reference=None, *, econd=True, backend=None):
    blob = ulstore.encode(target, reference, econd=econd, backend=backend)
    assert isinstance(blob, bytes)
    out = ulstore.decode(blob, reference, backend=backend)
    assert_bit_identical(out, target)
    return blob


# =====================================================================================
# 1. Bit-exact round trips
# =====================================================================================


def _all_patterns(dtype) -> np.ndarray:
    return np.arange(1 << W(dtype), dtype=np.uint64).astype(uint(dtype)).view(dtype)


@pytest.mark.parametrize("econd", [True, False], ids=["econd", "noecond"])
@pytest.mark.parametrize("name", SMALL)
def test_all_patterns_as_target(name, econd, awkward_bits, random_floats, assert_bit_identical):
    """Every 8/16-bit pattern as target, against constant, permuted and random references."""
    dt = DTYPES[name]
    allp = _all_patterns(dt)
    n = allp.size
    rng = np.random.default_rng(1)
    refs = {f"const {int(p):#x}": np.full(n, p, dtype=uint(dt)).view(dt) for p in awkward_bits(dt)}
    refs["identical"] = allp.copy()
    refs["reversed"] = allp[::-1].copy()
    refs["permuted"] = allp[rng.permutation(n)]
    refs["random"] = random_floats(dt, (n,), seed=2)
    refs["awkward tiled"] = np.resize(awkward_bits(dt), n).view(dt)
    for label, ref in refs.items():
        blob = ulstore.encode(allp, ref, econd=econd)
        out = ulstore.decode(blob, ref)
        try:
            assert_bit_identical(out, allp)
        except AssertionError as exc:
            raise AssertionError(f"{name} reference {label}: {exc}") from None
    # intra (against +0.0), in order and shuffled
    roundtrip(assert_bit_identical, allp, econd=econd)
    roundtrip(assert_bit_identical, allp[rng.permutation(n)], econd=econd)


@pytest.mark.parametrize("econd", [True, False], ids=["econd", "noecond"])
@pytest.mark.parametrize("name", SMALL)
def test_all_patterns_as_reference(name, econd, awkward_bits, random_floats, assert_bit_identical):
    """Every 8/16-bit pattern as reference, against constant, neighbouring and random targets."""
    dt = DTYPES[name]
    w = W(dt)
    allp = _all_patterns(dt)
    words = allp.view(uint(dt))
    n = allp.size
    rng = np.random.default_rng(3)
    sign = uint(dt).type(1 << (w - 1))
    targets = {f"const {int(p):#x}": np.full(n, p, dtype=uint(dt)).view(dt) for p in awkward_bits(dt)}
    targets.update(
        {
            "next pattern": (words + uint(dt).type(1)).view(dt),  # wraps at the top
            "previous pattern": (words - uint(dt).type(1)).view(dt),
            "sign flipped": (words ^ sign).view(dt),
            "lsb flipped": (words ^ uint(dt).type(1)).view(dt),
            "reversed": allp[::-1].copy(),
            "permuted": allp[rng.permutation(n)],
            "random": random_floats(dt, (n,), seed=4),
            "few ulps": ulp_steps(allp, rng, frac=0.3, max_step=5),
            "zeros": np.zeros(n, dtype=dt),
        }
    )
    for label, tgt in targets.items():
        out = ulstore.decode(ulstore.encode(tgt, allp, econd=econd), allp)
        try:
            assert_bit_identical(out, tgt)
        except AssertionError as exc:
            raise AssertionError(f"{name} target {label}: {exc}") from None


@st.composite
def _word_arrays(draw, width: int, awkward: np.ndarray, max_n: int = 200):
    """(target words, reference words): arbitrary, near each other, equal, or mixed."""
    udt = np.dtype(f"<u{width // 8}")
    n = draw(st.integers(0, max_n))
    elem = st.one_of(st.integers(0, (1 << width) - 1), st.sampled_from([int(a) for a in awkward]))
    ref = draw(hnp.arrays(udt, n, elements=elem))
    kind = draw(st.sampled_from(["arbitrary", "near", "equal", "mixed"]))
    if kind == "equal":
        return ref.copy(), ref
    other = draw(hnp.arrays(udt, n, elements=elem))
    steps = draw(hnp.arrays(np.int64, n, elements=st.integers(-(1 << 12), 1 << 12)))
    near = (ref.astype(np.uint64) + steps.astype(np.uint64)).astype(udt)  # mod 2**w
    if kind == "arbitrary":
        return other, ref
    if kind == "near":
        return near, ref
    pick = draw(hnp.arrays(np.bool_, n))
    return np.where(pick, other, near).astype(udt), ref


@pytest.mark.parametrize("name", WIDE)
@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_wide_property_roundtrip(name, data, awkward_bits, assert_bit_identical):
    """float32/float64: arbitrary bit patterns, delta and intra, econd on/off, both backends agree."""
    dt = DTYPES[name]
    tw, rw = data.draw(_word_arrays(W(dt), awkward_bits(dt)))
    target, reference = tw.view(dt), rw.view(dt)
    for econd in (True, False):
        for ref in (reference, None):
            blob = ulstore.encode(target, ref, econd=econd)
            assert_bit_identical(ulstore.decode(blob, ref), target)
            assert len(blob) <= target.nbytes + ulstore.header_bound(1)
            for be in BACKENDS:
                assert ulstore.encode(target, ref, econd=econd, backend=be) == blob
            assert_bit_identical(ulstore.decode(blob, ref, backend="numpy"), target)


@pytest.mark.parametrize("name", SMALL)
@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_small_property_roundtrip_multidim(name, data, assert_bit_identical):
    """8/16-bit: arbitrary bit patterns in arbitrary (>= 1-d) shapes, both backends agree."""
    dt = DTYPES[name]
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=7))
    udt = uint(dt)
    ref = data.draw(hnp.arrays(udt, shape)).view(dt)
    tgt = data.draw(hnp.arrays(udt, shape)).view(dt)
    for econd in (True, False):
        for r in (ref, None):
            blob = roundtrip(assert_bit_identical, tgt, r, econd=econd)
            assert ulstore.inspect_blob(blob)["shape"] == shape
            for be in BACKENDS:
                assert ulstore.encode(tgt, r, econd=econd, backend=be) == blob


def test_zero_d_roundtrip(awkward_floats, assert_bit_identical):
    """A 0-d array keeps its shape () (intra and delta), for every dtype."""
    for name, dt in DTYPES.items():
        vals = awkward_floats(dt)
        x = np.array(vals[3], dtype=dt).reshape(())
        r = np.array(vals[5], dtype=dt).reshape(())
        assert x.shape == () and x.ndim == 0
        for ref in (None, r):
            blob = ulstore.encode(x, ref)
            assert ulstore.inspect_blob(blob)["shape"] == (), name
            assert_bit_identical(ulstore.decode(blob, ref), x)


def test_numpy_scalar_input(assert_bit_identical):
    """A numpy scalar is a 0-d tensor, for every dtype."""
    for name, dt in DTYPES.items():
        x = np.array([1.5], dtype=dt)[0]
        assert isinstance(x, np.generic)
        out = ulstore.decode(ulstore.encode(x))
        assert_bit_identical(out, np.array(x, dtype=dt).reshape(()))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2), (2, 0, 1)])
@pytest.mark.parametrize("name", ALL)
def test_empty_roundtrip(name, shape, assert_bit_identical):
    dt = DTYPES[name]
    x = np.zeros(shape, dtype=dt)
    for econd in (True, False):
        for ref in (None, np.ones(shape, dtype=dt)):
            blob = roundtrip(assert_bit_identical, x, ref, econd=econd)
            assert len(blob) <= ulstore.header_bound(len(shape))
            info = ulstore.inspect_blob(blob)
            assert info["shape"] == shape and info["delta"] == (ref is not None)


def test_empty_with_huge_dimension(assert_bit_identical):
    """Empty tensors with a very long axis are legal numpy shapes: encode must not write blobs
    that decode rejects.  Axes up to the format's limit round-trip; longer ones are refused."""
    dt = DTYPES["float32"]
    limit = (1 << 32) - 1  # a header holds no dimension above MAX_ELEMENTS
    for shape in [(0, 1 << 20), (0, limit), (limit, 0, 7)]:
        x = np.zeros(shape, dtype=dt)
        blob = ulstore.encode(x)
        assert len(blob) <= ulstore.header_bound(len(shape))
        assert_bit_identical(ulstore.decode(blob), x)
    for shape in [(0, limit + 1), (0, 1 << 40), (0, 1 << 48), (0, (1 << 48) + 1), (1 << 50, 0), (0, (1 << 62) // 4)]:
        with pytest.raises(InvalidInputError, match="at most"):
            ulstore.encode(np.zeros(shape, dtype=dt))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 4095, 4096, 4097])
@pytest.mark.parametrize("name", ALL)
def test_odd_sizes(name, n, awkward_floats, assert_bit_identical):
    """Sizes around the lane count (4) and odd large sizes, with awkward values inside."""
    dt = DTYPES[name]
    rng = np.random.default_rng(n)
    ref = normal(dt, n, rng)
    tgt = ulp_steps(ref, rng, frac=0.5, max_step=3)
    aw = awkward_floats(dt)
    tgt.reshape(-1)[:: max(1, n // 7)] = np.resize(aw, len(tgt.reshape(-1)[:: max(1, n // 7)]))
    for econd in (True, False):
        roundtrip(assert_bit_identical, tgt, ref, econd=econd)
        roundtrip(assert_bit_identical, tgt, None, econd=econd)
        roundtrip(assert_bit_identical, ref, ref, econd=econd)


def _strided_views(base):
    return {
        "every 3rd row": base[::3],
        "every 2nd column": base[:, ::2],
        "transpose": base.T,
        "negative strides": base[::-1, ::-2],
        "offset slice": base[5:40:7, 3:],
        "fortran": np.asfortranarray(base),
        "column": base[:, 7],
    }


@pytest.mark.parametrize("name", ALL)
def test_non_contiguous_inputs(name, assert_bit_identical):
    dt = DTYPES[name]
    rng = np.random.default_rng(11)
    rbase = normal(dt, (48, 36), rng)
    tbase = ulp_steps(rbase, rng, frac=0.4, max_step=4)
    tviews, rviews = _strided_views(tbase), _strided_views(rbase)
    for label in tviews:
        t, r = tviews[label], rviews[label]
        expect = np.ascontiguousarray(t)
        for ref in (r, None):
            blob = ulstore.encode(t, ref)
            # a view and its contiguous copy are the same tensor: same blob
            assert blob == ulstore.encode(expect, None if ref is None else np.ascontiguousarray(ref)), label
            out = ulstore.decode(blob, ref)
            assert_bit_identical(out, expect)
        # the reference may be given in another layout than at encode time
        blob = ulstore.encode(np.ascontiguousarray(t), np.ascontiguousarray(r))
        assert_bit_identical(ulstore.decode(blob, r), expect)


@pytest.mark.parametrize("name", ALL)
def test_big_endian_inputs(name, awkward_floats, assert_bit_identical):
    """Big-endian target and/or reference: same blob as little-endian, native output."""
    dt = DTYPES[name]
    be = dt.newbyteorder(">")
    rng = np.random.default_rng(5)
    ref = normal(dt, (33,), rng)
    tgt = ulp_steps(ref, rng, frac=0.7, max_step=9)
    tgt[:10] = awkward_floats(dt)[:10]
    tbe, rbe = tgt.astype(be), ref.astype(be)
    if dt.itemsize > 1:
        assert tbe.dtype.byteorder == ">" and tbe.tobytes() != tgt.tobytes()
    want = ulstore.encode(tgt, ref)
    for t, r in [(tbe, ref), (tgt, rbe), (tbe, rbe)]:
        blob = ulstore.encode(t, r)
        assert blob == want
        assert_bit_identical(ulstore.decode(blob, r), tgt, dtype=dt)
        assert_bit_identical(ulstore.decode(blob, ref), tgt, dtype=dt)
    assert_bit_identical(ulstore.decode(ulstore.encode(tbe), None), tgt, dtype=dt)


def test_output_is_a_fresh_writeable_array(assert_bit_identical):
    """Decoded arrays own their memory: no aliasing of the reference or the blob."""
    rng = np.random.default_rng(0)
    ref = normal(np.float32, (64,), rng)
    keep = ref.copy()
    out = ulstore.decode(ulstore.encode(ref, ref), ref)  # same mode
    assert ulstore.inspect_blob(ulstore.encode(ref, ref))["mode"] == "same"
    assert out.flags.writeable and not np.shares_memory(out, ref)
    out[:] = 7
    assert_bit_identical(ref, keep)
    raw = bytearray(ulstore.encode(np.frombuffer(bytearray(rng.bytes(256)), np.float32)))
    assert ulstore.inspect_blob(raw)["mode"] == "raw"
    out = ulstore.decode(raw)
    snapshot = out.copy()
    raw[40:60] = bytes(20)
    assert out.flags.writeable
    assert_bit_identical(out, snapshot)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_inputs(backend, assert_bit_identical):
    """Read-only arrays (np.frombuffer of bytes, read-only memory maps) are valid targets and references."""
    rng = np.random.default_rng(2)
    for name, dt in DTYPES.items():
        r = normal(dt, (257,), rng)
        t = ulp_steps(r, rng, frac=0.5, max_step=3)
        want_delta, want_intra = ulstore.encode(t, r), ulstore.encode(t)
        tro = np.frombuffer(t.tobytes(), dtype=dt)
        rro = r.copy()
        rro.flags.writeable = False
        assert not tro.flags.writeable and not rro.flags.writeable
        assert ulstore.encode(tro, rro, backend=backend) == want_delta, name
        assert ulstore.encode(tro, None, backend=backend) == want_intra, name
        assert_bit_identical(ulstore.decode(want_delta, rro, backend=backend), t)
        assert_bit_identical(ulstore.decode(want_intra, backend=backend), t)


# -- torch ----------------------------------------------------------------------------


def _torch_from_words(torch, words: np.ndarray, name: str):
    via = {1: ("uint8", np.uint8), 2: ("int16", np.int16), 4: ("int32", np.int32), 8: ("int64", np.int64)}
    _, npint = via[words.dtype.itemsize]
    t = torch.from_numpy(np.ascontiguousarray(words).view(npint).copy())
    return t.view(getattr(torch, name))


@pytest.mark.parametrize("name", ALL)
def test_torch_tensors(name, awkward_bits, assert_bit_identical):
    torch = pytest.importorskip("torch")
    assert hasattr(torch, name), f"torch {torch.__version__} has no {name}: the test extra pins one that does"
    dt = DTYPES[name]
    rng = np.random.default_rng(8)
    rw = normal(dt, (24, 10), rng).view(uint(dt))
    tw = ulp_steps(rw.view(dt), rng, frac=0.5, max_step=4).view(uint(dt)).copy()
    tw.reshape(-1)[: len(awkward_bits(dt))] = awkward_bits(dt)[:240]
    tt, rt = _torch_from_words(torch, tw, name), _torch_from_words(torch, rw, name)
    tnp, rnp = tw.view(dt), rw.view(dt)
    for econd in (True, False):
        blob = ulstore.encode(tt, rt, econd=econd)
        assert blob == ulstore.encode(tnp, rnp, econd=econd)
        for ref in (rt, rnp):
            out = ulstore.decode(blob, ref)
            assert_bit_identical(out, tnp)
            assert_bits_equal(out, tt)
        assert ulstore.encode(tt, rnp, econd=econd) == blob  # mixed torch / numpy
        assert ulstore.encode(tt, None, econd=econd) == ulstore.encode(tnp, None, econd=econd)
    # non-contiguous tensors
    for view in (lambda a: a.T, lambda a: a[::3], lambda a: a[:, 1::2]):
        tv, rv = view(tt), view(rt)
        assert not tv.is_contiguous()
        expect = np.ascontiguousarray(view(tnp))
        assert_bit_identical(ulstore.decode(ulstore.encode(tv, rv), rv), expect)
        assert_bit_identical(ulstore.decode(ulstore.encode(tv), None), expect)


def test_torch_requires_grad_and_non_float(assert_bit_identical):
    torch = pytest.importorskip("torch")
    x = torch.linspace(-3, 3, 50, dtype=torch.float32, requires_grad=True)
    out = ulstore.decode(ulstore.encode(x * 1))
    assert_bit_identical(out, (x * 1).detach().numpy())
    for bad in (torch.arange(5), torch.zeros(3, dtype=torch.bool), torch.zeros(2, dtype=torch.complex64)):
        with pytest.raises(DtypeError):
            ulstore.encode(bad)


# =====================================================================================
# 2. Determinism
# =====================================================================================


def _mixed_pairs(seed: int = 0) -> list:
    """A batch of every dtype, mode and size class (bare targets are intra)."""
    rng = np.random.default_rng(seed)
    items = []
    for k, (name, dt) in enumerate(DTYPES.items()):
        r = normal(dt, (300 + 97 * k,), rng)
        items.append((ulp_steps(r, rng, frac=0.05, max_step=2), r))  # sparse delta
        r2 = normal(dt, (17, 41), rng)
        items.append((ulp_steps(r2, rng, frac=0.9, max_step=50), r2))  # dense delta
        items.append(normal(dt, (1000 + k,), rng))  # intra
        items.append((r.copy(), r))  # same
        items.append(np.frombuffer(rng.bytes(40 * dt.itemsize), dtype=dt).copy())  # raw intra
        items.append((np.zeros((0, 3), dt), np.zeros((0, 3), dt)))  # empty
        items.append((normal(dt, (), rng).reshape(1), normal(dt, (), rng).reshape(1)))  # 1 element
    items.append(normal(np.float32, (40_000,), rng))  # one larger tensor
    return items


@pytest.mark.parametrize("econd", [True, False], ids=["econd", "noecond"])
def test_encode_many_independent_of_budget_and_threads(econd, assert_bit_identical):
    items = _mixed_pairs()
    single = [ulstore.encode(*(p if isinstance(p, tuple) else (p, None)), econd=econd) for p in items]
    for budget in (1, 1024, 64 << 20):
        for threads in (1, 2, 4):
            blobs = ulstore.encode_many(items, budget=budget, threads=threads, econd=econd)
            assert isinstance(blobs, list) and len(blobs) == len(items)
            for i, (a, b) in enumerate(zip(blobs, single)):
                assert a == b, f"item {i} differs with budget={budget} threads={threads}"
    assert ulstore.encode_many(items, econd=econd) == single  # defaults
    assert ulstore.encode_many(iter(items), econd=econd, threads=2) == single  # any iterable
    # decode_many is also exact whatever the batching
    pairs = [(b, p[1]) if isinstance(p, tuple) else b for b, p in zip(single, items)]
    for budget in (1, 1024, 64 << 20):
        for threads in (1, 2, 4):
            outs = ulstore.decode_many(pairs, budget=budget, threads=threads)
            for out, p in zip(outs, items):
                assert_bit_identical(out, p[0] if isinstance(p, tuple) else p)


def test_encode_many_empty_input():
    assert ulstore.encode_many([]) == []
    assert ulstore.decode_many([]) == []


def test_repeated_and_concurrent_encodes_identical():
    items = _mixed_pairs(seed=3)
    want = [ulstore.encode(*(p if isinstance(p, tuple) else (p, None))) for p in items]
    for _ in range(2):
        assert [ulstore.encode(*(p if isinstance(p, tuple) else (p, None))) for p in items] == want
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: ulstore.encode(*(p if isinstance(p, tuple) else (p, None))), items * 3))
    assert got == want * 3


def _parity_cases():
    """(label, target, reference or None, econd), modest sizes for the pure-Python rANS loop."""
    cases = []
    for k, (name, dt) in enumerate(DTYPES.items()):
        rng = np.random.default_rng(100 + k)
        r = normal(dt, (12_000,), rng)
        cases.append((f"{name}-sparse", ulp_steps(r, rng, frac=0.05, max_step=2), r))
        cases.append((f"{name}-dense", ulp_steps(r, rng, frac=1.0, max_step=300), r))
        cases.append((f"{name}-intra", normal(dt, (9_001,), rng), None))
        cases.append(
            (
                f"{name}-randombits",
                np.frombuffer(rng.bytes(3001 * dt.itemsize), dt).copy(),
                np.frombuffer(rng.bytes(3001 * dt.itemsize), dt).copy(),
            )
        )
        cases.append((f"{name}-same", r.copy(), r))
        cases.append((f"{name}-tiny", r[:3].copy(), ulp_steps(r[:3], rng, 1.0, 1)))
    # the scale grows with the element count: reach 11 and 12 bits
    rng = np.random.default_rng(9)
    r = normal(np.float16, (50_000,), rng)
    cases.append(("float16-50k", ulp_steps(r, rng, frac=0.5, max_step=100), r))
    return cases


@needs_cython
@pytest.mark.parametrize("econd", [True, False], ids=["econd", "noecond"])
@pytest.mark.parametrize("case", _parity_cases(), ids=lambda c: c[0])
def test_backend_parity(case, econd, assert_bit_identical):
    """numpy and every compiled build: identical bytes, and each decodes the others' blobs."""
    _, target, reference = case
    a = ulstore.encode(target, reference, econd=econd, backend="numpy")
    for be in COMPILED:
        assert ulstore.encode(target, reference, econd=econd, backend=be) == a, be
    for be in BACKENDS:
        assert_bit_identical(ulstore.decode(a, reference, backend=be), target)


@needs_cython
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_backend_parity_exhaustive_8bit(name):
    """All 256 patterns as target against every one of the 256 constant references."""
    dt = DTYPES[name]
    allp = _all_patterns(dt)
    for p in range(256):
        ref = np.full(256, p, dtype=np.uint8).view(dt)
        for econd in (True, False):
            a = ulstore.encode(allp, ref, econd=econd, backend="numpy")
            for be in COMPILED:
                assert a == ulstore.encode(allp, ref, econd=econd, backend=be), (be, hex(p), econd)


@needs_cython
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_backend_parity_all_16bit_patterns(name, assert_bit_identical):
    """All 2**16 patterns (in two halves of 32768) against shifted references, both backends."""
    dt = DTYPES[name]
    allp = _all_patterns(dt)
    rng = np.random.default_rng(21)
    for half in (allp[: 1 << 15], allp[1 << 15 :]):
        for ref in (ulp_steps(half, rng, 1.0, 3), None):
            a = ulstore.encode(half, ref, backend="numpy")
            for be in COMPILED:
                assert a == ulstore.encode(half, ref, backend=be), be
                assert_bit_identical(ulstore.decode(a, ref, backend=be), half)
            assert_bit_identical(ulstore.decode(a, ref, backend="numpy"), half)


_SUBPROCESS_SCRIPT = r"""
import hashlib, json, sys
import numpy as np, ml_dtypes, ulstore
rng = np.random.default_rng(12345)
out = []
for dt in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
    r = (rng.standard_normal(2000)).astype(np.float32).astype(dt)
    u = r.view(f"<u{r.itemsize}").copy()
    u[::3] += 1
    t = u.view(dt)
    for ref in (r, None):
        for econd in (True, False):
            out.append(hashlib.sha256(ulstore.encode(t, ref, econd=econd)).hexdigest())
print(json.dumps([ulstore.backend(), out]))
"""


@pytest.mark.parametrize("backend", ["numpy", "cython", "cython-v3"])
def test_blobs_identical_across_processes(backend):
    """A fresh interpreter (backend chosen by ULSTORE_BACKEND) writes the same bytes as this one."""
    if backend not in BACKENDS:
        # only the x86-64-v3 build may be missing, and only on a CPU (or platform) that cannot run it
        from ulstore.codec._backend import _cpu_has_x86_64_v3

        assert backend == "cython-v3" and not _cpu_has_x86_64_v3(), f"{backend} backend was not built"
        pytest.skip("this CPU has no AVX2/BMI2: the x86-64-v3 build cannot run here")
    env = dict(os.environ, ULSTORE_BACKEND=backend)
    res = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    used, digests = json.loads(res.stdout.strip().splitlines()[-1])
    assert used == backend
    ns = {}
    exec(_SUBPROCESS_SCRIPT.replace("print(json.dumps([ulstore.backend(), out]))", ""), ns)
    assert digests == ns["out"]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "numpy"])
def test_compiled_constants_match_the_twin(backend):
    """The constants _constants.pxi declares for the kernels are the NumPy twin's (_format, _rans_tables)."""
    from ulstore.codec import _format, _rans_tables
    from ulstore.codec._backend import kernels

    c = kernels(backend).CONSTANTS
    assert c["LANES"] == _format.LANES
    assert c["STATE_LOW"] == _rans_tables.STATE_LOW
    assert c["STATE_BITS"] == _rans_tables.STATE_BITS
    assert c["SCALE_BITS"] == _rans_tables.SCALE_BITS
    entry = _rans_tables.ENC_ENTRY
    assert c["ENC_ENTRY_SIZE"] == entry.itemsize
    assert c["ENC_ENTRY"] == tuple(
        (name, entry.fields[name][1], entry.fields[name][0].itemsize) for name in entry.names
    )


# =====================================================================================
# 3. Bad input
# =====================================================================================


def test_error_tree():
    """The decode-side errors are all IntegrityErrors; input errors are InvalidInputErrors."""
    assert issubclass(CorruptBlobError, IntegrityError)
    assert issubclass(UnsupportedVersionError, CorruptBlobError)
    assert issubclass(ReferenceMismatchError, IntegrityError)
    assert not issubclass(ReferenceMismatchError, CorruptBlobError)
    assert issubclass(DtypeError, InvalidInputError) and issubclass(DtypeError, TypeError)
    assert issubclass(InvalidInputError, ValueError) and issubclass(IntegrityError, ValueError)
    assert not issubclass(IntegrityError, InvalidInputError)
    for cls in (IntegrityError, InvalidInputError):
        assert issubclass(cls, UlstoreError)


def _blobs_of_every_mode(dt):
    """label -> (blob, target, reference) for rans delta/noecond, intra (INTRA, and RANS against
    +0.0 for a mostly-zero tensor), raw, same, empty."""
    rng = np.random.default_rng(31)
    n = 40 if dt.itemsize > 1 else 150  # big enough for rANS to beat raw, small enough to cut everywhere
    r = normal(dt, (n,), rng)
    t = ulp_steps(r, rng, frac=0.5, max_step=3)
    zr = np.frombuffer(rng.bytes(12 * dt.itemsize), dt).copy()
    zt = np.frombuffer(rng.bytes(12 * dt.itemsize), dt).copy()
    q = normal(dt, (n + 20,), rng)
    z = (np.round(rng.standard_normal(n + 20) * 2) / 2).astype(np.float32)
    z[rng.random(n + 20) < 0.8] = 0  # mostly zeros: the residual coder beats INTRA
    z = z.astype(dt)
    cases = {
        "delta": (ulstore.encode(t, r), t, r),
        "delta-noecond": (ulstore.encode(t, r, econd=False), t, r),
        "intra": (ulstore.encode(q), q, None),
        "intra-zeros": (ulstore.encode(z), z, None),
        "raw-delta": (ulstore.encode(zt, zr), zt, zr),
        "raw-intra": (ulstore.encode(zt), zt, None),
        "same-delta": (ulstore.encode(r.copy(), r), r, r),
        "same-intra": (ulstore.encode(np.zeros(7, dt)), np.zeros(7, dt), None),
        "empty-delta": (
            ulstore.encode(np.zeros((2, 0), dt), np.zeros((2, 0), dt)),
            np.zeros((2, 0), dt),
            np.zeros((2, 0), dt),
        ),
        "empty-intra": (ulstore.encode(np.zeros(0, dt)), np.zeros(0, dt), None),
    }
    modes = {k: ulstore.inspect_blob(v[0])["mode"] for k, v in cases.items()}
    assert modes["delta"] == modes["intra-zeros"] == modes["delta-noecond"] == "rans", modes
    assert modes["intra"] == "intra", modes
    assert modes["raw-delta"] == modes["raw-intra"] == "raw", modes
    assert modes["same-delta"] == modes["same-intra"] == "same", modes
    return cases


@pytest.mark.parametrize("name", ALL)
def test_wrong_reference_raises(name, assert_bit_identical):
    dt = DTYPES[name]
    u = uint(dt)
    for label, (blob, t, r) in _blobs_of_every_mode(dt).items():
        if r is None:
            # intra blob: passing any reference is an error
            with pytest.raises(ReferenceMismatchError):
                ulstore.decode(blob, np.zeros(t.shape, dt))
            with pytest.raises(ReferenceMismatchError):
                ulstore.decode(blob, t)
            assert_bit_identical(ulstore.decode(blob), t)
            continue
        with pytest.raises(ReferenceMismatchError):
            ulstore.decode(blob)  # delta blob without its reference
        with pytest.raises(ReferenceMismatchError):
            ulstore.decode(blob, r.reshape(-1)[:-1] if r.size else np.zeros((1,), dt))  # other shape
        if r.ndim == 1 and r.size % 2 == 0 and r.size:
            with pytest.raises(ReferenceMismatchError):
                ulstore.decode(blob, r.reshape(2, -1))  # same elements, other shape
        other_dt = {
            1: np.dtype(ml_dtypes.float8_e5m2),
            2: np.dtype(ml_dtypes.bfloat16),
            4: np.dtype(np.float32),
            8: np.dtype(np.float64),
        }[dt.itemsize]
        if other_dt == dt:
            other_dt = {
                1: np.dtype(ml_dtypes.float8_e4m3fn),
                2: np.dtype(np.float16),
                4: np.dtype(np.float16),
                8: np.dtype(np.float32),
            }[dt.itemsize]
        with pytest.raises(ReferenceMismatchError):
            ulstore.decode(blob, np.ascontiguousarray(r).view(u).astype(uint(other_dt)).view(other_dt))
        if r.size == 0:
            continue
        rw = np.array(r, copy=True).view(u)
        variants = {}
        for pos in (0, rw.size // 2, rw.size - 1):
            v = rw.copy()
            v.reshape(-1)[pos] ^= u.type(1)
            variants[f"lsb flip at {pos}"] = v
        v = rw.copy()
        v.reshape(-1)[-1] ^= u.type(1 << (W(dt) - 1))
        variants["sign flip"] = v
        v = rw.copy()
        v.reshape(-1)[0] = u.type(1 << (W(dt) - 1))  # -0.0 where ...
        w2 = rw.copy()
        w2.reshape(-1)[0] = 0  # ... +0.0: equal as floats, different bits
        variants["-0.0"], variants["+0.0"] = v, w2
        variants["all different"] = ~rw
        for vlabel, v in variants.items():
            if np.array_equal(v, rw):
                continue
            with pytest.raises(ReferenceMismatchError):
                ulstore.decode(blob, v.view(dt))
            pytest.raises(ReferenceMismatchError, ulstore.decode, blob, v.view(dt), backend="numpy")
        assert_bit_identical(ulstore.decode(blob, r), t)


@pytest.mark.parametrize("name", ALL)
def test_reference_checksum_catches_paired_sign_flips(name):
    """A reference whose +0.0 became -0.0 in two elements is rejected, wherever the two are.

    The elements chosen are the last of two different 8-byte words (their sign is bit 63
    of the word), where a checksum built from a sum of weak per-word mixes can cancel.
    The target has the same +0.0 there (residual 0), so a wrong reference that slipped
    through would also decode to -0.0 in those two places.
    """
    import itertools

    dt = DTYPES[name]
    per = 8 // dt.itemsize  # elements per 8-byte word
    n = 96 * per
    rng = np.random.default_rng(12)
    r = normal(dt, (n,), rng)
    tops = list(range(per - 1, n, 2 * per))  # last element of every other word
    r.view(uint(dt))[tops] = 0  # +0.0
    t = ulp_steps(r, rng, frac=0.3, max_step=2)
    t.view(uint(dt))[tops] = 0
    blob = ulstore.encode(t, r)
    assert ulstore.inspect_blob(blob)["mode"] == "rans"
    neg0 = uint(dt).type(1 << (W(dt) - 1))
    accepted = []
    for i, j in itertools.combinations(tops, 2):
        r2 = r.copy()
        r2.view(uint(dt))[[i, j]] = neg0
        try:
            ulstore.decode(blob, r2)
        except ReferenceMismatchError:
            continue
        except IntegrityError as exc:  # caught later, by the target checksum: still a reference-check miss
            accepted.append((i, j, type(exc).__name__))
        else:
            accepted.append((i, j, "RETURNED WRONG VALUES"))
    assert not accepted, f"{len(accepted)} wrong references accepted, e.g. {accepted[:5]}"


@pytest.mark.parametrize("name", ["float16", "float32", "float8_e5m2", "float64"])
def test_truncation_at_every_length(name):
    dt = DTYPES[name]
    for label, (blob, t, r) in _blobs_of_every_mode(dt).items():
        assert len(blob) < 600, (label, len(blob))
        for cut in range(len(blob)):
            for be in BACKENDS:
                with pytest.raises(IntegrityError):
                    ulstore.decode(blob[:cut], r, backend=be)
            with pytest.raises(IntegrityError):
                ulstore.inspect_blob(blob[:cut])


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float8_e4m3fn", "float64"])
def test_every_single_byte_corruption(name):
    dt = DTYPES[name]
    for label, (blob, t, r) in _blobs_of_every_mode(dt).items():
        for pos in range(len(blob)):
            for x in (0x01, 0x02, 0x10, 0x80, 0xFF, 0x5A):
                bad = bytearray(blob)
                bad[pos] ^= x
                with pytest.raises(IntegrityError):
                    ulstore.decode(bytes(bad), r)
        # appended bytes are corruption too
        for extra in (b"\x00", b"\xff" * 3, blob[-4:]):
            with pytest.raises(IntegrityError):
                ulstore.decode(blob + extra, r)


@pytest.mark.parametrize("version", [0, 5, 255])
def test_unknown_version(version):
    blob = ulstore.encode(np.linspace(0, 1, 50, dtype=np.float32))
    assert blob[:4] == b"ULPK" and blob[4] == 3
    for candidate in (blob[:4] + bytes([version]) + blob[5:], reseal(blob[:4] + bytes([version]) + blob[5:-4])):
        with pytest.raises(UnsupportedVersionError):
            ulstore.decode(candidate)
        with pytest.raises(UnsupportedVersionError):
            ulstore.inspect_blob(candidate)


@pytest.mark.parametrize("bad", [b"", b"ULPK", b"\x00" * 64, b"not a blob at all, really not one", bytes(range(256))])
def test_garbage_blobs(bad):
    with pytest.raises(IntegrityError):
        ulstore.decode(bad)
    with pytest.raises(IntegrityError):
        ulstore.decode(bad, np.zeros(3, np.float32))


def test_decode_non_buffer_raises_ulstore_error():
    for bad in (12345, None, [1, 2, 3], "ULPK"):
        with pytest.raises(UlstoreError):
            ulstore.decode(bad)


def test_blob_accepts_any_buffer(assert_bit_identical):
    x = np.linspace(-2, 2, 77, dtype=np.float32)
    blob = ulstore.encode(x)
    for b in (blob, bytearray(blob), memoryview(blob), np.frombuffer(blob, np.uint8)):
        assert_bit_identical(ulstore.decode(b), x)
        assert ulstore.inspect_blob(b)["nbytes"] == len(blob)


@pytest.mark.parametrize("name", ALL)
def test_encode_shape_and_dtype_mismatch(name):
    dt = DTYPES[name]
    t = np.zeros((4, 6), dt)
    for r in (np.zeros((6, 4), dt), np.zeros(24, dt), np.zeros((4, 5), dt), np.zeros((4, 6, 1), dt), np.zeros((), dt)):
        with pytest.raises(InvalidInputError):
            ulstore.encode(t, r)
        with pytest.raises(InvalidInputError):
            ulstore.encode_many([(t, r)])
    for other in DTYPES.values():
        if other != dt:
            with pytest.raises(InvalidInputError):
                ulstore.encode(t, np.zeros((4, 6), other))


_NON_FLOATS = {
    "int32": np.arange(6, dtype=np.int32),
    "int8": np.arange(6, dtype=np.int8),
    "uint16": np.arange(6, dtype=np.uint16),
    "uint64": np.arange(6, dtype=np.uint64),
    "bool": np.ones(6, dtype=bool),
    "complex64": np.ones(6, dtype=np.complex64),
    "object": np.array([1.0, None, "x"], dtype=object),
    "str": np.array(["a", "b"]),
    "void": np.zeros(3, dtype="V2"),
    "datetime": np.zeros(3, dtype="datetime64[s]"),
    "list": [1.0, 2.0, 3.0],
    "tuple": (1.0, 2.0),
    "nested list": [[1.0], [2.0]],
    "bytes": b"\x00\x00\x80\x3f",
    "string": "1.0",
    "dict": {"a": 1.0},
    "int": 3,
    "None": None,
}
if np.dtype(np.longdouble).itemsize > 8:
    _NON_FLOATS["longdouble"] = np.ones(3, dtype=np.longdouble)


@pytest.mark.parametrize("label", list(_NON_FLOATS))
def test_encode_rejects_non_float_input(label):
    bad = _NON_FLOATS[label]
    with pytest.raises(InvalidInputError):  # DtypeError is one
        ulstore.encode(bad)
    if bad is not None:  # a None reference means intra
        with pytest.raises(InvalidInputError):
            ulstore.encode(np.zeros(3, np.float32), bad)
    with pytest.raises(InvalidInputError):
        ulstore.model_entropy_bits(bad)
    if isinstance(bad, np.ndarray):
        with pytest.raises(DtypeError):
            ulstore.encode(bad)


def test_encode_many_rejects_non_float_input():
    """encode_many raises the same documented errors as encode (InvalidInputError), not AttributeError."""
    failures = {}
    for label, bad in _NON_FLOATS.items():
        if isinstance(bad, tuple):
            continue  # a tuple item is a (target, reference) pair by definition
        for item in (bad, (bad, None)):
            try:
                ulstore.encode_many([item])
            except InvalidInputError:
                continue
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                failures[label] = f"{type(exc).__name__}: {exc}"
            else:
                failures[label] = "no error"
    assert not failures, failures


def test_encode_many_accepts_what_encode_accepts(assert_bit_identical):
    """numpy scalars and python floats are accepted by encode, so by encode_many too."""
    items = [np.float32(1.5), 2.5, np.zeros(3, np.float16)]
    want = [ulstore.encode(x) for x in items]
    assert ulstore.encode_many(items) == want


def test_unknown_backend():
    x = np.zeros(3, np.float32)
    with pytest.raises(InvalidInputError):
        ulstore.encode(x, backend="fortran")
    with pytest.raises(InvalidInputError):
        ulstore.decode(ulstore.encode(x), backend="gpu")


# =====================================================================================
# 4. Small tensors are never blown up
# =====================================================================================


@pytest.mark.parametrize("name", ALL)
def test_small_tensors_size_bound(name, assert_bit_identical):
    dt = DTYPES[name]
    rng = np.random.default_rng(77)
    for n in range(0, 301):
        bound = n * dt.itemsize + ulstore.header_bound(1)
        rnd = np.frombuffer(rng.bytes(n * dt.itemsize), dt).copy()
        ref = normal(dt, n, rng)
        near = ulp_steps(ref, rng, frac=0.5, max_step=2)
        quant = (np.round(rng.standard_normal(n)) / 4).astype(np.float32).astype(dt)
        for tgt, r in ((rnd, None), (rnd, ref), (ref, None), (near, ref), (quant, None), (ref, rnd)):
            for econd in (True, False):
                blob = ulstore.encode(tgt, r, econd=econd)
                assert len(blob) <= bound, (n, len(blob), bound)
                assert_bit_identical(ulstore.decode(blob, r), tgt)


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 5), (1, 1, 1, 1, 7), (300, 1), (1, 300), (7,) * 4])
@pytest.mark.parametrize("name", ["float16", "float64", "float8_e5m2"])
def test_small_tensors_size_bound_ndim(name, shape):
    dt = DTYPES[name]
    rng = np.random.default_rng(5)
    n = int(np.prod(shape))
    rnd = np.frombuffer(rng.bytes(n * dt.itemsize), dt).reshape(shape).copy()
    for r in (None, np.frombuffer(rng.bytes(n * dt.itemsize), dt).reshape(shape).copy()):
        blob = ulstore.encode(rnd, r)
        assert len(blob) <= rnd.nbytes + ulstore.header_bound(len(shape))


def test_header_bound_is_monotonic_and_positive():
    bounds = [ulstore.header_bound(d) for d in range(0, 33)]
    assert all(b > 0 for b in bounds)
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert ulstore.codec.HEADER_BOUND == ulstore.header_bound(1)


# =====================================================================================
# model_entropy_bits and inspect_blob
# =====================================================================================


def _spec_key(u: int, w: int) -> int:
    h = 1 << (w - 1)
    return (u | h) if not u & h else (~u) & ((1 << w) - 1)


def _spec_unkey(k: int, w: int) -> int:
    h = 1 << (w - 1)
    return (k & ~h) if k >= h else (~k) & ((1 << w) - 1)


def _spec_residual(x: int, r: int, w: int) -> int:
    """zigzag(key(x) - key(r)) per the spec (ulpack.md section 1), in Python integers."""
    x, r = int(x), int(r)
    d = (_spec_key(x, w) - _spec_key(r, w)) % (1 << w)
    delta = d - (1 << w) if d >= 1 << (w - 1) else d
    return ((delta << 1) ^ (delta >> (w - 1))) % (1 << w)


def _spec_target(r: int, z: int, w: int) -> int:
    r, z = int(r), int(z)
    delta = (z >> 1) if not z & 1 else -((z + 1) >> 1)
    return _spec_unkey((_spec_key(r, w) + delta) % (1 << w), w)


def _spec_token(z: int) -> tuple[tuple, int]:
    """((b, q1, q2), number of raw tail bits) per section 2."""
    b = z.bit_length()
    q1 = (z >> (b - 2)) & 1 if b >= 2 else None
    q2 = (z >> (b - 3)) & 1 if b >= 3 else None
    return (b, q1, q2), max(b - 3, 0)


def _spec_entropy_bits(xw, rw, name, econd) -> float:
    """Ideal model size from a histogram computed here, independently of the codec.

    As in the codec's model (format version 3), the contexts from the lowest to the
    highest that holds 256 elements or more have a row each; the others share one.
    """
    e, m = LAYOUT[name]
    w = np.dtype(xw.dtype).itemsize * 8
    hist: dict = {}
    tail = 0
    for i, x in enumerate(np.asarray(xw).reshape(-1).tolist()):
        r = 0 if rw is None else int(np.asarray(rw).reshape(-1)[i])
        ctx = (r >> m) & ((1 << e) - 1) if (rw is not None and econd) else 0
        tok, nt = _spec_token(_spec_residual(x, r, w))
        hist.setdefault(ctx, {}).setdefault(tok, 0)
        hist[ctx][tok] += 1
        tail += nt
    big = [ctx for ctx, row in hist.items() if sum(row.values()) >= 256]
    rows: dict = {}
    for ctx, row in hist.items():
        key = ctx if big and min(big) <= ctx <= max(big) else "pooled"
        for tok, count in row.items():
            rows.setdefault(key, {}).setdefault(tok, 0)
            rows[key][tok] += count
    bits = 0.0
    for row in rows.values():
        c = np.array(list(row.values()), dtype=np.float64)
        bits += float(-(c * np.log2(c / c.sum())).sum())
    return bits + tail


def _crafted(name, rng, scale=8):
    """Targets whose per-context token counts are uniform over 2**k tokens: exact entropies.

    Each context holds 32 * scale elements (scale 8: 256, enough for rows of their own).
    """
    dt = DTYPES[name]
    e, m = LAYOUT[name]
    w = W(dt)
    one = ((1 << (e - 1)) - 1) << m  # 1.0
    two = one + (1 << m)  # 2.0: the next exponent, another context
    rw, zs = [], []
    for z in (0, 1):  # context of 1.0: tokens 0 and 1, no tail
        rw += [one] * 16 * scale
        zs += [z] * 16 * scale
    for z in (8, 9, 12, 13):  # context of 2.0: tokens (b=4,q1=0,q2=0) and (b=4,q1=1,q2=0), one tail bit each
        rw += [two] * 8 * scale
        zs += [z] * 8 * scale
    order = rng.permutation(len(rw))
    rw = np.array(rw, dtype=np.uint64)[order]
    xw = np.array([_spec_target(int(r), z, w) for r, z in zip(rw, np.array(zs)[order])], dtype=np.uint64)
    return xw.astype(uint(dt)), rw.astype(uint(dt))


@pytest.mark.parametrize("name", ALL)
def test_model_entropy_bits_exact(name):
    dt = DTYPES[name]
    rng = np.random.default_rng(4)
    xw, rw = _crafted(name, rng)
    x, r = xw.view(dt), rw.view(dt)
    # the crafted residuals really are what the spec says
    assert sorted(_spec_residual(int(a), int(b), W(dt)) for a, b in zip(xw, rw)) == sorted(
        [0] * 128 + [1] * 128 + [8] * 64 + [9] * 64 + [12] * 64 + [13] * 64
    )
    expect_econd = _spec_entropy_bits(xw, rw, name, True)
    expect_pooled = _spec_entropy_bits(xw, rw, name, False)
    # 256 elements x 1 bit in each context + 256 tail bits; no e_r: 512 x 2 bits + 256 tail bits
    assert expect_econd == 768.0 and expect_pooled == 1280.0
    # contexts under 256 elements share one row: the small version models like no e_r
    xs, rs = _crafted(name, rng, scale=1)
    assert _spec_entropy_bits(xs, rs, name, True) == 160.0
    assert ulstore.model_entropy_bits(xs.view(dt), rs.view(dt)) == 160.0
    assert ulstore.model_entropy_bits(x, r) == expect_econd
    assert ulstore.model_entropy_bits(x, r, econd=True) == expect_econd
    assert ulstore.model_entropy_bits(x, r, econd=False) == expect_pooled
    # intra: +0.0 reference, one context whatever econd says
    xi = np.array([_spec_target(0, int(z), W(dt)) for z in np.repeat([0, 2, 4, 6], 16)], dtype=np.uint64)
    intra = _spec_entropy_bits(xi.astype(uint(dt)), None, name, True)
    assert intra == 128.0
    for econd in (True, False):
        assert ulstore.model_entropy_bits(xi.astype(uint(dt)).view(dt), econd=econd) == intra
    # one token per context, random tails: the entropy is exactly the tail bit count
    b = min(W(dt), 8)
    zt = (0b101 << (b - 3)) | rng.integers(0, 1 << (b - 3), size=40)
    xt = np.array([_spec_target(int(r0), int(z), W(dt)) for r0, z in zip(rs[:40], zt)], dtype=np.uint64)
    assert _spec_entropy_bits(xt.astype(uint(dt)), rs[:40], name, True) == 40.0 * (b - 3)
    assert ulstore.model_entropy_bits(xt.astype(uint(dt)).view(dt), rs[:40].view(dt)) == 40.0 * (b - 3)
    # blobs of these round-trip, and every residual zero costs nothing
    assert ulstore.model_entropy_bits(r, r) == 0.0
    assert ulstore.model_entropy_bits(np.zeros(0, dt)) == 0.0


@pytest.mark.parametrize("name", ALL)
def test_model_entropy_bits_order_and_conditioning(name):
    """Element order does not matter; conditioning never costs more than pooling (delta)."""
    dt = DTYPES[name]
    rng = np.random.default_rng(6)
    r = normal(dt, (500,), rng)
    t = ulp_steps(r, rng, frac=0.8, max_step=1000)
    perm = rng.permutation(500)
    a = ulstore.model_entropy_bits(t, r)
    b = ulstore.model_entropy_bits(t[perm], r[perm])
    # a permutation only reorders the histogram increments: the counts, so the result, are equal
    assert_bits_equal(np.float64(a), np.float64(b))
    assert a <= ulstore.model_entropy_bits(t, r, econd=False)
    assert a > 0


def test_inspect_blob_fields():
    rng = np.random.default_rng(0)
    for name, dt in DTYPES.items():
        for label, (blob, t, r) in _blobs_of_every_mode(dt).items():
            info = ulstore.inspect_blob(blob)
            assert info["version"] == 3
            assert info["dtype"] == name
            assert info["shape"] == t.shape
            assert info["delta"] == (r is not None)
            assert info["econd"] == ("noecond" not in label)
            assert info["nbytes"] == len(blob)
            kind = label.split("-")[0]
            expected = {"delta": "rans", "intra-zeros": "rans", "empty": "raw"}
            assert info["mode"] == expected.get(label, expected.get(kind, kind)), (label, info)
    x = normal(np.float32, (3, 4, 5), rng)
    info = ulstore.inspect_blob(ulstore.encode(x, econd=False))
    assert info["shape"] == (3, 4, 5) and info["econd"] is False and info["delta"] is False


def test_inspect_blob_rejects_corruption():
    blob = ulstore.encode(np.linspace(0, 1, 100, dtype=np.float16))
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(CorruptBlobError):
        ulstore.inspect_blob(bytes(bad))
    with pytest.raises(CorruptBlobError):
        ulstore.inspect_blob(blob[:-1])


def test_blob_hash_is_content_address():
    """Same values, however laid out or typed (numpy/torch/BE), give the same content address."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    digests = {
        hashlib.sha256(ulstore.encode(v)).hexdigest() for v in (x, np.asfortranarray(x), x.astype(">f4"), x.T.copy().T)
    }
    assert len(digests) == 1
