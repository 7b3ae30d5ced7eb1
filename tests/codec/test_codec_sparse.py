"""The SPARSE mode (format versions 4 and 2) and the O(changes) path: ``decode_changes`` + ``content_sum``.

Every check compares bits.  The point of the mode is that a caller who keeps
its reference's ``content_sum`` applies a delta touching only the changed
elements, so the tests hold ``decode_changes`` to exactly what ``decode``
returns, and its returned sum to ``content_sum`` of the true target.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import flat_bits, words_view
from tests.helpers.blobs import reseal
from ulstore import CorruptBlobError, IntegrityError, ReferenceMismatchError, content_sum, decode_changes
from ulstore.codec._dtypes import FORMATS
from ulstore.codec._sparse import SPARSE_ALWAYS_UP_TO, SPARSE_MAX_FRACTION

DTYPES = {f.name: f.dtype for f in FORMATS}
BACKENDS = ulstore.available_backends()


def changed_at(ref: np.ndarray, positions, rng) -> np.ndarray:
    """``ref`` with the elements at ``positions`` moved by a non-zero bit step (awkward values included)."""
    u = flat_bits(ref).copy()
    steps = rng.integers(1, 4, size=len(positions)) * rng.choice([-1, 1], size=len(positions))
    u[positions] = (u[positions].astype(np.int64) + steps).astype(u.dtype)
    return u.view(ref.dtype).reshape(ref.shape)


def reference(dtype, n, rng) -> np.ndarray:
    """Normal values with signed zeros, infinities and NaN mixed in (e4m3fn casts inf to NaN)."""
    r = (rng.standard_normal(n) * 2).astype(np.float32)
    r[1::7][:5] = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)[: len(r[1::7][:5])]
    return r.astype(dtype)


def check(blob, ref, target, backend=None):
    """decode and decode_changes (with and without the sum) give the target bits and its sum."""
    out = ulstore.decode(blob, ref, backend=backend)
    assert np.array_equal(flat_bits(out), flat_bits(target))
    want_sum = content_sum(target)
    for ref_sum in (None, content_sum(ref)):
        ch = decode_changes(blob, ref, reference_sum=ref_sum, backend=backend)
        assert ch.positions.dtype == np.int64 and np.all(np.diff(ch.positions) > 0)
        assert ch.values.dtype == target.dtype
        assert np.array_equal(ch.positions, np.flatnonzero(flat_bits(ref) != flat_bits(target)))
        applied = flat_bits(ref).copy()
        applied[ch.positions] = flat_bits(ch.values)
        assert np.array_equal(applied, flat_bits(target))
        assert ch.content_sum == want_sum


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 15, 17, 64, 1001, 4099])
def test_sparse_roundtrip_odd_sizes_and_edges(name, n):
    """First, last (padded last hash word), adjacent and lone changes, every dtype and odd size."""
    dt = DTYPES[name]
    rng = np.random.default_rng(n)
    ref = reference(dt, n, rng)
    budget = n // SPARSE_MAX_FRACTION
    picks = {0, n - 1, n // 2, n // 2 + 1} if budget >= 4 else {n - 1}
    positions = np.array(sorted(picks))[: max(1, budget)]
    target = changed_at(ref, positions, rng)
    blob = ulstore.encode(target, ref, sparse=True)
    mode = ulstore.inspect_blob(blob)["mode"]
    assert mode in ("sparse", "raw"), mode  # tiny tensors may be cheaper raw (and are SPARSE however dense)
    if n >= 64:
        assert mode == "sparse"
    check(blob, ref, target)


@pytest.mark.parametrize("name", list(DTYPES))
def test_density_threshold_and_size(name):
    """SPARSE up to 1/8 of the elements changed, dense RANS above; sizes stay bounded."""
    dt = DTYPES[name]
    n = 8 * 1000
    rng = np.random.default_rng(3)
    ref = reference(dt, n, rng)
    for m, want in ((1, "sparse"), (n // SPARSE_MAX_FRACTION, "sparse"), (n // SPARSE_MAX_FRACTION + 1, "rans")):
        target = changed_at(ref, np.sort(rng.choice(n, m, replace=False)), rng)
        blob = ulstore.encode(target, ref, sparse=True)
        assert ulstore.inspect_blob(blob)["mode"] == want, (m, want)
        assert len(blob) <= target.nbytes + ulstore.codec.HEADER_BOUND
        check(blob, ref, target)
    # sparse=False never writes SPARSE; no change at all is SAME either way
    assert ulstore.inspect_blob(ulstore.encode(target, ref))["mode"] != "sparse"
    for sparse in (False, True):
        assert ulstore.inspect_blob(ulstore.encode(ref.copy(), ref, sparse=sparse))["mode"] == "same"
    # intra blobs ignore sparse=True
    assert ulstore.encode(target, sparse=True) == ulstore.encode(target)


@pytest.mark.parametrize("name", ["bfloat16", "float32"])
def test_small_tensors_are_sparse_however_dense_the_change(name):
    """Up to SPARSE_ALWAYS_UP_TO elements a delta is SPARSE even with every element changed; above, RANS."""
    dt = DTYPES[name]
    rng = np.random.default_rng(5)
    for n, want in ((SPARSE_ALWAYS_UP_TO, "sparse"), (SPARSE_ALWAYS_UP_TO + 1, "rans")):
        ref = reference(dt, n, rng)
        for m in (n // 2, n):
            target = changed_at(ref, np.sort(rng.choice(n, m, replace=False)), rng)
            blob = ulstore.encode(target, ref, sparse=True)
            assert ulstore.inspect_blob(blob)["mode"] == want, (n, m)
            assert ulstore.encode(target, ref, sparse=True, backend="numpy") == blob
            check(blob, ref, target)


@pytest.mark.parametrize("econd", [True, False])
def test_backend_parity_and_versions(econd):
    rng = np.random.default_rng(11)
    ref = reference(ml_dtypes.bfloat16, 50_000, rng)
    target = changed_at(ref, np.sort(rng.choice(ref.size, 700, replace=False)), rng)
    blobs = {b: ulstore.encode(target, ref, econd=econd, sparse=True, backend=b) for b in BACKENDS}
    assert len(set(blobs.values())) == 1, "backends write different SPARSE bytes"
    blob = blobs["numpy"]
    assert blob[4] == 4 and ulstore.inspect_blob(blob)["version"] == 4  # SPARSE: Elias-Fano positions
    assert ulstore.encode(target, ref, econd=econd)[4] == 3  # other modes write version 3
    for b in BACKENDS:  # each decodes every other's blob (they are one blob)
        check(blob, ref, target, backend=b)
    # multi-dimensional: positions are C-order flat indices
    t2, r2 = target.reshape(250, 200), ref.reshape(250, 200)
    b2 = ulstore.encode(t2, r2, econd=econd, sparse=True)
    ch = decode_changes(b2, r2)
    assert np.array_equal(ch.positions, np.flatnonzero(flat_bits(r2) != flat_bits(t2)))
    assert ulstore.decode(b2, r2).shape == (250, 200)


def test_chained_deltas_keep_sums():
    """A replica's loop: apply deltas by position, keep only the sum; it never drifts."""
    rng = np.random.default_rng(5)
    state = reference(ml_dtypes.bfloat16, 30_000, rng)
    truth = state.copy()
    held_sum = content_sum(state)
    for step in range(12):
        nxt = changed_at(truth, np.sort(rng.choice(truth.size, int(rng.integers(1, 900)), replace=False)), rng)
        blob = ulstore.encode(nxt, truth, sparse=True)
        ch = decode_changes(blob, state, reference_sum=held_sum)
        words_view(state)[ch.positions] = flat_bits(ch.values)
        held_sum = ch.content_sum
        truth = nxt
        assert np.array_equal(flat_bits(state), flat_bits(truth)), step
        assert held_sum == content_sum(state), step


