"""``sparse_apply`` (many SPARSE blobs applied in place, one call) and its wrapper ``apply_sparse``.

The compiled kernel and its NumPy twin must agree on everything: the changed
positions, new and old words, target sums, and on corrupt input the same
status for the same blob.  Whatever fails, no array may change.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import flat_bits
from tests.helpers.blobs import reseal
from ulstore import content_sum
from ulstore.codec._apply_plan import ApplyPlan, _meta
from ulstore.codec._backend import kernels
from ulstore.codec._dtypes import FORMATS, format_of
from ulstore.codec._sparse import GAPS
from ulstore.codec._sparse_apply import apply_sparse, is_sparse_blob, reserve_buffers

BACKENDS = ulstore.available_backends()
#: the compiled builds (the NumPy twin's job has no native lifecycle to break)
COMPILED = [b for b in BACKENDS if b != "numpy"]
DTYPES = {f.name: f.dtype for f in FORMATS}


def chunks(dtype, sizes, seed=0, density=0.03, econd=True):
    """(references, targets, SPARSE blobs) for chunks of ``sizes`` elements (``econd``: see ``ulstore.encode``)."""
    rng = np.random.default_rng(seed)
    refs, targets, blobs = [], [], []
    for n in sizes:
        r = (rng.standard_normal(n) * 2).astype(np.float32).astype(dtype)
        u = flat_bits(r).copy()
        pos = np.union1d(rng.choice(n, max(1, int(n * density)), replace=False), [n - 1])  # the padded last word
        u[pos] = (u[pos].astype(np.int64) + rng.choice([-2, -1, 1, 2], size=len(pos))).astype(u.dtype)
        t = u.view(r.dtype)
        refs.append(r)
        targets.append(t)
        blobs.append(ulstore.encode(t, r, sparse=True, econd=econd))
        assert is_sparse_blob(blobs[-1])
    return refs, targets, blobs


def call(backend, dtype, blobs, arrays, sums=None, shapes=None, write=True):
    sums = [content_sum(a) for a in arrays] if sums is None else sums
    shapes = [a.shape for a in arrays] if shapes is None else shapes
    plan = ApplyPlan.of(dtype, list(blobs), list(arrays), np.array(sums, dtype=np.uint64), shapes=shapes)
    return kernels(backend).sparse_apply(plan, write)


def same(a, b):
    assert a[:2] == b[:2]
    starts = a[5]
    upto = len(starts) - 1 if a[1] < 0 else a[1]
    end = int(starts[upto])
    assert np.array_equal(a[5], b[5])
    for x, y in zip(a[2:5], b[2:5]):
        assert np.array_equal(x[:end], y[:end])
    assert np.array_equal(a[6][:upto], b[6][:upto])


def _compiled():
    return [k for k in (kernels(b) for b in BACKENDS) if hasattr(k, "mixsum_simd")]


@pytest.fixture(params=["avx512", "plain"])
def mixsum(request):
    """The checksum pass's mixing of finished words: 8 at a time (AVX-512), or one by one; both give one sum."""
    modules = _compiled()
    before = [m.mixsum_simd() for m in modules]
    if request.param == "avx512" and not all(before):
        pytest.skip("this CPU or build has no AVX-512 (avx512f and avx512dq)")
    for m in modules:
        m.mixsum_simd(request.param == "avx512")
    yield request.param
    for m, b in zip(modules, before):
        m.mixsum_simd(b)


def _mix(z: int) -> int:  # splitmix64's finaliser (ulstore/codec/_kernels.pyx: mix)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def test_the_mixed_difference_sums_agree_with_the_definition(mixsum):
    rng = np.random.default_rng(7)
    for n in (0, 1, 7, 8, 9, 127, 128, 129, 1000):  # around the 8-word registers and the 128-word blocks
        a = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        b = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        want = sum(_mix(int(x)) - _mix(int(y)) for x, y in zip(a, b)) % 2**64
        for module in _compiled():
            assert module.mix_diff_sum(a, b) == want, (module.__name__, n)


