"""ulstore.sync in one process: publish/follow exactness, snapshots and late joins, in-place torch
state, 0-d tensors, the change detector, fault injection at every write of a publish, corrupt and
missing objects, clear errors for misconfigured buckets, and the sync bucket read as a trajectory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from tests.helpers.store import CountingIO
from tests.helpers.sync import assert_same_bits, columns_taken, delta_modes, rl_states, state_digest
from ulstore.codec import ApplyPlan
from ulstore.core.objects import MAX_DOCUMENT_BYTES
from ulstore.errors import InvalidInputError, NotFoundError
from ulstore.sync import (
    BucketAccessError,
    ChangeDetector,
    Follower,
    Publisher,
    _in_place,
    _replica,
)
from ulstore.sync._arrays import Binding

BF16 = np.dtype(ml_dtypes.bfloat16)
CHUNK = 1 << 12  # small chunks: every tensor of the tiny model spans several


@pytest.fixture(scope="module")
def states():
    """13 checkpoints of a real RL-regime run of the tiny model (bf16)."""
    return rl_states(12)


@pytest.fixture
def url(tmp_path):
    return str(tmp_path / "store")


def publish_all(url, states, anchor_every=5, **kw):
    with Publisher(url, anchor_every=anchor_every, chunk_elems=CHUNK, **kw) as pub:
        return [pub.publish(v, s, metadata={"model_version": v}) for v, s in enumerate(states)]


def copy(state):
    return {k: v.copy() for k, v in state.items()}


# -- exactness ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_follower_matches_every_version(states, tmp_path, backend):
    url = str(tmp_path / "s") if backend == "local" else f"memory://sync-{uuid.uuid4().hex}"
    pub = Publisher(url, anchor_every=4, chunk_elems=CHUNK)
    f = Follower(url, poll_interval=0.001)
    assert f.poll() is None and f.version is None  # nothing published yet: not an error
    for v, s in enumerate(states):
        info = pub.publish(v, s, metadata={"model_version": v})
        assert info.kind == ("reset" if v == 0 else "delta") and info.anchor == (v % 4 == 0)
        assert f.poll() == v
        assert_same_bits(f.state, s)
        assert f.metadata == {"model_version": v}
    # RL regime: a delta is a small fraction of the weights
    assert info.delta_bytes < sum(a.nbytes for a in states[-1].values()) / 10
    assert f.stats.versions_applied == len(states) - 1 and f.stats.corrupt == 0
    pub.close()
    f.close()


def test_follow_yields_each_version_and_late_join_uses_nearest_anchor(states, url):
    publish_all(url, states[:8], anchor_every=5)  # anchors at 0 and 5
    reads = []
    f = Follower(url, poll_interval=0.001)
    io = f.trajectory._io
    orig, orig_ranges = io.get, io.get_ranges
    io.get = lambda key, **kw: (reads.append(key), orig(key, **kw))[1]
    io.get_ranges = lambda key, ranges: (reads.append(key), orig_ranges(key, ranges))[1]
    assert list(f.follow(timeout=0.05)) == [7]  # bootstrap jumps straight to the newest version
    assert f.events[0].kind == "bootstrap" and f.events[0].version == 5
    # the snapshot of 5 (whose change feed reads 4's tables), then 6 and 7: nothing older
    assert not any(k.startswith(f"steps/{i}/") for k in reads for i in range(0, 4)), reads
    # one full copy plus two deltas (a chunk unchanged since version 0 is read from 0's pack: its intra blob)
    assert f.stats.bytes_downloaded < sum(a.nbytes for a in states[7].values())
    assert_same_bits(f.state, states[7])
    with Publisher(url, anchor_every=5, chunk_elems=CHUNK) as pub:
        got = []
        for v in range(8, 13):
            pub.publish(v, states[v])
        for v in f.follow(until=12):
            assert_same_bits(f.state, states[v])
            got.append(v)
    assert got == [8, 9, 10, 11, 12]


def test_awkward_values_and_integer_tensors_roundtrip(url):
    words = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC1, 0xFFC5, 0x7F81, 0x3F80], np.uint16)
    a = {
        "w": words.view(BF16).copy(),
        "step": np.array([3], np.int64),
        "mask": np.array([True, False]),
        "f32": np.array([-0.0, np.nan, 1e-45], np.float32),
        "empty": np.zeros((0, 3), BF16),
    }
    b = copy(a)
    b["w"].view(np.uint16)[:2] = [0x8000, 0x0000]  # +0 <-> -0 is a change
    b["step"][0] = 4
    with Publisher(url, chunk_elems=4) as pub:
        pub.publish(0, a)
        assert pub.publish(1, b).changed_chunks == 2
    f = Follower(url)
    f.bootstrap()
    assert_same_bits(f.state, b)
    assert f.state["step"].dtype == np.int64 and f.state["mask"].dtype == bool


def test_in_place_torch_state_touching_only_changed_chunks(states, url):
    torch = pytest.importorskip("torch")
    from ulstore.core.torch import to_tensor as numpy_to_tensor

    publish_all(url, states[:3], anchor_every=10)
    state = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in states[0].items()}
    ptrs = {k: t.data_ptr() for k, t in state.items()}
    f = Follower(url, state=state)
    assert f.bootstrap() == 2
    assert_same_bits(state, states[2])
    assert all(t.data_ptr() == ptrs[k] for k, t in state.items()), "the state was not written in place"

    nxt = copy(states[2])
    nxt["lm_head.weight"].view(np.uint16)[0, 0] ^= 1  # one element of one chunk
    with Publisher(url, chunk_elems=CHUNK) as pub:  # a new process: resumes from the store
        info = pub.publish(3, {k: numpy_to_tensor(v) for k, v in nxt.items()})  # torch input too
    assert info.kind == "delta" and info.changed_chunks == 1
    writes = []
    orig_write, orig_apply = Binding.write, _in_place.apply_sparse

    def spy_apply(plans, **kwargs):  # SPARSE deltas, written in place by the compiled job
        out = orig_apply(plans, **kwargs)
        arrays = [a for plan in ([plans] if isinstance(plans, ApplyPlan) else plans) for a in plan.arrays]
        for a, applied in zip(arrays, out or []):
            names = [k for k, t in state.items() if np.shares_memory(a, t.view(torch.int16).numpy())]
            writes.append(("changes", names, applied.positions.tolist()))
        return out

    Binding.write = lambda self, start, values: (
        writes.append(("write", self.name, start, values.size)),
        orig_write(self, start, values),
    )[1]
    _in_place.apply_sparse = _replica.apply_sparse = spy_apply
    try:
        assert f.poll() == 3
    finally:
        Binding.write, _in_place.apply_sparse, _replica.apply_sparse = orig_write, orig_apply, orig_apply
    assert writes == [("changes", ["lm_head.weight"], [0])]  # one element written: a SPARSE delta
    assert_same_bits(state, nxt)


def test_a_follower_told_each_version_reads_its_document_and_one_range_of_its_pack(states, url):
    """Per version in step: the step document, then the step's blobs and tables in one range read."""
    publish_all(url, states[:1], anchor_every=0)
    f = Follower(url, trust_state=True)
    f.bootstrap()
    counter = CountingIO(f._io)
    with Publisher(url, anchor_every=0, chunk_elems=CHUNK) as pub:
        for v in range(1, 4):
            pub.publish(v, states[v])
            counter.reset()
            assert f.poll(to=v) == v
            assert_same_bits(f.state, states[v])
            assert counter.docs() == [f"steps/{v}/zarr.json"]
            (pack_read,) = counter.packs()
            assert pack_read[1][0] == 0  # from the pack's first byte: its blobs, then its table block


