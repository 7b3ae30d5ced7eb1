"""Format version 3: INTRA blobs, one-stream sections on 4 and 32 lanes, and declared sizes.

- Round trips and byte parity of every backend for both lane layouts (32 lanes
  run the AVX2 decoder for 16-bit words where the CPU has it, and a C encoder).
- Crafted, CRC-valid blobs: both backends raise ``CorruptBlobError`` and agree on why.
- Declared sizes (issue D11): a blob that declares far more elements than its
  payload can hold is refused before anything of that size is allocated, and
  ``decode(..., shape=)`` refuses any other shape first.  Memory is measured with
  tracemalloc (numpy reports its buffers there), never time.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal, uint
from tests.helpers.blobs import reseal
from ulstore import CorruptBlobError, IntegrityError
from ulstore.codec import _format as F
from ulstore.codec import _one_stream
from ulstore.codec._dtypes import FORMATS

DTYPES = {f.name: f.dtype for f in FORMATS}
BACKENDS = ulstore.available_backends()


def normal(dt, n, rng, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32).astype(dt)


def steps(ref, rng, frac, max_step):
    u = ref.view(uint(ref.dtype)).copy()
    moved = rng.random(u.size) < frac
    u[moved] = (u[moved].astype(np.int64) + rng.integers(-max_step, max_step + 1, size=int(moved.sum()))).astype(
        u.dtype
    )
    return u.view(ref.dtype)


@pytest.fixture
def wide(monkeypatch):
    """Every section on 32 lanes, whatever its size."""
    monkeypatch.setattr(_one_stream, "WIDE_BITS", 0)


def _params(blob) -> int:
    header, rd = F.open_blob(blob)
    return rd.buf[rd.pos]


def _roundtrip_all_backends(t, r=None):
    blobs = {be: ulstore.encode(t, r, backend=be) for be in BACKENDS}
    assert len(set(blobs.values())) == 1, "backends write different bytes"
    blob = blobs[BACKENDS[0]]
    for be in BACKENDS:
        out = ulstore.decode(blob, r, backend=be)
        assert_bits_equal(out, t)
    return blob


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("lanes", [4, 32])
@pytest.mark.parametrize("n", [1, 7, 8, 31, 33, 250, 1027])
def test_lane_layouts_roundtrip_and_parity(name, lanes, n, monkeypatch):
    """Every dtype, both lane counts, sizes around the group (8) and vector-block (32)
    boundaries: intra (INTRA) and delta blobs decode exactly, every backend writes the
    same bytes and decodes every other's."""
    if lanes == 32:
        monkeypatch.setattr(_one_stream, "WIDE_BITS", 0)
    dt = DTYPES[name]
    rng = np.random.default_rng(n)
    x = normal(dt, n, rng)
    r = steps(x, rng, 0.6, 30)
    for t, ref in ((x, None), (x, r)):
        blob = _roundtrip_all_backends(t, ref)
        info = ulstore.inspect_blob(blob)
        if info["mode"] in ("rans", "intra"):
            assert LANES_OF[_params(blob) & 3] == lanes


LANES_OF = dict(enumerate(_one_stream.LANE_COUNTS))


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_vector_decoder_on_every_16bit_pattern(name, wide):
    """All 65536 patterns, as target and as reference, through the 32-lane (AVX2) path."""
    dt = DTYPES[name]
    every = np.arange(1 << 16, dtype=np.uint16).view(dt)
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(every.view(np.uint16)).view(dt)
    for t, r in ((every, None), (every, shuffled), (shuffled, every), (every, steps(every, rng, 0.5, 3))):
        _roundtrip_all_backends(t, r)


def test_intra_is_smaller_than_version_1_on_weights():
    """The point of INTRA: exponent and top mantissa bits entropy-coded, not left in raw tails."""
    rng = np.random.default_rng(1)
    x = normal(ml_dtypes.bfloat16, 50_000, rng, scale=0.02)
    blob = ulstore.encode(x)
    assert ulstore.inspect_blob(blob)["mode"] == "intra"
    assert len(blob) < 0.70 * x.nbytes  # version 1 (residual against +0.0): ~75%


def test_mostly_zero_intra_uses_the_residual_coder():
    x = np.zeros(10_000, np.float32)
    x[::50] = 1.5
    blob = ulstore.encode(x)
    assert ulstore.inspect_blob(blob)["mode"] == "rans"
    assert len(blob) < 0.05 * x.nbytes