@pytest.mark.parametrize("econd", [True, False], ids=["econd", "no-econd"])  # no-econd: the one-pass kernel path
@pytest.mark.parametrize("density", [0.03, 0.12])  # 0.12: most 8-byte words of fp8/bf16 hold several changes
@pytest.mark.parametrize("name", list(DTYPES))
def test_backends_agree_and_apply_exactly(name, density, econd, mixsum):
    dtype = DTYPES[name]
    # 40013: more changed words than one block of the checksum pass mixes together
    refs, targets, blobs = chunks(
        dtype, [999, 1000, 1001, 1003, 4099, 40013], seed=len(name), density=density, econd=econd
    )
    results = []
    for backend in BACKENDS:
        arrays = [r.copy() for r in refs]
        out = call(backend, dtype, blobs, arrays)
        assert out[0] == 0 and out[1] == -1
        for a, t in zip(arrays, targets):
            assert np.array_equal(flat_bits(a), flat_bits(t))
        assert [int(s) for s in out[6]] == [content_sum(t) for t in targets]
        results.append(out)
    for out in results[1:]:
        same(results[0], out)


@pytest.mark.parametrize("econd", [True, False], ids=["econd", "no-econd"])
def test_every_byte_of_a_blob_corrupted_changes_nothing(econd):
    """Each byte of the middle blob changed (CRC recomputed): same status on every backend, arrays as before."""
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [500, 3000, 700], seed=3, econd=econd)
    good = blobs[1]
    statuses = set()
    for i in range(len(good) - 4):
        for flip in (0x01, 0x80):
            body = bytearray(good[:-4])
            body[i] ^= flip
            bad = [blobs[0], reseal(body), blobs[2]]
            outs = []
            for backend in BACKENDS:
                arrays = [r.copy() for r in refs]
                out = call(backend, dtype, bad, arrays)
                if out[0]:
                    assert out[1] == 1
                    for a, r in zip(arrays, refs):
                        assert flat_bits(a).tobytes() == flat_bits(r).tobytes(), f"byte {i} ^ {flip:#x} wrote"
                else:  # only padding bits may be ignored, and then the values are exact
                    for a, t in zip(arrays, targets):
                        assert np.array_equal(flat_bits(a), flat_bits(t)), f"byte {i} ^ {flip:#x} WRONG values"
                outs.append(out)
            for out in outs[1:]:
                same(outs[0], out)
            statuses.add(outs[0][0])
    assert {-20, -22, -23} <= statuses and any(s <= -100 for s in statuses), statuses


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_reference_shape_or_dtype_changes_nothing(backend):
    dtype = np.float16
    refs, targets, blobs = chunks(dtype, [300, 400], seed=4)

    def run(**kw):
        arrays = [r.copy() for r in refs]
        out = call(backend, dtype, blobs, arrays, **kw)
        assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs))
        return out[:2]

    sums = [content_sum(r) for r in refs]
    assert run(sums=[sums[0], sums[1] ^ 1]) == (-21, 1)
    assert run(shapes=[(300,), (20, 20)]) == (-20, 1)
    assert run(shapes=[(301,), (400,)]) == (-20, 0)
    fmt = format_of(np.dtype(np.float32))
    float16_numbers = dict(width=16, mant_bits=10, emask=31, g_alphabet=GAPS.alphabet, t_alphabet=60)
    plan = ApplyPlan(
        blobs,
        [r.view(np.uint16) for r in refs],
        np.array(sums, dtype=np.uint64),
        [_meta(fmt.code, (300,)), _meta(fmt.code, (400,))],
        fmt.code,
        **float16_numbers,
    )
    assert kernels(backend).sparse_apply(plan, True)[:2] == (-20, 0)
    stale = [r.copy() for r in refs]
    at = np.flatnonzero(flat_bits(refs[1]) != flat_bits(targets[1]))[0]
    stale[1].view(np.uint16)[at] ^= 1  # not the reference its sum claims, at a changed element: the target check fails
    stale_before = [flat_bits(a).tobytes() for a in stale]
    out = call(backend, dtype, blobs, stale, sums=sums)
    assert out[0] in (-23, -7) and out[1] == 1
    assert [flat_bits(a).tobytes() for a in stale] == stale_before


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_apply_sparse_is_all_or_nothing(parts):
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [2000] * 5, seed=5)
    sums = [content_sum(r) for r in refs]
    with cf.ThreadPoolExecutor(2) as pool:
        arrays = [r.copy() for r in refs]
        out = apply_sparse(
            ApplyPlan.of(dtype, blobs, arrays, sums, shapes=[a.shape for a in arrays]), pool=pool, parts=parts
        )
        assert out is not None
        for a, t, r in zip(arrays, targets, out):
            assert np.array_equal(flat_bits(a), flat_bits(t))
            assert r.content_sum == content_sum(t)
        for bad_at in (0, 4):
            body = bytearray(blobs[bad_at])
            body[-6] ^= 0x40  # CRC fails
            bad = list(blobs)
            bad[bad_at] = bytes(body)
            arrays = [r.copy() for r in refs]
            assert (
                apply_sparse(
                    ApplyPlan.of(dtype, bad, arrays, sums, shapes=[a.shape for a in arrays]), pool=pool, parts=parts
                )
                is None
            )
            assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs))


