"""The cost-driven anchor policy: decisions on real trajectories, the reason in the step document, old settings.

A new trajectory makes a step an anchor when reading it as a delta would cost
more than ``anchor_cost`` (k) times reading its chain's anchor, in the model of
``ulstore/store/format/_read_cost.py``; every step document records the model's
figures, and an anchor why it is one (``anchoring``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import ulstore
from tests.helpers.store import commit_states
from ulstore import cli, toytrain
from ulstore.core.sealed import canonical_json
from ulstore.errors import CorruptManifestError, InvalidInputError
from ulstore.store.commit._commit_plan import retry_due
from ulstore.store.format._stepdoc import Anchoring, StepDoc, _checksum

STEPS = 24


@pytest.fixture(scope="module")
def runs():
    """Two real toy trajectories: pretraining (dense: most bf16 weights change each step) and RL (sparse)."""
    return {kind: toytrain.trajectory(kind, STEPS, preset="tiny") for kind in ("pretrain", "rl")}


_commit_all = commit_states  # chunks of 16 KiB: several a tensor of the tiny model


def _anchors(traj) -> list[int]:
    return [s for s in traj.steps if traj.info(s).anchor_distance == 0]


def test_a_dense_run_anchors_often_and_a_sparse_run_rarely(runs, tmp_path):
    dense = _commit_all(tmp_path / "dense", runs["pretrain"])
    sparse = _commit_all(tmp_path / "sparse", runs["rl"])
    assert dense.anchor_cost == 2.0 and sparse.anchor_cost == 2.0  # the default of new trajectories
    n_dense, n_sparse = len(_anchors(dense)), len(_anchors(sparse))
    # a dense delta decodes as much as an anchor (and more work per byte): a chain of a few steps reaches k=2 (at
    # this tiny size the fixed cost of a read is most of an anchor's, so a few, not one); a sparse one goes long
    assert n_dense >= max(STEPS // 6, 2 * n_sparse), _anchors(dense)
    assert n_sparse <= 2, _anchors(sparse)
    # every anchor but the root is one by cost, and its reason holds: the predicted read was above the limit
    for traj in (dense, sparse):
        for s in _anchors(traj)[1:]:
            why = traj.info(s).anchoring["anchor"]
            assert why["policy"] == "cost" and why["k"] == 2.0 and why["predicted"] > why["limit"], why
        # and no delta's modelled read goes past k x its anchor's (the policy's promise, on the model)
        for s in traj.steps:
            a = traj.info(s).anchoring
            assert a["cost"] <= 2.0 * a["anchor_cost"] + a["step_cost"], (s, a)
    # the data read back is exact
    for s in (0, STEPS // 2, STEPS):
        got = sparse.read(s)
        assert all(np.array_equal(got[n].view(np.uint16), runs["rl"][s][n].view(np.uint16)) for n in got)


def test_k_moves_the_anchors(runs, tmp_path):
    tight = _commit_all(tmp_path / "tight", runs["pretrain"], anchor_cost=1.0)
    loose = _commit_all(tmp_path / "loose", runs["pretrain"], anchor_cost=4.0)
    assert len(_anchors(tight)) > len(_anchors(loose)) >= 1
    # k=1: after the root a delta is tried (no delta is known yet); then a dense run anchors, and keeps anchoring
    assert all(tight.info(s).anchor_distance <= 1 for s in tight.steps)


def test_a_run_whose_deltas_cost_too_much_keeps_anchoring(runs, tmp_path):
    """A delta tried with no delta cost known (after the root) is priced before its commit point: over the limit,
    the step is written as an anchor by cost instead; after an anchor by cost the next step is predicted with
    the estimate that made it one, so a dense run whose one delta already reads more than k x an anchor anchors
    every step, and no step reads past the bound (each anchor's reason carries the estimate on)."""
    traj = _commit_all(tmp_path / "t", runs["pretrain"], anchor_cost=1.05)
    assert _anchors(traj) == list(range(STEPS + 1))
    for s in range(1, STEPS + 1):
        why, before = traj.info(s).anchoring["anchor"], traj.info(s - 1).anchoring
        assert why["policy"] == "cost" and why["predicted"] > why["limit"] == int(1.05 * before["anchor_cost"])
        # the estimate carried on (the delta estimate of the anchor before it), unless this step re-priced a delta
        if s > 1 and not retry_due(traj._reader.doc(s - 1)):
            assert (
                why["predicted"] - before["cost"] == before["anchor"]["predicted"] - traj.info(s - 2).anchoring["cost"]
            )
    # the same run under the default k: deltas where they fit, and none reads past 2x its anchor in the model
    loose = _commit_all(tmp_path / "loose", runs["rl"])
    for s in loose.steps:
        a = loose.info(s).anchoring
        assert a["anchor"] is not None or a["cost"] <= 2.0 * a["anchor_cost"] + a["step_cost"], (s, a)


def _dense_k(states, tmp_path) -> float:
    """A k halfway through the model's price of one dense delta of the tiny model (over an anchor's, from the
    dense ``states`` stored as one chain): one dense delta reads over the limit; a sparse one, a small part of
    an anchor, fits."""
    chain = _commit_all(tmp_path / "chain", states, anchor_cost=1000.0)
    assert all(chain.info(s).anchor_distance == s for s in chain.steps)
    dense = min(chain.info(s).anchoring["step_cost"] / chain.info(s).anchoring["anchor_cost"] for s in chain.steps[1:])
    return 1 + dense / 2


def test_a_run_that_turns_sparse_after_a_dense_phase_goes_back_to_deltas(runs, tmp_path, monkeypatch):
    """After anchors by cost, a commit samples what the step changed: once the changes are few, its first
    sparse step is a delta (not ~RETRY_ONE_IN steps later), and the run goes on as deltas (at this tight k, a
    chain of two or three: an anchor by cost, on a sparse delta's estimate, is followed by a delta again)."""
    from ulstore.store.commit import _commit_plan

    traj = _commit_all(tmp_path / "t", runs["pretrain"], anchor_cost=_dense_k(runs["pretrain"], tmp_path))
    assert _anchors(traj) == list(range(STEPS + 1))  # the dense phase: every step an anchor
    monkeypatch.setattr(_commit_plan, "retry_due", lambda pdoc: False)  # no draw: the sample alone finds it
    rng = np.random.default_rng(7)
    state = {n: a.copy() for n, a in runs["pretrain"][-1].items()}
    for s in range(STEPS + 1, STEPS + 9):
        for a in state.values():  # a few low bits flip: an RL-like step
            w = a.reshape(-1).view(np.uint16)
            w[rng.integers(0, w.size, max(1, w.size // 500))] ^= 1
        traj.commit(s, state)
    sparse = [traj.info(s).anchor_distance for s in range(STEPS + 1, STEPS + 9)]
    assert sparse[0] == 1 and all(d == 1 + before for d, before in zip(sparse[1:], sparse) if before == 0), sparse
    assert sparse.count(0) <= len(sparse) // 2, sparse
    assert all(np.array_equal(traj.read(s)[n].view(np.uint16), state[n].view(np.uint16)) for n in state)


#: The two phases of one real run (as ``ulstore demo``'s): lr 1e-3 (dense) for DENSE steps, then 3e-6 (sparse).
DENSE, SPARSE = 10, 6


@pytest.fixture(scope="module")
def phases():
    """One real toy run whose learning rate drops after DENSE steps (Adam moments carry over)."""
    cfg = toytrain.ToyConfig.preset("tiny")
    return [st for _, st, _ in toytrain.train(cfg, DENSE + SPARSE, lr=lambda k: 1e-3 if k < DENSE else 3e-6)]


def _count_probes(monkeypatch) -> list[int]:
    """The steps whose delta a commit encodes to price it (``Committer._over_limit``), in order."""
    from ulstore.store.commit._commit import Committer

    probes: list[int] = []
    real = Committer._over_limit

    def counted(self, step, *args):
        probes.append(step)
        return real(self, step, *args)

    monkeypatch.setattr(Committer, "_over_limit", counted)
    return probes


def test_after_the_learning_rate_drops_the_first_step_is_a_delta(phases, tmp_path, monkeypatch):
    """A dense phase anchors every step without encoding a delta per step (the sample says dense: one compare of
    a few chunks, no probe); the first step after the drop is a delta (its sample says sparse, the probe
    confirms it fits); every step reads back exactly."""
    k = _dense_k(phases[: DENSE + 1], tmp_path)
    probes = _count_probes(monkeypatch)
    traj = _commit_all(tmp_path / "t", phases, anchor_cost=k)
    assert _anchors(traj)[: DENSE + 1] == list(range(DENSE + 1))  # the dense phase: every step an anchor
    assert traj.info(DENSE + 1).anchor_distance == 1, traj.info(DENSE + 1).anchoring  # the first sparse step
    sparse = [traj.info(s).anchor_distance for s in range(DENSE + 1, DENSE + SPARSE + 1)]
    assert all(d == 1 + before for d, before in zip(sparse[1:], sparse) if before == 0), sparse  # (k is tight)
    # the delta after the root was priced (no estimate yet), then the first sparse step: no dense step in between
    assert probes == [1, DENSE + 1], (probes, sparse)
    ro = ulstore.open(tmp_path / "t", mode="r")
    for s, want in enumerate(phases):
        got = ro.read(s)
        assert all(np.array_equal(got[n].view(np.uint16), want[n].view(np.uint16)) for n in want), s


def test_the_sample_decides_alike_whatever_holds_the_parent(phases, tmp_path, monkeypatch):
    """The same steps give the same anchors and the same bytes with the kept parent and without (then the sample
    decodes the parent's chunks), on one thread or two (pack ids and times pinned)."""
    import hashlib

    import ulstore.store.commit._finalize as finalize
    import ulstore.store.format._packs as packs

    k = _dense_k(phases[: DENSE + 1], tmp_path)
    monkeypatch.setattr(finalize, "_now", lambda: "2026-12-08T00:00:00+00:00")
    trees = []
    for threads, keep in ((1, True), (2, False)):
        counter = iter(range(10**6))
        monkeypatch.setattr(packs, "new_pack_id", lambda: f"{next(counter):032x}")
        root = tmp_path / f"t{threads}"
        _commit_all(root, phases, anchor_cost=k, threads=threads, keep_parent=keep)
        trees.append(
            {
                str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*"))
                if p.is_file() and "refs" not in p.parts
            }
        )
    assert trees[0] == trees[1]
    assert ulstore.open(tmp_path / "t1", mode="r").info(DENSE + 1).anchor_distance == 1


def test_a_commit_with_nothing_to_sample_falls_back_to_the_draw(runs, tmp_path):
    """A step whose float tensors the parent does not hold alike (here: all renamed) has nothing to sample:
    after anchors by cost, the 1-in-RETRY_ONE_IN draw from the parent's content hash decides, as before."""
    traj = _commit_all(tmp_path / "t", runs["pretrain"], anchor_cost=_dense_k(runs["pretrain"], tmp_path))
    parent = traj.steps[-1]
    renamed = {f"other.{n}": a for n, a in runs["pretrain"][-1].items()}
    plan = traj._committer._plan
    is_anchor, why = plan._is_anchor(parent, None, draw=False)
    assert is_anchor and why["policy"] == "cost"
    got = plan._retry_limit(parent, why, renamed, True)
    assert (got is not None) == retry_due(traj._reader.doc(parent))
    assert plan._retry_limit(parent, why, runs["pretrain"][-2], True) is None  # one dense step from it: anchor


def test_the_reason_round_trips_through_storage(runs, tmp_path):
    _commit_all(tmp_path / "t", runs["pretrain"][:6])
    ro = ulstore.open(tmp_path / "t", mode="r")
    root = ro.info(0).anchoring
    assert root["anchor"] == {"policy": "root"} and root["cost"] == root["anchor_cost"] == root["step_cost"] > 0
    for s in ro.steps:
        doc = ro._reader.doc(s)
        again = StepDoc.from_bytes(doc.to_bytes(), key="k", step=s)
        assert again == doc and again.anchoring == doc.anchoring
        if doc.anchor_distance:
            parent = ro._reader.doc(doc.parent).anchoring
            assert doc.anchoring.cost == parent.cost + doc.anchoring.step_cost  # the running chain cost


def test_asked_and_fixed_count_reasons(runs, tmp_path):
    traj = ulstore.open(tmp_path / "t", mode="w", anchor_every=3)
    states = runs["rl"]
    for s in range(7):
        traj.commit(s, states[s], anchor=True if s == 5 else None)
    reasons = {s: (traj.info(s).anchoring or {}).get("anchor") for s in traj.steps}
    assert reasons[0] == {"policy": "root"}
    assert reasons[3] == {"policy": "every", "every": 3}
    assert reasons[5] == {"policy": "asked"}
    assert reasons[1] is None and reasons[4] is None


def _sealed(body: dict) -> bytes:
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {"ulstore": body}}
    doc["attributes"]["ulstore_checksum"] = _checksum(canonical_json(doc))
    return canonical_json(doc)


@pytest.mark.parametrize(
    "anchoring",
    [
        {"cost": -1, "anchor_cost": 1, "step_cost": 1, "anchor": None},
        {"cost": 1.5, "anchor_cost": 1, "step_cost": 1, "anchor": None},
        {"cost": True, "anchor_cost": 1, "step_cost": 1, "anchor": None},
        {"cost": 1, "anchor_cost": 1, "step_cost": 1},
        {"cost": 1, "anchor_cost": 1, "step_cost": 1, "anchor": None, "extra": 0},
        {"cost": 1, "anchor_cost": 1, "step_cost": 1, "anchor": {"policy": "whim"}},
        {"cost": 1, "anchor_cost": 1, "step_cost": 1, "anchor": {"policy": "root", "k": 2}},
        {"cost": 1, "anchor_cost": 1, "step_cost": 1, "anchor": {"policy": "cost", "k": 2}},
        {"cost": 1, "anchor_cost": 1, "step_cost": 1, "anchor": {"policy": "cost", "k": 0, "predicted": 1, "limit": 0}},
        {
            "cost": 1,
            "anchor_cost": 1,
            "step_cost": 1,
            "anchor": {"policy": "cost", "k": 1e300, "predicted": 1, "limit": 0},
        },
        {"cost": 1, "anchor_cost": 1, "step_cost": 1, "anchor": {"policy": "every", "every": "16"}},
        {"cost": 1 << 70, "anchor_cost": 1, "step_cost": 1, "anchor": None},
        [1, 1, 1, None],
    ],
)
def test_crafted_anchoring_is_refused(runs, tmp_path, anchoring):
    _commit_all(tmp_path / "t", runs["rl"][:1])
    doc = ulstore.open(tmp_path / "t", mode="r")._reader.doc(0)
    body = json.loads(doc.to_bytes())["attributes"]["ulstore"]
    body["anchoring"] = anchoring
    with pytest.raises(CorruptManifestError, match="anchor"):
        StepDoc.from_bytes(_sealed(body), key="steps/0/zarr.json", step=0)
    # the same document with a well-formed field parses, and without it (an older writer's) too
    body["anchoring"] = Anchoring(5, 5, 5, {"policy": "cost", "k": 2.0, "predicted": 11, "limit": 10}).to_json()
    assert StepDoc.from_bytes(_sealed(body), key="k", step=0).anchoring.why["predicted"] == 11
    del body["anchoring"]
    assert StepDoc.from_bytes(_sealed(body), key="k", step=0).anchoring is None


def test_old_settings_keep_their_behaviour(runs, tmp_path):
    # a trajectory created with a fixed count stores no cost policy, and anchors every N as before
    fixed = _commit_all(tmp_path / "fixed", runs["pretrain"][:10], anchor_every=4)
    assert fixed.anchor_cost is None
    assert _anchors(fixed) == [0, 4, 8]
    root = json.loads((tmp_path / "fixed" / "zarr.json").read_bytes())["attributes"]["ulstore"]
    assert "anchor_cost" not in root and root["anchor_every"] == 4
    reopened = ulstore.open(tmp_path / "fixed")
    assert reopened.anchor_cost is None and reopened.anchor_every == 4
    # a new trajectory stores k beside the fixed count an older ulstore would follow
    new = _commit_all(tmp_path / "new", runs["rl"][:2])
    root = json.loads((tmp_path / "new" / "zarr.json").read_bytes())["attributes"]["ulstore"]
    assert root["anchor_cost"] == 2.0 and root["anchor_every"] == 16
    assert ulstore.open(tmp_path / "new", anchor_every=5).anchor_cost is None  # an explicit count overrides
    assert new.info(1).anchoring["anchor"] is None
    with pytest.raises(InvalidInputError, match="not both"):
        ulstore.open(tmp_path / "x", mode="w", anchor_every=4, anchor_cost=2.0)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(InvalidInputError, match="anchor_cost"):
            ulstore.open(tmp_path / "y", mode="w", anchor_cost=bad)


def test_log_shows_why_a_step_is_an_anchor(runs, tmp_path, capsys):
    _commit_all(tmp_path / "t", runs["pretrain"])  # the dense run: anchors by cost (the first test's premise)
    assert cli.main(["log", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "anchor: root" in out and "anchor: cost " in out and ">2" in out
    assert cli.main(["log", str(tmp_path / "t"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_step = {d["step"]: d for d in doc["steps"]}
    assert by_step[0]["anchoring"]["anchor"] == {"policy": "root"}
    assert any(d["anchoring"]["anchor"] and d["anchoring"]["anchor"]["policy"] == "cost" for d in doc["steps"])
