"""Bad settings, metadata and crafted store objects raise named errors (issue 14, "unnamed exceptions")."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

import ulstore
from tests.helpers.store import rewrite_step
from ulstore.errors import CorruptManifestError, InvalidInputError, UlstoreError
from ulstore.store.format._layout import ROOT_META


def test_deeply_nested_metadata_is_invalid_input():
    d: dict = {"a": 1}
    for _ in range(5000):
        d = {"a": d}
    traj = ulstore.open("memory://untrusted-deep", mode="w")
    with pytest.raises(InvalidInputError, match="nested"):
        traj.commit(0, {"w": np.zeros(2, np.float32)}, metadata=d)
    assert traj.steps == []


_CHANGED_BY_JSON = [
    ({1: 2}, "metadata: key 1 (int)"),
    ({"opt": {"betas": {0: 0.9}}}, "metadata['opt']['betas']: key 0 (int)"),
    ({"shape": (1, 2)}, "metadata['shape']: a tuple"),
    ({"runs": [1, {"ids": (2,)}]}, "metadata['runs'][1]['ids']: a tuple"),
    ({"tags": {"a", "b"}}, "metadata['tags']: a set"),
    ({"loss": [1.0, float("nan")]}, "metadata['loss'][1]: nan"),
    ({"loss": np.float32("inf")}, "metadata['loss']: inf"),
    ({"w": np.zeros(2)}, "metadata['w']: a ndarray"),
    ({"z": np.complex64(1j)}, "metadata['z']: a complex64"),
]


@pytest.mark.parametrize("metadata, named", _CHANGED_BY_JSON)
def test_metadata_that_json_would_change_is_refused_naming_its_path(metadata, named):
    """#43: non-string keys, tuples (and sets, arrays...) would read back as something else; NaN and
    infinities have no canonical JSON.  Refused, naming where, by commit and by Publisher.publish."""
    from ulstore.sync import Publisher

    state = {"w": np.zeros(4, np.float32)}
    traj = ulstore.open("memory://untrusted-metadata", mode="w")
    with pytest.raises(InvalidInputError) as e:
        traj.commit(0, state, metadata=metadata)
    assert named in str(e.value)
    assert traj.steps == []
    with Publisher("memory://untrusted-metadata-pub", resume=False) as pub:
        with pytest.raises(InvalidInputError) as e:
            pub.publish(0, state, metadata=metadata)
        assert named in str(e.value)
        assert pub.trajectory.steps == []


def test_numpy_scalars_in_metadata_are_stored_as_python_numbers():
    """#38: np.float32(1.5), np.int64(7)... are what a training loop has; they are stored as the numbers
    they hold (exactly: float16/32/64 are Python floats)."""
    from ulstore.sync import Publisher

    metadata = {
        "lr": np.float32(1.5e-4),
        "step": np.int64(7),
        "done": np.bool_(True),
        "hist": [np.float16(0.25), np.uint8(3)],
        "name": np.str_("run"),
    }
    want = {"lr": float(np.float32(1.5e-4)), "step": 7, "done": True, "hist": [0.25, 3], "name": "run"}
    traj = ulstore.open("memory://untrusted-np-metadata", mode="w")
    traj.commit(0, {"w": np.zeros(4, np.float32)}, metadata=metadata)
    got = ulstore.open("memory://untrusted-np-metadata", mode="r").info(0).metadata
    assert got == want and [type(got[k]) for k in want] == [float, int, bool, list, str]
    with Publisher("memory://untrusted-np-metadata-pub", resume=False) as pub:
        pub.publish(0, {"w": np.zeros(4, np.float32)}, metadata=metadata)
        assert pub.trajectory.info(0).metadata == want


@pytest.mark.parametrize(
    "kw",
    [
        {"cache_bytes": "x"},
        {"cache_bytes": -1},
        {"cache_bytes": 1.5},
        {"threads": "2"},
        {"threads": 0},
        {"threads": -3},
        {"threads": True},
        {"chunk_bytes": 1 << 40},
    ],
)
def test_bad_settings_are_invalid_input(kw):
    with pytest.raises(InvalidInputError, match=next(iter(kw))):
        ulstore.open("memory://untrusted-settings", mode="w", **kw)


@pytest.mark.parametrize(
    "damage",
    [
        "no chunk_bytes",
        "anchor_every is a string",
        "anchor_every negative",
        "chunk_bytes zero",
        "attributes a list",
        "anchor_cost is a string",
        "anchor_cost zero",
        "anchor_cost NaN",
    ],
)
def test_damaged_root_settings_are_named(tmp_path, damage):
    root = str(tmp_path / "t")
    ulstore.open(root, mode="w").commit(0, {"w": np.zeros(4, np.float32)})
    path = os.path.join(root, ROOT_META)
    doc = json.load(open(path))
    s = doc["attributes"]["ulstore"]
    if damage == "no chunk_bytes":
        del s["chunk_bytes"]
    elif damage == "anchor_every is a string":
        s["anchor_every"] = "x"
    elif damage == "anchor_every negative":
        s["anchor_every"] = -2
    elif damage == "chunk_bytes zero":
        s["chunk_bytes"] = 0
    elif damage.startswith("anchor_cost"):  # the cost policy's k, damaged
        s["anchor_cost"] = {"anchor_cost is a string": "2", "anchor_cost zero": 0, "anchor_cost NaN": float("nan")}[
            damage
        ]
    else:
        doc["attributes"] = [1]
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(UlstoreError) as e:
        ulstore.open(root, mode="a").commit(1, {"w": np.ones(4, np.float32)})
    assert e.value.key == ROOT_META


@pytest.mark.parametrize("name", ["\u00b2", "0012", "1e3", "-1", " 7"])
def test_odd_entries_under_steps_are_not_steps(tmp_path, name):
    root = str(tmp_path / "t")
    traj = ulstore.open(root, mode="w")
    traj.commit(5, {"w": np.zeros(4, np.float32)})
    os.makedirs(os.path.join(root, "steps", name))
    with open(os.path.join(root, "steps", name, "zarr.json"), "w") as f:
        f.write("{}")
    traj = ulstore.open(root, mode="r")
    assert traj.steps == [5]
    assert traj.verify().ok


@pytest.mark.parametrize(
    "shape, chunks",
    [([-4], [-4]), ([-4], [4]), ([4], [0]), ([1 << 40], [1 << 40]), ([1 << 62, 1 << 62], [1, 1 << 62]), ([4], [8, 1])],
)
def test_negative_or_huge_shapes_in_a_table_are_corrupt(tmp_path, monkeypatch, shape, chunks):
    """Format 2: a crafted table block (its hash in the step document recomputed) with a bad shape or chunk grid."""
    from ulstore.store.format import _table_block

    root = str(tmp_path / "t")
    traj = ulstore.open(root, mode="w")
    traj.commit(0, {"w": np.arange(4, dtype=np.float32)})
    # what a crafted binary holds: negative numbers are their two's complement as u64
    monkeypatch.setattr(_table_block, "_u64s", lambda vs: struct.pack(f"<{len(vs)}Q", *(v % (1 << 64) for v in vs)))

    def craft(tables, append):
        t = tables["w"]
        (p,) = t.pieces
        t.shape = tuple(shape)
        p.offset, p.shape, p.chunks = (0,) * len(shape), tuple(shape), tuple(chunks)

    rewrite_step(traj, 0, craft)
    monkeypatch.undo()
    traj = ulstore.open(root, mode="r")
    with pytest.raises(CorruptManifestError) as e:
        traj.read(0)
    assert e.value.key is not None and e.value.key.startswith("packs/")  # the pack holding the table block
    with pytest.raises(CorruptManifestError):
        traj[0]["w"][:]
    assert not traj.verify(raise_on_error=False).ok


def test_a_chunk_larger_than_the_bound_is_refused_at_commit():
    traj = ulstore.open("memory://untrusted-big-chunk", mode="w")
    w = traj.piece_writer(0)
    with pytest.raises(InvalidInputError, match="exceed"):
        huge = np.broadcast_to(np.zeros(1, np.float32), (1 << 16, 1 << 15))  # 8 GiB, never allocated
        w.write("w", huge, chunks=(1 << 16, 1 << 15))
    w.abort()


# -- parents that loop (#40) ---------------------------------------------------------------------


def _loop_parents(traj, links: dict[int, int]) -> None:
    """Rewrite step documents so that step -> parent as ``links`` says, each hash chain link recomputed to
    match (``parent_content`` = the parent's content), as a crafted store would."""
    content = {s: traj.info(s).content for s in links}

    for step, parent in links.items():

        def body(b, parent=parent):
            b["parent"], b["parent_content"] = parent, content[parent]

        rewrite_step(traj, step, body=body)


@pytest.mark.timeout(60)
def test_a_step_document_naming_itself_as_parent_is_corrupt(tmp_path):
    """#40: readers, verify and delete refuse a step that is its own parent (checksum recomputed)."""
    from ulstore.store.format._layout import step_key

    root = str(tmp_path / "t")
    traj = ulstore.open(root, mode="w")
    for s in range(3):
        traj.commit(s, {"w": np.full(8, s, np.float32)})
    _loop_parents(traj, {2: 2})
    ro = ulstore.open(root, mode="r")
    for read in (lambda: ro.info(2), lambda: ro.read(2), lambda: ro[2]["w"][:], lambda: ro.log()):
        with pytest.raises(CorruptManifestError, match="its own parent") as e:
            read()
        assert e.value.key == step_key(2)
    report = ro.verify(raise_on_error=False)
    assert [e["key"] for e in report.errors] == [step_key(2)], report.errors
    rw = ulstore.open(root)
    with pytest.raises(CorruptManifestError):
        rw.delete(2)
    assert rw.head() == 2 and rw.steps == [0, 1, 2]  # main never moves to a deleted step
    assert float(rw.read(1)["w"][0]) == 1.0  # the rest reads as before


@pytest.mark.timeout(60)
def test_parent_links_that_loop_are_reported(tmp_path):
    """#40: a later step may be a parent (an older checkpoint added on top of a newer one), so two crafted
    documents can form a loop, 1 -> 2 -> 1: log() raises naming it instead of stopping silently, verify()
    reports it (all steps, or the one asked)."""
    from ulstore.store.format._layout import step_key

    root = str(tmp_path / "t")
    # a fixed count: steps 1 and 2 stay deltas (the cost policy would make a step whose every element changed
    # an anchor), so the loop runs through their references too
    traj = ulstore.open(root, mode="w", anchor_every=16)
    for s in range(3):
        traj.commit(s, {"w": np.full(8, s, np.float32)})
    _loop_parents(traj, {1: 2, 2: 1})
    ro = ulstore.open(root, mode="r")
    assert ro.info(2).parent == 1 and ro.info(1).parent == 2  # each document alone is well-formed
    with pytest.raises(CorruptManifestError, match="loop") as e:
        ro.log()
    assert e.value.key in (step_key(1), step_key(2))
    for report in (ro.verify(raise_on_error=False), ro.verify(2, raise_on_error=False)):
        assert not report.ok
        assert any("loop" in e["message"] and e["key"] in (step_key(1), step_key(2)) for e in report.errors), (
            report.errors
        )
    assert ro.verify(0).ok  # the root is not on the loop
    rw = ulstore.open(root, mode="r+")
    with pytest.raises(CorruptManifestError, match="loop"):  # re-parenting would make a step its own parent
        rw.delete(1)
    assert rw.steps == [0, 1, 2] and rw.head() == 2 and rw.info(2).parent == 1


@pytest.mark.parametrize("step", [1 << 62, (1 << 63) - 1, 1 << 63, 1 << 64])
def test_steps_beyond_what_a_step_document_holds_are_refused_at_commit(step):
    """#40: a commit of a step no reader accepts (2**64) moved main before; a child raised OverflowError."""
    from ulstore.store.format._stepdoc import StepDoc

    MAX_STEP = 1 << 62  # (ulstore.store.format._layout.MAX_STEP, the one bound of checks and parser)
    traj = ulstore.open("memory://untrusted-huge-step", mode="w")
    traj.commit(0, {"w": np.zeros(4, np.float32)})
    with pytest.raises(InvalidInputError, match=f"below 2\\*\\*62.*{step}"):
        traj.commit(step, {"w": np.ones(4, np.float32)})
    with pytest.raises(InvalidInputError, match="below 2\\*\\*62"):
        traj.piece_writer(step)
    assert traj.steps == [0] and traj.head() == 0
    traj.commit(MAX_STEP - 1, {"w": np.ones(4, np.float32)})  # the largest step: committed, read back, a parent
    traj.commit(5, {"w": np.full(4, 2, np.float32)})
    assert traj.info(5).parent == MAX_STEP - 1 and float(traj.read(MAX_STEP - 1)["w"][0]) == 1.0
    assert ulstore.open("memory://untrusted-huge-step", mode="r").verify().ok
    # a document holding such a step is damage (the parser's bound is the same constant)
    doc = json.loads(traj._io.get("steps/5/zarr.json"))
    doc["attributes"]["ulstore"]["step"] = step
    with pytest.raises(CorruptManifestError, match="step"):
        StepDoc.from_bytes(json.dumps(doc).encode(), key="steps/5/zarr.json")
    from ulstore.store.format._layout import MAX_STEP as bound

    assert bound == MAX_STEP


@pytest.mark.timeout(120)
@pytest.mark.parametrize("links", [{2: 2}, {1: 2, 2: 1}], ids=["own-step", "cycle"])
def test_verify_names_the_step_document_and_tensor_of_a_crafted_reference(links):
    """#40: verify's report named these objects ``None``: a chunk coded against its own step, a reference
    cycle between steps (tables rewritten, hashes recomputed)."""
    from ulstore.store.format._layout import step_key

    url = f"memory://untrusted-refs-{len(links)}"
    traj = ulstore.open(url, mode="w", anchor_every=0)
    for s in range(3):
        traj.commit(s, {"a": np.full(64, s, np.float32), "b": np.full(64, -s, np.float32)})

    def point_at(ref):
        def mutate(tables, append):
            for p in tables["b"].pieces:
                p.ref[:] = ref

        return mutate

    for step, ref in links.items():
        rewrite_step(traj, step, point_at(ref))
    report = ulstore.open(url, mode="r").verify(raise_on_error=False)
    assert not report.ok
    for e in report.errors:
        assert e["key"] in {step_key(s) for s in links} and e["tensor"] == "b" and e["step"] in links, e
    with pytest.raises(CorruptManifestError) as e:
        ulstore.open(url, mode="r").read(2)
    assert e.value.key in {step_key(s) for s in links} and e.value.tensor == "b"