def test_a_tensor_replaced_in_the_state_dict_is_noticed_and_loaded(states, url):
    """The caller puts another array in the dict (or, torch, another storage under the same tensor): the
    follower used to keep writing the old memory, report the version as held and verify() True."""
    publish_all(url, states[:2], anchor_every=20)
    state = copy(states[0])
    f = Follower(url, state=state)
    f.bootstrap()
    name = "lm_head.weight"
    state[name] = np.zeros_like(states[0][name])  # e.g. a module re-created
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        pub.publish(2, states[2])
    assert f.poll() == 2
    assert_same_bits(state, states[2])  # the new array holds the version
    assert name in next(e for e in f.events if e.kind == "corrupt").detail and f.stats.rebootstraps == 1
    assert f.verify()

    torch = pytest.importorskip("torch")
    tstate = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in states[0].items()}
    g = Follower(url, state=tstate)
    assert g.bootstrap() == 2
    tstate[name].set_(torch.zeros_like(tstate[name]))  # same object, other storage
    assert not g.verify() and g.version is None and name in g.events[-1].detail
    assert g.poll() == 2
    assert_same_bits({k: t.view(torch.int16).numpy().view(states[2][k].dtype) for k, t in tstate.items()}, states[2])
    f.close()
    g.close()


def test_follower_rejects_mismatched_state(states, url):
    publish_all(url, states[:2])
    wrong = copy(states[0])
    wrong["lm_head.weight"] = wrong["lm_head.weight"][:, :8].copy()
    with pytest.raises(InvalidInputError, match="lm_head.weight"):
        Follower(url, state=wrong).bootstrap()
    missing = copy(states[0])
    del missing["model.norm.bias"]
    with pytest.raises(InvalidInputError, match="model.norm.bias"):
        Follower(url, state=missing).bootstrap()
    f32 = {k: v.astype(np.float32) for k, v in states[0].items()}
    with pytest.raises(InvalidInputError, match="dtype"):
        Follower(url, state=f32).bootstrap()


