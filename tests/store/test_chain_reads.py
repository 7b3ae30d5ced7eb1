"""Chain reads (issue 35): a chain of SPARSE deltas is applied in place on its root, exactly.

Each test reads from a fresh trajectory object (no kept step, no decoded-chunk
cache), so that the whole chain is walked, and compares bits with what was
committed.  Chains here mix SPARSE and dense deltas, change a tensor's shape or
dtype, lose steps to ``delete``, carry NaN payloads, -0.0 and infinities, and
break in the middle.
"""

from __future__ import annotations

import inspect
import threading
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.store import assert_state_equal, entries, flip_at
from ulstore.errors import CorruptBlobError
from ulstore.store.format._layout import pack_key
from ulstore.store.read import _column_plan, _decode_plan

# shapes and dtypes change mid-chain on purpose here: the commit's warning about it is tested in
# tests/store/test_features.py and tests/cli/test_cli_diff.py
pytestmark = pytest.mark.filterwarnings("ignore::ulstore.errors.FewSharedNamesWarning")

CHUNK = 4096  # 1024 float32 elements a chunk: a (64, 64) tensor is 4 chunks


def _mem() -> str:
    return f"memory://chain-{uuid.uuid4().hex}"


_SPECIALS = np.array([0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001], np.uint32)


def _specials(dtype) -> np.ndarray:
    """NaN payloads (quiet, signed), +-inf, -0.0 and a subnormal, as ``dtype`` bit patterns."""
    if np.dtype(dtype) == np.float32:
        return _SPECIALS.view(np.float32)
    return np.array([0x7FC1, 0xFFC3, 0x7F80, 0xFF80, 0x8000, 0x0001], np.uint16).view(ml_dtypes.bfloat16)


def _walk(seed: int, steps: int, fractions, shape=(64, 64), dtype=np.float32) -> list[dict]:
    """``steps + 1`` states of one tensor ``w`` (and a small ``b``); step i changes ``fractions[i - 1]`` of ``w``'s
    elements, some of them to special values (so chains carry NaN payloads, -0.0 and infinities)."""
    rng = np.random.default_rng(seed)
    specials = _specials(dtype)
    w = rng.standard_normal(shape).astype(dtype)
    w.reshape(-1)[: len(specials)] = specials
    b = rng.standard_normal(32).astype(dtype)
    out = [{"w": w, "b": b}]
    for i in range(steps):
        w = w.copy()
        k = max(1, int(w.size * fractions[i % len(fractions)]))
        idx = rng.choice(w.size, k, replace=False)
        w.reshape(-1)[idx] = rng.standard_normal(k).astype(dtype)
        w.reshape(-1)[idx[: len(specials)]] = specials[: min(k, len(specials))]
        out.append({"w": w, "b": b})
    return out


class _Calls:
    """Counts calls of a function of the read path's module (``apply_sparse``), or the blobs it is given
    (``decode_blobs``: the blobs decoded whole)."""

    def __init__(self, monkeypatch, name: str):
        self.n = 0
        real = getattr(_decode_plan, name)

        def counted(*a, **k):
            self.n += len(a[0]) if name == "decode_blobs" else 1
            return real(*a, **k)

        monkeypatch.setattr(_decode_plan, name, counted)


def _commit(states, *, sparse=True, url=None):
    traj = ulstore.open(url or _mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0, threads=1)
    for i, s in enumerate(states):
        traj.commit(i, s, sparse=sparse if isinstance(sparse, bool) else sparse[i])
    return traj


def _chunks(traj, step) -> int:
    return len(entries(traj, step))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_sparse_chain_decodes_its_root_once_and_applies_the_rest_in_place(monkeypatch, dtype):
    states = _walk(1, 9, [0.01], dtype=dtype)
    traj = _commit(states)
    decodes, applies = _Calls(monkeypatch, "decode_blobs"), _Calls(monkeypatch, "apply_sparse")
    got = ulstore.open(traj.url, mode="r").read(9)
    assert_state_equal(got, states[9])
    # "w" is a chain of SPARSE deltas: its 4 roots decoded whole, then one job per step; "b" never changed
    assert decodes.n == _chunks(traj, 0)
    assert applies.n == 9
    for step in (0, 1, 5, 8):
        assert_state_equal(ulstore.open(traj.url, mode="r").read(step), states[step])
    ro = ulstore.open(traj.url, mode="r")
    assert np.array_equal(ro[9]["w"][10:30, 5:60].view(np.uint8), states[9]["w"][10:30, 5:60].view(np.uint8))