def test_apply_sparse_undoes_the_other_runs_when_one_raises():
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [2000] * 4, seed=8)
    arrays = [r.copy() for r in refs]
    arrays[3].flags.writeable = False  # the second run cannot write (numpy: ValueError)
    with cf.ThreadPoolExecutor(2) as pool, pytest.raises((ValueError, BufferError)):
        apply_sparse(
            ApplyPlan.of(dtype, blobs, arrays, [content_sum(r) for r in refs], shapes=[a.shape for a in arrays]),
            pool=pool,
            parts=2,
        )
    assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_sparse_reuses_its_buffers(backend):
    """Outputs land in the caller's buffers from the second call on (no fresh pages per version)."""
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [3000] * 3, seed=7)
    sums = [content_sum(r) for r in refs]
    buffers: dict = {}
    for _ in range(3):
        arrays = [r.copy() for r in refs]
        out = apply_sparse(
            ApplyPlan.of(dtype, blobs, arrays, sums, shapes=[a.shape for a in arrays]), buffers=buffers, backend=backend
        )
        assert out is not None and len(buffers) == 1
        for a, t in zip(arrays, targets):
            assert np.array_equal(flat_bits(a), flat_bits(t))
    ((pos, new, old),) = buffers.values()
    assert all(np.shares_memory(r.positions, pos) and np.shares_memory(r.words, new) for r in out)
    assert all(np.shares_memory(r.old, old) for r in out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reserved_buffers_are_written_once_and_the_first_call_applies_into_them(backend):
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [3000] * 3, seed=8)
    buffers: dict = {}
    reserve_buffers(dtype, 5000, buffers)
    ((pos, new, old),) = buffers.values()
    assert len(pos) == len(new) == len(old) == 5000 and (pos.dtype, new.dtype) == (np.int64, np.uint16)
    assert not pos.any() and not new.any() and not old.any()  # written (its pages faulted in)
    reserve_buffers(dtype, 100, buffers)  # smaller: kept as they are
    assert buffers[2][0] is pos
    arrays = [r.copy() for r in refs]
    out = apply_sparse(
        ApplyPlan.of(dtype, blobs, arrays, [content_sum(r) for r in refs], shapes=[a.shape for a in arrays]),
        buffers=buffers,
        backend=backend,
    )
    assert out is not None and sum(len(r.positions) for r in out) <= 5000
    assert all(np.array_equal(flat_bits(a), flat_bits(t)) for a, t in zip(arrays, targets))
    assert buffers[2][0] is pos and all(np.shares_memory(r.positions, pos) for r in out)
    reserve_buffers(dtype, 9000, buffers)  # larger: replaced
    assert len(buffers[2][0]) == 9000


def test_is_sparse_blob():
    rng = np.random.default_rng(6)
    r = rng.standard_normal(100).astype(np.float32)
    t = r.copy()
    t[3] += 1
    assert is_sparse_blob(ulstore.encode(t, r, sparse=True))
    assert not is_sparse_blob(ulstore.encode(t, r))
    assert not is_sparse_blob(b"ULPK")


