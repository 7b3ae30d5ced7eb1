"""Tests of the trajectory store: exactness, laziness, dedup, errors, integrity, retention."""

from __future__ import annotations

import concurrent.futures as cf
import doctest
import os
import sys
import threading
import uuid

import ml_dtypes
import numpy as np
import pytest
import zarr

import ulstore
from tests.helpers.bits import assert_bits_equal
from tests.helpers.bits import bits_of as bits
from tests.helpers.store import (
    CHUNK,
    CountingIO,
    Crash,
    CrashAfter,
    assert_state_equal,
    entries,
    flip_at,
    states_bf16,
    states_fp32,
)
from ulstore import store as ustore
from ulstore import toytrain
from ulstore.errors import (
    ConflictError,
    CorruptBlobError,
    CorruptManifestError,
    DtypeError,
    FewSharedNamesWarning,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    ReadOnlyError,
    StepExistsError,
    StepNotFoundError,
)
from ulstore.store.format._layout import pack_key, step_key
from ulstore.store.format._stepdoc import StepDoc


def _mem():
    return f"memory://ulstore-{uuid.uuid4().hex}"


def _extras(i: int) -> dict:
    """Non-float and odd-shaped tensors ridden along with the model."""
    return {
        "optimizer/step": np.int64(i),  # 0-d int
        "flags.mask": (np.arange(37) % (i + 2) == 0),  # bool
        "scalar.temp": np.float32(0.5 + i),  # 0-d float
        "empty": np.zeros((0, 3), np.float32),
    }


#: The S3 variant of the heaviest tests (40 commits to moto, 6-8 s of CPU each) runs in the slow lane; the fast lane
#: keeps them on local disk and memory, and S3 in the lighter tests of every backend
_S3_SLOW = pytest.param("s3", marks=pytest.mark.slow)


# -- 1. exactness --------------------------------------------------------------