@pytest.mark.parametrize("trust_state", [False, True], ids=["hashing", "trusted"])
def test_new_tensor_reaches_follower_owned_state(states, url, trust_state):
    with Publisher(url, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        f = Follower(url, trust_state=trust_state)
        f.bootstrap()
        grown = {**states[1], "value_head.weight": np.ones((3, 64), BF16)}
        info = pub.publish(1, grown)
        assert info.kind == "delta"
        assert f.poll() == 1
        assert_same_bits(f.state, grown)
        moved = {**states[2], "value_head.weight": grown["value_head.weight"].copy()}
        moved["value_head.weight"].view(np.uint16)[1, ::9] += 1  # a delta of the new tensor
        pub.publish(2, moved)
        assert f.poll() == 2
    assert_same_bits(f.state, moved)
    assert not [e for e in f.events if e.kind == "corrupt"]


@pytest.mark.parametrize("how", ["publish", "submit"])
def test_a_tensor_published_in_another_dtype_is_warned_of_as_a_commit_does(states, url, how):
    """Stored whole, not as a delta against the version before (a delta needs its dtype): the publish says so
    (FewSharedNamesWarning, as ``Trajectory.commit`` does), once the version is committed; a blocking publish
    at its caller's line (a submit's commit runs on the publisher's thread, which warns)."""
    name = sorted(states[0])[0]
    retyped = {**states[1], name: states[1][name].astype(np.float32)}
    with Publisher(url, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        with pytest.warns(ulstore.FewSharedNamesWarning, match=f"{name!r} bfloat16 .* -> float32") as got:
            if how == "publish":
                pub.publish(1, retyped)
            else:
                pub.submit(1, retyped)
                pub.wait()
        assert len(got) == 1 and got[0].message.parent == 0
        if how == "publish":  # committed on the publisher's thread, warned of at the caller's line
            assert got[0].filename == __file__
    assert_same_bits(ulstore.open(url).read(1), retyped)


def test_versions_must_increase_and_metadata_must_be_json(states, url):
    with Publisher(url) as pub:
        pub.publish(5, states[0])
        with pytest.raises(InvalidInputError, match="greater"):
            pub.publish(5, states[1])
        with pytest.raises(InvalidInputError, match="JSON"):
            pub.publish(6, states[1], metadata={"x": object()})
        pub.publish(9, states[1])  # gaps are fine
    f = Follower(url)
    assert f.bootstrap() == 9


def test_publisher_resume_and_reset(states, url):
    publish_all(url, states[:4], anchor_every=10)
    with Publisher(url, anchor_every=10, chunk_elems=CHUNK) as pub:
        assert pub.latest == 3 and pub.publish(4, states[4]).kind == "delta"  # resumed from the store
    f = Follower(url)
    f.bootstrap()
    with Publisher(url, anchor_every=10, chunk_elems=CHUNK, resume=False) as pub:
        assert pub.publish(5, states[5]).kind == "reset"
    assert f.poll() == 5 and [e.kind for e in f.events][-1] == "apply"  # a reset is applied like any step
    assert ulstore.open(url, mode="r").info(5).anchor_distance == 0
    assert_same_bits(f.state, states[5])


# -- the change detector -------------------------------------------------------------


def test_change_detector_with_host_tensors_never_misses_a_change(tmp_path):
    """The detector saves device-to-host copies; host tensors are always hashed, so nothing is missed."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    model = model.to(torch.bfloat16)
    model[1].weight.requires_grad_(False)  # frozen: not in the optimizer, so never vouched for
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[2].weight, model[2].bias], "lr": 1e-2},  # these change
            {"params": [model[1].bias], "lr": 1e-9},  # far below half a bf16 ULP: never changes
        ]
    )
    det = ChangeDetector(opt, model)
    assert det.watched == {"0.weight", "2.weight", "2.bias", "1.bias"}
    url = str(tmp_path / "det")
    pub = Publisher(url, anchor_every=4, chunk_elems=256, detector=det)
    f = Follower(url)
    tokens = torch.tensor([[1, 2, 3]])
    for v in range(9):
        if v:
            opt.zero_grad()
            model(tokens).float().pow(2).mean().backward()
            opt.step()
            assert det.changed() == {"0.weight", "2.weight", "2.bias"}
        if v == 6:  # a change outside optimizer.step(): invisible to the detector, not to the publisher
            with torch.no_grad():
                model[1].bias[0] += 1
        info = pub.publish(v, model.state_dict())
        assert det.changed() == set()  # reset after each publish
        assert f.poll() == v
        assert info.skipped_tensors == 0  # CPU tensors: nothing to save
        assert_same_bits(f.state, model.state_dict())
    assert pub.stats["detector_misses"] == 0
    det.remove()
    pub.close()


# -- faults ---------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def inject(traj, prefix: str, action) -> list:
    """Call ``action(key)`` before every write of the trajectory's objects whose key starts with ``prefix``."""
    io, calls = traj._io, []
    for method in ("put", "create", "open_writer"):
        orig = getattr(io, method)

        def wrapped(key, *a, _orig=orig, **kw):
            calls.append(key)
            if key.startswith(prefix):
                action(key)
            return _orig(key, *a, **kw)

        setattr(io, method, wrapped)
    return calls


def uninject(traj) -> None:
    for method in ("put", "create", "open_writer"):
        traj._io.__dict__.pop(method, None)


@pytest.mark.parametrize("stage", ["packs/", "steps/", "refs/"])
def test_failed_publish_leaves_followers_on_last_complete_version(states, url, stage):
    """Fault injection at every write of a snapshot-carrying publish (version 5): pack, step document, ref."""
    publish_all(url, states[:5], anchor_every=5)
    f = Follower(url)
    assert f.bootstrap() == 4
    pub = Publisher(url, anchor_every=5, chunk_elems=CHUNK)
    grown = {**states[5], "extra": np.ones(10, BF16)}  # a new tensor too

    def boom(key):
        raise Boom(key)

    calls = inject(pub.trajectory, stage, boom)
    with pytest.raises(Boom):
        pub.publish(5, grown)
    assert any(k.startswith(stage) for k in calls)
    assert f.poll() is None and f.version == 4
    assert_same_bits(f.state, states[4])
    uninject(pub.trajectory)
    assert pub.publish(5, grown).anchor  # a retry of the same version succeeds (a leftover step 5 is dropped)
    assert f.poll() == 5
    assert_same_bits(f.state, grown)
    late = Follower(url)
    assert late.bootstrap() == 5 and late.events[0].version == 5
    assert ulstore.open(url, mode="r").verify().errors == []
    pub.close()


def _blob_path(url, version, snapshot=False, kind="delta"):
    """Path and offset of the middle of the first ``kind`` chunk's blob (or snapshot) of ``version``."""
    traj = ulstore.open(url, mode="r")
    c = next(c for c in traj.changes(version) if (c.snapshot is not None if snapshot else c.kind == kind))
    pack, off, n = c.snapshot if snapshot else c.blob
    return os.path.join(url, "packs", f"{pack}.pack"), off + n // 2


def _flip(path, offset=-20):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x40
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("trust_state", [False, True], ids=["hashing", "trusted"])
@pytest.mark.parametrize("damage", ["flip pack", "delete pack", "flip manifest", "delete manifest"])
def test_corrupt_or_missing_delta_rebootstraps_from_anchor(states, url, damage, trust_state):
    publish_all(url, states[:4], anchor_every=5)
    f = Follower(url, trust_state=trust_state)
    assert f.bootstrap() == 3
    publish_all_from = Publisher(url, anchor_every=5, chunk_elems=CHUNK)
    for v in range(4, 8):  # anchor at 5
        publish_all_from.publish(v, states[v])
    publish_all_from.close()
    if "pack" in damage:
        target, offset = _blob_path(url, 4)
    else:
        target, offset = (
            os.path.join(url, "steps/4/zarr.json"),
            len(open(os.path.join(url, "steps/4/zarr.json")).read()) // 2,
        )
    if damage.startswith("flip"):
        _flip(target, offset)
    else:
        os.remove(target)
    seen = []
    f.on_event = seen.append
    assert f.poll() == 7
    assert_same_bits(f.state, states[7])
    kinds = [e.kind for e in seen]
    # a missing step document is "missing"; a missing pack of a committed step is damage ("corrupt")
    assert kinds[0] == ("missing" if damage == "delete manifest" else "corrupt")
    assert "rebootstrap" in kinds and f.stats.rebootstraps == 1
    assert f.stats.missing + f.stats.corrupt == 1


def test_corrupt_delta_without_newer_anchor_stalls_then_recovers(states, url):
    publish_all(url, states[:7], anchor_every=5)  # anchors 0, 5
    f = Follower(url)
    assert f.bootstrap() == 6
    with Publisher(url, anchor_every=5, chunk_elems=CHUNK) as pub:
        pub.publish(7, states[7])
        pub.publish(8, states[8])
        _flip(*_blob_path(url, 7))
        assert f.poll() is None or f.version == 6  # re-bootstraps from anchor 5, replays 6, stalls before 7
        assert f.version == 6 and [e.kind for e in f.events][-1] == "stalled"
        assert_same_bits(f.state, states[6])
        n_events = len(f.events)
        assert f.poll() is None and len(f.events) == n_events  # quiet while waiting
        pub.publish(9, states[9])
        pub.publish(10, states[10])  # anchor after the bad version
    assert f.poll() == 10
    assert_same_bits(f.state, states[10])
    assert f.stats.rebootstraps == 2


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-deltas", "dense-deltas"])
def test_trusted_follower_tracks_every_version(states, url, sparse):
    """trust_state=True: exact at every version, and the kept sums are the held chunks' content_sum."""
    from ulstore import content_sum

    pub = Publisher(url, anchor_every=5, chunk_elems=CHUNK, sparse=sparse)
    f = Follower(url, trust_state=True)
    modes = set()
    for v, s in enumerate(states):
        pub.publish(v, s)
        assert (f.bootstrap() if v == 0 else f.poll()) == v
        assert_same_bits(f.state, s)
        r = f._replica
        assert len(r._sums) == len(r._contents)  # every chunk is a float chunk here
        for key, kept in r._sums.items():
            _, start, stop = r._contents[key]
            region = r.state[key[0]][tuple(slice(a, b) for a, b in zip(start, stop))]
            assert kept == content_sum(region), (v, key)
        if v:
            modes |= delta_modes(f, v)
    pub.close()
    f.close()
    assert ("sparse" in modes) == sparse, modes
    assert not [e for e in f.events if e.kind == "corrupt"], f.events


def test_trusted_follower_catches_divergence_at_a_changed_element(states, url):
    """Trusted, the follower still checks what a delta touches: an old value gone bad fails the target sum."""
    publish_all(url, states[:3], anchor_every=5)
    f = Follower(url, trust_state=True)
    f.bootstrap()
    name = next(k for k in states[3] if (states[3][k].view(np.uint16) != states[2][k].view(np.uint16)).any())
    pos = np.flatnonzero(states[3][name].view(np.uint16).reshape(-1) != states[2][name].view(np.uint16).reshape(-1))
    f.state[name].reshape(-1).view(np.uint16)[pos[0]] ^= 0x40  # the replica's memory went bad there
    with Publisher(url, anchor_every=5, chunk_elems=CHUNK) as pub:
        pub.publish(3, states[3])
        assert f.poll() == 3
    assert_same_bits(f.state, states[3])
    assert "corrupt" in [e.kind for e in f.events] and f.stats.rebootstraps == 1


@pytest.mark.parametrize("trust_state", [False, True], ids=["hashing", "trusted"])
def test_verify_finds_foreign_writes_and_the_next_poll_repairs_them(states, url, trust_state):
    publish_all(url, states[:3], anchor_every=5)
    f = Follower(url, trust_state=trust_state)
    assert f.verify()  # nothing held yet
    f.bootstrap()
    assert f.verify() and f.version == 2
    name = "lm_head.weight"
    unchanged = np.flatnonzero(
        states[3][name].view(np.uint16).reshape(-1) == states[2][name].view(np.uint16).reshape(-1)
    )
    f.state[name].reshape(-1).view(np.uint16)[unchanged[7]] ^= 1  # an element no delta will touch
    assert not f.verify()
    assert f.version is None and f.events[-1].kind == "corrupt" and name in f.events[-1].detail
    with Publisher(url, anchor_every=5, chunk_elems=CHUNK) as pub:
        pub.publish(3, states[3])
    assert f.poll() == 3 and f.verify()
    assert_same_bits(f.state, states[3])


def test_diverged_follower_state_is_repaired(states, url):
    publish_all(url, states[:3], anchor_every=5)
    f = Follower(url, check_every=1)  # default mode, whole state re-hashed after each version
    f.bootstrap()
    f.state["lm_head.weight"].view(np.uint16)[5, 5] ^= 1  # the replica's memory went bad
    with Publisher(url, anchor_every=5, chunk_elems=CHUNK) as pub:
        pub.publish(3, states[3])
        assert f.poll() == 3
    assert_same_bits(f.state, states[3])
    assert "corrupt" in [e.kind for e in f.events] and f.stats.rebootstraps == 1


def test_default_follower_scan_finds_a_foreign_write_within_check_every_versions(states, url):
    """Default mode: O(changes) apply plus a rotating re-hash of 1/check_every of the state per version."""
    publish_all(url, states[:3], anchor_every=20)
    f = Follower(url, check_every=4)
    f.bootstrap()
    name = "lm_head.weight"
    same = np.flatnonzero(
        np.all(
            [
                states[v][name].view(np.uint16).reshape(-1) == states[2][name].view(np.uint16).reshape(-1)
                for v in range(3, 8)
            ],
            axis=0,
        )
    )
    f.state[name].reshape(-1).view(np.uint16)[same[-1]] ^= 1  # no delta will touch it
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        for v in range(3, 8):
            pub.publish(v, states[v])
            assert f.poll() == v
    assert "corrupt" in [e.kind for e in f.events] and f.stats.rebootstraps == 1
    assert_same_bits(f.state, states[7])


def test_default_follower_scan_runs_after_the_apply_and_wait_scan_takes_its_result(states, url):
    """The re-sum starts once a version is written; wait_scan() reports what it found, the next poll repairs it."""
    publish_all(url, states[:2], anchor_every=20)
    f = Follower(url, check_every=1)  # every scan covers the whole state
    f.bootstrap()
    assert f.wait_scan() and f.wait_scan()  # the replayed version's scan found nothing; then none is running
    name = "lm_head.weight"
    same = states[2][name].view(np.uint16).reshape(-1, 4) == states[1][name].view(np.uint16).reshape(-1, 4)
    untouched = 4 * np.flatnonzero(same.all(axis=1))[-1]  # in an 8-byte word no change of version 2 touches
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        pub.publish(2, states[2])
        f.state[name].reshape(-1).view(np.uint16)[untouched] ^= 1  # a foreign write no delta touches
        assert f.poll() == 2 and f.version == 2  # applied: the check of version 2 runs after it
        assert not f.wait_scan() and f.version is None
        assert f.events[-1].kind == "corrupt" and f"{name}[" in f.events[-1].detail
        assert f.poll() == 2
    assert_same_bits(f.state, states[2])
    trusted = Follower(url, trust_state=True)
    trusted.bootstrap()
    assert trusted._scanning is None and trusted.wait_scan()
    f.close()
    trusted.close()


def test_a_finding_is_acted_on_even_if_on_event_raises(states, url):
    """The state is marked invalid before the corrupt event is delivered: a callback that raises cannot leave a
    state known to differ reported as the version."""
    publish_all(url, states[:3], anchor_every=5)

    def on_event(ev):
        if ev.kind == "corrupt":
            raise RuntimeError("the metrics client is down")

    f = Follower(url, on_event=on_event, check_every=1)
    f.bootstrap()
    f.state["lm_head.weight"].view(np.uint16)[5, 5] ^= 1  # a foreign write
    with pytest.raises(RuntimeError, match="metrics"):
        f.verify()
    assert f.version is None and f.events[-1].kind == "corrupt" and f.stats.corrupt == 1
    f.on_event = None
    assert f.poll() == 2
    assert_same_bits(f.state, states[2])
    f.close()


def test_a_closed_follower_refuses_to_work_and_close_takes_the_running_checks_result(states, url):
    """After close() every call that would use the stopped threads raises InvalidInputError before anything is
    written (poll() used to apply a version and then raise RuntimeError; wait_scan() raised CancelledError); the
    check running at close() is waited for and what it found is reported, not dropped."""
    publish_all(url, states[:2], anchor_every=20)
    f = Follower(url, check_every=1)
    f.bootstrap()
    assert f.wait_scan()
    name = "lm_head.weight"
    same = states[2][name].view(np.uint16).reshape(-1, 4) == states[1][name].view(np.uint16).reshape(-1, 4)
    untouched = 4 * np.flatnonzero(same.all(axis=1))[-1]
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        pub.publish(2, states[2])
        f.state[name].reshape(-1).view(np.uint16)[untouched] ^= 1  # a foreign write no delta touches
        assert f.poll() == 2  # the check of version 2 now runs in the background
        f.close()
        assert f.version is None and f.events[-1].kind == "corrupt"  # found, reported, the state invalid
        f.close()  # twice is fine
        assert f.wait_scan()  # nothing running
        pub.publish(3, states[3])
    for call in (f.poll, f.bootstrap, f.verify, lambda: next(f.follow())):
        with pytest.raises(InvalidInputError, match="closed"):
            call()
    assert f.version is None and f.stats.versions_applied == 2  # 1 (replayed by the bootstrap) and 2
    assert f.published() == 3  # one small read, no thread needed

    g = Follower(url)
    g.bootstrap()
    assert g.version == 3
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        pub.publish(4, states[4])
        pub.publish(5, states[5])
    follow = g.follow()
    assert next(follow) == 4
    g.close()  # while the generator is suspended, the next version being fetched
    with pytest.raises(InvalidInputError, match="closed"):
        next(follow)
    assert g.version == 4
    assert_same_bits(g.state, states[4])


@pytest.mark.parametrize("call", ["poll", "bootstrap"])
def test_a_follow_overtaken_by_a_poll_on_the_same_thread_is_not_a_corrupt_version(states, url, call):
    """follow() suspended in the middle of a replay while poll()/bootstrap() bring the state to the head: resumed,
    it finds nothing left to apply (it used to report the next version as corrupt and re-bootstrap)."""
    publish_all(url, states[:2], anchor_every=20)
    f = Follower(url)
    f.bootstrap()
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        for v in range(2, 6):
            pub.publish(v, states[v])
    follow = f.follow(timeout=0)
    assert next(follow) == 2
    assert getattr(f, call)() == 5
    assert list(follow) == []
    assert f.version == 5 and f.stats.corrupt == 0 and f.stats.rebootstraps == 0
    assert [e.kind for e in f.events if e.kind != "apply"] == ["bootstrap"] * (1 + (call == "bootstrap"))
    assert_same_bits(f.state, states[5])
    f.close()


def test_damaged_branch_ref_is_reported_not_applied(states, url):
    publish_all(url, states[:3])
    f = Follower(url)
    f.bootstrap()
    refs = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(url, "refs")) for n in names]
    saved = {p: open(p, "rb").read() for p in refs}
    for p in refs:
        open(p, "wb").write(b"{damaged")
    assert f.poll() is None and f.version == 2 and f.events[-1].kind == "corrupt"
    for p, raw in saved.items():
        open(p, "wb").write(raw)
    with Publisher(url, chunk_elems=CHUNK) as pub:
        pub.publish(3, states[3])
    assert f.poll() == 3


