"""gc and delete under crash injection: whatever write fails, every step stays readable, exactly, and a rerun finishes."""

from __future__ import annotations

import os
import shutil

import pytest

import ulstore
from tests.helpers.store import CHUNK, Crash, CrashAfter, assert_state_equal, states_bf16


def _store(tmp_path):
    states = states_bf16(20)
    url = tmp_path / "base"
    traj = ulstore.open(str(url), mode="w", chunk_bytes=4 * CHUNK, anchor_every=0, pack_bytes=40_000)
    for i in range(8):
        traj.commit(i, states[i], files={"config.json": b'{"i": %d}' % i})
    traj.commit(50, states[9], parent=3, branch="side")
    return url, states


def _check(url, states, steps):
    ro = ulstore.open(str(url), mode="r")
    assert sorted(steps) == ro.steps
    for s in steps:
        assert_state_equal(ro.read(s), states[9] if s == 50 else states[s])


@pytest.mark.slow
@pytest.mark.parametrize("operation", ["gc", "delete"])
def test_crash_at_every_write_loses_nothing(tmp_path, operation):
    base, states = _store(tmp_path)
    if operation == "gc":
        ulstore.open(str(base), mode="r+").delete(2)
        ulstore.open(str(base), mode="r+").delete(5)
        run, steps = (lambda t: t.gc(repack_below=1.0)), [0, 1, 3, 4, 6, 7, 50]
    else:
        run, steps = (lambda t: t.delete(3)), [0, 1, 2, 4, 5, 6, 7, 50]
    points = 0
    for k in range(10_000):
        url = tmp_path / f"try{k}"
        shutil.copytree(base, url)
        traj = ulstore.open(str(url), mode="r+")
        crash = CrashAfter(traj._io, k)
        try:
            run(traj)
        except Crash:
            pass
        finally:
            crash.restore()
        if not crash.crashed:
            break
        points += 1
        # whatever happened, every step that exists reads back exactly...
        ro = ulstore.open(str(url), mode="r")
        present = [s for s in ro.steps if s in steps or s == 3]
        _check(url, states, present)
        if k % 3 == 0:  # ...and running the operation again (then a gc) finishes it
            if 3 in present or operation == "gc":
                run(ulstore.open(str(url), mode="r+"))
            ulstore.open(str(url), mode="r+").gc()
            _check(url, states, steps)
            assert k % 9 or ulstore.open(str(url), mode="r").verify().ok
        shutil.rmtree(url)
    assert points > 10
    _check(url, states, steps)
    assert ulstore.open(str(url), mode="r").verify().ok


def test_repack_keeps_every_live_blob_and_drops_the_rest(tmp_path):
    base, states = _store(tmp_path)
    traj = ulstore.open(str(base), mode="r+")
    for s in (1, 2, 4, 5, 6):
        traj.delete(s)
    before = traj.stats()
    result = traj.gc(repack_below=0.9)
    after = traj.stats()
    assert result["repacked"] > 0 and result["steps_rewritten"] > 0
    assert after["stored_bytes"] < 0.8 * before["stored_bytes"]
    listed = {p for s in traj.steps for p in traj._reader.doc(s).packs}
    stored = {k.split("/")[1][:32] for k in traj._io.find("packs")}
    assert listed == stored
    _check(base, states, [0, 3, 7, 50])
    assert [traj.read_file(s, "config.json") for s in (0, 3, 7)] == [b'{"i": 0}', b'{"i": 3}', b'{"i": 7}']
    contents = {s: traj.info(s).content for s in traj.steps}
    traj.gc(repack_below=1.0)
    assert {s: traj.info(s).content for s in traj.steps} == contents  # repacking never changes a step's content
    assert ulstore.open(str(base), mode="r").verify().ok