@pytest.mark.parametrize("backend_url", ["local", "memory", _S3_SLOW], indirect=True)
def test_exact_every_step_every_backend(backend_url):
    url, so = backend_url
    bf16, fp32 = states_bf16(20), states_fp32(20)
    # bigger chunks on S3: every chunk is a request to the (slow, single-process) moto server
    chunk = CHUNK * 2 if url.startswith("s3://") else CHUNK
    traj = ulstore.open(url, mode="w", storage_options=so, chunk_bytes=chunk, anchor_every=8)
    for i, s in enumerate(bf16):
        traj.commit(i, {**s, **_extras(i)}, metadata={"i": i})
    for i, s in enumerate(fp32):  # a second root on its own branch
        traj.commit(100 + i, s, parent=None if i == 0 else 100 + i - 1, branch="fp32")
    assert traj.head() == 20 and traj.head("fp32") == 120
    ro = ulstore.open(url, mode="r", storage_options=so)  # fresh caches: everything decoded from storage
    assert ro.steps == list(range(21)) + list(range(100, 121))
    for i, s in enumerate(bf16):
        assert_state_equal(ro.read(i), {**s, **_extras(i)})
    for i, s in enumerate(fp32):
        assert_state_equal(ro.read(100 + i), s)
    # zarr view: real dtypes, edge chunks, 0-d, nested names
    g = ro[20]
    assert isinstance(g, zarr.Group) and g.attrs["i"] == 20
    w = g["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == np.dtype(ml_dtypes.bfloat16) and w.chunks[0] < w.shape[0]
    assert_bits_equal(w[:], bf16[20]["model.layers.0.mlp.up_proj.weight"])
    assert_bits_equal(w[5:70, 3], bf16[20]["model.layers.0.mlp.up_proj.weight"][5:70, 3])
    assert g["optimizer/step"][()] == 20 and g["optimizer"]["step"].shape == ()
    assert g["empty"].shape == (0, 3)
    assert ro[120]["lm_head.weight"].dtype == np.float32
    assert [x.step for x in ro.log("fp32")] == list(range(120, 99, -1))


def test_odd_dtypes_and_edge_chunks():
    rng = np.random.default_rng(0)
    state = {
        "f16": rng.normal(size=(7, 5)).astype(np.float16),
        "f64": rng.normal(size=(3, 11)),
        "e4m3": rng.normal(size=(9, 4)).astype(ml_dtypes.float8_e4m3fn),
        "e5m2": rng.normal(size=(9,)).astype(ml_dtypes.float8_e5m2),
        "u8": rng.integers(0, 255, size=(13, 2), dtype=np.uint8),
        "i32": rng.integers(-9, 9, size=(6,), dtype=np.int32),
        "c64": (rng.normal(size=4) + 1j).astype(np.complex64),
        "big_endian": rng.normal(size=(5, 3)).astype(">f4"),
        "nan_payloads": np.array([0x7FC00001, 0xFFC00123, 0x80000000, 1, 0x7F800000], np.uint32).view(np.float32),
    }
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=24)
    traj.commit(0, state)
    with pytest.warns(FewSharedNamesWarning, match="'big_endian' float32 5x3 -> float32 big-endian 5x3"):
        traj.commit(1, {k: v for k, v in state.items()})  # stored in the machine's byte order: no delta
    ro = ulstore.open(traj.url, mode="r")
    got = ro.read(1)
    for k, v in state.items():
        assert got[k].dtype == v.dtype.newbyteorder("=") or got[k].dtype.name == v.dtype.name
        np.testing.assert_array_equal(
            bits(got[k].astype(got[k].dtype.newbyteorder("<"))), bits(v.astype(v.dtype.newbyteorder("<"))), err_msg=k
        )
    g = ro[0]
    assert_bits_equal(g["f16"][6, :], state["f16"][6, :])  # last, padded chunk
    assert g["e4m3"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_doctests():
    from ulstore.store import trajectory

    result = doctest.testmod(trajectory, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5


# -- 2. laziness ---------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 3, 7])
def test_one_element_fetches_only_its_chain(tmp_path, depth):
    states = states_bf16(20)
    url = str(tmp_path / "t")
    traj = ulstore.open(url, mode="w", chunk_bytes=CHUNK, anchor_every=8)
    for i in range(12):
        traj.commit(i, states[i])
    step = 8 + depth if depth < 4 else depth  # anchors at 0 and 8
    assert traj.info(step).anchor_distance == depth
    ro = ulstore.open(url, mode="r")
    counter = CountingIO(ro._io)
    name = "model.layers.0.mlp.up_proj.weight"
    value = ro[step][name][17, 5]
    assert_bits_equal(np.asarray(value), np.asarray(states[step][name][17, 5]))
    # per step of the chain: its step document, one table block, at most one blob (range reads of packs)
    assert len(set(counter.docs())) <= depth + 1
    assert len(counter.packs()) <= 2 * (depth + 1)
    assert len(counter.reads) == len(counter.packs()) + len(counter.docs())  # nothing else (root meta is read at open)
    counter.reset()
    ro[step][name][17, 6]  # same chunk: cache hit, no backend read at all
    assert counter.reads == []
    counter.reset()
    other = ro[step][name][60, 0]  # another chunk of the same tensor: only its own chain
    assert_bits_equal(np.asarray(other), np.asarray(states[step][name][60, 0]))
    # one blob per step of its chain that changed the chunk (a step that left it alone shares the
    # parent's blob), never a step document or table block again: they were all read for the first chunk
    blobs = counter.packs()
    assert 1 <= len(blobs) <= depth + 1 and counter.docs() == []
    assert len(blobs) == len(set(blobs)), "a blob was fetched twice"


def test_consecutive_full_reads_keep_the_step():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for i in range(6):
        traj.commit(i, states[i])
    ro = ulstore.open(traj.url, mode="r")
    counter = CountingIO(ro._io)
    assert_state_equal(ro.read(4), states[4])
    assert_state_equal(ro.read(5), states[5])  # sequential: step 5 is kept from now on
    n = len(counter.packs())
    counter.reset()
    assert_state_equal(ro.read(5), states[5])  # the kept step: nothing fetched again
    assert counter.packs() == [] and n > 0


# -- 3. dedup ------------------------------------------------------------------


def test_same_state_twice_adds_no_blobs():
    s = states_bf16(20)[3]
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, s)
    before = traj.stats()
    traj.commit(1, s)
    after = traj.stats()
    assert after["blobs"] == before["blobs"] and after["blob_bytes"] == before["blob_bytes"]
    assert entries(traj, 1) == entries(traj, 0)  # entries reused verbatim


def test_unchanged_tensors_add_no_blob_bytes():
    a, b = states_bf16(20)[4], states_bf16(20)[5]
    changed = ["lm_head.weight", "model.in_proj.bias"]
    mixed = {k: (b[k] if k in changed else a[k]) for k in a}
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, a)
    n0 = traj.stats()["blobs"]
    traj.commit(1, mixed)
    e0 = {(e["tensor"], e["coord"]): e for e in entries(traj, 0)}
    e1 = {(e["tensor"], e["coord"]): e for e in entries(traj, 1)}
    new = {e["blob"] for e in e1.values()} - {e["blob"] for e in e0.values()}
    changed_chunks = sum(e1[k]["content"] != e0[k]["content"] for k in e1 if k[0] in changed)
    assert traj.stats()["blobs"] - n0 == len(new) <= changed_chunks
    for k in e1:
        if k[0] not in changed:
            assert e1[k] == e0[k]
    assert_state_equal(ulstore.open(traj.url, mode="r").read(1), mixed)