def test_intra_falls_back_when_symbols_do_not_fit():
    """More than 256 distinct (exponent, top mantissa) symbols even with no mantissa bits:
    float64 with exponents everywhere.  Coded against +0.0 instead, still exact."""
    rng = np.random.default_rng(2)
    x = np.frombuffer(rng.bytes(8 * 4000), np.float64).copy()
    x = np.where(np.isfinite(x), x, 1.0)
    blob = _roundtrip_all_backends(x)
    assert ulstore.inspect_blob(blob)["mode"] in ("rans", "raw")


# -- declared sizes: nothing of the declared size before the checks (D11) ---------------------


def _with_shape(blob: bytes, shape: tuple) -> bytes:
    """``blob`` with its header's shape replaced (CRC recomputed)."""
    header, rd = F.open_blob(blob)
    new = F.Header(
        header.fmt, header.mode, header.flags, shape, header.ref_hash, header.target_hash, header.version
    ).pack()
    return reseal(new + bytes(rd.buf[rd.pos : rd.end]))


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _golden_v1(name: str) -> bytes:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "fixtures" / "ulpack_v1" / f"{name}.ulpk").read_bytes()


def _crafted_huge() -> dict[str, bytes]:
    """Small CRC-valid blobs that declare 2**28 elements (2**27 for the 8-byte dtype)."""
    rng = np.random.default_rng(5)
    zeros = np.zeros(600, np.float16)
    zeros[::40] = 2.0
    out = {
        "v3-intra": ulstore.encode(normal(np.float16, 600, rng)),
        "v3-intra-fp64": ulstore.encode(normal(np.float64, 300, rng)),
        "v3-rans-against-zero": ulstore.encode(zeros),
        "v3-constant": ulstore.encode(np.full(600, 6e-8, np.float16)),  # one token, no tail
        "v3-same-intra": ulstore.encode(np.zeros(600, np.float16)),
        "v3-raw": ulstore.encode(np.frombuffer(rng.bytes(64), np.float16).copy()),
        "v1-rans-intra": _golden_v1("float16_intra"),
        "v1-same-intra": _golden_v1("float16_same_intra"),
        "v1-raw-intra": _golden_v1("float16_raw_intra"),
    }
    modes = {k: ulstore.inspect_blob(b)["mode"] for k, b in out.items()}
    assert modes["v3-intra"] == modes["v3-intra-fp64"] == "intra", modes
    assert modes["v3-rans-against-zero"] == modes["v3-constant"] == modes["v1-rans-intra"] == "rans", modes
    return {k: _with_shape(b, (1 << 27,) if "fp64" in k else (1 << 14, 1 << 14)) for k, b in out.items()}


HUGE = _crafted_huge()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", list(HUGE))
def test_huge_declared_size_refused_before_allocation(label, backend):
    """A blob of a few hundred bytes declaring 2**28 elements (256-512 MiB of values) must
    fail with CorruptBlobError having allocated next to nothing: checked against what
    its payload can hold, or (constant and all-zero tensors, whose payload is the same
    whatever the size) against its target checksum computed in constant memory."""
    blob = HUGE[label]
    assert len(blob) < 4000

    def run():
        with pytest.raises(CorruptBlobError):
            ulstore.decode(blob, backend=backend)

    assert _peak_bytes(run) < 16 << 20, label


@pytest.mark.parametrize("label", list(HUGE))
def test_expected_shape_refused_first(label):
    blob = HUGE[label]

    def run():
        with pytest.raises(CorruptBlobError, match="expected"):
            ulstore.decode(blob, shape=(600,))

    assert _peak_bytes(run) < 1 << 20


def test_decode_shape_argument():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    blob = ulstore.encode(x)
    assert ulstore.decode(blob, shape=(3, 4)).shape == (3, 4)
    assert ulstore.decode(blob, shape=[3, 4]).shape == (3, 4)
    for bad in ((12,), (4, 3), 12, ()):
        with pytest.raises(CorruptBlobError, match="expected"):
            ulstore.decode(blob, shape=bad)
    assert ulstore.decode(ulstore.encode(np.arange(5, dtype=np.float32)), shape=5).shape == (5,)


def test_legitimate_constant_and_zero_tensors_still_decode():
    """The constant-memory checks accept what they must: large constant tensors."""
    for x in (np.zeros(1 << 20, np.float16), np.full(1 << 20, 6e-8, np.float16), np.full(3, -0.0, np.float32)):
        blob = ulstore.encode(x)
        assert len(blob) < 200
        out = ulstore.decode(blob)
        assert_bits_equal(out, x)


