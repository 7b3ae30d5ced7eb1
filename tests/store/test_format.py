"""The bytes of format 2: table blocks, step documents, pieces, packs, hashes (units, no trajectory)."""

from __future__ import annotations

import struct
import uuid

import ml_dtypes
import numpy as np
import pytest

from tests.helpers.bits import assert_bits_equal
from ulstore.core.objects import ObjectStore
from ulstore.errors import CorruptBlobError, CorruptManifestError
from ulstore.store.format._chunk_tables import Piece, TensorTable, content_checksum, pieces_problem
from ulstore.store.format._chunkcodec import decode_chunk, encode_chunk, zstd_compress, zstd_decompress
from ulstore.store.format._layout import is_pack_id, new_pack_id, pack_key
from ulstore.store.format._packs import PackStream, coalesce, fetch
from ulstore.store.format._stepdoc import FileRef, StepDoc, TableRef
from ulstore.store.format._table_block import TableError, decode_block, encode_block


def _piece(offset, shape, chunks, rng, n_packs=3, snapshots=False) -> Piece:
    n = int(np.prod([-(-s // c) for s, c in zip(shape, chunks)]))
    pack = np.sort(rng.integers(0, n_packs, n))
    length = rng.integers(1, 5000, n)
    off = np.zeros(n, np.int64)
    for k in range(n):  # mostly contiguous within a pack, sometimes a gap or a jump back
        if k and pack[k] == pack[k - 1]:
            off[k] = off[k - 1] + length[k - 1] + (0 if rng.random() < 0.8 else int(rng.integers(-2000, 9000)))
            off[k] = max(off[k], 0)
    snap = None
    if snapshots:
        snap = np.full((n, 3), -1, np.int64)
        has = rng.random(n) < 0.5
        snap[has] = np.column_stack(
            [rng.integers(0, n_packs, has.sum()), rng.integers(0, 10**9, has.sum()), rng.integers(1, 10**6, has.sum())]
        )
    return Piece(
        tuple(offset), tuple(shape), tuple(chunks),
        rng.integers(0, 256, (n, 16), dtype=np.uint8),
        np.where(rng.random(n) < 0.3, -1, rng.integers(0, 50, n)).astype(np.int64),
        pack.astype(np.int64), off, length.astype(np.int64), snap,
    )  # fmt: skip


def _tables(rng) -> list[TensorTable]:
    return [
        TensorTable("a.weight", np.dtype(ml_dtypes.bfloat16), (10, 6), "ulpack", (_piece((0, 0), (10, 6), (3, 6), rng),)),
        TensorTable(
            "b/sharded", np.dtype(np.float32), (8, 5), "ulpack",
            (_piece((0, 0), (4, 5), (3, 5), rng, snapshots=True), _piece((4, 0), (4, 5), (2, 5), rng)),
        ),
        TensorTable("c.step", np.dtype(np.int64), (), "zstd", (_piece((), (), (), rng),)),
        TensorTable("d.empty", np.dtype(np.float16), (0, 3), "ulpack", (_piece((0, 0), (0, 3), (1, 3), rng),)),
    ]  # fmt: skip


def _same(a: TensorTable, b: TensorTable) -> bool:
    if (a.name, a.dtype, a.shape, a.codec, len(a.pieces)) != (b.name, b.dtype, b.shape, b.codec, len(b.pieces)):
        return False
    for p, q in zip(a.pieces, b.pieces):
        if p.layout != q.layout:
            return False
        for x, y in ((p.content, q.content), (p.ref, q.ref), (p.pack, q.pack), (p.off, q.off), (p.length, q.length)):
            if not np.array_equal(x, y):
                return False
        ps = p.snap if p.snap is not None and (p.snap[:, 0] >= 0).any() else None
        qs = q.snap if q.snap is not None and (q.snap[:, 0] >= 0).any() else None
        if (ps is None) != (qs is None) or (ps is not None and not np.array_equal(ps, qs)):
            return False
    return True


def test_table_block_roundtrip():
    rng = np.random.default_rng(0)
    tables = _tables(rng)
    raw = encode_block(tables)
    assert raw[:4] == b"ULTB"
    back = decode_block(raw, n_packs=3)
    assert [t.name for t in back] == [t.name for t in tables]
    assert all(_same(a, b) for a, b in zip(tables, back))
    assert encode_block(back) == raw  # one table, one byte string


def test_table_block_rejects_damage_and_crafted_content():
    rng = np.random.default_rng(1)
    tables = _tables(rng)
    raw = encode_block(tables)
    with pytest.raises(TableError):
        decode_block(raw, n_packs=2)  # an entry names a pack the step does not have
    for pos in range(0, len(raw), 3):  # flipped bytes: an error or (Zstd is not a checksum) a clean parse
        bad = bytearray(raw)
        bad[pos] ^= 0x5A
        try:
            decode_block(bytes(bad), n_packs=3)
        except TableError:
            pass
    head = struct.pack("<4sBBHQ", b"ULTB", 1, 0, 0, 1 << 40)
    with pytest.raises(TableError, match="declares"):
        decode_block(head + raw[16:], n_packs=3)  # refuses to inflate beyond a bound
    small = struct.pack("<4sBBHQ", b"ULTB", 1, 0, 0, 10)
    with pytest.raises(TableError):
        decode_block(small + raw[16:], n_packs=3)  # the frame holds more than declared: never inflated past it

    def crafted(body: bytes) -> bytes:
        return struct.pack("<4sBBHQ", b"ULTB", 1, 0, 0, len(body)) + zstd_compress(body)

    dt = struct.pack("<I", 1) + bytes([7]) + b"float32"
    name = b"x"
    huge = dt + struct.pack("<I", 1) + struct.pack("<I", 1) + name + bytes([0, 0, 1]) + struct.pack("<Q", 1 << 40)
    huge += struct.pack("<I", 1) + struct.pack("<QQQ", 0, 1 << 40, 1) + b"\x00"
    with pytest.raises(TableError, match="more chunks"):
        decode_block(crafted(huge), n_packs=1)  # 2^40 chunks declared in a few bytes: never allocated
    bad_name = dt + struct.pack("<I", 1) + struct.pack("<I", 8) + b"../x\\y/z" + bytes([0, 0, 0])
    with pytest.raises(TableError):
        decode_block(crafted(bad_name), n_packs=1)


def test_pieces_must_tile_the_tensor():
    assert pieces_problem((8, 4), [((0, 0), (8, 4), (3, 4))]) is None
    assert pieces_problem((8, 4), [((0, 0), (4, 4), (3, 4)), ((4, 0), (4, 4), (4, 4))]) is None
    assert (
        pieces_problem((8, 4), [((0, 0), (4, 2), (1, 1)), ((0, 2), (4, 2), (1, 1)), ((4, 0), (4, 4), (2, 2))]) is None
    )
    assert pieces_problem((), [((), (), ())]) is None
    assert "overlap or leave a gap" in pieces_problem((8, 4), [((0, 0), (5, 4), (1, 4)), ((4, 0), (4, 4), (1, 4))])
    assert "overlap or leave a gap" in pieces_problem((8, 4), [((0, 0), (3, 4), (1, 4)), ((4, 0), (4, 4), (1, 4))])
    assert "outside" in pieces_problem((8, 4), [((0, 0), (9, 4), (1, 4))])
    assert "outside" in pieces_problem((8, 4), [((0, 0), (8, 4), (0, 4))])
    assert pieces_problem((8, 4), [((0, 0), (4, 4), (1, 4))]) is not None


def test_content_checksum_is_logical():
    rng = np.random.default_rng(2)
    tables = _tables(rng)
    files = {"config.json": "ab" * 16}
    base = content_checksum(tables, files, {"loss": 1.0})
    moved = [
        TensorTable(t.name, t.dtype, t.shape, t.codec,
                    tuple(Piece(p.offset, p.shape, p.chunks, p.content, p.ref * 0 - 1, p.pack * 0, p.off + 7, p.length)
                          for p in t.pieces))
        for t in reversed(tables)
    ]  # fmt: skip
    assert content_checksum(moved, files, {"loss": 1.0}) == base  # where blobs live and how they are coded: no
    assert content_checksum(tables, files, {"loss": 2.0}) != base
    assert content_checksum(tables, {"config.json": "cd" * 16}, {"loss": 1.0}) != base
    changed = _tables(np.random.default_rng(2))
    changed[0].pieces[0].content[1, 3] ^= 1
    assert content_checksum(changed, files, {"loss": 1.0}) != base


def _doc(**kw) -> StepDoc:
    pid = new_pack_id()
    base = dict(
        step=12, parent=11, content="a" * 32, parent_content="b" * 32, anchor_distance=3, packs=(pid,),
        tables=(TableRef("a", "m", 0, 0, 100, "c" * 32), TableRef("n", "z", 0, 100, 50, "d" * 32)),
        files={"config.json": FileRef(0, 150, 20, 40, "e" * 32)}, metadata={"loss": 2.5}, created="2026-01-01",
    )  # fmt: skip
    return StepDoc(**{**base, **kw})


def test_step_document_roundtrip_and_directory():
    d = _doc()
    raw = d.to_bytes()
    assert StepDoc.from_bytes(raw, key="k", step=12) == d
    assert d.table_for("a") == 0 and d.table_for("k") == 0 and d.table_for("p") == 1 and d.table_for("zz") is None
    for pos in range(len(raw)):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptManifestError):
            StepDoc.from_bytes(bytes(bad), key="k", step=12)
    with pytest.raises(CorruptManifestError, match="for step 12"):
        StepDoc.from_bytes(raw, key="k", step=13)


def test_step_document_checksum_is_checked_whatever_the_document_holds():
    """The checksum is taken over the document without it: cut from the canonical bytes where the document has
    the shape ulstore writes, dumped again where it has another (an extra attribute, sealed too)."""
    import json

    from ulstore.core.sealed import canonical_json
    from ulstore.store.format._stepdoc import _checksum

    d = _doc(metadata={"ulstore_checksum": "f" * 32, "note": '"},"node_type":"group","zarr_format":3}'})
    assert StepDoc.from_bytes(d.to_bytes(), key="k", step=12) == d
    doc = json.loads(d.to_bytes())
    doc["attributes"]["ulstore_checksum"] = "0" * 32  # canonical, well-formed, wrong
    with pytest.raises(CorruptManifestError, match="fails its checksum"):
        StepDoc.from_bytes(canonical_json(doc), key="k", step=12)
    del doc["attributes"]["ulstore_checksum"]
    doc["attributes"]["zz"] = 1  # another attribute, sealed with the rest: read as before
    doc["attributes"]["ulstore_checksum"] = _checksum(canonical_json(doc))
    assert StepDoc.from_bytes(canonical_json(doc), key="k", step=12) == d
    doc["attributes"]["zz"] = 2  # ... and covered by the checksum
    with pytest.raises(CorruptManifestError, match="fails its checksum"):
        StepDoc.from_bytes(canonical_json(doc), key="k", step=12)


@pytest.mark.parametrize(
    "change",
    [
        {"packs": ("../../etc/passwd",)},
        {"packs": ("A" * 32,)},
        {"tables": (TableRef("a", "m", 1, 0, 100, "c" * 32),)},  # no pack 1
        {"tables": (TableRef("n", "z", 0, 0, 1, "c" * 32), TableRef("a", "m", 0, 0, 1, "d" * 32))},  # unsorted
        {"tables": (TableRef("a/../b", "m", 0, 0, 1, "c" * 32),)},
        {"files": {"../x": FileRef(0, 0, 1, 1, "e" * 32)}},
        {"content": "not hex"},
        {"anchor_distance": -1},
    ],
)
def test_step_document_refuses_crafted_fields(change):
    """Checksums recomputed: the document is sealed, but its fields are still untrusted."""
    raw = _doc(**change).to_bytes()
    with pytest.raises(CorruptManifestError, match="malformed"):
        StepDoc.from_bytes(raw, key="k", step=12)


def test_pack_ids_are_checked_before_any_key_is_built():
    pid = new_pack_id()
    assert is_pack_id(pid) and pack_key(pid) == f"packs/{pid}.pack"
    for bad in ("../" + pid[3:], pid.upper(), pid[:-1], pid + "0", "", None, pid[:-1] + "/", pid + "\n"):
        assert not is_pack_id(bad)
        with pytest.raises(ValueError):
            pack_key(bad)


def test_names_read_from_storage_match_whole_not_up_to_a_trailing_newline():
    """``$`` also matches before a final newline: every name checked from storage is matched to its very end."""
    from ulstore.store.format._layout import check_ref_name, step_of
    from ulstore.store.format._stepdoc import is_hex128

    assert check_ref_name("main") == "main" and step_of("12") == 12 and is_hex128("0" * 32)
    with pytest.raises(ValueError):
        check_ref_name("main\n")
    assert step_of("12\n") is None and not is_hex128("0" * 32 + "\n")


def test_coalesce_merges_near_ranges_only():
    ranges = [(0, 10), (10, 20), (25, 30), (5000, 5010), (20, 22)]
    got = coalesce(ranges, max_gap=100, max_span=1000)
    assert got == [(0, 30, [0, 1, 4, 2]), (5000, 5010, [3])]
    assert len(coalesce(ranges, max_gap=0, max_span=1000)) == 3
    assert len(coalesce([(0, 600), (600, 1200)], max_gap=100, max_span=1000)) == 2


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_pack_stream_rolls_over_and_fetch_coalesces(tmp_path, backend):
    url = str(tmp_path / "o") if backend == "local" else f"memory://packs-{uuid.uuid4().hex}"
    io = ObjectStore.from_url(url)
    stream = PackStream(io, pack_bytes=1000)
    blobs = [bytes([k]) * (100 + 37 * k) for k in range(20)]
    locs = [stream.append(b) for b in blobs]
    assert len(io.find("packs")) == len(stream.ids) - 1  # the open pack is not visible yet
    ids = stream.close()
    assert len(ids) > 3 and all(is_pack_id(p) for p in ids)
    assert sorted(io.find("packs")) == sorted(pack_key(p) for p in ids)
    assert all(io.size(pack_key(p)) <= 1000 or sum(1 for loc in locs if loc[0] == p) == 1 for p in ids)
    got = fetch(io, locs[::-1])
    assert [bytes(g) for g in got] == blobs[::-1]
    io.delete(pack_key(ids[0]))
    with pytest.raises(CorruptBlobError, match="missing") as info:
        fetch(io, locs)
    assert info.value.key == pack_key(ids[0])
    pid, off, n = locs[-1]
    with pytest.raises(CorruptBlobError, match="shorter"):
        fetch(io, [(pid, off, n + 10)])


def test_decode_checks_declared_sizes_before_allocating():
    x = np.arange(4, dtype=np.float32)
    blob = encode_chunk(x, None, "ulpack")
    with pytest.raises(CorruptBlobError, match="declares shape"):
        decode_chunk(blob, None, "ulpack", np.dtype(np.float32), (5,), key="k")  # before the codec runs
    big = zstd_compress(bytes(1 << 20))  # 1 MiB of zeros in a few dozen bytes
    with pytest.raises(CorruptBlobError, match="declares 1048576 bytes, expected 16") as info:
        decode_chunk(big, None, "zstd", np.dtype(np.int32), (4,), key="k")
    assert info.value.key == "k"
    ints = np.arange(4, dtype=np.int32)
    assert_bits_equal(decode_chunk(encode_chunk(ints, None, "zstd"), None, "zstd", ints.dtype, (4,), key="k"), ints)
    with pytest.raises(ValueError):
        zstd_decompress(b"not zstd", 4)


def test_table_block_parse_reuses_checked_headers_and_sorts_pieces():
    from ulstore.store.format import _table_block

    rng = np.random.default_rng(7)
    a, b = _piece((4, 0), (4, 5), (2, 5), rng), _piece((0, 0), (4, 5), (3, 5), rng, snapshots=True)
    t = TensorTable("w", np.dtype(np.float32), (8, 5), "ulpack", (a, b))  # stored in this order, not by offset
    raw = encode_block([t])
    _table_block._HEADS.clear()
    first = decode_block(raw, n_packs=3)  # parses the headers
    again = decode_block(raw, n_packs=3)  # reuses them
    for back in (first, again):
        assert [p.offset for p in back[0].pieces] == [(0, 0), (4, 0)]  # sorted by offset, columns follow
        assert _same(TensorTable("w", t.dtype, t.shape, t.codec, (b, a)), back[0])
    # the same headers with other columns (the next step): parsed from their own bytes
    t2 = TensorTable("w", t.dtype, t.shape, t.codec, (_piece((4, 0), (4, 5), (2, 5), rng), b))
    back = decode_block(encode_block([t2]), n_packs=3)
    assert _same(TensorTable("w", t.dtype, t.shape, t.codec, (b, t2.pieces[0])), back[0])
    assert len(_table_block._HEADS) == 1  # one parse of these header bytes, kept


def test_a_parsed_table_block_builds_its_tables_once_and_derives_the_layout_once_per_headers():
    import threading

    from ulstore.store.format._table_block import parse_block

    rng = np.random.default_rng(10)
    tables = _tables(rng)
    raw = encode_block(tables)
    block = parse_block(raw, n_packs=3)
    got = []
    threads = [threading.Thread(target=lambda: got.append(block.tables())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is got[0] for g in got) and block.tables() is got[0]  # one set of TensorTables
    assert [t.name for t in got[0].values()] == [t.name for t in decode_block(raw, n_packs=3)]
    assert block.specs() == {t.name: (t.shape, t.dtype) for t in tables}
    again = parse_block(raw, n_packs=3)  # the same headers: what they determine is derived once
    assert again.heads is block.heads and again.heads.feed() is block.heads.feed()
    feed = block.heads.feed()
    expected = [
        (name, j, coord, *p.box(coord), t.dtype)
        for name, t in got[0].items()
        for j, p in enumerate(t.pieces)
        for coord in p.coords()
    ]
    assert [x[1:] for x in feed] == expected
    rows = [bytes(p.content[i]) for t in got[0].values() for p in t.pieces for i in range(p.n)]
    assert [bytes(block.content[x[0]]) for x in feed] == rows  # each chunk's row of the block's columns


def test_table_block_rejects_snapshots_in_a_piece_that_declares_none():
    from ulstore.store.format import _table_block
    from ulstore.store.format._chunk_tables import _u64s

    rng = np.random.default_rng(8)
    raw = encode_block(_tables(rng))
    body = bytearray(zstd_decompress(raw[16:], struct.unpack_from("<Q", raw, 8)[0]))
    flag = bytes(_u64s((0, 0)) + _u64s((4, 5)) + _u64s((3, 5))) + b"\x01"  # b/sharded's piece with snapshots
    at = bytes(body).index(flag) + len(flag) - 1
    body[at] = 0
    crafted = struct.pack("<4sBBHQ", b"ULTB", 1, 0, 0, len(body)) + zstd_compress(bytes(body))
    for _ in range(2):  # headers parsed, then reused: checked either way
        with pytest.raises(TableError, match="'b/sharded' has snapshots in a piece that declares none"):
            decode_block(crafted, n_packs=3)
    _table_block._HEADS.clear()


def test_chunk_boxes_match_the_pieces_geometry_and_stay_bounded(monkeypatch):
    from ulstore.store.format import _chunk_tables

    rng = np.random.default_rng(9)
    for layout in [((0, 0), (10, 6), (3, 6)), ((4, 2), (5, 7), (2, 3)), ((), (), ()), ((0, 0), (0, 3), (1, 3))]:
        p = _piece(*layout, rng)
        boxes = _chunk_tables.chunk_boxes(*layout)
        assert [c for c, _, _ in boxes] == p.coords()
        assert [(lo, hi) for _, lo, hi in boxes] == [p.box(c) for c in p.coords()]
        assert _chunk_tables.chunk_boxes(*layout) is boxes  # cached
    monkeypatch.setattr(_chunk_tables, "_BOXES_MAX", 20)
    for k in range(30):
        _chunk_tables.chunk_boxes((0,), (k + 8,), (2,))
        assert (
            _chunk_tables._boxes_held <= 20
            and sum(len(v) for v in _chunk_tables._BOXES.values()) == _chunk_tables._boxes_held
        )
    assert len(_chunk_tables.chunk_boxes((0,), (100,), (2,))) == 50  # larger than the whole cache: computed, not kept
    assert ((0,), (100,), (2,)) not in _chunk_tables._BOXES


def test_sparse_deltas_are_coded_without_exponent_contexts_and_everything_else_with():
    """``encode_chunk(sparse=True)``: a SPARSE delta carries flag NO_ECOND (its in-place apply reads and writes each
    changed word in one pass); dense deltas (a sparse request's too) and intra chunks keep the exponent contexts,
    and the dense one is the blob a dense request makes.  All decode exactly."""
    from ulstore.codec import _format as F

    rng = np.random.default_rng(7)
    ref = (rng.standard_normal(8192) * 2).astype(np.float32).astype(ml_dtypes.bfloat16)
    few, many = ref.view(np.uint16).copy(), ref.view(np.uint16).copy()
    few[rng.choice(8192, 40, replace=False)] += 1  # (more than 4096 elements: not always sparse)
    many[::2] += 1  # half the elements: dense, whatever ``sparse`` asks
    cases = {
        "sparse delta": (few.view(ref.dtype), ref, True, F.MODE_SPARSE, True),
        "dense delta, sparse asked": (many.view(ref.dtype), ref, True, F.MODE_RANS, False),  # coded again, contexts
        "dense delta": (few.view(ref.dtype), ref, False, F.MODE_RANS, False),
        "intra": (ref, None, True, F.MODE_INTRA, False),
    }
    for what, (target, reference, sparse, mode, no_econd) in cases.items():
        blob = encode_chunk(target, reference, "ulpack", sparse)
        header, _ = F.open_blob(blob)
        assert (header.mode, bool(header.flags & F.FLAG_NO_ECOND)) == (mode, no_econd), what
        if mode == F.MODE_RANS:
            assert blob == encode_chunk(target, reference, "ulpack", False), what
        got = decode_chunk(blob, reference, "ulpack", target.dtype, target.shape, key=what)
        assert_bits_equal(got, target, what)