def test_wrong_reference_or_sum_raises():
    rng = np.random.default_rng(8)
    ref = reference(np.float16, 5000, rng)
    target = changed_at(ref, np.sort(rng.choice(ref.size, 100, replace=False)), rng)
    blob = ulstore.encode(target, ref, sparse=True)
    other = changed_at(ref, [17], rng)
    with pytest.raises(ReferenceMismatchError):
        ulstore.decode(blob, other)
    with pytest.raises(ReferenceMismatchError):
        decode_changes(blob, other)  # sum computed from the wrong reference
    with pytest.raises(ReferenceMismatchError):
        decode_changes(blob, ref, reference_sum=content_sum(ref) ^ 1)
    with pytest.raises(ReferenceMismatchError):
        decode_changes(blob, ref.astype(np.float32))
    with pytest.raises(ReferenceMismatchError, match="intra"):
        decode_changes(ulstore.encode(target), ref)
    with pytest.raises(ReferenceMismatchError, match="intra"):
        decode_changes(ulstore.encode(target), None)


def test_changed_old_value_with_right_sum_is_caught():
    """A reference wrong *at a changed element* fails the target check even with a trusted sum."""
    rng = np.random.default_rng(9)
    ref = reference(ml_dtypes.bfloat16, 4000, rng)
    pos = np.sort(rng.choice(ref.size, 50, replace=False))
    target = changed_at(ref, pos, rng)
    blob = ulstore.encode(target, ref, sparse=True)
    tampered = ref.copy()
    words_view(tampered)[pos[3]] ^= 1
    with pytest.raises(CorruptBlobError, match="target checksum"):
        decode_changes(blob, tampered, reference_sum=content_sum(ref))


