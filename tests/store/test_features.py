"""Format-2 features: pieces, snapshots, files, the change feed, the hash chain, the kept parent, packs."""

from __future__ import annotations

import dataclasses
import pickle
import re
import uuid

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import bits_of as bits
from tests.helpers.store import CHUNK, CountingIO, assert_state_equal, entries, states_bf16
from ulstore.core.objects import MAX_DOCUMENT_BYTES
from ulstore.errors import (
    CorruptBlobError,
    CorruptManifestError,
    FewSharedNamesWarning,
    InvalidInputError,
    TensorNotFoundError,
)
from ulstore.store.commit import _piece_writer
from ulstore.store.format._layout import pack_key
from ulstore.store.read import _decode_plan
from ulstore.store.read._table_reader import _MAX_AHEAD_PACKS


def _mem():
    return f"memory://features-{uuid.uuid4().hex}"


class _Count:
    """Counts calls of a module-level function (decodes, encodes)."""

    def __init__(self, monkeypatch, module, name):
        self.n = 0
        real = getattr(module, name)

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(module, name, counted)


class _Decodes:
    """Counts the blobs the read path decodes whole (one at a time, or a list through the codec's door)."""

    def __init__(self, monkeypatch):
        self.n = 0
        one, many = _decode_plan.decode_chunk, _decode_plan.decode_blobs

        def counted(*a, **k):
            self.n += 1
            return one(*a, **k)

        def counted_many(blobs, *a, **k):
            self.n += len(blobs)
            return many(blobs, *a, **k)

        monkeypatch.setattr(_decode_plan, "decode_chunk", counted)
        monkeypatch.setattr(_decode_plan, "decode_blobs", counted_many)


# -- pieces ------------------------------------------------------------------------------------------


def _shards(w: np.ndarray, rows: list[int]):
    """(offset, piece) row bands of ``w`` cut at ``rows``."""
    cuts = [0, *rows, w.shape[0]]
    return [((a, 0), w[a:b]) for a, b in zip(cuts, cuts[1:])]