def test_poll_to_an_announced_version_reads_no_ref_and_proves_the_chain(states, url):
    """A control plane's message names the version: the follower reaches exactly it without reading the branch
    head, the chain still proven; stale and unknown versions are told apart."""
    publish_all(url, states[:6], anchor_every=5)
    f = Follower(url)
    reads = []
    io = f.trajectory._io
    orig_get, orig_list = io.get, io.list
    io.get = lambda key, **kw: (reads.append(key), orig_get(key, **kw))[1]
    io.list = lambda prefix, *a, **kw: (reads.append(prefix), orig_list(prefix, *a, **kw))[1]
    assert f.poll(to=2) == 2  # the first call bootstraps: from the snapshot at 0, to 2 and not the head (5)
    assert_same_bits(f.state, states[2])
    assert f.poll(to=4) == 4
    assert_same_bits(f.state, states[4])
    assert not any(k.startswith("refs") for k in reads), reads
    assert f.poll(to=3) is None and f.poll(to=4) is None and f.version == 4  # stale: nothing moves
    assert_same_bits(f.state, states[4])
    with pytest.raises(NotFoundError, match="version 9 is not published"):
        f.poll(to=9)
    for bad in (-1, 2.0, "5", True):
        with pytest.raises(InvalidInputError, match="version number"):
            f.poll(to=bad)
    assert f.version == 4 and f.poll() == 5  # the branch head, as before
    assert_same_bits(f.state, states[5])
    f.close()