def test_every_payload_byte_corruption_resealed():
    """Each payload byte changed (CRC recomputed): an IntegrityError or the exact target, on both paths."""
    from ulstore.codec._format import open_blob

    rng = np.random.default_rng(12)
    ref = reference(ml_dtypes.bfloat16, 3000, rng)
    target = changed_at(ref, np.sort(rng.choice(ref.size, 120, replace=False)), rng)
    blob = ulstore.encode(target, ref, sparse=True)
    start, ref_sum = open_blob(blob)[1].pos, content_sum(ref)
    accepted = 0
    for i in range(start, len(blob) - 4):
        for flip in (0x01, 0x80, 0xFF):
            body = bytearray(blob[:-4])
            body[i] ^= flip
            bad = reseal(body)
            for decode in (lambda: ulstore.decode(bad, ref), lambda: decode_changes(bad, ref, reference_sum=ref_sum)):
                try:
                    out = decode()
                except IntegrityError:
                    continue
                got = flat_bits(out) if isinstance(out, np.ndarray) else None
                if got is None:
                    got = flat_bits(ref).copy()
                    got[out.positions] = flat_bits(out.values)
                assert np.array_equal(got, flat_bits(target)), f"byte {i} ^ {flip:#x} decoded to WRONG values"
                accepted += 1
    assert accepted <= 8 * 3  # only padding bits of the two raw tails can be ignored


def test_backends_agree_on_corrupt_sparse_blobs():
    """Every backend rejects the same resealed corruptions with the same message (the kernels' statuses agree)."""
    from ulstore.codec._format import open_blob

    rng = np.random.default_rng(13)
    ref = reference(np.float16, 2000, rng)
    target = changed_at(ref, np.sort(rng.choice(ref.size, 90, replace=False)), rng)
    blob = ulstore.encode(target, ref, sparse=True)
    start = open_blob(blob)[1].pos
    messages = set()
    for i in range(start, len(blob) - 4):
        body = bytearray(blob[:-4])
        body[i] ^= 0x10
        bad = reseal(body)
        outcomes = []
        for b in BACKENDS:
            try:
                outcomes.append(flat_bits(ulstore.decode(bad, ref, backend=b)).tobytes())
            except IntegrityError as e:
                outcomes.append(str(e))
        assert len(set(outcomes)) == 1, (i, outcomes)
        messages.add(outcomes[0] if isinstance(outcomes[0], str) else "decoded")
    assert len(messages) >= 4, messages  # table, stream, position and checksum failures all occur


def test_version_mode_pairing_is_strict():
    rng = np.random.default_rng(2)
    ref = reference(np.float32, 2000, rng)
    target = changed_at(ref, [5, 900, 1999], rng)
    sparse, dense = ulstore.encode(target, ref, sparse=True), ulstore.encode(target, ref)
    assert sparse[4] == 4 and dense[4] == 3
    as_v1 = reseal(sparse[:4] + b"\x01" + sparse[5:-4])
    with pytest.raises(CorruptBlobError, match="unknown mode"):
        ulstore.decode(as_v1, ref)
    # the other versions' headers or payloads have other layouts: misread, they are refused somewhere
    for bad in (
        reseal(dense[:4] + b"\x02" + dense[5:-4]),
        reseal(dense[:4] + b"\x04" + dense[5:-4]),
        reseal(sparse[:4] + b"\x03" + sparse[5:-4]),
        reseal(sparse[:4] + b"\x02" + sparse[5:-4]),  # Elias-Fano positions read as a gap section
    ):
        with pytest.raises(IntegrityError):
            ulstore.decode(bad, ref)
    intra_flagged = bytearray(sparse[:-4])
    intra_flagged[7] &= ~1  # clear the delta flag
    with pytest.raises(CorruptBlobError, match="not a delta"):
        ulstore.decode(reseal(intra_flagged))


def test_numcodecs_sparse_config():
    import numcodecs

    codec = numcodecs.get_codec({"id": "ulpack", "econd": True, "sparse": True})
    assert codec.get_config() == {"id": "ulpack", "econd": True, "sparse": True}
    assert repr(codec) == "ULPack(econd=True, sparse=True)"
    assert numcodecs.get_codec({"id": "ulpack"}).get_config() == {"id": "ulpack", "econd": True}
    rng = np.random.default_rng(4)
    ref = reference(np.float16, 4000, rng)
    target = changed_at(ref, np.arange(0, 4000, 97), rng)
    blob = codec.encode(target, reference=ref)
    assert ulstore.inspect_blob(blob)["mode"] == "sparse"
    assert np.array_equal(flat_bits(codec.decode(blob, reference=ref)), flat_bits(target))