def test_blobs_taken_by_whichever_thread_is_free_keep_blob_order_and_all_or_nothing():
    """Threads take blobs from one job: results in blob order; a bad blob anywhere undoes them all."""
    dtype = ml_dtypes.bfloat16
    sizes = [300, 5000, 700, 4000, 900, 3000, 1200, 2500, 800, 6000, 400, 1500]
    refs, targets, blobs = chunks(dtype, sizes, seed=11)
    sums = [content_sum(r) for r in refs]
    shapes = [r.shape for r in refs]
    with cf.ThreadPoolExecutor(2) as pool:
        arrays = [r.copy() for r in refs]
        out = apply_sparse(ApplyPlan.of(dtype, blobs, arrays, sums, shapes=shapes), pool=pool, parts=2, buffers={})
        assert out is not None and len(out) == len(blobs)
        for a, t, r, ref in zip(arrays, targets, out, refs):
            assert np.array_equal(flat_bits(a), flat_bits(t))
            changed = np.flatnonzero(flat_bits(t) != flat_bits(ref))
            assert np.array_equal(r.positions, changed) and r.content_sum == content_sum(t)
        for bad_at in range(len(blobs)):
            body = bytearray(blobs[bad_at][:-4])
            body[-5] ^= 0x01  # a residual tail bit: the CRC is resealed, the target checksum fails
            bad = list(blobs)
            bad[bad_at] = reseal(body)
            arrays = [r.copy() for r in refs]
            assert (
                apply_sparse(ApplyPlan.of(dtype, bad, arrays, sums, shapes=shapes), pool=pool, parts=2, buffers={})
                is None
            ), bad_at
            assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs)), bad_at


def job_args(dtype, blobs, arrays, order=None, crc=True) -> tuple:
    """``SparseApply``'s arguments: ``blobs`` applied to ``arrays`` (their sums and shapes as they are now)."""
    sums = np.array([content_sum(a) for a in arrays], dtype=np.uint64)
    plan = ApplyPlan.of(dtype, list(blobs), list(arrays), sums, shapes=[a.shape for a in arrays])
    return plan, True, None, order, crc


def job(backend, dtype, blobs, arrays, order=None, crc=True):
    return kernels(backend).SparseApply(*job_args(dtype, blobs, arrays, order, crc))


@pytest.mark.parametrize("backend", BACKENDS)
def test_job_in_any_order_and_from_several_threads_gives_sparse_apply_s_result(backend):
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [700, 3000, 200, 1800, 2500, 90, 1200], seed=12)
    want = call(backend, dtype, blobs, [r.copy() for r in refs])
    assert want[0] == 0
    for order, workers in ((None, 1), (list(range(len(blobs)))[::-1], 1), ([1, 4, 3, 6, 0, 2, 5], 3)):
        arrays = [r.copy() for r in refs]
        j = job(backend, dtype, blobs, arrays, order)
        with cf.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda _: j.work(), range(workers)))
        same(j.finish(), want)
        assert all(np.array_equal(flat_bits(a), flat_bits(t)) for a, t in zip(arrays, targets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_job_checks_each_blob_s_crc_when_asked(backend):
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [900, 1500, 600], seed=13)
    bad = list(blobs)
    bad[1] = blobs[1][:-1] + bytes([blobs[1][-1] ^ 0x80])  # the CRC-32 field only: the payload is intact
    arrays = [r.copy() for r in refs]
    j = job(backend, dtype, bad, arrays)
    j.work()
    assert j.finish()[:2] == (-24, 1)
    assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs))
    j = job(backend, dtype, bad, arrays, crc=False)  # the caller has checked it: decoded as it is
    j.work()
    assert j.finish()[0] == 0
    assert all(np.array_equal(flat_bits(a), flat_bits(t)) for a, t in zip(arrays, targets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_job_misuse_is_an_error_and_a_job_never_worked_writes_nothing(backend):
    dtype = ml_dtypes.bfloat16
    refs, _, blobs = chunks(dtype, [500, 800], seed=14)
    with pytest.raises(ValueError, match="permutation"):
        job(backend, dtype, blobs, [r.copy() for r in refs], order=[0, 0])
    arrays = [r.copy() for r in refs]
    j = job(backend, dtype, blobs, arrays)
    assert j.finish()[0] == -8  # nobody took a blob
    assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs))
    with pytest.raises(RuntimeError):
        j.finish()
    j.work()  # a worker that starts after finish() (a pool thread that started late) takes nothing
    assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs))


def rounds(backend, n_chunks: int, seed: int):
    """Four fresh jobs over the same large chunks (10% changed, so that a worker takes a while): ``(job, arrays,
    references, targets)``."""
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [200_000] * n_chunks, seed=seed, density=0.1)
    for _ in range(4):
        arrays = [r.copy() for r in refs]
        yield job(backend, dtype, blobs, arrays), arrays, refs, targets