# -- crafted version-3 blobs -------------------------------------------------------------------


def _split(blob: bytes):
    """(header, params byte, table, states, words) of a version-3 RANS or INTRA blob."""
    header, rd = F.open_blob(blob)
    start = rd.pos
    fmt = header.fmt
    params = blob[start]
    lanes = LANES_OF[params & 3]
    kk = (params >> 2) & 3
    intra = header.mode == F.MODE_INTRA
    n_ctx = 1 if intra or header.flags & F.FLAG_NO_ECOND or not header.is_delta else fmt.n_contexts
    alphabet = 1 << (fmt.exp_bits + kk) if intra else fmt.alphabet
    k = ulstore.codec._backend.kernels("numpy")
    freqs = np.zeros((n_ctx + 1, alphabet), np.uint32)
    used = k.read_table3(
        blob[start + 1 : -4], int(n_ctx > 1), n_ctx, alphabet, 256 if intra else alphabet, np.zeros(2, np.int64), freqs
    )
    assert used > 0
    t0 = start + 1
    s0 = t0 + used
    w0 = s0 + 4 * lanes
    return blob[:start], blob[start : start + 1], blob[t0:s0], blob[s0:w0], blob[w0:-4]


def _crafted_v3() -> dict:
    rng = np.random.default_rng(9)
    r = normal(np.float32, 300, rng)
    t = steps(r, rng, 0.7, 50)
    x = normal(ml_dtypes.bfloat16, 300, rng)
    out = {}
    for label, (tt, rr) in {"delta": (t, r), "intra": (x, None)}.items():
        blob = ulstore.encode(tt, rr)
        hdr, params, table, states, words = _split(blob)
        p = params[0]
        out[f"{label}-lanes-2"] = (reseal(hdr + bytes([p & ~3 | 2]) + table + states + words), rr)
        out[f"{label}-params-high"] = (reseal(hdr + bytes([p | 0x40]) + table + states + words), rr)
        out[f"{label}-k-3"] = (reseal(hdr + bytes([p | 0x0C]) + table + states + words), rr)
        out[f"{label}-table-truncated"] = (reseal(hdr + params + table[:2]), rr)
        out[f"{label}-table-padding"] = (
            reseal(hdr + params + table[:-1] + bytes([table[-1] | 1]) + states + words),
            rr,
        )
        out[f"{label}-no-table"] = (reseal(hdr + params), rr)
        out[f"{label}-states-zero"] = (reseal(hdr + params + table + bytes(len(states)) + words), rr)
        out[f"{label}-states-max"] = (
            reseal(hdr + params + table + b"\xff\xff\xff\x7f" * (len(states) // 4) + words),
            rr,
        )
        out[f"{label}-odd-words"] = (reseal(hdr + params + table + states + words[:-1]), rr)
        out[f"{label}-no-words"] = (reseal(hdr + params + table + states), rr)
        out[f"{label}-extra-words"] = (reseal(hdr + params + table + states + words + b"\x00\x80"), rr)
    return out


CRAFTED_V3 = _crafted_v3()


@pytest.mark.parametrize("label", list(CRAFTED_V3))
def test_crafted_v3_blobs_rejected_identically_by_every_backend(label):
    blob, ref = CRAFTED_V3[label]
    errors = {}
    for be in BACKENDS:
        with pytest.raises(CorruptBlobError) as info:
            ulstore.decode(blob, ref, backend=be)
        errors[be] = str(info.value)
    assert len(set(errors.values())) == 1, errors


def test_flag_and_mode_combinations_refused():
    blob = ulstore.encode(normal(np.float16, 100, np.random.default_rng(0)))
    assert ulstore.inspect_blob(blob)["mode"] == "intra"
    body = bytearray(blob[:-4])
    body[5] |= 0x40  # INTRA marked as a delta
    with pytest.raises(IntegrityError, match="intra-coded but marked"):
        ulstore.decode(reseal(body), np.zeros(100, np.float16))
    body = bytearray(blob[:-4])
    body[5] = (body[5] & 7) | 7 << 3  # mode 7
    with pytest.raises(CorruptBlobError, match="unknown mode"):
        ulstore.decode(reseal(body))


def test_every_build_of_this_platform_imports():
    """The portable and the x86-64-v3 builds come from the same source: if one imports and
    the other does not (a symbol missing from one build), the tests would silently skip it."""
    import importlib
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("one build only")
    built = [
        m for m in ("_kernels", "_kernels_x86_64_v3") if list((Path(ulstore.codec.__file__).parent).glob(f"{m}.*.so"))
    ]
    for name in built:
        importlib.import_module(f"ulstore.codec.{name}")  # raises ImportError if it cannot load
    if "cython-v3" in BACKENDS:
        assert "cython" in BACKENDS


def test_model_entropy_bits_follows_the_intra_model():
    """Intra: the ideal is the INTRA model's (symbol entropy plus the raw bits), which the
    blob reaches up to its tables and fixed bytes; for a mostly-zero tensor it is the
    residual model that encode picks."""
    rng = np.random.default_rng(3)
    x = normal(ml_dtypes.bfloat16, 100_000, rng, scale=0.02)
    ideal = ulstore.model_entropy_bits(x)
    blob = ulstore.encode(x)
    assert ideal <= 8 * len(blob) <= ideal * 1.01 + 8 * 200
    z = np.zeros(20_000, np.float32)
    z[::100] = 1.0
    assert ulstore.inspect_blob(ulstore.encode(z))["mode"] == "rans"
    assert ulstore.model_entropy_bits(z) <= 8 * len(ulstore.encode(z))


def _rl_step(n, rng, step):
    """A bf16 RL-like step: the same tiny update on every fp32 master weight, so that only the
    small weights (low exponents) change in bf16."""
    master = (rng.standard_normal(n) * 0.02).astype(np.float32)
    move = (step * np.sign(rng.standard_normal(n))).astype(np.float32)
    return (master + move).astype(ml_dtypes.bfloat16), master.astype(ml_dtypes.bfloat16)


def test_sparse_delta_band_gives_changed_contexts_rows(monkeypatch):
    """In a sparse delta the encoder's band also covers contexts with few elements but many
    changes (``choose_band``): smaller than the band of >= 256 elements, the same bytes from
    every backend, and the decoder needs nothing new.  A dense delta keeps that band."""
    rng = np.random.default_rng(11)
    t, r = _rl_step(50_000, rng, 1e-6)
    assert 0.01 < np.mean(t.view(np.uint16) != r.view(np.uint16)) < 1 / 16
    chosen = _roundtrip_all_backends(t, r)
    dense_t = steps(r, rng, 0.7, 9)
    dense = ulstore.encode(dense_t, r)
    choose = _one_stream.choose_band
    monkeypatch.setattr(_one_stream, "choose_band", lambda k, h, n_c, tot, sparse: choose(k, h, n_c, tot, False))
    by_count = ulstore.encode(t, r)
    assert len(chosen) < len(by_count)
    assert ulstore.encode(dense_t, r) == dense


def test_inspect_blob_splits_a_one_stream_payload():
    """A version-3 RANS or INTRA blob's parts are its params byte, table, lane states (4 bytes a
    lane: 4 or 32 lanes) and rANS words; they sum to the blob, and the table is what a blob of the
    same data with more contexts grows by."""
    rng = np.random.default_rng(8)
    ref = normal(ml_dtypes.bfloat16, 60_000, rng, scale=0.02)
    target = steps(ref, rng, 0.05, 2)
    wide = normal(np.float32, 300_000, rng)
    for blob, lanes in (
        (ulstore.encode(target, ref), 4),
        (ulstore.encode(target, ref, econd=False), 4),
        (ulstore.encode(ref), 4),
        (ulstore.encode(wide), 32),
    ):
        info = ulstore.inspect_blob(blob)
        parts = info["parts"]
        assert info["mode"] in ("rans", "intra") and "payload" not in parts
        assert sum(parts.values()) == len(blob) == info["nbytes"]
        assert parts["params"] == 1 and parts["lane states"] == 4 * lanes and parts["words"] % 2 == 0
        assert parts["table"] > 0 and parts["words"] > 0
    econd = ulstore.inspect_blob(ulstore.encode(target, ref))["parts"]
    flat = ulstore.inspect_blob(ulstore.encode(target, ref, econd=False))["parts"]
    assert econd["table"] > flat["table"]  # one row per band context against one row
    # RAW and SAME blobs keep one payload entry (or none)
    assert "payload" in ulstore.inspect_blob(ulstore.encode(ref[:3]))["parts"]
    assert set(ulstore.inspect_blob(ulstore.encode(ref, ref))["parts"]) == {"header", "crc"}


# -- the version-3 kernels against their twins, directly -----------------------------------


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "numpy"])
def test_compiled_v3_constants_match_the_twin(backend):
    from ulstore.codec._backend import kernels
    from ulstore.codec.reference import _one_stream_rans

    c = kernels(backend).CONSTANTS3
    assert c["RAW_CHUNK"] == _one_stream_rans.RAW_CHUNK == _one_stream.RAW_CHUNK
    assert c["MAX_LANES"] == max(_one_stream.LANE_COUNTS)