def test_deleting_the_parent_of_a_snapshot_step_makes_its_snapshots_its_entries(tmp_path, monkeypatch):
    """A step that carries snapshots (commit(snapshot=True)) loses its parent: each of its chunks coded against
    the parent takes its snapshot as its entry, with nothing decoded or encoded; every step reads exactly."""
    from ulstore.store.maintenance import _delete

    states = states_bf16(20)
    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=4 * CHUNK, anchor_every=0)
    for i in range(6):
        traj.commit(i, states[i], snapshot=i == 3)
    ro = ulstore.open(str(tmp_path / "t"), mode="r")
    snaps = {(t.name, j, i): p.snapshot(i) for t in ro._reader.tables(3).values() for j, p in enumerate(t.pieces)
             for i in range(p.n) if p.ref[i] == 2}  # fmt: skip
    assert snaps and all(loc is not None for loc in snaps.values())
    encodes = []
    real = _delete.encode_chunk
    monkeypatch.setattr(_delete, "encode_chunk", lambda *a, **k: encodes.append(a) or real(*a, **k))
    traj.delete(2)
    assert encodes == []
    ro = ulstore.open(str(tmp_path / "t"), mode="r")
    tables = ro._reader.tables(3)
    for (name, j, i), loc in snaps.items():
        p = tables[name].pieces[j]
        assert p.ref[i] == -1 and (int(p.pack[i]), int(p.off[i]), int(p.length[i])) == loc and p.snapshot(i) is None
    assert ro.info(3).parent == 1 and ro.info(3).anchor_distance == 0
    assert ro.verify().ok
    for s in (0, 1, 3, 4, 5):
        assert_state_equal(ro.read(s), states[s])
    packs = sorted(os.listdir(tmp_path / "t" / "packs"))
    traj.delete(1)  # 3 depends on no older step now: re-parented only, its tables where they were
    assert encodes == [] and ulstore.open(str(tmp_path / "t"), mode="r").info(3).parent == 0
    assert sorted(os.listdir(tmp_path / "t" / "packs")) == packs
    assert ulstore.open(str(tmp_path / "t"), mode="r").verify().ok
    assert_state_equal(ulstore.open(str(tmp_path / "t"), mode="r").read(5), states[5])


def test_a_delete_reads_again_only_the_tables_it_rewrote(tmp_path, monkeypatch):
    """Each delete checks every step for dependants: from the cached tables, not from storage again (a
    delete used to drop every cached table, so deleting n of N steps read n * N table blocks)."""
    from ulstore.store.read._chunk_reader import ChunkReader

    states = states_bf16(20)
    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=4 * CHUNK, anchor_every=0)
    for i in range(8):
        traj.commit(i, states[i])
    traj = ulstore.open(str(tmp_path / "t"), mode="r+")
    for s in traj.steps:
        traj._reader.tables(s)
    parsed = []
    real = ChunkReader._parse_block
    monkeypatch.setattr(
        ChunkReader, "_parse_block", staticmethod(lambda step, *a: parsed.append(step) or real(step, *a))
    )
    for s in (6, 5, 4):
        traj.delete(s)
    assert parsed == [7, 7]  # step 7, rewritten by each delete, read back by the next one
    ro = ulstore.open(str(tmp_path / "t"), mode="r")
    assert ro.steps == [0, 1, 2, 3, 7] and ro.info(7).parent == 3 and ro.verify().ok
    for s in ro.steps:
        assert_state_equal(ro.read(s), states[s])


def test_delete_updates_the_anchor_distances_below_it(tmp_path):
    states = states_bf16(20)
    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=4 * CHUNK, anchor_every=4)
    for i in range(7):  # 0 (anchor) 1 2 3, 4 (anchor) 5 6; a branch off 2
        traj.commit(i, states[i])
    traj.commit(50, states[9], parent=2, branch="side")
    assert [traj.info(s).anchor_distance for s in (0, 1, 2, 3, 4, 5, 6, 50)] == [0, 1, 2, 3, 0, 1, 2, 3]
    traj.delete(1)
    # 2 re-coded against 0 and re-parented: one step nearer its anchor, and so is everything below it up to 4
    assert {s: traj.info(s).anchor_distance for s in traj.steps} == {0: 0, 2: 1, 3: 2, 4: 0, 5: 1, 6: 2, 50: 2}
    ro = ulstore.open(str(tmp_path / "t"), mode="r")
    assert ro.verify().ok
    for s in (2, 3, 6):
        assert_state_equal(ro.read(s), states[s])
    assert_state_equal(ro.read(50), states[9])