def test_read_boxes_reads_many_boxes_in_one_plan_exactly():
    """Boxes of several tensors (whole, across chunks, empty) read together: each one's exact values in a fresh
    array, in fewer range reads than one read_box call per box; a box outside its tensor is refused."""
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=1024)
    for step in range(2):
        traj.commit(step, states[step])
    ro = ulstore.open(traj.url, mode="r", cache_bytes=0)
    names = [n for n, v in states[1].items() if v.ndim == 2][:4]
    boxes = []
    for n in names:
        rows, cols = states[1][n].shape
        boxes += [(n, (0, 0), (rows, cols)), (n, (rows // 3, 1), (rows // 2, cols - 2)), (n, (1, 1), (0, 3))]
    boxes.append((names[0], (2, 0), (5, 4)))  # chunks another box reads too
    for n in names:
        ro.pieces(1, n)  # the tables read first: only blobs are counted
    counter = CountingIO(ro._io)
    got = ro.read_boxes(1, boxes)
    together = len(counter.packs())
    assert len(got) == len(boxes)
    for (n, off, shape), g in zip(boxes, got, strict=True):
        want = states[1][n][tuple(slice(o, o + k) for o, k in zip(off, shape))]
        assert g.shape == want.shape and g.dtype == want.dtype and g.flags.writeable
        np.testing.assert_array_equal(bits(g), bits(want))
    assert got[0].base is None or got[0].base is not got[3].base  # fresh arrays, none a view of another
    counter.reset()
    for box, g in zip(boxes, got, strict=True):
        np.testing.assert_array_equal(bits(ro.read_box(1, *box)), bits(g))
    assert 0 < together < len(counter.packs())
    assert ro.read_boxes(1, []) == []
    with pytest.raises(InvalidInputError, match="outside"):
        ro.read_boxes(1, [(names[0], (0, 0), (1, 1)), (names[1], (0, 0), (10**6, 1))])


def test_read_boxes_into_the_callers_arrays_decodes_whole_chunks_in_place(monkeypatch):
    """read_boxes(out=...) fills the caller's arrays (contiguous or strided) with exactly what read_boxes returns;
    a chunk whole in its box is decoded straight into the caller's memory, a chunk the box's edge cuts is copied
    in; arrays that cannot take the values are refused, naming the tensor."""
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=1024)
    for step in range(3):
        traj.commit(step, states[step])
    ro = ulstore.open(traj.url, mode="r", cache_bytes=0)
    names = [n for n, v in states[2].items() if v.ndim == 2][:3]
    boxes = []
    for n in names:
        rows, cols = states[2][n].shape
        boxes += [(n, (0, 0), (rows, cols)), (n, (rows // 3, 1), (rows // 2, cols - 2)), (n, (0, 0), (rows, cols))]
    want = ro.read_boxes(2, boxes)
    # contiguous arrays, and strided views (every other box): a view of a larger buffer
    buffers = [np.full(tuple(d + k % 2 for d in shape), 7, states[2][n].dtype) for k, (n, _, shape) in enumerate(boxes)]
    outs = [b[1:, 1:] if k % 2 else b for k, b in enumerate(buffers)]
    in_place = []
    real = _decode_plan.decode_blobs  # the read path's whole decodes, into the buffers it gives

    def decode_blobs(blobs, refs, targets, *a, **k):
        in_place.extend(any(np.shares_memory(t, b) for b in buffers) for t in targets)
        return real(blobs, refs, targets, *a, **k)

    monkeypatch.setattr(_decode_plan, "decode_blobs", decode_blobs)
    got = ro.read_boxes(2, boxes, out=outs)
    assert len(got) == len(boxes) and all(g is o for g, o in zip(got, outs))
    for (n, _, _), g, w in zip(boxes, got, want, strict=True):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=n)
    assert any(in_place) and not all(in_place)  # whole chunks in place; cut chunks and references aside
    assert ro.read_boxes(2, [], out=[]) == []
    n, (rows, cols) = names[0], states[2][names[0]].shape
    for bad, match in [
        (np.zeros((rows, cols), np.float32), "float32"),
        (np.zeros((rows, cols + 1), states[2][n].dtype), "is bfloat16"),
        (np.zeros((rows, cols), states[2][n].dtype)[None][0].view(), None),
    ]:
        if match is None:
            bad.flags.writeable = False
            match = "read-only"
        with pytest.raises(InvalidInputError, match=match) as e:
            ro.read_boxes(2, [(n, (0, 0), (rows, cols))], out=[bad])
        assert n in str(e.value)
    with pytest.raises(InvalidInputError, match="2 arrays in out for 1 boxes"):
        ro.read_boxes(2, [(n, (0, 0), (rows, cols))], out=[outs[0], outs[0]])


@pytest.mark.parametrize("sparse", [False, True])
def test_read_boxes_into_arrays_is_exact_at_every_depth_of_a_chain(sparse):
    """read_boxes(out=...) at each depth of a chain (SPARSE deltas applied in place, or dense ones), boxes whole
    and cut across chunks, in contiguous and strided arrays: the bits committed, NaN payloads and -0.0 included."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    w.reshape(-1)[:4] = np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x00000001], np.uint32).view(np.float32)
    states = [w]
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=2048)
    traj.commit(0, {"w": w})
    for step in range(1, 5):
        w = w.copy()
        idx = rng.choice(w.size, w.size // 50, replace=False)
        w.reshape(-1)[idx] = rng.standard_normal(len(idx)).astype(np.float32)
        states.append(w)
        traj.commit(step, {"w": w}, sparse=sparse)
    boxes = [("w", (0, 0), (64, 48)), ("w", (5, 3), (40, 30)), ("w", (0, 0), (32, 48))]
    for step, want in enumerate(states):
        ro = ulstore.open(traj.url, mode="r", cache_bytes=0)  # no kept step, no cache: the whole chain walked
        outs = [np.empty(shape, np.float32) for _, _, shape in boxes]
        outs[1] = np.empty((40, 31), np.float32)[:, :30]
        ro.read_boxes(step, boxes, out=outs)
        for (_, (r, c), (nr, nc)), got in zip(boxes, outs):
            np.testing.assert_array_equal(bits(got), bits(want[r : r + nr, c : c + nc]), err_msg=f"step {step}")


def test_pieces_from_several_writers_make_one_logical_tensor():
    states = states_bf16(20)
    name = "model.layers.0.mlp.up_proj.weight"
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=1024)
    records = []
    for rank, cut in enumerate(([0, 40], [40, None])):  # two "ranks", each with its own writer and pack
        w = traj.piece_writer(0)
        for n, v in states[0].items():
            if v.ndim == 2 and v.shape[0] >= 96:
                w.write(n, np.ascontiguousarray(v[cut[0] : cut[1]]), offset=(cut[0], 0), shape=v.shape)
            elif rank == 0:
                w.write(n, v)
        records += pickle.loads(pickle.dumps(w.close()))  # records travel between processes
    assert len({p for r in records for p in r.packs}) == 2
    traj.finalize(0, records, metadata={"ranks": 2})
    ro = ulstore.open(traj.url, mode="r")
    assert_state_equal(ro.read(0), states[0])
    assert len(ro._reader.tensor(0, name).pieces) == 2
    g = ro[0]
    np.testing.assert_array_equal(bits(g[name][30:50, 3:9]), bits(states[0][name][30:50, 3:9]))  # across the cut
    np.testing.assert_array_equal(bits(ro.read_box(0, name, (38, 1), (5, 7))), bits(states[0][name][38:43, 1:8]))
    # the next step from 3 ranks cut elsewhere: deltas against the overlapping regions of step 0
    cuts = [25, 70]
    records = []
    for a, b in zip([0, *cuts], [*cuts, 1 << 30]):
        w = traj.piece_writer(1)
        for n, v in states[1].items():
            if v.ndim == 2 and v.shape[0] >= 96:
                w.write(n, np.ascontiguousarray(v[a:b]), offset=(a, 0), shape=v.shape)
            elif a == 0:
                w.write(n, v)
        records += w.close()
    traj.finalize(1, records)
    ro = ulstore.open(traj.url, mode="r")
    assert_state_equal(ro.read(1), states[1])
    assert traj.info(1).anchor_distance == 1
    changes = [c for c in ro.changes(1) if c.tensor == name]
    assert {c.piece for c in changes} == {0, 1, 2} and all(c.kind == "delta" for c in changes)
    assert ro.verify().ok
    one = ulstore.open(_mem(), mode="w", chunk_bytes=1024)  # the same states committed unsharded
    one.commit(0, states[0])
    one.commit(1, states[1])
    assert traj.stats()["blob_bytes"] < 1.3 * one.stats()["blob_bytes"]


def test_pieces_says_how_a_step_stores_a_tensor():
    w_state = np.arange(60, dtype=np.float32).reshape(15, 4)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=32)  # 8 floats: 2-row chunks of a 4-column band
    traj.commit(0, {"w": w_state})
    assert traj.pieces(0, "w") == [((0, 0), (15, 4), (2, 4))]  # unsharded: one piece at offset 0
    records = []
    for a, b in ((0, 8), (8, 15)):  # two writers, as two ranks
        w = traj.piece_writer(1)
        w.write("w", w_state[a:b] + 1, offset=(a, 0), shape=(15, 4), chunks=(3, 4) if a else None)
        records += w.close()
    traj.finalize(1, records)
    ro = ulstore.open(traj.url, mode="r")
    assert ro.pieces(1, "w") == [((0, 0), (8, 4), (2, 4)), ((8, 0), (7, 4), (3, 4))]
    assert ro.pieces("main", "w") == ro.pieces(1, "w")  # a ref names a step
    with pytest.raises(TensorNotFoundError):
        ro.pieces(1, "v")


def test_finalize_refuses_pieces_that_do_not_tile():
    w_state = np.arange(40, dtype=np.float32).reshape(10, 4)
    traj = ulstore.open(_mem(), mode="w")
    w = traj.piece_writer(0)
    w.write("w", w_state[:6], offset=(0, 0), shape=(10, 4))
    w.write("w", w_state[5:], offset=(5, 0), shape=(10, 4))  # rows 5..6 twice
    with pytest.raises(InvalidInputError, match="tile"):
        traj.finalize(0, w.close())
    w = traj.piece_writer(0)
    w.write("w", w_state[:6], offset=(0, 0), shape=(10, 4))  # rows 6.. missing
    with pytest.raises(InvalidInputError, match="tile"):
        traj.finalize(0, w.close())
    w = traj.piece_writer(0)
    with pytest.raises(InvalidInputError, match="outside"):
        w.write("w", w_state, offset=(1, 0), shape=(10, 4))
    w.abort()
    a, b = traj.piece_writer(0), traj.piece_writer(0, parent=None, anchor=True)
    a.write("w", w_state)
    b.write("v", w_state)
    assert traj.steps == []
    traj.finalize(0, a.close() + b.close())  # same step, same parent, same anchor: fine
    c = traj.piece_writer(1)
    c.write("w", w_state + 1)
    d = traj.piece_writer(2)
    d.write("v", w_state)
    with pytest.raises(InvalidInputError, match="written for step 2"):
        traj.finalize(1, c.close() + d.close())


# -- snapshots -----------------------------------------------------------------------------------------


def test_snapshots_alongside_deltas_bound_the_chain(monkeypatch):
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for i in range(6):
        traj.commit(i, states[i], snapshot=i == 4)
    snap = entries(traj, 4)
    assert traj.info(4).anchor_distance == 0 and traj.info(5).anchor_distance == 1
    assert all(
        e["ref"] == 3 or e["ref"] is None or e["content"] == e2["content"] for e, e2 in zip(snap, entries(traj, 3))
    )
    assert all(e["snapshot"] is not None or e["ref"] is None for e in snap)
    changes = traj.changes(4)
    deltas = [c for c in changes if c.kind == "delta"]
    assert deltas and all(c.snapshot is not None for c in deltas)  # a replica in step reads the delta...
    blobs, snaps = traj.fetch_blobs(deltas), traj.fetch_blobs(deltas, snapshot=True)
    assert all(ulstore.inspect_blob(b)["delta"] for b in blobs)  # ...a late joiner the snapshot
    views = traj.fetch_blobs(deltas, snapshot=True, copy=False)  # the same bytes, not copied, not writeable
    assert all(isinstance(b, bytes) for b in snaps) and [bytes(v) for v in views] == snaps
    assert all(isinstance(v, memoryview) and v.readonly for v in views)
    assert not any(ulstore.inspect_blob(b)["delta"] for b in snaps)
    ro = ulstore.open(traj.url, mode="r")
    decodes = _Decodes(monkeypatch)
    assert_state_equal(ro.read(5), states[5])
    n = sum(len(t.pieces[0].ref) for t in ro._reader.tables(5).values())
    assert decodes.n <= 2 * n  # step 5 walks back to the snapshots of step 4, not to step 0
    assert ro.verify().ok


# -- files -----------------------------------------------------------------------------------------------


def test_files_are_kept_with_the_step_and_deduplicated():
    states = states_bf16(20)
    config = b'{"model_type": "toy", "hidden_size": 64}'
    tokenizer = bytes(range(256)) * 50
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0], files={"config.json": config, "tokenizer/vocab.bin": tokenizer})
    traj.commit(1, states[1], files={"config.json": config, "trainer_state.json": b'{"step": 1}'})
    traj.commit(2, states[2])
    assert traj.files(0) == ["config.json", "tokenizer/vocab.bin"] and traj.files(2) == []
    ro = ulstore.open(traj.url, mode="r")
    assert ro.read_file(0, "tokenizer/vocab.bin") == tokenizer and ro.read_file(1, "config.json") == config
    assert ro._reader.doc(1).files["config.json"].hash == ro._reader.doc(0).files["config.json"].hash
    d0, d1 = ro._reader.doc(0), ro._reader.doc(1)
    f0, f1 = d0.files["config.json"], d1.files["config.json"]
    assert (d0.packs[f0.pack], f0.offset) == (d1.packs[f1.pack], f1.offset)  # stored once
    with pytest.raises(TensorNotFoundError):
        ro.read_file(1, "tokenizer/vocab.bin")
    assert ro.info(0).content != ro.info(2).content  # files are part of a step's content
    f = d0.files["tokenizer/vocab.bin"]
    pid, off = d0.packs[f.pack], f.offset
    data = bytearray(ro._io.get(pack_key(pid)))
    data[off + 5] ^= 1
    ro._io.put(pack_key(pid), bytes(data))
    with pytest.raises(CorruptBlobError):
        ulstore.open(traj.url, mode="r").read_file(0, "tokenizer/vocab.bin")
    for bad in ({"../x": b""}, {"a\\b": b""}, {"x": "text"}, {"": b""}):
        with pytest.raises(InvalidInputError):
            traj.commit(3, states[3], files=bad)
    assert 3 not in traj


# -- change feed and hash chain ---------------------------------------------------------------------------


def test_change_feed_and_hash_chain():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    traj.commit(0, states[0])
    mixed = dict(states[1])
    mixed["model.in_proj.bias"] = states[0]["model.in_proj.bias"]  # unchanged
    mixed["new.weight"] = np.ones((3, 5), ml_dtypes.bfloat16)
    mixed["lm_head.weight"] = states[1]["lm_head.weight"][:, :10].copy()  # reshaped
    with pytest.warns(ulstore.FewSharedNamesWarning, match="lm_head.weight"):
        traj.commit(1, mixed)
    feed = traj.changes(1)
    kinds = {c.tensor: {x.kind for x in feed if x.tensor == c.tensor} for c in feed}
    assert kinds["model.in_proj.bias"] == {"unchanged"} and kinds["new.weight"] == {"new"}
    assert kinds["lm_head.weight"] == {"reshaped"}
    assert "delta" in kinds["model.layers.0.mlp.up_proj.weight"]
    counter = CountingIO(traj._io)
    chosen = [c for c in feed if c.kind == "delta"]
    blobs = traj.fetch_blobs(chosen)
    assert len(counter.packs()) < len(chosen)  # neighbouring blobs come in one range read
    old = traj.read(0)
    for c, blob in zip(chosen, blobs):  # apply a delta in place, as a weight-sync follower does
        region = tuple(slice(a, b) for a, b in zip(c.start, c.stop))
        target = old[c.tensor][region].copy()
        ulstore.decode_changes(blob, target).apply_to(target)
        np.testing.assert_array_equal(bits(target), bits(mixed[c.tensor][region]))
    i0, i1 = traj.info(0), traj.info(1)
    assert i1.parent_content == i0.content and i0.parent_content is None
    traj.delete(0)  # re-parenting keeps a step's content; the chain follows the new parent
    assert traj.info(1).content == i1.content and traj.info(1).parent_content is None
    assert traj.verify().ok


def _read_ahead_traj(**commit):
    """A trajectory of two steps, step 1 committed with ``commit``; a fresh reader of it (nothing cached)."""
    states = states_bf16(20)
    url = _mem()
    w = ulstore.open(url, mode="w", chunk_bytes=CHUNK, anchor_every=0)
    w.commit(0, states[0])
    w.commit(1, states[1], **commit)
    traj = ulstore.open(url)
    traj.changes(0)  # the parent's tables are held, as a follower in step holds them
    return traj, states, url


def test_read_ahead_fetches_a_steps_tables_and_blobs_in_one_request():
    traj, states, url = _read_ahead_traj()
    plain_traj = ulstore.open(url)  # another reader of the same steps
    counter = CountingIO(traj._io)
    feed = traj.changes(1, read_ahead=True)
    changed = [c for c in feed if c.kind != "unchanged"]
    assert changed and all(c.kind == "delta" for c in changed)
    blobs = traj.fetch_blobs(changed)
    reads = counter.packs()
    assert len(reads) == 1 and reads[0][1][0] == 0  # the pack's head and its table block, one range
    # exactly the bytes the step wrote: its blobs, then its table block
    doc = traj._reader.doc(1)
    assert reads[0][1][1] == doc.tables[0].offset + doc.tables[0].length
    assert sum(c.blob[2] for c in changed) == doc.tables[0].offset
    # the same feed and bytes as without read-ahead
    plain = plain_traj.changes(1)
    assert _feed(plain) == _feed(feed)
    assert blobs == plain_traj.fetch_blobs([c for c in plain if c.kind != "unchanged"])
    for c, blob in zip(changed, blobs):
        region = tuple(slice(a, b) for a, b in zip(c.start, c.stop))
        target = traj.read(0)[c.tensor][region].copy()
        ulstore.decode_changes(blob, target).apply_to(target)
        np.testing.assert_array_equal(bits(target), bits(states[1][c.tensor][region]))
    # the bytes read ahead serve one fetch: a second one reads the pack again
    counter.reset()
    assert traj.fetch_blobs(changed) == blobs
    assert len(counter.packs()) >= 1


def test_bytes_read_ahead_and_never_fetched_are_bounded():
    """A caller that reads ahead and never fetches holds the heads of the last two packs read, no more."""
    states = states_bf16(20)
    url = _mem()
    w = ulstore.open(url, mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for step in range(5):
        w.commit(step, states[step])
    traj = ulstore.open(url)
    for step in range(1, 5):
        traj.changes(step, read_ahead=True)
    held = traj._reader._ahead
    assert len(held) == _MAX_AHEAD_PACKS == 2
    last = [traj._reader.doc(s) for s in (3, 4)]
    assert set(held) == {d.packs[d.tables[0].pack] for d in last}
    assert all(len(v) == d.tables[0].offset for v, d in zip(held.values(), last))


@pytest.mark.parametrize("commit", [{"snapshot": True}, {"files": {"config.json": b'{"a": 1}'}}])
def test_read_ahead_reads_nothing_a_follower_would_not_fetch(commit):
    """A step whose pack also holds snapshots or files: its tables are read alone, as without read-ahead."""
    traj, _, _ = _read_ahead_traj(**commit)
    counter = CountingIO(traj._io)
    feed = traj.changes(1, read_ahead=True)
    doc = traj._reader.doc(1)
    assert counter.packs() == [
        (pack_key(doc.packs[doc.tables[0].pack]), (doc.tables[0].offset, doc.tables[0].offset + doc.tables[0].length))
    ]
    counter.reset()
    changed = [c for c in feed if c.kind != "unchanged"]
    traj.fetch_blobs(changed)
    assert sum(b - a for _, (a, b) in counter.packs()) < doc.tables[0].offset  # only the blobs asked for


def _feed(changes) -> list[tuple]:
    return [
        (c.tensor, c.piece, c.coord, c.start, c.stop, c.dtype, c.kind, c.content, c.ref, c.blob, c.snapshot)
        for c in changes
    ]


def _expected_feed(r, step) -> list[tuple]:
    """The change feed of ``step``, chunk by chunk from the tables of the step and its parent."""
    expected = []
    tables, parent = r.tables(step), r.tables(step - 1)
    for n, t in tables.items():
        pt = parent.get(n)
        for j, p in enumerate(t.pieces):
            same = pt is not None and pt.dtype == t.dtype and pt.shape == t.shape
            pj = pt.find_piece(p.layout) if same else None
            for i, coord in enumerate(p.coords()):
                if pt is None:
                    kind = "new"
                elif not same:
                    kind = "reshaped"
                elif pj is not None and bytes(pt.pieces[pj].content[i]) == bytes(p.content[i]):
                    kind = "unchanged"
                else:
                    kind = "intra" if p.ref[i] < 0 else "delta"
                ref, snap, packs = int(p.ref[i]), p.snapshot(i), r.doc(step).packs
                expected.append(
                    (n, j, coord, *p.box(coord), t.dtype, kind, bytes(p.content[i]).hex(), None if ref < 0 else ref)
                    + ((packs[int(p.pack[i])], int(p.off[i]), int(p.length[i])),)
                    + (None if snap is None else (packs[snap[0]], snap[1], snap[2]),)
                )
    return expected


def test_change_feed_matches_the_tables_chunk_by_chunk():
    states = states_bf16(20)
    name = "model.layers.0.mlp.up_proj.weight"
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    traj.commit(0, states[0])
    records = []
    for a, b in ((40, 1 << 30), (0, 40)):  # two pieces, written in reverse order
        w = traj.piece_writer(1)
        for n, v in states[1].items():
            if n == name:
                w.write(n, np.ascontiguousarray(v[a:b]), offset=(a, 0), shape=v.shape)
            elif a == 0:
                w.write(n, v)
        records += w.close()
    traj.finalize(1, records)
    mixed = dict(states[2])
    mixed["model.in_proj.bias"] = states[1]["model.in_proj.bias"]  # unchanged
    mixed["lm_head.weight"] = states[2]["lm_head.weight"][:, :10].copy()  # reshaped
    with pytest.warns(ulstore.FewSharedNamesWarning, match="lm_head.weight"):
        traj.commit(2, mixed)
    r = ulstore.open(traj.url, mode="r")._reader
    for step in (1, 2):
        expected = _expected_feed(r, step)
        assert _feed(traj.changes(step)) == expected
    kinds = {c.kind for c in traj.changes(2) if c.tensor == name}
    assert kinds <= {"delta", "intra", "unchanged"} and "delta" in kinds  # the pieces of step 1 are found
    assert {c.kind for c in traj.changes(2) if c.tensor == "model.in_proj.bias"} == {"unchanged"}
    c = traj.changes(2)[0]
    assert c == dataclasses.replace(c) and hash(c) == hash(dataclasses.replace(c))  # a plain frozen dataclass
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kind = "new"  # type: ignore[misc]


def test_change_feed_of_steps_with_their_parents_layout_and_after_a_layout_change(monkeypatch):
    """A step whose table block has its parent's exact header bytes gets its feed from whole columns and
    what was derived once for those headers; any other step (a tensor rechunked, added, or snapshots
    declared in one step only) from the tables, piece by piece.  Both give the feed the tables say."""
    from ulstore.store.format import _table_block
    from ulstore.store.read import _change_feed

    states = states_bf16(20)
    name = "model.layers.0.mlp.up_proj.weight"
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    traj.commit(0, states[0])
    traj.commit(1, states[1])  # same layout
    for i in (2, 3, 4):
        traj.commit(i, states[i], snapshot=True)  # declares snapshots (step 2: other headers; then mostly not)
    mixed = dict(states[5])
    mixed["model.in_proj.bias"] = states[4]["model.in_proj.bias"]  # unchanged
    traj.commit(5, mixed)  # no snapshots: other headers
    mixed = dict(states[6])
    mixed[name] = np.ascontiguousarray(states[6][name][:, :-1])  # reshaped
    mixed["new.weight"] = np.ones((3, 5), ml_dtypes.bfloat16)  # new
    with pytest.warns(ulstore.FewSharedNamesWarning, match=name):
        traj.commit(6, mixed)
    mixed = dict(mixed)
    mixed["lm_head.weight"] = states[7]["lm_head.weight"]
    traj.commit(7, mixed)  # the layout of step 6
    w = traj.piece_writer(8)  # the same values, rechunked: other headers
    for n, v in mixed.items():
        w.write(n, v, chunks=(1,) * v.ndim if n == "model.in_proj.bias" else None)
    traj.finalize(8, w.close())
    mixed = {**mixed, "lm_head.weight": states[8]["lm_head.weight"]}
    traj.commit(9, mixed)  # the chunks of step 8

    _table_block._HEADS.clear()
    fast = []
    real = _change_feed._same_layout_changes
    monkeypatch.setattr(_change_feed, "_same_layout_changes", lambda *a: fast.append(a[1]) or real(*a))
    slow = _Count(monkeypatch, _change_feed, "_piece_changes")
    ro = ulstore.open(traj.url, mode="r")  # a reader that wrote nothing (a writer knows its tables only)

    def layout(step):  # what a block's header bytes say (with one block per step, as here)
        tables = ro._reader.tables(step)
        return [(n, t.dtype, t.shape, [(p.layout, p.snap is not None) for p in t.pieces]) for n, t in tables.items()]

    columns = []
    for step in range(1, 10):
        before, feed = slow.n, ro.changes(step)
        assert _feed(feed) == _expected_feed(ro._reader, step), step
        if slow.n == before:
            columns.append(step)
        assert (slow.n == before) == (layout(step) == layout(step - 1)), step
    assert fast == list(range(1, 10))
    assert {1, 4, 7, 9} <= set(columns) and not {2, 5, 6, 8} & set(columns)
    kinds = {c.tensor: c.kind for c in ro.changes(6)}
    assert kinds[name] == "reshaped" and kinds["new.weight"] == "new"
    assert {c.kind for c in ro.changes(5) if c.tensor == "model.in_proj.bias"} == {"unchanged"}
    assert {c.kind for c in ro.changes(4)} == {"delta", "unchanged"}
    assert all(c.snapshot is not None for c in ro.changes(4) if c.kind == "delta")
    assert ro.tensors(9) == {n: (v.shape, v.dtype) for n, v in sorted(mixed.items())}
    again = ulstore.open(traj.url, mode="r")
    parent = again._reader.blocks(8)[0]
    _table_block._HEADS.clear()  # step 9's headers are parsed again: another object, the same bytes
    before = slow.n
    assert _feed(again.changes(9)) == _expected_feed(again._reader, 9) and slow.n == before
    assert again._reader.blocks(9)[0].heads is not parent.heads


def test_verify_names_a_broken_hash_chain():
    from tests.helpers.store import rewrite_step

    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    traj.commit(1, states[1])
    rewrite_step(traj, 1, body=lambda b: b.update(parent_content="0" * 32))
    report = ulstore.open(traj.url, mode="r").verify(raise_on_error=False)
    assert [e["key"] for e in report.errors] == ["steps/1/zarr.json"] and "hash chain" in report.errors[0]["message"]


# -- the kept parent and deep reads ---------------------------------------------------------------------------


def _chunks(traj, step) -> int:
    return sum(p.n for t in traj._reader.tables(step).values() for p in t.pieces)


def test_kept_parent_a_training_loop_never_decodes(monkeypatch):
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    decodes = _Decodes(monkeypatch)
    for i in range(5):
        traj.commit(i, states[i])
    assert decodes.n == 0
    fresh = ulstore.open(traj.url, mode="a")  # a new process: decodes its parent once, then never again
    fresh.commit(5, states[5])
    first = decodes.n
    assert 0 < first <= _chunks(traj, 4) * (traj.info(4).anchor_distance + 1)
    for i in range(6, 9):
        fresh.commit(i, states[i])
    assert decodes.n == first
    off = ulstore.open(traj.url, mode="a", keep_parent=False, cache_bytes=0)  # the fallback decodes, exactly
    off.commit(9, states[9])
    assert decodes.n > first
    assert_state_equal(ulstore.open(traj.url, mode="r").read(9), states[9])


@pytest.mark.parametrize("block_bytes", [None, 512])
def test_change_columns_say_what_the_feed_says_of_the_changed_chunks(monkeypatch, block_bytes):
    """Columns for a step with its parent's layout (its tables in one block or in several), None for a root
    step or after a layout change; row by row what changes() says of the chunks that are not unchanged, the
    same blobs fetched, and one FeedLayout object for the steps of one layout (feed_layout() gives it too)."""
    from ulstore.store.commit import _finalize

    if block_bytes is not None:
        monkeypatch.setattr(_finalize, "TABLE_BLOCK_BYTES", block_bytes)
    states = states_bf16(6)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for step in range(3):
        traj.commit(step, states[step])
    added = {**states[3], "new.weight": np.ones((3, 5), ml_dtypes.bfloat16)}
    traj.commit(3, added)  # a tensor added: another layout
    traj.commit(4, {**states[4], "new.weight": added["new.weight"]}, anchor=True)  # every changed chunk intra
    ro = ulstore.open(traj.url, mode="r")
    assert (len(ro._reader.blocks(1)) > 1) == (block_bytes is not None)
    assert ro.change_columns(0) is None and ro.change_columns(3) is None
    for step in (1, 2, 4):
        cols, feed = ro.change_columns(step), ro.changes(step)
        assert cols is not None
        assert list(cols.layout.rows) == [(c.tensor, c.piece, c.coord, c.start, c.stop, c.dtype) for c in feed]
        changed = [c for c in feed if c.kind != "unchanged"]
        assert 0 < len(changed) < len(feed)
        assert cols.changed.tolist() == [i for i, c in enumerate(feed) if c.kind != "unchanged"]
        assert cols.ref.tolist() == [-1 if c.ref is None else c.ref for c in changed]
        assert [row.tobytes().hex() for row in cols.content] == [c.content for c in changed]
        assert cols.blobs == [c.blob for c in changed]
        assert ro.fetch_blobs(cols) == ro.fetch_blobs(changed)
    assert set(ro.change_columns(2).ref.tolist()) == {1} and set(ro.change_columns(4).ref.tolist()) == {-1}
    assert ro.change_columns(2).layout is ro.change_columns(1).layout
    # a step held whole knows the layout its children's columns carry (a writer never parsed its tables)
    assert ro.feed_layout(0) is ro.feed_layout(2) is ro.change_columns(1).layout
    assert ro.feed_layout(3) is ro.change_columns(4).layout is not ro.feed_layout(2)
    assert traj.feed_layout(2) is None
    assert ro.change_columns(4).layout is not ro.change_columns(1).layout
    with pytest.raises(InvalidInputError, match="no snapshots"):
        ro.fetch_blobs(ro.change_columns(1), snapshot=True)


def test_change_columns_of_some_tensors_are_the_rows_of_those_tensors(monkeypatch):
    """``change_columns(step, names)``: the rows of the whole columns whose tensor is named (blocks split or
    not), in the same layout; their blobs fetched alone; a name the step lacks is TensorNotFoundError."""
    from ulstore.store.commit import _finalize

    monkeypatch.setattr(_finalize, "TABLE_BLOCK_BYTES", 512)
    states = states_bf16(3)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for step in range(3):
        traj.commit(step, states[step])
    ro = ulstore.open(traj.url, mode="r")
    assert len(ro._reader.blocks(1)) > 1
    everything = sorted(states[0])
    for names in (everything[:1], everything[1::2], everything[-2:], everything):
        for step in (1, 2):
            whole, some = ro.change_columns(step), ro.change_columns(step, names)
            keep = [k for k, i in enumerate(whole.changed.tolist()) if whole.layout.rows[i][0] in names]
            assert some.layout is whole.layout and 0 < len(keep)
            assert some.changed.tolist() == whole.changed[keep].tolist()
            assert some.ref.tolist() == whole.ref[keep].tolist()
            assert some.content.tobytes() == whole.content[keep].tobytes()
            assert some.blobs == [whole.blobs[k] for k in keep]
            assert ro.fetch_blobs(some) == [b for k, b in enumerate(ro.fetch_blobs(whole)) if k in set(keep)]
            assert {some.layout.rows[i][0] for i in some.changed.tolist()} <= set(names)
    for step in (0, 1):  # a root step has no columns, but its tensors are known
        with pytest.raises(TensorNotFoundError, match=rf"no tensor 'nope' in step {step}"):
            ro.change_columns(step, [everything[0], "nope"])
    assert ro.change_columns(0, everything[:1]) is None


def test_a_step_of_many_table_blocks_parses_their_headers_once_for_all_steps(monkeypatch):
    """A follower parses every table block of a step per version: with more blocks than a short list of recent
    headers would hold (a 1T-parameter step has hundreds), each block's headers are still found by their first
    bytes and parsed once; with a budget too small to keep them, they are parsed again, to the same tables."""
    from ulstore.store.commit import _finalize
    from ulstore.store.format import _table_block

    monkeypatch.setattr(_finalize, "TABLE_BLOCK_BYTES", 256)
    states = states_bf16(6)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for step in range(6):
        traj.commit(step, states[step])
    monkeypatch.setattr(_table_block, "_HEADS", _table_block._HeadsCache(64 << 20))
    parses = _Count(monkeypatch, _table_block, "_parse_heads")
    ro = ulstore.open(traj.url, mode="r")
    n_blocks = len(ro._reader.blocks(0))
    assert n_blocks > 8 and parses.n == n_blocks
    tables = [ro._reader.tables(step) for step in range(6)]
    assert parses.n == n_blocks  # steps 1-5: the same headers, none parsed again
    assert len(_table_block._HEADS) == n_blocks
    for step in range(1, 6):
        assert ro.change_columns(step).layout is ro.change_columns(1).layout
    tight = _table_block._HeadsCache(1)  # keeps one parse at a time
    monkeypatch.setattr(_table_block, "_HEADS", tight)
    again = ulstore.open(traj.url, mode="r")
    for step in range(6):
        got = again._reader.tables(step)
        assert list(got) == list(tables[step])
        for name, t in got.items():
            want = tables[step][name]
            assert (t.dtype, t.shape) == (want.dtype, want.shape)
            for p, q in zip(t.pieces, want.pieces, strict=True):
                assert p.layout == q.layout and np.array_equal(p.content, q.content)
                assert np.array_equal(p.ref, q.ref) and np.array_equal(p.length, q.length)
        assert len(tight) == 1
    assert parses.n == n_blocks + 6 * n_blocks
    assert_state_equal(again.read(5), states[5])


def test_consecutive_reads_cost_one_decode_per_changed_chunk(monkeypatch):
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    for i in range(8):
        traj.commit(i, states[i])
    ro = ulstore.open(traj.url, mode="r", cache_bytes=0)
    decodes = _Decodes(monkeypatch)
    assert_state_equal(ro.read(7), states[7])  # depth 7 from nothing: each chain once
    n = _chunks(traj, 7)
    assert n < decodes.n <= 8 * n
    ro = ulstore.open(traj.url, mode="r", cache_bytes=0)
    decodes.n = 0
    for i in range(8):
        assert_state_equal(ro.read(i), states[i])
    # the first read is a one-off (it keeps nothing), so the second decodes its chains from step 0;
    # from then on one decode per chunk per step (unchanged chunks cost none)
    assert decodes.n <= 9 * n
    ro = ulstore.open(traj.url, mode="r", cache_bytes=0)
    assert_state_equal(ro.read(0), states[0])  # a one-off read of a root step keeps nothing
    assert ro._kept.nbytes == 0


def test_a_failed_commit_leaves_the_kept_parent_sound():
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, threads=2)
    traj.commit(0, states[0])
    real = _piece_writer.encode_chunk
    calls = {"n": 0}

    def fail_late(*a):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("boom")
        return real(*a)

    _piece_writer.encode_chunk = fail_late
    try:
        with pytest.raises(RuntimeError):
            traj.commit(1, states[1])  # half the kept step now holds step 1's values
    finally:
        _piece_writer.encode_chunk = real
    traj.commit(1, states[2])  # so this is coded against what step 0 really holds, not the kept values
    ro = ulstore.open(traj.url, mode="r")
    assert_state_equal(ro.read(0), states[0])
    assert_state_equal(ro.read(1), states[2])


def test_streaming_commit_holds_a_bounded_window(tmp_path):
    """Memory-mapped tensors, kept parent off: a commit allocates a window of chunks, whatever the step's size."""
    import tracemalloc

    rng = np.random.default_rng(0)

    def peak(n_tensors: int) -> tuple[int, int]:
        d = tmp_path / str(n_tensors)
        d.mkdir()
        arrays = {f"w{i}": np.memmap(d / f"w{i}", np.float32, "w+", shape=(256, 1024)) for i in range(n_tensors)}
        for a in arrays.values():
            a[:] = rng.normal(size=a.shape).astype(np.float32)
        traj = ulstore.open(str(d / "t"), mode="w", chunk_bytes=128 << 10, keep_parent=False, threads=2)
        traj.commit(0, arrays)
        for a in arrays.values():
            a[::7] += np.float32(1e-3)
        tracemalloc.start()
        try:
            traj.commit(1, arrays)
            got = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert_state_equal(ulstore.open(str(d / "t"), mode="r").read(1), {k: np.asarray(v) for k, v in arrays.items()})
        return got, sum(a.nbytes for a in arrays.values())

    small, small_bytes = peak(8)  # 8 MiB
    large, large_bytes = peak(32)  # 32 MiB: four times the data, about the same memory
    assert large < 1.5 * small and large < 0.2 * large_bytes, (small, large)


def test_identical_blobs_are_written_once():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=1024)
    traj.commit(0, {"embed": w, "lm_head": w.copy(), "zeros": np.zeros((64, 32), np.float32)})
    e = entries(traj, 0)
    blobs = [x["blob"] for x in e]
    assert len(blobs) == 24 and len(set(blobs)) == 8 + 1  # the tie shares every blob; the zero chunks share one
    w2 = w + np.float32(1e-4)
    traj.commit(1, {"embed": w2, "lm_head": w2.copy(), "zeros": np.zeros((64, 32), np.float32)})
    new = [x for x in entries(traj, 1) if x["tensor"] != "zeros"]
    assert len({x["blob"] for x in new}) == len(new) // 2
    assert_state_equal(
        ulstore.open(traj.url, mode="r").read(1), {"embed": w2, "lm_head": w2, "zeros": np.zeros((64, 32), np.float32)}
    )


def test_a_commit_writes_one_pack_and_two_small_objects(tmp_path):
    """One pack, the step document, one ref entry; plus the pending marker (put, then deleted)."""
    states = states_bf16(20)
    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=CHUNK)
    traj.commit(0, states[0])
    counter: dict = {"put": [], "create": [], "delete": [], "stream": []}
    io = traj._io
    for name in ("put", "create", "delete"):
        real = getattr(io, name)
        setattr(io, name, lambda k, *d, real=real, name=name: counter[name].append(k) or real(k, *d))
    real_open = io.open_writer
    io.open_writer = lambda k, **kw: counter["stream"].append(k) or real_open(k, **kw)
    traj.commit(1, states[1])
    marker = counter["put"][0]
    assert re.fullmatch(r"pending/commit/0/1\.[0-9a-f]{32}\.json", marker)  # a token per writer
    assert counter == {
        "put": [marker],
        "create": ["steps/1/zarr.json", "refs/main/00000000000000000001.json"],
        "delete": [marker],
        "stream": [counter["stream"][0]],
    }
    assert counter["stream"][0].startswith("packs/")
    assert len(traj._reader.doc(1).tables) == 1 and traj._reader.doc(1).packs[-1] in traj._reader.doc(1).packs


def test_add_of_a_sharded_checkpoint_streams_it(tmp_path):
    """``ulstore add`` of sharded safetensors memory-maps them: the commit holds a window, not the checkpoint."""
    import tracemalloc

    from ulstore.io import checkpoints, import_checkpoint

    rng = np.random.default_rng(0)
    state = {f"layer.{i}.weight": rng.normal(size=(512, 1024)).astype(ml_dtypes.bfloat16) for i in range(16)}
    checkpoints.save_safetensors(state, tmp_path / "ckpt-1", max_shard_size="4MB")  # 16 MiB in 4 shards
    loaded = checkpoints.load(tmp_path / "ckpt-1", mmap=True)
    assert all(isinstance(v, np.memmap) for v in loaded.tensors.values())
    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=256 << 10, keep_parent=False, threads=2)
    tracemalloc.start()
    try:
        import_checkpoint(traj, tmp_path / "ckpt-1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.25 * sum(v.nbytes for v in state.values()), peak
    assert_state_equal(ulstore.open(str(tmp_path / "t"), mode="r").read(1), state)


def test_the_kept_step_copies_nothing_for_a_chunk_it_already_holds():
    from ulstore.store.read._kept import KeptPiece

    kp = KeptPiece(((0,), (4,), (4,)), np.dtype(np.float32), 1)
    a, b = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    kp.put(0, a, b"x" * 16)
    held = kp.arrays[0]
    kp.put(0, b, b"x" * 16)  # the same content hash: an unchanged chunk, nothing to copy
    assert kp.arrays[0] is held and (held == a).all()
    kp.put(0, b, b"y" * 16)  # new content: copied in place
    assert kp.arrays[0] is held and (held == b).all() and kp.get(0, b"y" * 16) is held


def test_a_commit_that_grows_the_kept_step_returns_free_memory(monkeypatch):
    from ulstore.store.commit import _commit
    from ulstore.store.read import _kept

    _kept.release_free_memory()  # glibc: malloc_trim; elsewhere a no-op; never raises
    calls = []
    monkeypatch.setattr(_commit, "release_free_memory", lambda: calls.append(1))
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK, anchor_every=0)
    traj.commit(0, states[0])
    assert calls == [1]  # the kept step was allocated
    traj.commit(1, states[1])
    assert calls == [1]  # overwritten in place: nothing to return


def test_step_documents_cached_are_bounded_and_read_again_checked(monkeypatch):
    from ulstore.errors import CorruptManifestError
    from ulstore.store.read import _table_reader

    monkeypatch.setattr(_table_reader, "_MAX_DOCS", 3)
    states = states_bf16(20)
    traj = ulstore.open(_mem(), mode="w", chunk_bytes=CHUNK)
    for i in range(6):
        traj.commit(i, states[i])
    ro = ulstore.open(traj.url, mode="r")
    assert [i.step for i in ro.log(5)] == [5, 4, 3, 2, 1, 0]  # walks every document
    assert sorted(ro._reader._docs) == [0, 1, 2]  # the first read went first
    key = "steps/5/zarr.json"
    raw = bytearray(ro._io.get(key))
    raw[len(raw) // 2] ^= 1
    ro._io.put(key, bytes(raw))
    with pytest.raises(CorruptManifestError):  # an evicted document is read again, and checked again
        ro.info(5)
    assert_state_equal(ro.read(4), states[4])
    assert len(ro._reader._docs) <= 3


def test_a_step_document_handed_over_spares_the_reader_its_request():
    """step_document() on the writer, accept_step_document() on a reader holding its parent: the step is then read
    with its blobs' ranges only, exactly; a damaged, unlinked, mismatched or different document is refused (or, on
    another parent, not kept)."""
    states = states_bf16(3)
    traj = ulstore.open(_mem(), mode="w")
    for step in range(3):
        traj.commit(step, states[step])
    doc = traj.step_document(2)
    assert doc == traj._io.get("steps/2/zarr.json") and doc.isascii()
    assert traj.step_document("main") == doc
    with pytest.raises(InvalidInputError, match="mode='r'"):
        traj.accept_step_document(2, doc, parent=(1, traj.info(1).content))  # a writer reads its own
    ro = ulstore.open(traj.url, mode="r", cache_bytes=0)
    held = (1, ro.info(1).content)
    counter = CountingIO(ro._io)
    info = ro.accept_step_document(2, doc.decode(), parent=held)
    assert info == traj.info(2) and info.parent == 1
    assert ro.accept_step_document(2, doc, parent=held) == info  # the same one again
    assert_state_equal(ro.read(2), states[2])
    assert "steps/2/zarr.json" not in counter.docs() and counter.packs()
    fresh = ulstore.open(traj.url, mode="r")
    for bad, step, parent, err, match in [
        (doc[:-2] + b"0}", 2, held, CorruptManifestError, "checksum|canonical"),
        (doc, 1, held, CorruptManifestError, "is for step 2"),
        (b"not json", 2, held, CorruptManifestError, "malformed"),
        (bytearray(MAX_DOCUMENT_BYTES + 1), 2, held, InvalidInputError, "at most"),
        ([1, 2], 2, held, InvalidInputError, "bytes or str"),
        (doc, -1, held, InvalidInputError, "step"),
    ]:
        with pytest.raises(err, match=match):
            fresh.accept_step_document(step, bad, parent=parent)
    assert fresh.accept_step_document(2, doc, parent=(0, traj.info(0).content)) == info  # another parent: not kept
    assert fresh.accept_step_document(2, doc, parent=(1, "0" * 32)) == info  # another parent content: not kept
    assert fresh._reader._docs == {}  # nothing kept from the refused ones
    other = ulstore.open(_mem(), mode="w")
    other.commit(0, states[0])
    other.commit(1, states[2], parent=0)  # a step 1 of another trajectory, on the same step 0
    ro.info(1)
    with pytest.raises(CorruptManifestError, match="differs from the step document already read"):
        ro.accept_step_document(1, other.step_document(1), parent=(0, traj.info(0).content))
    assert ro.info(1) == traj.info(1)


def test_a_commit_says_which_tensors_changed_dtype_or_shape(tmp_path):
    """A commit stores a float tensor whose dtype or shape moved since the parent whole (a delta needs its
    parent's dtype and shape): it warns, naming them, as an import does (the same warning and words, once), on a
    delta step or an anchor; integer tensors (never deltas) and new or unchanged tensors say nothing."""
    import warnings

    from ulstore import io as uio
    from ulstore.io import checkpoints

    rng = np.random.default_rng(5)
    w = (0.02 * rng.standard_normal((64, 16))).astype(np.float32)
    b = (0.02 * rng.standard_normal(16)).astype(np.float32)
    traj = ulstore.open(_mem(), mode="w", anchor_every=0, chunk_bytes=1024)
    traj.commit(0, {"w": w, "b": b, "i": np.arange(4, dtype=np.int32)})
    with pytest.warns(FewSharedNamesWarning) as caught:
        traj.commit(1, {"w": w.astype(ml_dtypes.bfloat16), "b": b[:8], "i": np.arange(6, dtype=np.int32)})
    (warning,) = [c.message for c in caught.list]
    assert isinstance(warning, FewSharedNamesWarning) and warning.parent == 0
    assert warning.changed == {
        "w": (((64, 16), np.dtype(np.float32)), ((64, 16), np.dtype(ml_dtypes.bfloat16))),
        "b": (((16,), np.dtype(np.float32)), ((8,), np.dtype(np.float32))),
    }
    text = str(warning)
    assert text.startswith("step 1: 2 tensors have another dtype or shape than in parent step 0 ('w' float32 64x16")
    assert "'b' float32 16 -> float32 8" in text and "stored whole" in text and "parent's dtype" in text
    assert caught.list[0].filename == __file__  # it points at the caller's commit
    assert {e["ref"] for e in entries(traj, 1) if e["tensor"] in ("w", "b")} == {None}
    with pytest.warns(
        FewSharedNamesWarning, match=r"step 1 \('w' bfloat16 64x16 -> float32 64x16, 'b' float32 8 -> float32 16\)"
    ):
        traj.commit(2, {"w": w, "b": b, "new": b}, anchor=True)  # an anchor too: the dtype moved
    with warnings.catch_warnings():
        warnings.simplefilter("error", FewSharedNamesWarning)
        traj.commit(3, {"w": w, "b": b + 1, "i": np.arange(9, dtype=np.int32), "new": b})  # same dtypes and shapes
    with pytest.warns(FewSharedNamesWarning, match="'w' float32 64x16 -> float16 64x16") as caught:
        traj.commit(4, {"w": w.astype(np.float16), "b": b})
    assert len(caught.list) == 1
    # an import whose dtype moved: one warning (the commit's), not the import's and the commit's
    path = tmp_path / "step_5.safetensors"
    checkpoints.save_safetensors({"w": w.astype(np.float32), "b": b}, path)
    with pytest.warns(FewSharedNamesWarning) as caught:
        uio.import_checkpoint(traj, path)
    assert [str(c.message)[:7] for c in caught.list] == ["step 5:"] and "'w' float16" in str(caught.list[0].message)