def test_poll_with_the_announced_document_makes_one_request_per_version(states, url):
    """The publisher's document sent with the version: a follower one version behind reads only the range of its
    pack (TRL's one file per version), and ends bit-exact; a second announcement of the same document is fine."""
    infos = publish_all(url, states[:2], anchor_every=20)
    f = Follower(url)
    assert f.poll(to=1, document=infos[1].document) == 1
    io = f.trajectory._io
    counter, listed = CountingIO(io), []
    io.list = lambda prefix, *a, _list=io.list, **kw: (listed.append(prefix), _list(prefix, *a, **kw))[1]
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        for v in range(2, 5):
            info = pub.publish(v, states[v])
            assert info.document == open(os.path.join(url, "steps", str(v), "zarr.json"), "rb").read()
            counter.reset()
            assert f.poll(to=v, document=info.document.decode() if v == 3 else info.document) == v
            assert len(counter.reads) == 1 and counter.packs() and not listed, (counter.reads, listed)
            assert_same_bits(f.state, states[v])
            assert f.poll(to=v, document=info.document) is None  # stale: nothing moves, nothing read
    f.close()


def test_poll_with_a_damaged_or_foreign_document_raises_and_changes_nothing(states, url, tmp_path):
    """A refused document: InvalidInputError, the state, version, stats and events as they were, nothing recovered
    and nothing kept; the version's genuine document then works.  Among them another bucket's document of the same
    version on the same history (its pack is not in this bucket) and one not committed on the version held."""
    infos = publish_all(url, states[:4], anchor_every=20)
    mirror = str(tmp_path / "mirror")  # the same versions 0 and 1, then its own version 2
    foreign = publish_all(mirror, [states[0], states[1], states[5]], anchor_every=20)[2].document
    assert foreign != infos[2].document
    f = Follower(url)
    assert f.poll(to=1) == 1
    good = infos[2].document
    flipped = good.replace(b'"step":2', b'"step":3')
    before = (dataclasses.replace(f.stats), list(f.events))
    for bad, to, match in [
        (good[:-1] + b"!", 2, "refused"),  # a damaged byte: fails its canonical form / checksum
        (flipped, 2, "refused"),  # the number changed: fails its checksum
        (infos[3].document, 2, "refused"),  # another version's document
        (foreign, 2, "could not be applied from the document announced"),
        (good, None, "pass both"),
        (bytearray(MAX_DOCUMENT_BYTES + 1), 2, "at most"),
        (12, 2, "bytes or str"),
        (12, 1, "bytes or str"),  # even with a stale version
    ]:
        with pytest.raises(InvalidInputError, match=match):
            f.poll(to=to, document=bad)
        assert f.version == 1 and (f.stats, f.events) == before
        assert_same_bits(f.state, states[1])
    assert f.poll(to=2, document=good) == 2
    assert_same_bits(f.state, states[2])
    with Publisher(mirror, anchor_every=20, chunk_elems=CHUNK) as pub:  # the mirror's 3 is not on this bucket's 2
        other3 = pub.publish(3, states[3]).document
    counter = CountingIO(f.trajectory._io)
    assert f.poll(to=3, document=other3) == 3  # not committed on the version held: the bucket's 3 is read instead
    assert counter.docs() == ["steps/3/zarr.json"]
    assert [e.kind for e in f.events[len(before[1]) :]] == ["apply", "apply"]  # versions 2 and 3, nothing else
    assert f.stats.corrupt == 0 and f.stats.rebootstraps == 0
    assert_same_bits(f.state, states[3])
    f.close()