def test_quantize_rows3_parity():
    from ulstore.codec._backend import kernels

    rng = np.random.default_rng(0)
    for trial in range(200):
        rows, alpha = int(rng.integers(1, 6)), int(rng.choice([2, 60, 124, 300]))
        counts = np.zeros((rows, alpha), np.int64)
        for i in range(rows):
            k = int(rng.integers(0, alpha + 1))
            idx = rng.choice(alpha, k, replace=False)
            counts[i, idx] = rng.integers(1, int(rng.choice([2, 10, 1000, 10**6, 10**9])), k)
        outs = []
        for be in BACKENDS:
            f, f12 = np.zeros((rows, alpha), np.uint32), np.zeros((rows, alpha), np.uint32)
            sc, od = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
            total = kernels(be).quantize_rows3(counts, _one_stream.COST, f, f12, sc, od)
            for i in range(rows):
                if counts[i].any():  # every row sums to 2**scale; symbols that occur keep >= 1
                    assert int(f[i].sum()) == 1 << int(sc[i]) and int(f12[i].sum()) == 4096
                    assert ((f[i] > 0) == (counts[i] > 0)).all()
            outs.append((total, f.tobytes(), f12.tobytes(), sc.tobytes(), od.tobytes()))
        assert all(o == outs[0] for o in outs), trial