@pytest.mark.parametrize("backend", BACKENDS)
def test_join_waits_for_every_worker_inside_the_job_then_finish_is_safe(backend):
    """The caller's work() returns once every blob is taken; join() waits for the other workers still decoding."""
    for j, arrays, _, targets in rounds(backend, 6, seed=16):
        with cf.ThreadPoolExecutor(2) as pool:
            helpers = [pool.submit(j.work) for _ in range(2)]
            j.work()
            while not j.join():  # each call spins for at most 0.2 ms: False while a helper is still inside
                pass
            out = j.finish()  # never "while work() is running"
            assert out[0] == 0
            assert all(np.array_equal(flat_bits(a), flat_bits(t)) for a, t in zip(arrays, targets))
            for f in helpers:
                f.result()  # a helper that started after finish() returned at once, without an error


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_sparse_waits_on_the_helpers_when_the_spin_gives_up(backend, monkeypatch):
    """A busy machine: join() gives up spinning while a helper is inside; apply_sparse then sleeps on the
    helpers' futures, and the result is the same."""
    import ulstore.codec._sparse_apply as inplace

    real = kernels(backend)
    joins = []

    class GivesUp(real.SparseApply):
        def join(self, seconds=2e-4):
            joins.append(seconds)
            return False  # as if a helper were still inside after the spin

    monkeypatch.setattr(inplace, "kernels", lambda backend=None: type("K", (), {"SparseApply": GivesUp})())
    dtype = ml_dtypes.bfloat16
    refs, targets, blobs = chunks(dtype, [200_000] * 6, seed=17, density=0.1)
    arrays = [r.copy() for r in refs]
    with cf.ThreadPoolExecutor(2) as pool:
        out = apply_sparse(
            ApplyPlan.of(dtype, blobs, arrays, [content_sum(r) for r in refs], shapes=[r.shape for r in refs]),
            pool=pool,
            parts=3,
        )
    assert joins and out is not None and len(out) == len(blobs)
    assert all(np.array_equal(flat_bits(a), flat_bits(t)) for a, t in zip(arrays, targets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_job_finish_while_a_worker_runs_is_an_error_and_writes_stay_all_or_nothing(backend):
    """finish() under a running work() (it used to release the job under the worker: a crash) raises; later works."""
    for j, arrays, refs, targets in rounds(backend, 4, seed=15):
        started = threading.Event()

        def run():
            started.set()
            try:
                j.work()
            except RuntimeError:  # finish() came first: nothing is written
                pass

        worker = threading.Thread(target=run)
        worker.start()
        started.wait()
        try:
            out = j.finish()
        except RuntimeError as e:
            assert "while work() is running" in str(e)
            worker.join()
            out = j.finish()
            assert out[0] == 0
        worker.join()
        if out[0]:
            assert all(flat_bits(a).tobytes() == flat_bits(r).tobytes() for a, r in zip(arrays, refs))
        else:
            assert all(np.array_equal(flat_bits(a), flat_bits(t)) for a, t in zip(arrays, targets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_job_refuses_arrays_that_overlap(backend):
    """Two blobs writing one array defeat all or nothing (undo goes blob by blob): refused before anything runs.

    Here blob 0 goes from the second state to the third, blob 1 from the first to the second, on one array: taken
    in the order 1, 0, both checked out, and a third blob that failed left the second state behind (undo put blob
    1's old words back first, then blob 0's, which were blob 1's new ones).
    """
    dtype = ml_dtypes.bfloat16
    fmt = format_of(np.dtype(dtype))
    rng = np.random.default_rng(16)
    states = [(rng.standard_normal(3000) * 2).astype(np.float32).astype(dtype)]
    at = np.sort(rng.choice(3000, 90, replace=False))
    for _ in range(2):
        u = flat_bits(states[-1]).copy()
        u[at] += 1
        states.append(u.view(dtype))
    first, second = ulstore.encode(states[1], states[0], sparse=True), ulstore.encode(states[2], states[1], sparse=True)
    refs, _, blobs = chunks(dtype, [800], seed=16)
    body = bytearray(blobs[0][:-4])
    body[-5] ^= 0x01  # the target checksum fails
    arr, other = states[0].copy(), refs[0].copy()
    with pytest.raises(ValueError, match="overlap"):
        plan = ApplyPlan.of(
            dtype,
            [second, first, reseal(body)],
            [arr, arr, other],
            np.array([content_sum(states[1]), content_sum(states[0]), content_sum(refs[0])], dtype=np.uint64),
            metas=[_meta(fmt.code, (3000,))] * 2 + [_meta(fmt.code, (800,))],
        )
        kernels(backend).SparseApply(plan, True, None, [1, 0, 2], True)
    assert flat_bits(arr).tobytes() == flat_bits(states[0]).tobytes()
    # parts of one buffer: overlapping ones are refused, neighbours (the replica's chunks of a tensor) are fine
    refs, targets, blobs = chunks(dtype, [1000, 1000], seed=17)
    whole = np.concatenate(refs)
    with pytest.raises(ValueError, match="overlap"):
        call(backend, dtype, blobs, [whole[:1000], whole[999:1999]], sums=[content_sum(r) for r in refs])
    assert flat_bits(whole).tobytes() == flat_bits(np.concatenate(refs)).tobytes()
    assert call(backend, dtype, blobs, [whole[:1000], whole[1000:]])[0] == 0
    assert np.array_equal(flat_bits(whole), flat_bits(np.concatenate(targets)))
    # nothing is written without write: the same array may be read for several blobs
    assert call(backend, dtype, [blobs[0]] * 2, [refs[0], refs[0]], write=False)[0] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_arrays_of_any_shape_are_their_words_in_memory_order(backend):
    """A C-contiguous array is its flat words on every backend (the twin used to take its first axis for its
    length, and to accept a Fortran-ordered one the compiled job refuses)."""
    dtype = np.float16
    refs, targets, blobs = chunks(dtype, [1200], seed=18)
    ref, target = refs[0].reshape(30, 40), targets[0].reshape(30, 40)
    blob = ulstore.encode(target, ref, sparse=True)
    arr = ref.copy()
    out = call(backend, dtype, [blob], [arr])
    assert out[:2] == (0, -1)
    assert np.array_equal(flat_bits(arr), flat_bits(target))
    fortran = np.asfortranarray(ref)
    with pytest.raises((ValueError, BufferError)):
        call(backend, dtype, [blob], [fortran], shapes=[(30, 40)])
    assert flat_bits(fortran).tobytes() == flat_bits(ref).tobytes()


@pytest.mark.parametrize("backend", COMPILED)
def test_a_job_never_initialised_or_whose_init_raised_refuses_work_and_finish(backend):
    """No crash and nothing written: RuntimeError from work() and finish() (a subclass may skip or swallow
    ``__init__``)."""
    k = kernels(backend)
    j = k.SparseApply.__new__(k.SparseApply)
    with pytest.raises(RuntimeError, match="before __init__"):
        j.work()
    with pytest.raises(RuntimeError, match="before __init__"):
        j.finish()
    dtype = ml_dtypes.bfloat16
    refs, _, blobs = chunks(dtype, [300, 300], seed=9)
    arr = refs[0].copy()
    j = k.SparseApply.__new__(k.SparseApply)
    with pytest.raises(ValueError, match="overlap"):  # raises after its buffers and C arrays were allocated
        j.__init__(*job_args(dtype, blobs, [arr, arr]))
    for call in (j.work, j.finish):
        with pytest.raises(RuntimeError, match="before __init__"):
            call()
    assert flat_bits(arr).tobytes() == flat_bits(refs[0]).tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_job_never_worked_reports_lists_like_a_finished_one(backend):
    """``finish()`` gives starts and sums as lists of ints on every backend, worked or not."""
    dtype = ml_dtypes.bfloat16
    refs, _, blobs = chunks(dtype, [300, 500], seed=4)
    for work in (True, False):
        j = job(backend, dtype, blobs, [r.copy() for r in refs], crc=False)
        if work:
            j.work()
        j.join()
        status, _, _, _, _, starts, sums = j.finish()
        assert (status == 0) == work
        assert type(starts) is list and type(sums) is list and len(starts) == 3 and len(sums) == 2
        assert all(type(x) is int for x in starts + sums)
