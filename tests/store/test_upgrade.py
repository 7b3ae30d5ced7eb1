"""Format 1 -> format 2: the committed fixture converts exactly; opening format 1 names the command."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ulstore
from ulstore.errors import ConflictError, CorruptBlobError, FormatError, InvalidInputError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "store_format1"
#: step -> tensor -> [dtype, shape, SHA-256 of the bytes], as the format-1 code read the fixture back
#: (``make_store_format1.py --expected``)
EXPECTED = FIXTURE.parent / "store_format1_states.json"


def _described(state: dict) -> dict:
    return {
        name: [str(a.dtype), list(a.shape), hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()]
        for name, a in state.items()
    }


def test_opening_format1_names_the_upgrade_command():
    with pytest.raises(FormatError, match=f"ulstore upgrade {FIXTURE}") as info:
        ulstore.open(FIXTURE, mode="r")
    assert info.value.key == "zarr.json"


def test_upgrade_converts_the_fixture_exactly(tmp_path):
    src = tmp_path / "old"
    shutil.copytree(FIXTURE, src)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    seen = []
    ulstore.upgrade(src, tmp_path / "new", progress=lambda done, total: seen.append((done, total)))
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before  # the source is only read
    assert seen[-1] == (7, 7)
    want = {int(step): state for step, state in json.loads(EXPECTED.read_text()).items()}
    ro = ulstore.open(tmp_path / "new", mode="r")
    assert ro.steps == sorted(want) == [0, 1, 2, 4, 5, 6, 100]
    assert ro.refs == {"main": 6, "side": 100, "v1": 4}
    assert ro.anchor_every == 3 and ro.chunk_bytes == 1024
    for step, described in want.items():
        assert _described(ro.read(step)) == described, step
    # parents (step 3 was deleted: 4 hangs on 2), anchors, metadata, creation times: as they were
    log = {i.step: i for i in ro.log("main")} | {i.step: i for i in ro.log("side")}
    assert {s: i.parent for s, i in log.items()} == {6: 5, 5: 4, 4: 2, 2: 1, 1: 0, 0: None, 100: 2}
    assert log[100].metadata == {"note": "branch"} and log[5].metadata == {"i": 5, "loss": 1.5}
    for s, info in log.items():
        old = json.loads((FIXTURE / "steps" / str(s) / "zarr.json").read_text())["attributes"]["ulstore"]
        assert info.created == old["created"] and info.anchor_distance <= old["anchor_distance"], s
        assert (info.anchor_distance == 0) == all(e[1] is None for t in old["tensors"].values() for e in t["entries"])
        assert info.parent_content == (log[info.parent].content if info.parent is not None else None)
        grids = {n: tuple(t["chunks"]) for n, t in old["tensors"].items()}
        tables = ro._reader.tables(s)
        assert {n: t.pieces[0].chunks for n, t in tables.items()} == grids
    assert ro.verify().ok
    with pytest.raises(ConflictError):
        ulstore.upgrade(src, tmp_path / "new")
    with pytest.raises(InvalidInputError, match="not a format-1"):
        ulstore.upgrade(tmp_path / "new", tmp_path / "again")


def test_upgrade_stops_at_a_damaged_blob(tmp_path):
    src = tmp_path / "old"
    shutil.copytree(FIXTURE, src)
    blob = sorted(p for p in (src / "blobs").rglob("*") if p.is_file())[7]
    blob.write_bytes(blob.read_bytes()[:-1] + bytes([blob.read_bytes()[-1] ^ 1]))
    with pytest.raises(CorruptBlobError) as info:
        ulstore.upgrade(src, tmp_path / "new")
    assert info.value.key.endswith(blob.name)


@pytest.mark.parametrize(
    "shape, chunks",
    [([-4], [-4]), ([-4], [4]), ([4], [0]), ([1 << 40], [1 << 40]), ([1 << 62, 1 << 62], [1, 1 << 62]), (["4"], [4])],
)
def test_negative_or_huge_shapes_in_a_format1_manifest_are_corrupt(tmp_path, shape, chunks):
    """The legacy reader trusts a format-1 manifest no more than the store trusted it (nothing huge is allocated)."""
    import json

    from ulstore.core.sealed import canonical_json, digest128
    from ulstore.errors import CorruptManifestError
    from ulstore.store.format._layout import step_key

    src = tmp_path / "old"
    shutil.copytree(FIXTURE, src)
    path = src / step_key(0)
    doc = json.loads(path.read_bytes())
    t = doc["attributes"]["ulstore"]["tensors"]["flags"]
    t["shape"], t["chunks"] = shape, chunks
    doc["attributes"].pop("ulstore_checksum")
    doc["attributes"]["ulstore_checksum"] = digest128(canonical_json(doc))
    path.write_bytes(canonical_json(doc))
    with pytest.raises(CorruptManifestError) as e:
        ulstore.upgrade(src, tmp_path / "new")
    assert e.value.key == step_key(0)