def test_hash_fill_parity():
    from ulstore.codec._backend import kernels

    for value, count, size in [
        (0, 0, 2),
        (0, 1000, 2),
        (0x1234, 12345, 2),
        (7, 99, 1),
        ((1 << 63) + 5, 33, 8),
        (3, 1 << 16, 4),
        (0xFFFF, 7, 2),
    ]:
        want = kernels("numpy").hash64(np.full(count, value, dtype=f"<u{size}"))
        assert {kernels(be).hash_fill(value, count, size) for be in BACKENDS} == {want}


def test_read_table3_statuses_match_on_random_bits():
    """Random bit strings as tables: every backend returns the same status (or length)
    and, when it parses, the same band and frequencies."""
    from ulstore.codec._backend import kernels

    rng = np.random.default_rng(1)
    for trial in range(400):
        data = rng.bytes(int(rng.integers(0, 40)))
        has_band, n_ctx, alphabet = (
            int(rng.integers(0, 2)),
            int(rng.choice([1, 32, 256])),
            int(rng.choice([8, 60, 124])),
        )
        outs = []
        for be in BACKENDS:
            band = np.zeros(2, np.int64)
            freqs = np.zeros((n_ctx + 1, alphabet), np.uint32)
            used = kernels(be).read_table3(
                np.frombuffer(data, np.uint8), has_band, n_ctx, alphabet, alphabet, band, freqs
            )
            # on a status the outputs are unspecified (the section reader discards them)
            outs.append((used, band.tobytes() + freqs.tobytes() if used >= 0 else b""))
        assert all(o == outs[0] for o in outs), (trial, [o[0] for o in outs])


def _decode3_cases():
    """Valid version-3 payloads (intra, delta, against +0.0; 4 and 32 lanes; every dtype) and damaged copies."""
    rng = np.random.default_rng(5)
    cases = []
    for name, dt in DTYPES.items():
        for n in (5, 300, 3000):
            r = normal(dt, n, rng, 0.02)
            t = steps(r, rng, 0.3, 3)
            for tt, rr in ((r, None), (t, r), (t, None)):
                blob = ulstore.encode(tt, rr)
                header, rd = F.open_blob(blob)
                if header.version == 3 and header.mode in (F.MODE_RANS, F.MODE_INTRA):
                    cases.append((blob, rr))
    damaged = []
    for blob, rr in cases[::3]:
        header, rd = F.open_blob(blob)
        for _ in range(6):
            b = bytearray(blob)
            at = int(rng.integers(rd.pos, len(b) - 4))
            b[at] ^= 1 << int(rng.integers(0, 8))
            damaged.append((reseal(bytes(b[:-4])), rr))
        damaged.append((reseal(blob[: int(rng.integers(rd.pos, len(blob) - 4))]), rr))
    return cases + damaged