@pytest.mark.parametrize("width", [8, 16, 32, 64])
def test_sparse_kernels_agree_across_backends(width):
    """gap_gather, sum_update and scatter: every backend gives the numpy reference's result."""
    from ulstore.codec._backend import kernels

    rng = np.random.default_rng(width)
    word = np.dtype(f"<u{width // 8}")
    for n in (1, 5, 8, 9, 1000, 4097):
        r = rng.integers(0, 1 << width, n, dtype=np.uint64 if width == 64 else np.int64).astype(word)
        m = int(rng.integers(1, n + 1))
        pos = np.sort(rng.choice(n, m, replace=False)).astype(np.int64)
        gaps = (np.diff(pos, prepend=-1) - 1).astype(np.uint32)
        values = rng.integers(0, 1 << min(width, 62), m).astype(word)
        expect_sum = (content_sum_words(r, pos, values) - kernels("numpy").hash_sum64(r)) % (1 << 64)
        for b in BACKENDS:
            k = kernels(b)
            got_pos, got_r = np.empty(m, np.int64), np.empty(m, word)
            assert k.gap_gather(gaps, r, got_pos, got_r) == 0
            assert np.array_equal(got_pos, pos) and np.array_equal(got_r, r[pos]), b
            short = np.empty(m, np.int64), np.empty(m, word)
            assert k.gap_gather(gaps, r[: pos[-1]], *short) == -6, b  # a position past the end
            assert k.sum_update(r, pos, values) == expect_sum, (b, n)
            dst = r.copy()
            assert k.scatter(dst, pos, values) == 0
            want = r.copy()
            want[pos] = values
            assert np.array_equal(dst, want), b
            # bad arguments: the same refusal from every backend, nothing written
            assert k.scatter(dst, pos[::-1].copy(), values) == (-1 if m > 1 else 0), b
            assert k.scatter(r.copy(), pos, values[:-1].copy()) == -1, b
            with pytest.raises(ValueError):
                k.sum_update(r, pos[::-1].copy() if m > 1 else pos + n, values)
            z = np.zeros(n, word)
            z[pos] = 1
            sym = np.zeros(n, np.uint16)
            outs = (
                np.empty(m + 1, np.uint32),
                np.empty(m + 1, np.uint16),
                np.empty(m + 1, word),
                np.empty(m + 1, np.uint16),
            )
            assert k.sparse_split(z, sym, *outs) == -1, b  # outputs not sized to the non-zero count
            none = np.empty(0, np.uint8)
            args = (
                r,
                0,
                0,
                256,
                none,
                np.full(4, 1 << 15, np.uint32),
                none,
                none,
                0,
                124,
                none,
                np.full(4, 1 << 15, np.uint32),
                none,
                none,
                0,
                124,
            )
            assert k.sparse_decode(*args, np.empty(0, np.int64), np.empty(0, word), np.zeros(1, np.uint64)) == -9, b


def content_sum_words(r, pos, values) -> int:
    """hash_sum64 of ``r`` with ``r[pos] = values``, computed whole (the slow way)."""
    from ulstore.codec._backend import kernels

    t = r.copy()
    t[pos] = values
    return kernels("numpy").hash_sum64(t)


def test_changes_apply_to_checks_its_target():
    rng = np.random.default_rng(1)
    ref = reference(ml_dtypes.bfloat16, 1000, rng)
    target = changed_at(ref, [3, 999], rng)
    ch = decode_changes(ulstore.encode(target, ref, sparse=True), ref)
    out = ref.copy()
    ch.apply_to(out)
    assert np.array_equal(flat_bits(out), flat_bits(target))
    from ulstore import InvalidInputError

    for bad in (ref.astype(np.float32), ref[:500].copy(), ref[::2], np.frombuffer(ref.tobytes(), ref.dtype), [1, 2]):
        with pytest.raises(InvalidInputError):
            ch.apply_to(bad)
    # hand-made Changes are checked before anything is written: in range, ascending, one value each
    from ulstore import Changes

    values = np.ones(3, np.float32)
    for positions, vals in (
        ([0, 2**40, 9], values),
        ([0, -5, 9], values),
        ([4, 2, 9], values),
        ([1, 1, 2], values),
        (list(range(8)), values[:1]),
        ([0, 1], values),
    ):
        for b in BACKENDS:
            out = np.zeros(10, np.float32)
            with pytest.raises(InvalidInputError, match="ascend"):
                Changes(np.array(positions, dtype=np.int64), vals, 0).apply_to(out, backend=b)
            assert not out.any(), (positions, b)