def test_chains_that_mix_sparse_and_dense_deltas_read_exactly(monkeypatch):
    # 1% changes (SPARSE), 40% (too many for SPARSE: dense even when asked), and commits that ask for dense
    states = _walk(2, 12, [0.01, 0.01, 0.4, 0.02, 0.01, 0.3])
    asked = [i % 5 != 3 for i in range(len(states))]
    traj = _commit(states, sparse=asked)
    applies = _Calls(monkeypatch, "apply_sparse")
    for step in range(len(states)):
        assert_state_equal(ulstore.open(traj.url, mode="r").read(step), states[step])
    assert applies.n > 0
    ro = ulstore.open(traj.url, mode="r")  # the same through the kept step (sequential reads) and lazy slices
    for step in range(len(states)):
        assert_state_equal(ro.read(step), states[step])
        assert np.array_equal(ro[step]["w"][:].view(np.uint8), states[step]["w"].view(np.uint8))


def test_a_change_of_shape_or_dtype_mid_chain_starts_a_new_chain():
    states = _walk(3, 10, [0.01])
    for i in range(4, 11):  # "w" reshaped from step 4 on, "b" turns bf16 from step 7 on
        states[i] = dict(states[i])
        states[i]["w"] = states[i]["w"].reshape(32, 128).copy()
        if i >= 7:
            states[i]["b"] = states[i]["b"].astype(ml_dtypes.bfloat16)
    traj = _commit(states)
    for step in range(len(states)):
        assert_state_equal(ulstore.open(traj.url, mode="r").read(step), states[step])


def test_deletes_inside_a_sparse_chain_keep_every_other_step_exact():
    states = _walk(4, 9, [0.01, 0.015])
    traj = _commit(states)
    traj.delete(3)
    traj.delete(6)
    for step in (0, 1, 2, 4, 5, 7, 8, 9):
        assert_state_equal(ulstore.open(traj.url, mode="r").read(step), states[step])
    assert ulstore.open(traj.url, mode="r").verify().ok