def test_anchor_policy():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=4)
    for i in range(10):
        traj.commit(i, states[i])
    assert [traj.info(i).anchor_distance for i in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    for i in (0, 4, 8):
        assert all(e["ref"] is None for e in entries(traj, i))
    for i in range(10):  # no chunk's reference chain is longer than its step's anchor distance
        by_step = {s: {(e["tensor"], e["coord"]): e for e in entries(traj, s)} for s in range(i + 1)}
        for key, e in by_step[i].items():
            hops, ee = 0, e
            while ee["ref"] is not None:
                ee = by_step[ee["ref"]][key]
                hops += 1
            assert hops <= traj.info(i).anchor_distance
    traj.commit(10, states[10], anchor=True)
    assert traj.info(10).anchor_distance == 0


# -- 4. crash safety and concurrent writers ------------------------------------


@pytest.mark.parametrize("threads", [1, 4])
def test_commit_failing_after_k_writes(threads):
    states = states_bf16(20)
    url = _mem()
    traj = ulstore.open(url, mode="w", chunk_bytes=1 << 13, threads=threads, pack_bytes=20_000)
    traj.commit(0, states[0])
    traj.commit(1, states[1])
    for k in range(10_000):  # fail after 0, 1, 2, ... writes until the commit needs fewer
        inject = CrashAfter(traj._io, k)
        try:
            traj.commit(2, states[2])
        except Crash:
            pass
        finally:
            inject.restore()
        if not inject.crashed:
            break  # k >= the number of writes the commit makes: it went through
        ro = ulstore.open(url, mode="r")
        if ro.steps == [0, 1, 2]:  # failed moving the ref (after the commit point): main did not move
            assert ro.head() == 1
            assert traj.commit(2, states[2]) == 2  # D12: retrying the same commit moves main
            break
        assert ro.steps == [0, 1] and ro.head() == 1  # failed before the step document: no step
        assert_state_equal(ro.read(1), states[1])
        if k % 7 == 0:
            assert_state_equal(traj.read(1), states[1])  # the writer's kept step is still sound
    assert k > 10  # many failure points were exercised (several packs: pack_bytes is small)
    ro = ulstore.open(url, mode="r")
    assert ro.steps == [0, 1, 2] and ro.head() == 2
    assert_state_equal(ro.read(2), states[2])
    assert ro.verify().ok
    assert traj._io.find("pending") == []  # no marker outlives the finished commit
    assert traj.gc()["packs"] > 0  # the orphans of the failed attempts
    assert len(traj._io.find("packs")) == traj.stats()["packs"]
    assert_state_equal(ulstore.open(url, mode="r").read(2), states[2])


_KILL_SCRIPT = r"""
import sys, time
import ulstore
from ulstore import toytrain
url = sys.argv[1]
states = toytrain.trajectory("finetune", 3, preset="tiny", dtype="bfloat16")
traj = ulstore.open(url, mode="a", chunk_bytes=4096, threads=1, pack_bytes=8192)
traj.commit(0, states[0]); traj.commit(1, states[1])
real_open = traj._io.open_writer
def open_writer(key, **kw):
    w = real_open(key, **kw)
    real_write = w.write
    def write(data):
        at = real_write(data)
        print("BLOB", flush=True)
        time.sleep(0.05)
        return at
    w.write = write
    return w
traj._io.open_writer = open_writer
traj.commit(2, states[2])
print("DONE", flush=True)
"""


def test_a_commit_lists_no_steps(backend_url):
    """A commit checks the steps it is coded against one by one: listing ``steps/`` walks a directory per
    step on local disk and pages through 1,000 steps a request on S3, so each commit of a long run would
    take longer than the last."""
    url, so = backend_url
    traj = ulstore.open(url, mode="w", storage_options=so, chunk_bytes=64)
    states = [{"w": np.arange(100, dtype=np.float32) * (i + 1)} for i in range(3)]
    traj.commit(0, states[0])
    traj.commit(1, states[1])
    listed = []
    real = traj._io.find
    traj._io.find = lambda prefix, **kw: listed.append(prefix.rstrip("/")) or real(prefix, **kw)
    traj.commit(2, states[2])
    assert listed == ["pending"]
    for i in range(3):
        assert_bits_equal(ulstore.open(url, mode="r", storage_options=so).read(i)["w"], states[i]["w"], f"step {i}")


def test_a_local_commit_reads_no_listing_that_grows_with_the_run(tmp_path):
    """A commit on local disk neither walks ``steps/`` (a directory per step) nor finds the directories of
    earlier commits' intents under ``pending/``: a long run's commits stay as fast as its first."""
    root = tmp_path / "t"
    traj = ulstore.open(root, mode="w", chunk_bytes=64)
    states = [{"w": np.arange(100, dtype=np.float32) * (i + 1)} for i in range(6)]
    for i in range(5):
        traj.commit(i, states[i])
    traj.commit(100, states[0], parent=2, branch="side")
    traj.delete(100)
    listed = []
    real = traj._io.find
    traj._io.find = lambda prefix, **kw: listed.append(prefix.rstrip("/")) or real(prefix, **kw)
    traj.commit(5, states[5])
    assert listed == ["pending"]
    # no directory is left empty below the top-level ones (each commit's intent had one)
    empty = [d for d, dirs, files in os.walk(root) if not dirs and not files and os.path.dirname(d) != str(root)]
    assert not empty, empty
    for i in range(6):
        assert_bits_equal(ulstore.open(root, mode="r").read(i)["w"], states[i]["w"], f"step {i}")


def test_writer_killed_mid_commit(tmp_path):
    import signal
    import subprocess

    url = str(tmp_path / "t")
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, url], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(5):  # a few blobs of step 2 are written, not all
            assert proc.stdout.readline().strip() == "BLOB"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    states = toytrain.trajectory("finetune", 3, preset="tiny", dtype="bfloat16")  # what the script committed
    traj = ulstore.open(url, mode="a")
    assert traj.steps == [0, 1] and traj.head() == 1
    assert os.listdir(tmp_path / "t" / ".tmp")  # the pack being written
    assert_state_equal(traj.read(0), states[0])
    assert_state_equal(traj.read(1), states[1])
    traj.commit(2, states[2])
    assert_state_equal(ulstore.open(url, mode="r").read(2), states[2])
    traj.gc()
    assert not os.listdir(tmp_path / "t" / ".tmp")
    assert traj.verify().ok