def test_a_document_of_a_version_after_missed_ones_is_not_used(states, url):
    """Messages were missed: the announced version's document names a parent the follower does not hold; the chain
    is read from the bucket (the document too) and proven as always."""
    infos = publish_all(url, states[:5], anchor_every=20)
    f = Follower(url)
    assert f.poll(to=1) == 1
    counter = CountingIO(f.trajectory._io)
    assert f.poll(to=4, document=infos[4].document) == 4
    assert set(counter.docs()) >= {"steps/2/zarr.json", "steps/3/zarr.json", "steps/4/zarr.json"}
    assert_same_bits(f.state, states[4])
    f.close()


def test_a_follower_that_read_a_version_later_deleted_and_published_again_reaches_the_new_one(states, url):
    """The publisher deletes version 2 and publishes another 2: the follower holding the old 2 finds the chain
    broken, re-bootstraps with its cached step documents dropped, and holds the bucket's versions exactly."""
    publish_all(url, states[:3], anchor_every=0)
    f = Follower(url)
    assert f.poll() == 2
    with Publisher(url, anchor_every=0, chunk_elems=CHUNK) as pub:
        pub.trajectory.delete(2)
        pub.publish(2, states[6])
        pub.publish(3, states[3])
    assert f.poll() == 3
    assert_same_bits(f.state, states[3])
    assert any(e.kind == "reset" for e in f.events), f.events
    f.close()


def test_poll_to_a_version_with_a_damaged_step_document_recovers_as_a_polled_head(states, url):
    publish_all(url, states[:7], anchor_every=5)
    f = Follower(url)
    assert f.poll(to=3) == 3
    doc = os.path.join(url, "steps", "4", "zarr.json")  # version 4's step document
    raw = open(doc, "rb").read()
    open(doc, "wb").write(raw[:-10] + b"0123456789")
    assert f.poll(to=6) == 6  # 4 cannot be read: reported, and the snapshot at 5 leads to 6
    assert any(e.kind == "corrupt" and e.version == 6 for e in f.events), f.events
    assert_same_bits(f.state, states[6])
    f.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("links", [{3: 3}, {2: 3, 3: 2}], ids=["itself", "two-step-loop"])
def test_parent_links_that_loop_never_hang_a_follower(states, url, links):
    """#40: crafted step documents (checksums recomputed) whose parent links loop: a new follower's poll()
    raises instead of walking the loop forever, and one holding a version reports it and keeps its state."""
    from tests.helpers.store import rewrite_step
    from ulstore.errors import IntegrityError

    publish_all(url, states[:4], anchor_every=10)  # 0 a snapshot, 1..3 deltas
    held = Follower(url)
    assert held.poll(to=1) == 1
    traj = ulstore.open(url)
    content = {s: traj.info(s).content for s in links.values()}
    for step, parent in links.items():

        def body(b, parent=parent):
            b["parent"], b["parent_content"] = parent, content[parent]

        rewrite_step(traj, step, body=body)
    fresh = Follower(url)
    with pytest.raises(IntegrityError, match="own parent|loop"):
        fresh.poll()
    assert fresh.version is None
    assert held.poll() is None and held.version == 1
    assert any(e.kind == "corrupt" and ("own parent" in e.detail or "loop" in e.detail) for e in held.events), [
        (e.kind, e.detail) for e in held.events
    ]
    assert_same_bits(held.state, states[1])


