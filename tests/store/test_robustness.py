"""Regression tests for the defects of issue 14 that live in the reader and gc (D1-D7, D10, D11).

Each of these failed on the format-1 code (commit 24251ed): D1 verify said OK,
D2 raised RecursionError, D3 hung, D4 opened files outside the root, D5 and
D7 deleted files they must not, D6 lost a blob of a retried commit, D10 read
another tensor, D11 allocated gigabytes before failing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid

import numpy as np
import pytest

import ulstore
from tests.helpers.store import CHUNK, assert_state_equal, entries, flip_at, rewrite_step, states_bf16
from ulstore.errors import CorruptBlobError, CorruptManifestError, IntegrityError, InvalidInputError
from ulstore.store.format._chunkcodec import zstd_compress
from ulstore.store.format._layout import pack_key, step_key


def _mem():
    return f"memory://robust-{uuid.uuid4().hex}"


def _run_with_timeout(fn, seconds=30):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not finish in time."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed back to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not finish within {seconds} s (a hang)"
    return out


# -- D1: verify reads and checks every blob -------------------------------------------------


def test_d1_verify_checks_every_blob_even_when_its_content_was_seen():
    a, b = states_bf16(20)[0], states_bf16(20)[1]
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=2)
    for i, s in enumerate((a, b, b)):  # step 2 is an anchor: B's chunks again, coded intra
        traj.commit(i, s)
    own = {e["blob"] for e in entries(traj, 2)} - {e["blob"] for s in (0, 1) for e in entries(traj, s)}
    assert len(own) > 5
    for pid, off, n in sorted(own)[:: max(1, len(own) // 8)]:
        original = flip_at(traj._io, pack_key(pid), off + n // 2, 0x08)
        report = ulstore.open(traj.url, mode="r").verify(raise_on_error=False)
        assert not report.ok and pack_key(pid) in {e["key"] for e in report.errors}
        traj._io.put(pack_key(pid), original)
    assert ulstore.open(traj.url, mode="r").verify().ok


def test_d1_verify_checks_snapshots_too():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    traj.commit(1, states[1], snapshot=True)
    snaps = [e["snapshot"] for e in entries(traj, 1) if e["snapshot"] is not None]
    assert snaps
    pid, off, n = snaps[len(snaps) // 2]
    flip_at(traj._io, pack_key(pid), off + n // 2, 0x08)
    ro = ulstore.open(traj.url, mode="r")
    report = ro.verify(raise_on_error=False)
    assert [e["key"] for e in report.errors] == [pack_key(pid)]


# -- D2: no recursion in chain walks ------------------------------------------------------------


@pytest.mark.slow
def test_d2_a_300_step_chain_reads_from_a_fresh_process(tmp_path):
    url = str(tmp_path / "long")
    traj = ulstore.open(url, mode="w", anchor_every=0, threads=1)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    for i in range(300):
        w = w.copy()
        w[i % 16, i % 8] += np.float32(1e-3)
        traj.commit(i, {"w": w, "step": np.int64(i)})
    assert traj.info(299).anchor_distance == 299
    script = (
        "import sys, numpy as np, ulstore\n"
        "t = ulstore.open(sys.argv[1], mode='r')\n"
        "w = t.read(299)['w']\n"
        "print(float(t[299]['w'][3, 5]) == float(w[3, 5]), t.verify(299).ok, w.tobytes().hex())\n"
    )
    p = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    same, ok, data = p.stdout.split()
    assert same == "True" and ok == "True" and bytes.fromhex(data) == w.tobytes()


# -- D3: a reference cycle raises, never hangs ------------------------------------------------


def test_d3_a_reference_cycle_in_crafted_tables_is_an_error_not_a_hang():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for i in range(3):
        traj.commit(i, states[i])

    def point_at(step):
        def mutate(tables, append):
            for t in tables.values():
                for p in t.pieces:
                    if t.codec == "ulpack":
                        p.ref[:] = step

        return mutate

    rewrite_step(traj, 1, point_at(2))  # 1 -> 2 and 2 -> 1: checksums recomputed, a cycle
    rewrite_step(traj, 2, point_at(1))
    ro = ulstore.open(traj.url, mode="r", threads=4)
    name = "model.layers.0.mlp.up_proj.weight"
    for fn in (lambda: ro.read(2), lambda: ro[2][name][0, 0], lambda: ro.verify(raise_on_error=False)):
        got = _run_with_timeout(fn)
        if "error" in got:
            assert isinstance(got["error"], CorruptManifestError) and "cycle" in str(got["error"])
        else:
            report = got["value"]
            assert not report.ok and any("cycle" in e["message"] for e in report.errors)


# -- D4: names from storage are checked; nothing outside the root is opened ----------------------


def _two_steps(tmp_path):
    """(url, trajectory, states) of a local trajectory holding steps 0 and 1 of real bf16 states."""
    states = states_bf16(20)
    url = str(tmp_path / "t")
    traj = ulstore.open(url, mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    traj.commit(1, states[1])
    return url, traj, states


def test_d4_crafted_pack_names_and_tensor_names_are_refused(tmp_path):
    url, traj, states = _two_steps(tmp_path)
    secret = tmp_path / "secret.pack"
    secret.write_bytes(b"outside the root")
    opened: list[str] = []
    real_open = os.open

    def spy(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    original = traj._io.get(step_key(1))
    for bad in ("../../secret", "../" * 6 + "dev/zero", "A" * 32, "0" * 31 + "/"):
        traj._io.put(step_key(1), original)
        rewrite_step(traj, 1, body=lambda b, bad=bad: b.update(packs=[bad]))
        ro = ulstore.open(url, mode="r")
        os.open = spy
        try:
            with pytest.raises(CorruptManifestError, match="malformed") as info:
                ro.read(1)
        finally:
            os.open = real_open
        assert info.value.key == step_key(1)
        assert not any("secret" in p or "/dev/" in p for p in opened)

    def rename(tables, append):  # (a name that sorts inside its table block's range: the block keeps it)
        t = tables.pop("model.embed_tokens.weight")
        t.name = "model.embed_tokens/../../secret"
        tables[t.name] = t

    with pytest.raises(CorruptManifestError, match="malformed"):  # a commit proves its parent: refused too
        traj.commit(2, states[2])
    traj._io.put(step_key(1), original)
    traj.commit(2, states[2])
    rewrite_step(traj, 2, rename)  # a tensor name is never a key, but it is checked all the same
    with pytest.raises(CorruptManifestError, match="malformed"):
        ulstore.open(url, mode="r").read(2)


def test_d4_a_fifo_or_device_in_place_of_a_pack_never_hangs(tmp_path):
    states = states_bf16(20)
    url = str(tmp_path / "t")
    traj = ulstore.open(url, mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    pid = traj._reader.doc(0).packs[0]
    path = tmp_path / "t" / "packs" / f"{pid}.pack"
    path.unlink()
    os.mkfifo(path)
    got = _run_with_timeout(lambda: ulstore.open(url, mode="r").read(0))
    assert isinstance(got.get("error"), IntegrityError) and got["error"].key == pack_key(pid)
    path.unlink()
    os.symlink("/dev/zero", path)
    got = _run_with_timeout(lambda: ulstore.open(url, mode="r").read(0))
    assert isinstance(got.get("error"), IntegrityError)


def test_d4_a_fifo_or_symlink_in_place_of_a_step_document_or_ref_never_hangs_nor_leaves_the_root(tmp_path):
    url, traj, _ = _two_steps(tmp_path)
    doc = tmp_path / "t" / step_key(1)
    doc.unlink()
    os.mkfifo(doc)
    got = _run_with_timeout(lambda: ulstore.open(url, mode="r").info(1))
    assert isinstance(got.get("error"), ulstore.NotFoundError) and got["error"].key == step_key(1)
    doc.unlink()
    outside = tmp_path / "outside.json"
    outside.write_bytes((tmp_path / "t" / step_key(0)).read_bytes())  # a valid document, outside the root
    os.symlink(outside, doc)
    got = _run_with_timeout(lambda: ulstore.open(url, mode="r").info(1))
    assert isinstance(got.get("error"), ulstore.NotFoundError)  # never read through the link
    refs = sorted((tmp_path / "t" / "refs" / "main").iterdir())
    head = refs[-1]
    head.unlink()
    os.mkfifo(head)
    got = _run_with_timeout(lambda: ulstore.open(url, mode="r").head())
    assert "value" in got or isinstance(got.get("error"), IntegrityError)  # an answer, not a hang


def test_d4_a_huge_step_document_is_refused_without_reading_it(tmp_path):
    url, _, _ = _two_steps(tmp_path)
    doc = tmp_path / "t" / step_key(1)
    os.truncate(doc, 4 << 30)  # a planted 4 GiB document (sparse: no disk used)
    tracemalloc.start()
    try:
        got = _run_with_timeout(lambda: ulstore.open(url, mode="r").info(1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(got.get("error"), OSError) and "more than" in str(got["error"])
    assert peak < 512 << 20  # at most the document limit was read, never the 4 GiB


def test_d4_a_table_block_longer_than_any_writer_makes_is_refused_before_it_is_fetched(tmp_path):
    url, traj, _ = _two_steps(tmp_path)

    def longer(b):
        b["tables"][0][4] = 4 << 30  # a 4 GiB "table block": it would be fetched before its hash is checked

    rewrite_step(traj, 1, body=longer)
    with pytest.raises(CorruptManifestError, match="malformed.*length"):
        ulstore.open(url, mode="r").info(1)


def test_d4_a_step_directory_symlinked_out_of_the_root_is_never_read(tmp_path):
    url, traj, _ = _two_steps(tmp_path)
    step_dir = tmp_path / "t" / step_key(1).rsplit("/", 1)[0]
    outside = tmp_path / "outside"
    os.rename(step_dir, outside)  # a valid step directory, now outside the root
    os.symlink(outside, step_dir)
    with pytest.raises(PermissionError, match="outside"):
        ulstore.open(url, mode="r").info(1)
    pid = traj._reader.doc(0).packs[0]
    packs = tmp_path / "t" / "packs"
    os.rename(packs, tmp_path / "outside-packs")
    os.symlink(tmp_path / "outside-packs", packs)
    with pytest.raises(PermissionError, match="outside"):
        ulstore.open(url, mode="r").read(0)
    assert pid  # (the pack that was not read)


# -- D5, D6, D7: gc --------------------------------------------------------------------------------


def test_d5_gc_never_deletes_outside_the_root(tmp_path):
    states = states_bf16(20)
    url = tmp_path / "t"
    traj = ulstore.open(str(url), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    (outside / ("0" * 32 + ".pack")).write_bytes(b"looks like a pack")
    os.rmdir(url / ".tmp") if (url / ".tmp").exists() else None
    os.symlink(outside, url / ".tmp")
    with pytest.raises(OSError, match="not a real directory"):
        traj.gc()  # (it announces itself first: no write is staged through the symlink)
    assert sorted(os.listdir(outside)) == ["0" * 32 + ".pack", "precious"]
    with pytest.raises(OSError, match="not a real directory"):
        traj.commit(1, states[1])  # and never stages a write through it
    os.unlink(url / ".tmp")
    os.rename(url / "packs", tmp_path / "real-packs")
    os.symlink(outside, url / "packs")
    with pytest.raises(InvalidInputError, match="symlink"):
        traj.gc()
    assert sorted(os.listdir(outside)) == ["0" * 32 + ".pack", "precious"]


def test_d7_gc_respects_the_grace_period_for_tmp(tmp_path):
    states = states_bf16(20)
    url = tmp_path / "t"
    traj = ulstore.open(str(url), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    young = url / ".tmp" / "a-live-writers-file"
    young.write_bytes(b"half a pack")
    old = url / ".tmp" / "a-dead-writers-file"
    old.write_bytes(b"half a pack")
    t = time.time() - 7200
    os.utime(old, (t, t))
    traj.gc(older_than=3600)
    assert young.exists() and not old.exists()
    traj.gc()
    assert not young.exists()


def test_d6_gc_never_deletes_what_a_retried_commit_needs(tmp_path):
    """A gc that listed an old orphan pack, then deletes it after a retried commit finished: the retry is intact."""
    states = states_bf16(20)
    url = str(tmp_path / "t")
    traj = ulstore.open(url, mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    real_create = traj._io.create

    def crash(key, data):
        raise RuntimeError("killed before the step document")

    traj._io.create = crash
    with pytest.raises(RuntimeError):
        traj.commit(1, states[1])
    traj._io.create = real_create
    (orphan,) = [k for k in traj._io.find("packs") if k.split("/")[1][:32] not in traj._reader.doc(0).packs]
    t = time.time() - 7200
    os.utime(os.path.join(url, orphan), (t, t))
    gc_io = ulstore.open(url, mode="r+")
    real_delete = gc_io._io.delete_many

    def delete_late(keys):  # the retry runs between gc's listing and its deletes
        if 1 not in ulstore.open(url, mode="r"):
            ulstore.open(url, mode="a", chunk_bytes=CHUNK).commit(1, states[1])
        return real_delete(keys)

    gc_io._io.delete_many = delete_late
    gc_io.gc(older_than=3600)
    assert not os.path.exists(os.path.join(url, orphan))  # the orphan went...
    ro = ulstore.open(url, mode="r")
    assert_state_equal(ro.read(1), states[1])  # ...and the retry's own pack did not
    assert ro.verify().ok


def test_d6_repacked_packs_wait_out_the_grace_period(tmp_path):
    states = states_bf16(20)
    url = str(tmp_path / "t")
    traj = ulstore.open(url, mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for i in range(4):
        traj.commit(i, states[i])
    before = set(traj._io.find("packs"))
    traj.delete(1)
    result = traj.gc(older_than=3600, repack_below=1.0)
    assert result["repacked"] > 0
    assert before <= set(traj._io.find("packs"))  # retired, not deleted: a commit in flight may still name them
    for s in (0, 2, 3):
        assert_state_equal(ulstore.open(url, mode="r").read(s), states[s])
    result = traj.gc()  # no grace: the retired packs go now
    assert result["packs"] >= 1 and not traj._io.find("gc")
    for s in (0, 2, 3):
        assert_state_equal(ulstore.open(url, mode="r").read(s), states[s])


def test_gc_running_beside_a_committing_writer_loses_nothing(tmp_path):
    states = states_bf16(20)
    url = str(tmp_path / "t")
    writer = ulstore.open(url, mode="w", chunk_bytes=CHUNK, anchor_every=3)
    writer.commit(0, states[0])
    done = threading.Event()
    errors: list = []

    def collect():
        g = ulstore.open(url, mode="r+")
        while not done.is_set():
            try:
                g.gc(older_than=5.0)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    t = threading.Thread(target=collect)
    t.start()
    try:
        for i in range(1, 12):
            writer.commit(i, states[i])
    finally:
        done.set()
        t.join(60)
    assert not errors
    ro = ulstore.open(url, mode="r")
    for i in range(12):
        assert_state_equal(ro.read(i), states[i])
    assert ro.verify().ok


# -- D10, D11 ---------------------------------------------------------------------------------------


def test_d10_backslash_names_are_refused_at_commit():
    traj = ulstore.open(_mem(), mode="w")
    x = np.ones(3, np.float32)
    for name in ("a\\b", "model\\layers.0", "x\x00y"):
        with pytest.raises(InvalidInputError, match="backslash or NUL"):
            traj.commit(0, {name: x, "a/b": x * 2})
    assert traj.steps == []


def test_d11_declared_sizes_are_checked_before_allocating():
    rng = np.random.default_rng(0)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=64)
    state = {"w": rng.normal(size=(8, 4)).astype(np.float32), "ids": np.arange(4, dtype=np.int32)}
    traj.commit(0, state)
    # a 47-byte ULPack header that declares 2^28 elements, and 32 KB of Zstd that inflate to 1 GiB
    ulpack_bomb = b"ULPK" + bytes([1, 3, 0, 0, 1]) + bytes([0x80, 0x80, 0x80, 0x80, 0x01]) + bytes(33)
    zstd_bomb = zstd_compress(bytes(1 << 30))
    assert len(zstd_bomb) < 64 << 10

    def plant(tables, append):
        for name, bomb in (("w", ulpack_bomb), ("ids", zstd_bomb)):
            p = tables[name].pieces[0]
            p.pack[0], p.off[0], p.length[0] = append(bomb)

    rewrite_step(traj, 0, plant)
    ro = ulstore.open(traj.url, mode="r")
    tracemalloc.start()
    try:
        for name in ("w", "ids"):
            # (the ULPack bomb's header fails its CRC before its sizes are read: either way, nothing is allocated)
            with pytest.raises(CorruptBlobError, match="declares|CRC-32"):
                ro.read(0, [name])
            with pytest.raises(CorruptBlobError):
                ro[0][name][0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