def test_decode3_matches_the_step_by_step_path_and_its_twin():
    """``decode3`` (one call: the payload's checks, tables and decode) gives every backend's values, hashes
    and status alike, and succeeds exactly when section3_args and rans_decode3 do, with their values."""
    from ulstore.codec._api import _econd_mask
    from ulstore.codec._backend import kernels

    ok = failed = 0
    for blob, rr in _decode3_cases():
        header, rd = F.open_blob(blob)
        fmt = header.fmt
        ref = None if rr is None else rr.reshape(-1).view(fmt.word)
        emask = _econd_mask(fmt, ref is not None, not header.flags & F.FLAG_NO_ECOND)
        results = set()
        for be in BACKENDS:
            k = kernels(be)
            status, out, hv, hr = k.decode3(
                rd.buf,
                rd.pos,
                rd.end,
                None,
                ref,
                header.mode == F.MODE_INTRA,
                fmt.width,
                fmt.mant_bits,
                fmt.exp_bits,
                fmt.token_bits,
                fmt.alphabet,
                emask,
                header.size,
            )
            results.add((status, out.tobytes() if status == 0 else None, hv, hr) if status == 0 else (status,))
            try:
                args = _one_stream.section3_args(k, fmt, header, F.Reader(rd.buf, rd.pos, rd.end), ref, emask)
                step_status = k.rans_decode3(*args)
            except CorruptBlobError:
                step_status = None
            assert (status == 0) == (step_status == 0), (be, status, step_status)
            if status == 0:
                assert out.tobytes() == args[-2].tobytes() and [hv, hr] == [int(h) for h in args[-1]]
        assert len(results) == 1, results
        ok += status == 0
        failed += status != 0
    assert ok > 50 and failed > 20  # (both kinds met)


def test_a_kernel_build_without_decode3_decodes_step_by_step(monkeypatch):
    """A build older than its sources (no ``decode3``) still decodes, through the step-by-step path."""
    from ulstore.codec import _backend, decode_blobs

    class Older:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            if name == "decode3":
                raise AttributeError(name)
            return getattr(self._real, name)

    rng = np.random.default_rng(3)
    r = normal(ml_dtypes.bfloat16, 2000, rng, 0.02)
    t = steps(r, rng, 0.3, 3)
    blobs = [ulstore.encode(r), ulstore.encode(t, r)]
    monkeypatch.setattr(_backend, "_active", Older(_backend.kernels()))
    assert_bits_equal(ulstore.decode(blobs[0]), r)
    assert_bits_equal(ulstore.decode(blobs[1], r), t)
    outs = [np.empty_like(r), np.empty_like(t)]
    assert all(s is not None for s in decode_blobs(blobs, [None, r], outs, [r.shape, t.shape]))
    assert_bits_equal(outs[0], r)
    assert_bits_equal(outs[1], t)


def test_the_compact_header_parse_agrees_with_the_general_one():
    """``_open_compact`` (the few-step parse of a version-3 header) returns what the general parse does, or
    None, on random headers: never a header the general parse would refuse or read otherwise."""
    rng = np.random.default_rng(11)
    base = [ulstore.encode(normal(np.float16, 60, rng).reshape(3, 20)), ulstore.encode(normal(np.float32, 9, rng))]
    base.append(ulstore.encode(steps(normal(np.float32, 40, rng), rng, 0.5, 9), normal(np.float32, 40, rng)))
    agreed = 0
    for trial in range(3000):
        blob = bytearray(base[trial % len(base)])
        for _ in range(int(rng.integers(1, 4))):
            blob[int(rng.integers(5, 16))] = int(rng.integers(0, 256))
        buf = memoryview(bytes(blob))
        body_end = len(buf) - F.CRC_BYTES
        fast = F._open_compact(buf, body_end)
        try:
            general = F._open_general(buf, 3, body_end)
        except CorruptBlobError:
            assert fast is None, trial
            continue
        if fast is not None:
            assert fast[0] == general[0] and (fast[1].pos, fast[1].end) == (general[1].pos, general[1].end)
            agreed += 1
    assert agreed > 300