def test_two_writers_same_step(backend_url):
    url, so = backend_url
    a, b = states_bf16(20)[1], states_bf16(20)[2]
    w1 = ulstore.open(url, mode="a", storage_options=so, chunk_bytes=CHUNK)
    w1.commit(0, states_bf16(20)[0])
    w2 = ulstore.open(url, mode="a", storage_options=so)
    # both pass the early existence check of step 1, then race on the conditional create
    for w in (w1, w2):
        w._io.exists = lambda key, real=w._io.exists: False if key == step_key(1) else real(key)
    barrier = threading.Barrier(2)
    for w in (w1, w2):
        real = w._io.create

        def create(key, data, real=real):
            if key.startswith("steps/"):  # the commit point (ref entries are created too)
                barrier.wait(timeout=30)
            return real(key, data)

        w._io.create = create
    results = {}

    def run(name, w, s):
        try:
            w.commit(1, s, parent=0)
            results[name] = "ok"
        except StepExistsError as e:
            results[name] = e

    threads = [threading.Thread(target=run, args=("a", w1, a)), threading.Thread(target=run, args=("b", w2, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [k for k, v in results.items() if v == "ok"]
    assert len(winners) == 1, results
    loser = "b" if winners == ["a"] else "a"
    assert isinstance(results[loser], StepExistsError) and results[loser].step == 1
    got = ulstore.open(url, mode="r", storage_options=so).read(1)
    assert_state_equal(got, a if winners == ["a"] else b)


# -- 5. corruption -------------------------------------------------------------


def test_flipped_byte_in_any_blob_is_named():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=1 << 14, anchor_every=4)
    for i in range(3):
        traj.commit(i, states[i])
    io = traj._io
    rng = np.random.default_rng(1)
    blobs = {e["blob"]: (s, e) for s in traj.steps for e in entries(traj, s)}
    assert len(blobs) > 20
    for (pid, off, n), (s, e) in blobs.items():
        key = pack_key(pid)
        original = flip_at(io, key, off + int(rng.integers(n)), mask=int(rng.integers(1, 256)))
        ro = ulstore.open(traj.url, mode="r")
        with pytest.raises(IntegrityError) as info:
            ro._reader.chunk(s, e["tensor"], e["coord"], e["piece"])
        assert info.value.key == key
        with pytest.raises(IntegrityError):
            ro[s][e["tensor"]][...]
        report = ro.verify(raise_on_error=False)
        assert key in {d["key"] for d in report.errors}
        with pytest.raises(CorruptBlobError, match=pid):
            ro.verify()
        io.put(key, original)
    assert ulstore.open(traj.url, mode="r").verify().ok


def test_flipped_byte_in_manifest_is_named():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=1 << 14)
    traj.commit(0, states[0])
    traj.commit(1, states[1])
    io = traj._io
    original = io.get(step_key(1))
    for pos in range(len(original)):  # every byte, two different flips, at the parser
        for mask in (0x01, 0x20):
            bad = bytearray(original)
            bad[pos] ^= mask
            with pytest.raises(CorruptManifestError):
                StepDoc.from_bytes(bytes(bad), key=step_key(1), step=1)
    for pos in range(0, len(original), len(original) // 25):  # and end to end, for a sample
        flip_at(io, step_key(1), pos)
        ro = ulstore.open(traj.url, mode="r")
        with pytest.raises(CorruptManifestError) as info:
            ro.read(1)
        assert info.value.key == step_key(1)
        io.put(step_key(1), original)
    flip_at(io, step_key(1), len(original) // 2, 0x04)
    report = ulstore.open(traj.url, mode="r").verify(raise_on_error=False)
    assert [d["key"] for d in report.errors] == [step_key(1)]
    assert_state_equal(ulstore.open(traj.url, mode="r").read(0), states[0])


def test_flipped_byte_in_a_table_block_is_named():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=1 << 14)
    traj.commit(0, states[0])
    traj.commit(1, states[1])
    d = traj._reader.doc(1)
    io = traj._io
    for t in d.tables:
        key = pack_key(d.packs[t.pack])
        for pos in range(t.offset, t.offset + t.length, max(1, t.length // 40)):
            original = flip_at(io, key, pos, 0x10)
            ro = ulstore.open(traj.url, mode="r")
            with pytest.raises(CorruptManifestError) as info:
                ro.read(1)
            assert info.value.key == key and info.value.step == 1
            io.put(key, original)
    assert_state_equal(ulstore.open(traj.url, mode="r").read(1), states[1])


# -- 6. bad input --------------------------------------------------------------


def test_bad_input_errors(tmp_path):
    states = states_bf16(20)
    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    with pytest.raises(StepExistsError):
        traj.commit(0, states[1])
    with pytest.raises(StepNotFoundError):
        traj.commit(1, states[1], parent=99)
    changed = dict(states[1])
    changed["lm_head.weight"] = changed["lm_head.weight"].astype(np.float32)
    with pytest.raises(InvalidInputError, match="anchor=False") as info:
        traj.commit(1, changed, anchor=False)
    assert info.value.tensor == "lm_head.weight"
    reshaped = dict(states[1])
    reshaped["model.in_proj.bias"] = reshaped["model.in_proj.bias"][:10]
    with pytest.raises(InvalidInputError, match="anchor=False"):
        traj.commit(1, reshaped, anchor=False)
    with pytest.raises(InvalidInputError):
        traj.commit(1, {**states[1], "new": np.ones(3, np.float32)}, anchor=False)
    with pytest.raises(InvalidInputError):
        traj.commit(1, {"w": [1.0, 2.0]})
    with pytest.raises(InvalidInputError):
        traj.commit(1, {"w": "text"})
    with pytest.raises(InvalidInputError):
        traj.commit(1, [("w", np.ones(2))])
    with pytest.raises(DtypeError):
        traj.commit(1, {"w": np.array(["a"], dtype=object)})
    for bad_name in ("", "a//b", "/a", "a/", "../x", "__meta", "x/zarr.json"):
        with pytest.raises(InvalidInputError):
            traj.commit(1, {bad_name: np.ones(2, np.float32)})
    with pytest.raises(InvalidInputError):
        traj.commit(1, {"a": np.ones(2, np.float32), "a/b": np.ones(2, np.float32)})
    with pytest.raises(InvalidInputError):
        traj.commit(1, states[1], metadata={"x": object()})
    with pytest.raises(InvalidInputError):
        traj.commit(-1, states[1])
    with pytest.raises(ConflictError):
        traj.commit(5, states[1], parent=None, branch="main")  # main is at 0, not at None
    # a dtype/shape change without anchor=False is fine: that tensor starts a new chain (said: test_features.py)
    with pytest.warns(FewSharedNamesWarning, match="'lm_head.weight' bfloat16"):
        traj.commit(1, changed)
    assert all(e["ref"] is None for e in entries(traj, 1) if e["tensor"] == "lm_head.weight")
    assert_state_equal(traj.read(1), changed)
    ro = ulstore.open(str(tmp_path / "t"), mode="r")
    with pytest.raises(ReadOnlyError):
        ro.commit(2, states[2])
    with pytest.raises(ReadOnlyError):
        ro.delete(0)
    with pytest.raises(ReadOnlyError):
        ro[0]["lm_head.weight"][0, 0] = 1
    with pytest.raises(StepNotFoundError):
        ro[42]
    with pytest.raises(KeyError):  # not-found errors are KeyErrors too
        ro.read("no-such-branch")
    with pytest.raises(NotFoundError):
        ulstore.open(str(tmp_path / "missing"), mode="r")
    with pytest.raises(ConflictError):
        ulstore.open(str(tmp_path / "t"), mode="w-")


def test_mode_w_replaces_a_trajectory_and_refuses_to_delete_anything_else(tmp_path):
    """``open(url, mode="w")`` starts over on a trajectory (or nothing); a directory of checkpoint files,
    a file, or another Zarr hierarchy given by mistake is refused, named, and left as it was."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for i in range(5):
        (ckpts / f"step_{i}.safetensors").write_bytes(b"x" * (i + 1))
    with pytest.raises(InvalidInputError, match=r"holds 5 entries \('step_0.safetensors'.* and 2 more\)"):
        ulstore.open(ckpts, mode="w")
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{i}.safetensors" for i in range(5)]
    # reading it says what is there and how checkpoint files become a trajectory, not "create one here"
    with pytest.raises(NotFoundError, match=r"it holds 5 entries .*import_checkpoint") as caught:
        ulstore.open(ckpts, mode="r")
    assert "mode='a'" not in str(caught.value)
    with pytest.raises(NotFoundError, match="create one"):
        ulstore.open(tmp_path / "nothing-here", mode="r")
    with pytest.raises(InvalidInputError, match="is a file, not a trajectory"):
        ulstore.open(ckpts / "step_3.safetensors", mode="w")
    assert (ckpts / "step_3.safetensors").read_bytes() == b"xxxx"
    zarr_dir = tmp_path / "arrays"
    zarr_dir.mkdir()
    (zarr_dir / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    with pytest.raises(InvalidInputError, match="not a ulstore trajectory"):
        ulstore.open(zarr_dir, mode="w")
    assert (zarr_dir / "zarr.json").exists()
    # a trajectory is replaced, an empty directory or a missing path is created
    traj = ulstore.open(tmp_path / "t", mode="w")
    traj.commit(0, {"w": np.ones(3, np.float32)})
    assert ulstore.open(tmp_path / "t", mode="w").steps == []
    (tmp_path / "empty").mkdir()
    assert ulstore.open(tmp_path / "empty", mode="w").steps == []
    assert ulstore.open(tmp_path / "new" / "run", mode="w").steps == []


@pytest.mark.parametrize("mode", ["a", "w-"])
def test_creating_a_trajectory_among_other_files_is_refused(tmp_path, mode):
    """``open(url, mode="a")`` (or "w-") creates a trajectory where there is none, but not inside a directory
    of checkpoint files or over a file: refused, naming what is there, and left as it was.  An empty
    directory, a missing path and an existing trajectory open as before."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for i in range(5):
        (ckpts / f"step_{i}.safetensors").write_bytes(b"x" * (i + 1))
    with pytest.raises(InvalidInputError, match=r"holds 5 entries \('step_0.safetensors'.* and 2 more\)") as caught:
        ulstore.open(ckpts, mode=mode)
    assert "import_checkpoint" in str(caught.value) and f"mode={mode!r}" in str(caught.value)
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{i}.safetensors" for i in range(5)]
    with pytest.raises(InvalidInputError, match="is a file, not a trajectory"):
        ulstore.open(ckpts / "step_3.safetensors", mode=mode)
    assert (ckpts / "step_3.safetensors").read_bytes() == b"xxxx"
    (tmp_path / "empty").mkdir()
    ulstore.open(tmp_path / "empty", mode=mode).commit(0, {"w": np.ones(3, np.float32)})
    ulstore.open(tmp_path / "new" / "run", mode=mode).commit(0, {"w": np.ones(3, np.float32)})
    assert ulstore.open(tmp_path / "empty", mode="a").steps == [0]  # an existing trajectory opens
    with pytest.raises(InvalidInputError, match="holds 1 entry"):
        ulstore.open(_mem_with({"notes.txt": b"hi"}), mode=mode)


def _mem_with(objects: dict[str, bytes]) -> str:
    """A fresh memory:// location holding ``objects``."""
    import fsspec

    url = _mem()
    fs = fsspec.filesystem("memory")
    for key, data in objects.items():
        fs.pipe(f"{url}/{key}", data)
    return url


def test_a_trajectory_created_meanwhile_by_another_writer_is_opened(tmp_path, monkeypatch):
    """Two writers (DCP ranks) opening a new trajectory at once: the one that finds the other's objects but had
    read no root document a moment before reads it again and opens that trajectory, instead of refusing."""
    from ulstore.store import trajectory as trajectory_module

    url = str(tmp_path / "t")
    real = trajectory_module._check_creatable

    def other_writer_first(io, where, mode):
        monkeypatch.setattr(trajectory_module, "_check_creatable", real)
        ulstore.open(url, mode="w-", chunk_bytes=4096)  # another process creates it between our read and our listing
        return real(io, where, mode)

    monkeypatch.setattr(trajectory_module, "_check_creatable", other_writer_first)
    traj = ulstore.open(url, mode="a")
    assert traj.chunk_bytes == 4096  # the other writer's settings


def test_awkward_tensor_names():
    names = ["model/layers.0/attn.q_proj.weight", "日本語/重み", "a.b.c", "emoji🙂", "x/c/0"]
    rng = np.random.default_rng(3)
    state = {n: rng.normal(size=(4, 3)).astype(ml_dtypes.bfloat16) for n in names}
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=8)
    traj.commit(7, state)
    traj.commit(8, {k: v + v for k, v in state.items()})
    ro = ulstore.open(traj.url, mode="r")
    assert_state_equal(ro.read(7), state)
    g = ro[8]
    for n in names:
        assert_bits_equal(g[n][1:3, 2], (state[n] + state[n])[1:3, 2], n)
    assert set(g["model"].keys()) == {"layers.0"}


# -- 7. retention --------------------------------------------------------------


@pytest.mark.parametrize("backend_url", ["local", "memory", _S3_SLOW], indirect=True)
def test_delete_middle_steps_and_gc(backend_url):
    url, so = backend_url
    states = states_bf16(20)
    traj = ulstore.open(url, mode="w", storage_options=so, chunk_bytes=CHUNK, anchor_every=0)
    for i in range(8):
        traj.commit(i, states[i])
    traj.commit(50, states[9], parent=3, branch="side")  # a branch off a step we delete
    before = traj.stats()
    for s in (3, 4, 7):
        traj.delete(s)
    assert traj.steps == [0, 1, 2, 5, 6, 50]
    assert traj.head() == 6 and traj.head("side") == 50 and traj.info(50).parent == 2
    assert traj.info(5).parent == 2
    removed = traj.gc()
    after = traj.stats()
    assert removed["packs"] + removed["repacked"] > 0 and removed["bytes"] > 0
    assert after["stored_bytes"] < before["stored_bytes"] and after["unreferenced_bytes"] < 0.5 * after["stored_bytes"]
    stored = {k.rsplit("/", 1)[-1][: -len(".pack")] for k in traj._io.find("packs")}
    listed = {p for s in traj.steps for p in traj._reader.doc(s).packs}
    assert stored == listed  # unreachable packs are gone, nothing reachable was removed
    ro = ulstore.open(url, mode="r", storage_options=so)
    for s in (0, 1, 2, 5, 6):
        assert_state_equal(ro.read(s), states[s])
    assert_state_equal(ro.read(50), states[9])
    assert ro.verify().ok
    traj.delete(0)  # the root: its children are re-anchored
    traj.gc()
    assert_state_equal(ulstore.open(url, mode="r", storage_options=so).read(6), states[6])


# -- parallel commits ----------------------------------------------------------


class CountingExecutor(cf.Executor):
    """Hands every task to ``inner`` and records it: a commit that ignored ``executor=`` records nothing."""

    def __init__(self, inner):
        self.inner = inner
        self.submitted: list[str] = []

    def submit(self, fn, /, *args, **kwargs):
        self.submitted.append(fn.__name__)
        return self.inner.submit(fn, *args, **kwargs)


def test_commit_with_external_thread_executor():
    states = states_bf16(20)
    with cf.ThreadPoolExecutor(2) as pool:
        on_open, on_commit = CountingExecutor(pool), CountingExecutor(pool)
        traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, executor=on_open)
        for i in range(2):
            traj.commit(i, states[i])
        encoded = len(on_open.submitted)
        traj.commit(2, states[2], executor=on_commit)  # the commit's own executor wins
    assert encoded > 0 and set(on_open.submitted) == {"encode_chunk"}
    assert len(on_open.submitted) == encoded and len(on_commit.submitted) > 0
    assert set(on_commit.submitted) == {"encode_chunk"}
    assert_state_equal(ulstore.open(traj.url, mode="r").read(2), states[2])


@pytest.mark.parametrize("processes", [False, True])
def test_commit_with_dask_distributed(tmp_path, processes):
    distributed = pytest.importorskip("distributed")
    states = states_fp32(20)
    with (
        distributed.LocalCluster(
            processes=processes, n_workers=1, threads_per_worker=2, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        executor = CountingExecutor(client.get_executor())
        traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=CHUNK, executor=executor)
        for i in range(3):
            traj.commit(i, states[i])
    assert executor.submitted and set(executor.submitted) == {"encode_chunk"}  # the chunks went to dask
    assert_state_equal(ulstore.open(str(tmp_path / "t"), mode="r").read(2), states[2])


def test_exported_from_package():
    assert ulstore.open is ustore.open and ulstore.Trajectory is ustore.Trajectory


def test_resolve_names_a_step_by_number_or_ref():
    traj = ulstore.open(_mem(), mode="w")
    traj.commit(3, {"w": np.ones(4, np.float32)})
    traj.set_ref("stable", 3)
    assert traj.resolve(3) == traj.resolve("main") == traj.resolve("stable") == 3
    with pytest.raises(StepNotFoundError):
        traj.resolve(4)
    with pytest.raises(StepNotFoundError):
        traj.resolve("nightly")
    with pytest.raises(InvalidInputError):
        traj.resolve(-1)


def test_head_survives_pickling():
    """``parent=HEAD`` shipped to another process (a pickled writer's arguments) still means HEAD."""
    import pickle

    assert pickle.loads(pickle.dumps(ustore.HEAD)) is ustore.HEAD
    assert pickle.loads(pickle.dumps({"parent": ustore.HEAD}))["parent"] is ustore.HEAD


def test_contents_recurring_along_a_chain_do_not_deadlock():
    # weights that flip back (A, B, A, B, ...) put equal contents at several depths of
    # one reference chain; concurrent readers must neither deadlock nor mix them up
    a, b = states_bf16(20)[0], states_bf16(20)[1]
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for i in range(7):
        traj.commit(i, a if i % 2 == 0 else b)
    ro = ulstore.open(traj.url, mode="r", threads=8)
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ro.read, [6, 5, 4, 3]))
    for step, state in zip([6, 5, 4, 3], got):
        assert_state_equal(state, a if step % 2 == 0 else b)