def test_zero_dim_tensors_are_published_and_followed_as_zero_dim(url):
    """A model with a BatchNorm (num_batches_tracked is a 0-d int64 buffer) bootstraps and follows."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(torch.bfloat16)
    with Publisher(url, anchor_every=3, chunk_elems=CHUNK) as pub:
        pub.publish(0, model.state_dict())
        model[1].num_batches_tracked += 5
        with torch.no_grad():
            model[0].weight[0, 0] += 1
        pub.publish(1, model.state_dict())
        replica = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(torch.bfloat16)
        f = Follower(url, state=replica.state_dict())
        assert f.bootstrap() == 1
        assert replica[1].num_batches_tracked.shape == () and int(replica[1].num_batches_tracked) == 5
        model[1].num_batches_tracked += 1
        pub.publish(2, model.state_dict())
        assert f.poll() == 2 and int(replica[1].num_batches_tracked) == 6
    assert_same_bits(replica.state_dict(), model.state_dict())
    assert ulstore.open(url, mode="r").tensors(2)["1.num_batches_tracked"][0] == ()
    own = Follower(url)  # follower-owned numpy state: 0-d too
    own.bootstrap()
    assert own.state["1.num_batches_tracked"].shape == ()


def test_sync_bucket_is_a_trajectory_for_every_tool(states, tmp_path):
    """ulstore.open, log, ls, export, verify and a lazy slice work on what the publisher wrote."""
    from ulstore import cli

    url = str(tmp_path / "bucket")
    publish_all(url, states[:7], anchor_every=3)
    traj = ulstore.open(url, mode="r")
    assert traj.steps == list(range(7)) and traj.head() == 6
    assert [i.step for i in traj.log()] == list(range(6, -1, -1))
    assert [i.metadata["model_version"] for i in traj.log()][0] == 6
    for v in (0, 4, 6):
        assert_same_bits(traj.read(v), states[v])
    name = "lm_head.weight"
    lazy = traj[5][name][2:4, 1:7]
    assert_bits_equal(lazy, states[5][name][2:4, 1:7])
    assert traj.verify().errors == []
    # hash chain: each version names its parent's content checksum
    log = traj.log()
    assert all(a.parent_content == b.content for a, b in zip(log, log[1:]))
    assert cli.main(["log", url]) == 0
    assert cli.main(["ls", url, "4"]) == 0
    assert cli.main(["verify", url]) == 0
    out = tmp_path / "v5.safetensors"
    assert cli.main(["export", url, "5", str(out)]) == 0
    from ulstore.sync.trl import read_trl_file

    _, tensors, _ = read_trl_file(out.read_bytes(), str(out))
    assert_same_bits(tensors, states[5])


def test_objects_per_delta_version(states, tmp_path):
    """A delta version leaves three objects: one pack, one step document, one ref log entry.

    The store's commit also writes a transient intent (``pending/commit/...``,
    deleted once the ref has moved) so that a concurrent ``delete`` cannot break it.
    """
    url = str(tmp_path / "objs")
    with Publisher(url, anchor_every=10, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        writes = inject(pub.trajectory, "", lambda key: None)
        pub.publish(1, states[1])
        left = [k for k in writes if pub.trajectory._io.exists(k)]
    assert len(left) == 3 and [k.split("/")[0] for k in left] == ["packs", "steps", "refs"], writes
    assert len(writes) <= 4, writes


# -- configuration errors ---------------------------------------------------------------


def test_missing_bucket_is_a_clear_error_at_construction(moto_s3):
    with pytest.raises(BucketAccessError, match="does not exist"):
        Publisher("s3://no-such-bucket-ulstore/run", storage_options=moto_s3.options)
    with pytest.raises(BucketAccessError, match="does not exist"):
        Follower("s3://no-such-bucket-ulstore/run", storage_options=moto_s3.options)


def test_unreachable_endpoint_is_a_clear_error_at_construction():
    opts = {
        "key": "k",
        "secret": "s",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
    }
    t0 = time.monotonic()
    with pytest.raises(BucketAccessError, match="127.0.0.1:9"):
        Publisher("s3://bucket/run", storage_options=opts)
    with pytest.raises(BucketAccessError):
        Follower("s3://bucket/run", storage_options=opts)
    assert time.monotonic() - t0 < 30


def test_unknown_protocol_and_foreign_prefix(tmp_path):
    with pytest.raises(BucketAccessError, match="nosuchfs"):
        Publisher("nosuchfs://x/y")

    (tmp_path / "other").mkdir()  # a Zarr hierarchy that is not a trajectory
    (tmp_path / "other" / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}})
    )
    with pytest.raises(InvalidInputError, match="not a ulstore trajectory"):
        Follower(str(tmp_path / "other"))
    with pytest.raises(InvalidInputError, match="not a ulstore trajectory"):
        Publisher(str(tmp_path / "other"))


def test_a_publisher_refuses_a_directory_of_other_files(tmp_path, states):
    """A Publisher given a directory of checkpoint files does not make its bucket among them: refused, naming
    what is there, the directory left as it was; an empty directory is a new bucket."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(InvalidInputError, match=r"holds 1 entry \('model.safetensors'\)"):
        Publisher(str(ckpts))
    assert [p.name for p in ckpts.iterdir()] == ["model.safetensors"]
    (tmp_path / "empty").mkdir()
    with Publisher(str(tmp_path / "empty"), chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
    with Publisher(str(tmp_path / "empty"), chunk_elems=CHUNK) as pub:  # an existing bucket opens (resumed)
        assert pub.latest == 0


def test_s3_publish_follow(states, moto_s3):
    url = f"s3://{moto_s3.bucket()}/run"
    with Publisher(url, anchor_every=3, storage_options=moto_s3.options, chunk_elems=CHUNK) as pub:
        f = Follower(url, storage_options=moto_s3.options)
        with pytest.raises(NotFoundError):
            f.bootstrap()
        for v in range(5):
            pub.publish(v, states[v])
        assert f.bootstrap() == 4 and f.events[0].version == 3
        assert state_digest(f.state) == state_digest(states[4])


def test_prune_keeps_what_followers_need(states, url, monkeypatch):
    from ulstore.store.maintenance import _delete

    publish_all(url, states[:6], anchor_every=4)
    stale = Follower(url)
    assert stale.bootstrap() == 5
    with Publisher(url, anchor_every=4, chunk_elems=CHUNK) as pub:
        for v in range(6, 13):  # anchors 0, 4, 8, 12
            pub.publish(v, states[v])
        current = Follower(url, trust_state=True)
        assert current.bootstrap() == 12
        encodes = []
        real = _delete.encode_chunk
        monkeypatch.setattr(_delete, "encode_chunk", lambda *a, **k: encodes.append(a) or real(*a, **k))
        out = pub.prune(keep_anchors=2)
        assert encodes == []  # the cutoff's snapshots became its entries: no chunk re-encoded
        pub.publish(13, states[11])  # (any state: the fixture has 13)
    assert current.poll() == 13 and current.stats.rebootstraps == 0  # in step: the next delta, as before
    assert_same_bits(current.state, states[11])
    assert out["cutoff"] == 8 and out["objects"] > 0
    traj = ulstore.open(url, mode="r")
    assert traj.steps == list(range(8, 14)) and traj.verify().errors == []
    for v in range(8, 14):
        assert_same_bits(traj.read(v), states[v if v < 13 else 11])
    fresh = Follower(url)
    assert fresh.bootstrap() == 13  # snapshot 12, then the delta 13
    assert_same_bits(fresh.state, states[11])
    assert stale.poll() == 13  # its next delta (6) is gone: re-bootstraps from a kept snapshot
    assert_same_bits(stale.state, states[11])
    assert stale.stats.rebootstraps == 1


def test_unreachable_bucket_mid_run(states, url):
    publish_all(url, states[:2])
    f = Follower(url, poll_interval=0.001)
    f.bootstrap()
    with Publisher(url, chunk_elems=CHUNK) as pub:
        pub.publish(2, states[2])
    io = f.trajectory._io
    orig, failures = io.get, {"n": 0}

    def flaky(key, **kw):  # the first three reads fail, like a network blip
        failures["n"] += 1
        if failures["n"] <= 3:
            raise BucketAccessError("simulated outage", key=key)
        return orig(key, **kw)

    io.get = flaky
    with pytest.raises(BucketAccessError):
        f.poll()  # poll raises; the state still holds version 1
    assert f.version == 1
    assert_same_bits(f.state, states[1])
    assert list(f.follow(until=2, timeout=5)) == [2]  # follow reports and retries
    assert f.stats.unreachable == 2 and [e.kind for e in f.events].count("unreachable") == 2
    assert_same_bits(f.state, states[2])


def test_cuda_tensors_publish_and_follow(states, url):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():  # the device code path itself is also run on CPU: see
        pytest.skip("no CUDA device")  # test_device_binding_writes_through_a_cpu_stand_in
    from ulstore.core.torch import to_tensor as numpy_to_tensor

    def on_gpu(state):
        return {k: numpy_to_tensor(v.copy()).cuda() for k, v in state.items()}

    with Publisher(url, chunk_elems=CHUNK) as pub:  # the publisher copies device tensors to host itself
        pub.publish(0, on_gpu(states[0]))
        replica = {k: torch.zeros(v.shape, dtype=torch.bfloat16, device="cuda") for k, v in states[0].items()}
        f = Follower(url, state=replica)
        f.bootstrap()
        pub.publish(1, on_gpu(states[1]))
        assert f.poll() == 1
    assert_same_bits({k: v.cpu() for k, v in replica.items()}, states[1])


def test_unusable_newest_anchor_falls_back_to_an_older_one(states, url):
    publish_all(url, states[:8], anchor_every=5)  # anchors 0 and 5
    _flip(*_blob_path(url, 5, snapshot=True))
    f = Follower(url)
    assert f.bootstrap() == 7
    assert_same_bits(f.state, states[7])
    assert [e.kind for e in f.events][:2] == ["corrupt", "bootstrap"] and f.events[1].version == 0


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float32"])
def test_device_binding_writes_through_a_cpu_stand_in(name):
    """The device half of a Binding (CUDA in production) takes whole chunks and changes alike."""
    pytest.importorskip("torch")
    from ulstore import decode_changes, encode
    from ulstore.core.torch import to_tensor as numpy_to_tensor

    dt = np.dtype(getattr(ml_dtypes, name, name))
    word = np.dtype(f"<u{dt.itemsize}")
    ref = np.linspace(-1, 1, 5000).astype(np.float32).astype(dt)
    target = ref.copy()
    target.view(word)[[0, 3, 777, 4999]] += 1
    device = numpy_to_tensor(ref.copy())  # what a CUDA tensor would be (fp8: no index_copy_ kernel)
    b = Binding("w", ref.copy(), device=device)
    b.apply(0, ref.size, decode_changes(encode(target, ref, sparse=True), ref))
    for got in (b.mirror, device):
        assert_bits_equal(got, target)
    b.write(1000, ref[1000:2000])  # a whole chunk
    want = target.copy()
    want[1000:2000] = ref[1000:2000]
    for got in (b.mirror, device):
        assert_bits_equal(got, want)


def follower_a_version_behind(states, url, way: str, anchor_every: int):
    """A trusted follower loaded whole at version 0 and, ``way="columns"``, moved on to version 1, so that the
    next version goes through the change columns (``"feed"``: the layout held forgotten, as a replica whose
    step's tables were written by its own process, so that it goes through the feed); then that next version
    published.  Returns (follower, next version)."""
    publish_all(url, states[:1], anchor_every=anchor_every)
    f = Follower(url, trust_state=True)
    assert f.bootstrap() == 0
    assert f._replica._layout is not None  # loaded whole: its children's columns are taken from the first
    if way == "feed":
        f._replica._layout = None
    with Publisher(url, anchor_every=anchor_every, chunk_elems=CHUNK) as pub:
        if way == "columns":
            pub.publish(1, states[1])
            assert f.poll() == 1
        target = f.version + 1
        pub.publish(target, states[target])
    return f, target


@pytest.mark.parametrize("way", ["feed", "columns"])
def test_device_copies_get_exactly_the_changes_written(states, url, way, monkeypatch):
    """A state on a device gets, per chunk written in place, the changed positions and words of the mirror:
    replayed on the last version's bits they make this version's."""
    f, target = follower_a_version_behind(states, url, way, anchor_every=0)
    device = {n: np.asarray(v).reshape(-1).view(np.uint16).copy() for n, v in states[target - 1].items()}
    taken = columns_taken(monkeypatch)
    orig = Binding.push

    def push(self, start, positions, values):  # what a CUDA copy's index_copy_ is given
        device[self.name][start + positions] = values

    bindings = f._replica._bindings.values()
    for b in bindings:
        b.device = "a device"
    Binding.push = push
    try:
        assert f.poll() == target
    finally:
        Binding.push = orig
        for b in bindings:
            b.device = None
    assert taken == [way == "columns"]
    assert_same_bits(f.state, states[target])
    for n, v in states[target].items():
        assert_bits_equal(device[n], np.asarray(v).reshape(-1).view(np.uint16), n)  # the device holds words


@pytest.mark.parametrize("way", ["feed", "columns"])
def test_failed_write_leaves_the_follower_invalid_then_bootstraps(states, url, way):
    """An error while writing a version (phase 2) leaves no claim on the state: the next poll bootstraps."""
    f, target = follower_a_version_behind(states, url, way, anchor_every=5)
    orig = Binding.push
    calls = []

    def failing(self, start, positions, values):  # the device copy of a chunk's changes
        calls.append(self.name)
        if len(calls) == 2:  # after one chunk was written
            raise RuntimeError("device lost")

    # as if every tensor lived on a device (a copy is pushed there once the host mirror is written)
    bindings = f._replica._bindings.values()
    for b in bindings:
        b.device = "a device"
    Binding.push = failing
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            f.poll()
    finally:
        Binding.push = orig
        for b in bindings:
            b.device = None
    assert f.version is None and f._replica._sums == {}
    assert f.poll() == target
    assert_same_bits(f.state, states[target])


def test_a_tensor_rechunked_between_versions_is_followed_without_a_false_alarm(states, url):
    """The same tensors with other chunks: no chunk held under the old chunking vouches for a new one."""
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        pub.publish(1, states[1])
    f = Follower(url, check_every=1)  # default mode: the whole state re-summed each version
    f.bootstrap()
    with Publisher(url, anchor_every=20, chunk_elems=CHUNK * 3) as pub:
        for v in (2, 3):
            pub.publish(v, states[v])
            assert f.poll() == v
    assert_same_bits(f.state, states[3])
    assert [e.kind for e in f.events if e.kind not in ("apply", "bootstrap")] == []
    assert f.verify() and f.stats.rebootstraps == 0