def test_a_corrupt_delta_in_the_middle_of_a_chain_is_named_and_nothing_is_returned():
    states = _walk(5, 8, [0.01])
    traj = _commit(states)
    deltas = [e for e in entries(traj, 4) if e["ref"] is not None and e["tensor"] == "w"]
    assert deltas
    pid, off, n = deltas[0]["blob"]
    flip_at(traj._io, pack_key(pid), off + n // 2, 0x10)
    with pytest.raises(CorruptBlobError) as e:
        ulstore.open(traj.url, mode="r").read(8)
    assert e.value.key == pack_key(pid)
    with pytest.raises(CorruptBlobError):
        ulstore.open(traj.url, mode="r")[8]["w"][:]
    assert_state_equal(ulstore.open(traj.url, mode="r").read(3), states[3])  # the chain below it still reads


def test_a_chain_end_that_fails_its_content_hash_is_refused(monkeypatch):
    """The values a chain overwrites in place are not hashed: the hash of the chunk at its end is what
    stands between a wrong value and the caller (here a table entry whose content hash lies)."""
    states = _walk(6, 5, [0.01])
    traj = _commit(states)
    real = _decode_plan.content_digest
    for module in (_decode_plan, _column_plan):  # the general plan's check, and the column plan's
        monkeypatch.setattr(module, "content_digest", lambda v: bytes(16) if v.size == 1024 else real(v))
    with pytest.raises(CorruptBlobError, match="content hash"):
        ulstore.open(traj.url, mode="r").read(5)


@pytest.mark.parametrize("backend", ulstore.available_backends())
def test_every_backend_reads_the_same_values(backend):
    states = _walk(7, 6, [0.01, 0.3])
    traj = _commit(states)
    active = ulstore.backend()
    ulstore.set_backend(backend)
    try:
        for step in (0, 3, 6):
            assert_state_equal(ulstore.open(traj.url, mode="r").read(step), states[step])
    finally:
        ulstore.set_backend(active)


# -- hops: calls from Trajectory.read to the kernel (issue 37) ------------------------------------------


class _KernelProxy:
    """The active kernel module, with ``rans_decode3`` and ``decode3`` (whole decodes) and ``SparseApply.work``
    (SPARSE deltas in place) recording the stack they are entered from."""

    def __init__(self, real):
        self._real = real
        self.stacks: dict[str, list[list[str]]] = {"rans_decode3": [], "SparseApply.work": []}

    def _record(self, kernel: str) -> None:
        frames = inspect.stack()[2:]  # from the kernel's caller on (this method and the wrapper left out)
        self.stacks[kernel].append([f"{Path(f.filename).name}:{f.function}" for f in frames])

    def __getattr__(self, name):
        real = getattr(self._real, name)
        if name in ("rans_decode3", "decode3"):  # (decode3: a whole payload in one call, rans_decode3 inside)

            def whole(*a):
                self._record("rans_decode3")
                return real(*a)

            return whole
        if name == "SparseApply":
            proxy = self

            class Job:
                def __init__(self, *a):
                    self._job = real(*a)

                def work(self):
                    proxy._record("SparseApply.work")
                    return self._job.work()

                def __getattr__(self, attr):
                    return getattr(self._job, attr)

            return Job
        return real


def _hops(stack: list[str]) -> list[str]:
    """The frames from the kernel's caller up to ``Trajectory.read`` (its delegating function), inclusive."""
    end = stack.index("trajectory.py:delegated")
    return stack[: end + 1]


@pytest.mark.parametrize("sparse", [True, False])
def test_a_full_read_reaches_the_kernel_in_four_calls(monkeypatch, sparse):
    """Trajectory.read -> Reader.read -> _Job.run -> codec door (decode_blobs, apply_sparse) -> kernel: the
    anchor's intra blobs, dense deltas and SPARSE deltas alike."""
    from ulstore.codec import _backend

    states = _walk(8, 3, [0.01])
    traj = _commit(states, sparse=sparse)
    proxy = _KernelProxy(_backend.kernels())
    monkeypatch.setattr(_backend, "_active", proxy)
    for step in (0, 3):
        assert_state_equal(ulstore.open(traj.url, mode="r").read(step), states[step])
    whole, in_place = proxy.stacks["rans_decode3"], proxy.stacks["SparseApply.work"]
    assert whole and (bool(in_place) == sparse)
    for stack in whole:
        assert _hops(stack) == [
            "_decode_blobs.py:decode_blobs",
            "_decode_plan.py:run",
            "_step_reader.py:read",
            "trajectory.py:delegated",
        ]
    for stack in in_place:
        assert _hops(stack) == [
            "_sparse_apply.py:apply_sparse",
            "_decode_plan.py:run",
            "_step_reader.py:read",
            "trajectory.py:delegated",
        ]


def test_batches_on_several_threads_read_exactly_and_a_failure_in_any_is_raised(monkeypatch):
    """Small batches (one chunk or two each) on 3 threads: the caller's thread and two helpers take them."""
    monkeypatch.setattr(_decode_plan, "BATCH_BYTES", 4096)
    states = _walk(9, 6, [0.01, 0.3])
    traj = _commit(states)
    for step in (0, 6):
        assert_state_equal(ulstore.open(traj.url, mode="r", threads=3).read(step), states[step])
    deltas = [e for e in entries(traj, 3) if e["ref"] is not None and e["tensor"] == "w"]
    pid, off, n = deltas[-1]["blob"]
    flip_at(traj._io, pack_key(pid), off + n // 2, 0x10)
    with pytest.raises(CorruptBlobError) as e:
        ulstore.open(traj.url, mode="r", threads=3).read(6)
    assert e.value.key == pack_key(pid)


def test_co_located_sparse_chains_are_walked_by_columns_and_the_rest_by_nodes_fetching_each_blob_once(monkeypatch):
    """A chain of SPARSE deltas over blocks of one layout is planned by columns (no node-by-node walk); a chain
    with a dense delta is handed to the general plan with the blobs already fetched (no byte read twice)."""
    from ulstore.store.read._table_reader import TableReader

    walked, fetched = [], []
    real_add, real_fetch = _decode_plan._Plan.add, TableReader.fetch
    monkeypatch.setattr(_decode_plan._Plan, "add", lambda self, *a, **k: walked.append(a) or real_add(self, *a, **k))
    monkeypatch.setattr(
        TableReader, "fetch", lambda self, locs, *a, **k: fetched.extend(locs) or real_fetch(self, locs, *a, **k)
    )
    states = _walk(11, 6, [0.01, 0.02])
    for sparse, nodes in ((True, False), ([i != 3 for i in range(7)], True)):
        traj = _commit(states, sparse=sparse)
        walked.clear(), fetched.clear()
        assert_state_equal(ulstore.open(traj.url, mode="r").read(6), states[6])
        assert bool(walked) == nodes
        assert fetched and len(fetched) == len(set(fetched))


# -- one step on every decode thread (issue 35: a dense chain's read used one thread of two) ------------------


def test_batched_cuts_a_small_read_into_one_part_per_thread_in_order():
    """At least SPLIT_BYTES a part: one list per thread, about equal bytes, items in order, each once."""
    split = _decode_plan.SPLIT_BYTES
    items = [(i, split // 4 + 1000 * (i % 3)) for i in range(40)]  # ~10 SPLIT_BYTES, uneven sizes
    total = sum(n for _, n in items)
    for parts in (1, 2, 3, 7):
        got = list(_decode_plan.batched(items, parts))
        assert [i for b in got for i in b] == [i for i, _ in items]
        assert len(got) == parts
        sizes = [sum(items[i][1] for i in b) for b in got]
        assert max(sizes) - min(sizes) <= 2 * max(n for _, n in items)  # about equal: within an item or two
        assert abs(sum(sizes) - total) == 0
    few = [(i, split // 8) for i in range(12)]  # 1.5 SPLIT_BYTES: two parts would be under SPLIT_BYTES
    assert len(list(_decode_plan.batched(few, 2))) == 1
    assert list(_decode_plan.batched([], 2)) == [] and list(_decode_plan.batched([("z", 0)], 2)) == [["z"]]


def test_batched_keeps_batches_under_batch_bytes(monkeypatch):
    monkeypatch.setattr(_decode_plan, "BATCH_BYTES", 10_000)
    items = [(i, 900) for i in range(100)]
    got = list(_decode_plan.batched(items, 2))
    assert len(got) == 9 and all(sum(900 for _ in b) <= 10_000 + 900 for b in got)


class _ThreadsProxy(_KernelProxy):
    """The kernel module, recording the threads ``rans_decode3`` and ``SparseApply.work`` run on.  The first
    thread in waits (up to 10 s) for a second one, so that a thread that would decode everything before a
    helper starts does not hide the helper (a read on one thread fails the test in 10 s a read, not hangs it)."""

    def __init__(self, real):
        super().__init__(real)
        self.threads: set[str] = set()
        self._two = threading.Event()

    def clear(self) -> None:
        self.threads.clear()
        self._two.clear()

    def _record(self, kernel: str) -> None:
        name = threading.current_thread().name
        if name in self.threads:
            return
        self.threads.add(name)
        if len(self.threads) >= 2:
            self._two.set()
        self._two.wait(10)


@pytest.mark.parametrize("sparse", [True, False])
def test_a_step_is_decoded_on_every_decode_thread_exactly(monkeypatch, sparse):
    """A step far under BATCH_BYTES is cut into one batch per decode thread: the kernel is entered from two
    threads, the values exact, and a damaged blob in the second batch is still raised, naming its pack."""
    from ulstore.codec import _backend

    states = _walk(10, 3, [0.02, 0.6], shape=(256, 64))
    traj = _commit(states, sparse=sparse)
    monkeypatch.setattr(_decode_plan, "SPLIT_BYTES", 8 * CHUNK)  # the (256, 64) float32 tensor: 16 chunks
    monkeypatch.setattr(_decode_plan, "decode_workers", lambda reader: 2)
    proxy = _ThreadsProxy(_backend.kernels())
    monkeypatch.setattr(_backend, "_active", proxy)
    for step in (0, 3):
        proxy.clear()
        assert_state_equal(ulstore.open(traj.url, mode="r", threads=2).read(step), states[step])
        assert len(proxy.threads) == 2
    last = [e for e in entries(traj, 3) if e["tensor"] == "w"][-1]  # the end of the tensor: the second batch
    pid, off, n = last["blob"]
    flip_at(traj._io, pack_key(pid), off + n // 2, 0x10)
    with pytest.raises(CorruptBlobError) as e:
        ulstore.open(traj.url, mode="r", threads=2).read(3)
    assert e.value.key == pack_key(pid)


@pytest.mark.parametrize("sparse", [True, False])
def test_a_chain_is_walked_and_fetched_once_and_its_parts_run_on_every_decode_thread(monkeypatch, sparse):
    """A batch's chains are walked and fetched once, then cut into a plan per decode thread (not a batch per
    thread, each walking and fetching the chain again): the kernel entered from two threads, each blob fetched
    once, the values exact (SPARSE chains: column plans in parts; dense: general plans sharing the blobs)."""
    from ulstore.codec import _backend
    from ulstore.store.read._table_reader import TableReader

    states = _walk(12, 4, [0.02, 0.05], shape=(256, 64))
    traj = _commit(states, sparse=sparse)
    monkeypatch.setattr(_decode_plan, "SPLIT_BYTES", 8 * CHUNK)
    monkeypatch.setattr(_decode_plan, "decode_workers", lambda reader: 2)
    walks, fetched = [], []
    real_walk, real_fetch = _column_plan.ColumnPlan.walk, TableReader.fetch
    monkeypatch.setattr(_column_plan.ColumnPlan, "walk", lambda self: walks.append(1) or real_walk(self))
    monkeypatch.setattr(
        TableReader, "fetch", lambda self, locs, *a, **k: fetched.extend(locs) or real_fetch(self, locs, *a, **k)
    )
    proxy = _ThreadsProxy(_backend.kernels())
    monkeypatch.setattr(_backend, "_active", proxy)
    for step in (0, 4):
        proxy.clear(), walks.clear(), fetched.clear()
        assert_state_equal(ulstore.open(traj.url, mode="r", threads=2).read(step), states[step])
        assert len(proxy.threads) == 2 and len(walks) == 1
        assert fetched and len(fetched) == len(set(fetched))
