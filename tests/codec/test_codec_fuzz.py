"""Seeded fuzzing of the compiled ULPack decoder with mutated real blobs.

Every mutated blob must either raise an exception from the ``IntegrityError``
tree or, only when the mutation changed nothing the decoder depends on, return
the exact original values.  No crash, no other exception type, never wrong values.

Two families:

* plain mutations of the whole blob (bit flips, byte overwrites, truncations,
  extensions, splices, insertions, deletions, cross-blob splices): the trailing
  CRC-32 catches almost all of them;
* "resealed" mutations of the payload (everything after the fixed header) whose
  CRC-32 is recomputed afterwards, so that the deeper checks run: table
  validation, lane states, stream lengths, tail bit count and the target checksum.
  Every single payload bit is flipped this way too; the bits whose flip is
  accepted (padding) must look like padding: an edge run of < 8 bits in a byte.

Blobs of every mode of today's format (version 3, with 4- and 32-lane sections:
the latter decode through the AVX2 loop where the CPU has it; SPARSE: version 4),
and golden blobs of versions 1 and 2 (``tests/fixtures/ulpack_v1``), which must
keep decoding safely.

The header end comes from ``ulstore.codec._format.open_blob`` (the reader it returns
stands at the payload).  Only the crafted-blob tests at the end parse the table
layouts themselves.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal, uint
from tests.helpers.blobs import reseal
from ulstore import CorruptBlobError, IntegrityError

pytestmark = pytest.mark.skipif("cython" not in ulstore.available_backends(), reason="compiled kernels not built")
#: the compiled build ``auto`` selects on this CPU: the one users run
FUZZED = "cython-v3" if "cython-v3" in ulstore.available_backends() else "cython"

N_PLAIN = 3_000  # per blob kind
N_RESEALED = 3_000  # per blob kind
NUMPY_EVERY = 25  # every n-th resealed mutation also goes through the numpy backend


def _steps(ref, rng, frac, max_step):
    u = ref.view(uint(ref.dtype)).copy()
    moved = rng.random(u.size) < frac
    steps = rng.integers(-max_step, max_step + 1, size=u.size)
    u[moved] = (u[moved].astype(np.int64) + steps[moved]).astype(u.dtype)
    return u.view(ref.dtype)


def _normal(dt, n, rng, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32).astype(dt)


def _make_kinds():
    """kind -> (target, reference or None, econd); encoded later."""
    rng = np.random.default_rng(20240601)
    bf16, f16, f32, f64 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    r_sparse = _normal(bf16, 4096, rng)
    r_dense = _normal(f32, 700, rng)
    r_same = _normal(bf16, 500, rng)
    r_noecond = _normal(f16, 1200, rng)
    r_fp8 = _normal(fp8, 600, rng, scale=3.0)
    kinds = {
        "sparse-delta-bf16": (_steps(r_sparse, rng, 0.05, 2), r_sparse, True),
        "sparse-mode-bf16": (_steps(r_sparse, rng, 0.03, 3), r_sparse, True),  # encode(sparse=True)
        "sparse-mode-f64": (_steps(r_dense.astype(f64), rng, 0.1, 9), r_dense.astype(f64), True),
        "dense-delta-f32": (_steps(r_dense, rng, 1.0, 5000), r_dense, True),
        "intra-f16": ((np.round(rng.standard_normal(900) * 8) / 8).astype(f16), None, True),
        "intra-f64-long-tails": (_normal(f64, 160, rng).astype(f64) * np.pi, None, True),
        "delta-noecond-f16": (_steps(r_noecond, rng, 0.7, 20), r_noecond, False),
        "delta-fp8": (_steps(r_fp8, rng, 0.3, 2), r_fp8, True),
        "raw-fp8": (
            np.frombuffer(rng.bytes(300), dtype=fp8).copy(),
            np.frombuffer(rng.bytes(300), dtype=fp8).copy(),
            True,
        ),
        "same-bf16": (r_same.copy(), r_same, True),
        "same-intra-f32": (np.zeros(64, f32), None, True),
        "intra-zeros-f32": (np.where(rng.random(800) < 0.85, 0, _normal(f32, 800, rng)).astype(f32), None, True),
        # 32-lane sections (WIDE): the AVX2 decoder for 16-bit words, the scalar one otherwise
        "wide-delta-bf16": (_steps(r_sparse[:2000], rng, 0.8, 40), r_sparse[:2000], True),
        "wide-intra-bf16": (_normal(bf16, 1500, rng), None, True),
        "wide-delta-f32": (_steps(r_dense, rng, 0.9, 300), r_dense, True),
    }
    return kinds


KINDS = _make_kinds()
WIDE = {k for k in KINDS if k.startswith("wide-")}  # encoded with _one_stream.WIDE_BITS = 0
EXPECTED_MODE = {
    "raw-fp8": "raw",
    "same-bf16": "same",
    "same-intra-f32": "same",
    "sparse-mode-bf16": "sparse",
    "sparse-mode-f64": "sparse",
    "intra-f16": "intra",
    "intra-f64-long-tails": "intra",
    "wide-intra-bf16": "intra",
}

# golden blobs of versions 1 and 2: kind -> fixture case
GOLDEN_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "ulpack_v1"
V1_KINDS = {
    "v1-intra-f16": "float16_intra",
    "v1-delta-bf16": "bfloat16_delta",
    "v1-delta-f64": "float64_delta",
    "v1-sparse-bf16": "bfloat16_delta_sparse",
    "v1-sparse-mode-f16": "float16_delta_sparse_mode",
    "v1-delta-32k-fp8": "float8_e4m3fn_delta_32k",
}
ALL_KINDS = list(KINDS) + list(V1_KINDS)
#: The kinds whose every payload bit is flipped (the exhaustive scan, and the resealed mutations that use it):
#: the 32k-element version-1 blob (8 s of CPU) in the slow lane, the other version-1 kinds in both lanes.
SCANNED_KINDS = [pytest.param(k, marks=pytest.mark.slow) if k == "v1-delta-32k-fp8" else k for k in ALL_KINDS]


def _golden_v1(case_name: str):
    """(blob, target, reference or None) of a version-1 golden case."""
    cases = {c["name"]: c for c in json.loads((GOLDEN_V1 / "manifest.json").read_text())["cases"]}
    case = cases[case_name]
    dt = np.dtype(
        {
            "bfloat16": ml_dtypes.bfloat16,
            "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
            "float8_e5m2": ml_dtypes.float8_e5m2,
        }.get(case["dtype"], case["dtype"])
    )

    def load(role):
        raw = (GOLDEN_V1 / case[role]).read_bytes()
        return np.frombuffer(raw, dtype=uint(dt)).view(dt).reshape(case["shape"]).copy()

    return (GOLDEN_V1 / case["blob"]).read_bytes(), load("target"), load("reference") if "reference" in case else None


def _encode(t, r, econd, sparse, wide, backend=None):
    from ulstore.codec import _one_stream

    saved = _one_stream.WIDE_BITS
    if wide:
        _one_stream.WIDE_BITS = 0
    try:
        return ulstore.encode(t, r, econd=econd, sparse=sparse, backend=backend)
    finally:
        _one_stream.WIDE_BITS = saved


@dataclass
class Layout:
    header_end: int  # first payload byte
    payload_end: int  # first CRC byte
    tail_start: int = -1
    tail_bits: int = 0


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def parse_layout(blob: bytes) -> Layout:
    """Independent parse of a valid format-v1 blob (docs/format.md): magic, version, dtype,
    mode, flags, ndim, dims, 2 four-byte hashes; for rANS blobs the payload sections."""
    assert blob[:4] == b"ULPK" and blob[4] == 1
    mode, ndim = blob[6], blob[8]
    pos = 9
    for _ in range(ndim):
        _, pos = _varint(blob, pos)
    pos += 8
    lay = Layout(header_end=pos, payload_end=len(blob) - 4)
    if mode != 2:  # raw or same: no tail
        return lay
    pos += 1  # scale bits
    table_size, pos = _varint(blob, pos)
    pos += table_size
    pos += 16  # lane states
    n_words, pos = _varint(blob, pos)
    pos += 2 * n_words
    tail_bits, pos = _varint(blob, pos)
    lay.tail_start, lay.tail_bits = pos, tail_bits
    assert pos + (tail_bits + 7) // 8 == lay.payload_end, "layout parse out of sync with the format"
    return lay


@pytest.fixture(scope="module")
def blobs():
    out = {}
    for kind, (t, r, econd) in KINDS.items():
        sparse = EXPECTED_MODE.get(kind) == "sparse"
        blob = _encode(t, r, econd, sparse, kind in WIDE)
        assert _encode(t, r, econd, sparse, kind in WIDE, backend="numpy") == blob
        info = ulstore.inspect_blob(blob)
        assert info["mode"] == EXPECTED_MODE.get(kind, "rans"), (kind, info)
        assert info["version"] == (4 if sparse else 3), (kind, info)
        assert len(blob) < 8000, (kind, len(blob))
        if kind in WIDE:
            assert blob != _encode(t, r, econd, sparse, False), f"{kind}: 32 lanes were not forced"
        out[kind] = (blob, t, r)
    for kind, case in V1_KINDS.items():
        blob, t, r = _golden_v1(case)
        assert ulstore.inspect_blob(blob)["version"] in (1, 2)
        out[kind] = (blob, t, r)
    return out


def header_end(blob: bytes) -> int:
    """Offset of the first payload byte (after magic, version, dtype, mode, flags, shape, hashes)."""
    from ulstore.codec import _format

    return _format.open_blob(blob)[1].pos


_IGNORED: dict[str, dict[int, int]] = {}


def ignored_bits(kind: str, blobs) -> dict[int, int]:
    """Flip every payload bit (CRC recomputed): {byte offset: mask of bits whose flip is accepted}.

    Every other flip must raise from the IntegrityError tree; accepted flips must
    decode to the exact original.  Cached: the scan is exhaustive.
    """
    if kind not in _IGNORED:
        blob, target, ref = blobs[kind]
        start, end = header_end(blob), len(blob) - 4
        found: dict[int, int] = {}
        body = bytearray(blob[:-4])
        for pos in range(start, end):
            for bit in range(8):
                body[pos] ^= 1 << bit
                bad = reseal(body)
                body[pos] ^= 1 << bit
                what = f"{kind}: resealed flip of bit {bit} at byte {pos}"
                res = _decode(bad, ref, FUZZED)
                if _check(res, target, what) == "returned":
                    found[pos] = found.get(pos, 0) | 1 << bit
                elif "CRC" in str(res):
                    pytest.fail(f"{what}: the reseal did not produce a valid CRC")
                if (pos * 8 + bit) % 97 == 0:  # a sample through the reference implementation
                    res_np = _decode(bad, ref, "numpy")
                    same = (
                        (type(res_np) is type(res))
                        if isinstance(res, BaseException)
                        else not isinstance(res_np, BaseException)
                    )
                    assert same, (what, res, res_np)
        _IGNORED[kind] = found
    return _IGNORED[kind]


_EDGE_RUNS = {(0xFF << k) & 0xFF for k in range(1, 8)} | {(1 << k) - 1 for k in range(1, 8)}


@pytest.mark.parametrize("kind", SCANNED_KINDS)
def test_every_payload_bit_flip_resealed(kind, blobs):
    """Each payload bit flipped (CRC recomputed) is detected, unless it is a padding bit."""
    ignored = ignored_bits(kind, blobs)
    for pos, mask in ignored.items():
        assert mask in _EDGE_RUNS, f"{kind}: bits {mask:#010b} of byte {pos} are ignored but are not padding"
    assert len(ignored) <= 4, f"{kind}: ignored bits in {len(ignored)} bytes: {ignored}"


def _mutate(rng, data: bytes, donors: list[bytes]) -> bytes:
    """One random structural mutation of ``data``."""
    b = bytearray(data)
    n = len(b)
    op = int(rng.integers(0, 9))
    if op == 0 and n:  # flip 1-4 bits
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(0, n))] ^= 1 << int(rng.integers(0, 8))
    elif op == 1 and n:  # overwrite 1-4 bytes
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(0, n))] = int(rng.integers(0, 256))
    elif op == 2:  # truncate
        del b[int(rng.integers(0, n + 1)) if n else 0 :]
        if len(b) == n and n:
            del b[-1]
    elif op == 3:  # extend with random bytes
        b += rng.bytes(int(rng.integers(1, 33)))
    elif op == 4 and n:  # splice: replace a range with random bytes of another length
        i = int(rng.integers(0, n))
        j = min(n, i + int(rng.integers(0, 24)))
        b[i:j] = rng.bytes(int(rng.integers(0, 24)))
    elif op == 5:  # insert random bytes
        i = int(rng.integers(0, n + 1))
        b[i:i] = rng.bytes(int(rng.integers(1, 9)))
    elif op == 6 and n:  # delete a range
        i = int(rng.integers(0, n))
        del b[i : i + int(rng.integers(1, 9))]
    elif op == 7:  # splice in a piece of another real blob
        d = donors[int(rng.integers(0, len(donors)))]
        i = int(rng.integers(0, n + 1))
        j = min(n, i + int(rng.integers(0, 40)))
        k = int(rng.integers(0, len(d)))
        b[i:j] = d[k : k + int(rng.integers(1, 40))]
    elif op == 8:  # head of this blob, tail of another one
        d = donors[int(rng.integers(0, len(donors)))]
        b = b[: int(rng.integers(0, n + 1))] + d[int(rng.integers(0, len(d))) :]
    else:  # empty input and ops that need bytes: overwrite with noise
        b = bytearray(rng.bytes(int(rng.integers(0, 64))))
    return bytes(b)


def _check(decoded_or_exc, target, what: str) -> str:
    """Classify one outcome: 'raised', or 'returned' (exact original only); fail otherwise."""
    if isinstance(decoded_or_exc, BaseException):
        exc = decoded_or_exc
        assert isinstance(exc, IntegrityError), f"{what}: {type(exc).__name__}: {exc}"
        return "raised"
    out = decoded_or_exc
    assert isinstance(out, np.ndarray), f"{what}: a corrupted blob decoded to a {type(out).__name__}"
    assert_bits_equal(out, target, f"{what}: a corrupted blob decoded to WRONG values")
    return "returned"


def _decode(blob, ref, backend):
    try:
        return ulstore.decode(blob, ref, backend=backend)
    except Exception as exc:  # noqa: BLE001 - classified by _check
        return exc


def test_fuzz_budget():
    assert N_PLAIN * len(ALL_KINDS) >= 10_000
    assert N_RESEALED * len(ALL_KINDS) >= 10_000


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_fuzz_plain_mutations(kind, blobs):
    blob, target, ref = blobs[kind]
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    donors = [b for b, *_ in blobs.values()]
    stats = {"raised": 0, "returned": 0, "no-op": 0}
    for i in range(N_PLAIN):
        bad = _mutate(rng, blob, donors)
        res = _decode(bad, ref, FUZZED)
        outcome = _check(res, target, f"{kind} plain #{i}")
        if bad == blob:
            stats["no-op"] += 1
        elif outcome == "returned":
            raise AssertionError(f"{kind} plain #{i}: a changed blob ({len(bad)} bytes) was accepted")
        stats[outcome] += 1
    assert stats["raised"] + stats["no-op"] == N_PLAIN, stats
    assert stats["no-op"] <= N_PLAIN * 0.05, stats


@pytest.mark.parametrize("kind", SCANNED_KINDS)
def test_fuzz_resealed_payload_mutations(kind, blobs):
    """Payload mutations with a recomputed CRC reach the table, stream and checksum checks."""
    blob, target, ref = blobs[kind]
    rng = np.random.default_rng(zlib.crc32(kind.encode()) ^ 0x5EA1)
    start = header_end(blob)
    header, payload = blob[:start], blob[start:-4]
    donors = [b[header_end(b) : -4] for b, *_ in blobs.values() if len(b) - 4 > header_end(b)]
    try:
        ignored = ignored_bits(kind, blobs)
    except AssertionError:
        ignored = {}  # the exhaustive scan fails on its own (test_every_payload_bit_flip_resealed)
    stats = {"raised": 0, "returned": 0, "padding-only": 0, "no-op": 0}
    crc_errors = 0
    for i in range(N_RESEALED):
        new_payload = _mutate(rng, payload, donors)
        bad = reseal(header + new_payload)
        res = _decode(bad, ref, FUZZED)
        what = f"{kind} resealed #{i}"
        outcome = _check(res, target, what)
        if isinstance(res, BaseException) and "CRC" in str(res):
            crc_errors += 1
        if bad == blob:
            stats["no-op"] += 1
        elif outcome == "returned":
            # the only bits a decoder may ignore: padding, as found by the exhaustive bit scan
            assert len(bad) == len(blob), f"{what}: a blob of another length was accepted"
            # (the CRC bytes differ too: they were recomputed)
            diff = {i: a ^ b for i, (a, b) in enumerate(zip(bad[:-4], blob[:-4])) if a != b}
            assert all(d & ~ignored.get(i, 0) == 0 for i, d in diff.items()), (
                f"{what}: a changed payload decoded without error (changed bytes {sorted(diff)})"
            )
            stats["padding-only"] += 1
        stats[outcome] += 1
        if i % NUMPY_EVERY == 0:
            # the reference implementation agrees on rejecting (or accepting) it
            res_np = _decode(bad, ref, "numpy")
            assert _check(res_np, target, what + " (numpy)") == outcome, (what, res, res_np)
    assert crc_errors == 0, "the reseal did not produce valid CRCs: the deeper checks were not exercised"
    assert stats["raised"] + stats["no-op"] + stats["padding-only"] == N_RESEALED, stats
    assert stats["raised"] >= N_RESEALED * 0.8, stats


# -- crafted, CRC-valid blobs --------------------------------------------------------------


def _split_rans(blob: bytes):
    """(header, scale byte, table size + table bytes, rest of payload) of a v1 rANS blob."""
    lay = parse_layout(blob)
    start = lay.header_end + 1
    table_size, pos = _varint(blob, start)
    pos += table_size
    return blob[: lay.header_end], blob[lay.header_end : start], blob[start:pos], blob[pos : lay.payload_end]


def _crafted():
    out = {}
    for label, case in {"intra": "float32_intra", "delta": "float32_delta"}.items():
        blob, _, rr = _golden_v1(case)  # version 1: today's encoder writes version 3
        hdr, scale, tables, rest = _split_rans(blob)
        # an empty table: the reference's contexts have no rows
        out[f"{label}-zero-contexts"] = (reseal(hdr + scale + b"\x00" + rest), rr)
        # one row holding only token 0 (bits 1, gamma(1)): the whole scale to one symbol
        out[f"{label}-one-symbol"] = (reseal(hdr + scale + b"\x01\xc0" + rest), rr)
        for s in (0, 16, 255):
            out[f"{label}-scale-{s}"] = (reseal(hdr + bytes([s]) + tables + rest), rr)
        out[f"{label}-states-zero"] = (reseal(hdr + scale + tables + bytes(16) + rest[16:]), rr)
        out[f"{label}-states-max"] = (reseal(hdr + scale + tables + b"\xff\xff\xff\x7f" * 4 + rest[16:]), rr)
        out[f"{label}-no-payload"] = (reseal(hdr), rr)
        out[f"{label}-scale-only"] = (reseal(hdr + scale), rr)
    return out


CRAFTED_LABELS = [
    f"{kind}-{what}"
    for kind in ("intra", "delta")
    for what in (
        "zero-contexts",
        "one-symbol",
        "scale-0",
        "scale-16",
        "scale-255",
        "states-zero",
        "states-max",
        "no-payload",
        "scale-only",
    )
]


@pytest.fixture(scope="module")
def crafted():
    out = _crafted()
    assert sorted(out) == sorted(CRAFTED_LABELS)
    return out


@pytest.mark.parametrize("label", CRAFTED_LABELS)
def test_crafted_blobs_rejected_identically_by_both_backends(label, crafted):
    """CRC-valid but inconsistent blobs: both backends raise CorruptBlobError and agree on why.

    ``*-zero-contexts``: the table is empty although the reference has contexts.  The
    table rows are parsed per context of the reference, so this must be reported as a
    truncated table, never read out of bounds.
    """
    blob, ref = crafted[label]
    errors = {}
    for be in ulstore.available_backends():
        with pytest.raises(CorruptBlobError) as info:
            ulstore.decode(blob, ref, backend=be)
        errors[be] = str(info.value)
    assert len(set(errors.values())) == 1, errors


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float16", "float32", "float64"])
def test_target_checksum_catches_paired_top_bit_flips(name):
    """Raw-mode blob, CRC recomputed: flipping bit 63 of two different 8-byte words of the
    stored values must fail the target checksum, for every pair of words."""
    import itertools

    dt = np.dtype({"float8_e4m3fn": ml_dtypes.float8_e4m3fn}.get(name, name))
    rng = np.random.default_rng(5)
    t = np.frombuffer(rng.bytes(64 * 8), dtype=dt).copy()  # incompressible: stored raw
    blob = ulstore.encode(t)
    assert ulstore.inspect_blob(blob)["mode"] == "raw"
    start = len(blob) - 4 - t.nbytes
    assert blob[start:-4] == t.tobytes(), "raw values are not stored verbatim before the CRC"
    body = bytearray(blob[:-4])
    accepted = []
    for a, b in itertools.combinations(range(64), 2):
        i, j = start + 8 * a + 7, start + 8 * b + 7  # the top byte of words a and b
        body[i] ^= 0x80
        body[j] ^= 0x80
        try:
            ulstore.decode(reseal(body))
        except IntegrityError:
            pass
        else:
            accepted.append((a, b))
        body[i] ^= 0x80
        body[j] ^= 0x80
    assert not accepted, f"{len(accepted)} of 2016 corrupted blobs decoded to wrong values, e.g. {accepted[:5]}"