def test_lane_states_reach_the_kernels_aligned():
    """The kernels read lane states as ``uint32_t``: a view of the blob at an odd offset would be undefined
    behaviour (UBSan flagged it); ``read_fields`` hands them over aligned."""
    from ulstore.codec._dtypes import format_of
    from ulstore.codec._elias_fano import sizes
    from ulstore.codec._format import open_blob
    from ulstore.codec._section import read_fields

    rng = np.random.default_rng(13)
    ref = reference(np.float32, 3000, rng)
    misaligned = 0
    for m in range(1, 40):
        target = changed_at(ref, np.sort(rng.choice(ref.size, m, replace=False)), rng)
        _, rd = open_blob(bytearray(ulstore.encode(target, ref, sparse=True)))  # a buffer at an aligned address
        assert rd.varint("m", limit=ref.size) == m
        rd.take(sum(sizes(ref.size, m)), "positions")
        misaligned += (rd.pos + 1 + 1) % 4 != 0  # scale byte, one-byte table size: where the states would start
        states = read_fields(rd, m, format_of(np.dtype(np.float32))).states
        assert states.flags.aligned and states.ctypes.data % 4 == 0
    assert misaligned  # some blobs put their states at an unaligned offset


def test_inspect_blob_parts_split_a_sparse_blob():
    """``inspect_blob``'s parts sum to the blob, and a SPARSE blob's positions follow Elias-Fano's sizes."""
    from pathlib import Path

    from ulstore.codec._elias_fano import sizes

    rng = np.random.default_rng(5)
    ref = reference(ml_dtypes.bfloat16, 40_000, rng)
    pos = np.sort(rng.choice(ref.size, 500, replace=False))
    target = changed_at(ref, pos, rng)
    for blob in (ulstore.encode(target, ref, sparse=True), ulstore.encode(target, ref), ulstore.encode(target)):
        info = ulstore.inspect_blob(blob)
        assert sum(info["parts"].values()) == len(blob) == info["nbytes"]
        assert info["parts"]["crc"] == 4 and info["parts"]["header"] > 4
    parts = ulstore.inspect_blob(ulstore.encode(target, ref, sparse=True))["parts"]
    assert (parts["positions low"], parts["positions high"]) == sizes(ref.size, len(pos))
    assert parts["residual states"] == 16 and parts["residual words"] > 0 and "payload" not in parts
    # version 2 (gap section) blobs of the frozen fixtures are split too
    for path in sorted(Path(__file__).parent.parent.joinpath("fixtures", "ulpack_v1").glob("*_delta_sparse*.ulpk")):
        blob = path.read_bytes()
        info = ulstore.inspect_blob(blob)
        assert sum(info["parts"].values()) == len(blob), path.name
        if info["mode"] == "sparse":
            assert "gaps" in info["parts"] and "payload" not in info["parts"], path.name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("econd", [True, False])
def test_decode_applies_a_sparse_blob_in_the_kernels_job(monkeypatch, backend, econd):
    """decode of a valid SPARSE blob takes the in-place job (one kernel call), not the step-by-step path
    that names faults; both give the same values."""
    from ulstore.codec import _api

    rng = np.random.default_rng(4)
    ref = (rng.standard_normal(3000) * 0.02).astype(ml_dtypes.bfloat16)
    tgt = ref.copy()
    at = rng.choice(ref.size, 40, replace=False)
    tgt[at] = (tgt[at].astype(np.float32) * 1.5).astype(ml_dtypes.bfloat16)
    blob = ulstore.encode(tgt, ref, sparse=True, econd=econd)
    stepped = []
    real = _api._sparse_changes
    monkeypatch.setattr(_api, "_sparse_changes", lambda *a: stepped.append(1) or real(*a))
    out = ulstore.decode(blob, ref, backend=backend)
    assert flat_bits(out).tobytes() == flat_bits(tgt).tobytes() and not stepped
    into = np.empty_like(ref)
    assert ulstore.codec.decode_into(blob, ref, into, backend=backend) is into
    assert flat_bits(into).tobytes() == flat_bits(tgt).tobytes() and not stepped
    bad = ref.copy()
    bad[0] = bad[1]  # another reference: the job refuses it, the step path says why
    with pytest.raises(ReferenceMismatchError):
        ulstore.decode(blob, bad, backend=backend)
    assert stepped
