"""Deletes and gc inside chains keep every remaining step exact, and its stored read cost true and within k.

A step document keeps the modelled cost of reading its step (``anchoring``,
``ulstore/store/format/_read_cost.py``); a delete inside a chain changes what
the steps below it read, so their figures are rewritten (and a step that would
read more than k x its chain's anchor is re-anchored).  Here every remaining
step is read back bit for bit from a fresh open, and every stored figure is
compared with one recomputed from the stored tables.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ulstore
from tests.helpers.store import assert_state_equal, commit_states
from ulstore import cli, toytrain
from ulstore.errors import IntegrityError
from ulstore.store.format._layout import step_key
from ulstore.store.format._read_cost import PER_READ, own_cost

STEPS = 16


@pytest.fixture(scope="module")
def runs():
    """Real toy trajectories: pretraining (dense deltas, anchors every step or two) and RL (SPARSE, long chains)."""
    return {kind: toytrain.trajectory(kind, STEPS, preset="tiny") for kind in ("pretrain", "rl")}


_commit_all = commit_states  # chunks of 16 KiB: several a tensor of the tiny model


def recomputed(traj) -> dict[int, dict]:
    """Every step's ``anchoring`` figures recomputed from its stored tables (what it adds to its parent's read;
    an anchor's own, plus the fixed cost of a read), walking parents first."""
    r = ulstore.open(traj.url, mode="r")._reader
    out: dict[int, dict] = {}

    def one(s: int) -> dict:
        if s in out:
            return out[s]
        d = r.doc(s)
        if d.anchoring.why is not None:
            own = own_cost(r.tables(s), d.packs, None, (), r.fetch) + PER_READ
            out[s] = {"cost": own, "anchor_cost": own, "step_cost": own}
        else:
            p = one(d.parent)
            pd = r.doc(d.parent)
            own = own_cost(r.tables(s), d.packs, r.tables(d.parent), pd.packs, r.fetch)
            out[s] = {"cost": p["cost"] + own, "anchor_cost": p["anchor_cost"], "step_cost": own}
        return out[s]

    for s in ulstore.open(traj.url, mode="r").steps:
        one(s)
    return out


def check(traj, states, before: dict | None = None, k: float = 2.0) -> None:
    """Every remaining step reads exactly; its stored figures are the recomputed ones; a delta's read is within
    k x its anchor's (or no worse than before the delete); anchors have no delta entry; verify is clean."""
    ro = ulstore.open(traj.url, mode="r")
    again = recomputed(traj)
    for s in ro.steps:
        assert_state_equal(ulstore.open(traj.url, mode="r").read(s), states[s])
        a = ro.info(s).anchoring
        assert {f: a[f] for f in ("cost", "anchor_cost", "step_cost")} == again[s], s
        if ro.info(s).anchor_distance == 0:  # read with no reference (a snapshot step's deltas have snapshots)
            tables = ro._reader.tables(s).values()
            assert all(p.has_intra(i) for t in tables for p in t.pieces for i in range(p.n)), s
        else:
            old = before.get(s, {}).get("cost", 0) if before else 0
            assert a["cost"] <= max(k * a["anchor_cost"] + a["step_cost"], old), (s, a)
    report = ro.verify(raise_on_error=False)
    assert report.ok and not report.warnings, (report.errors, report.warnings)


def _figures(traj) -> dict[int, dict]:
    return {s: traj.info(s).anchoring for s in traj.steps}


def test_commits_store_the_costs_a_recount_gives(runs, tmp_path):
    for kind in ("pretrain", "rl"):
        traj = _commit_all(tmp_path / kind, runs[kind])
        check(traj, runs[kind])


@pytest.mark.parametrize("kind", ["rl", "pretrain"])
def test_deleting_deltas_inside_a_chain(runs, tmp_path, kind):
    states = runs[kind]
    traj = _commit_all(tmp_path / "t", states)
    deltas = [s for s in traj.steps if traj.info(s).anchor_distance > 0 and s < STEPS]
    gone = deltas[len(deltas) // 2 :: 3][:3]
    assert gone
    for s in gone:
        before = _figures(traj)
        traj.delete(s)
        check(traj, states, before)
    traj.gc()
    check(traj, states)


def test_deleting_an_anchor_re_anchors_the_step_after_it(runs, tmp_path):
    """Its children take its intra blobs (or re-encode intra): re-parented onto the chain before, they would read
    both; each is made an anchor by cost, its reason saying what its read would have cost."""
    states = runs["pretrain"]
    traj = _commit_all(tmp_path / "t", states)
    anchors = [s for s in traj.steps if traj.info(s).anchor_distance == 0 and s > 0]
    victim = next(a for a in anchors if a + 1 in traj.steps and traj.info(a + 1).anchor_distance == 1)
    traj.delete(victim)
    a = traj.info(victim + 1).anchoring
    assert traj.info(victim + 1).anchor_distance == 0
    assert a["anchor"]["policy"] == "cost" and a["anchor"]["predicted"] > a["anchor"]["limit"]
    check(traj, states)
    traj.gc()
    check(traj, states)


def test_deleting_the_root_of_a_sparse_chain(runs, tmp_path):
    states = runs["rl"]
    traj = _commit_all(tmp_path / "t", states)
    traj.delete(0)
    assert traj.info(1).anchor_distance == 0
    check(traj, states)


def test_a_snapshot_step_deleted_under_an_anchor_that_reuses_its_entries(runs, tmp_path):
    """An anchor may reuse entries that are deltas with a snapshot; deleting it leaves its child with delta
    entries: the child is re-anchored by re-encoding them (the snapshot, where there is one) and its own
    descendants' entries follow it."""
    states = runs["rl"]
    traj = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=1 << 14)
    traj.commit(0, states[0])
    traj.commit(1, states[1], snapshot=True)
    traj.commit(2, states[2], anchor=True)
    for s in range(3, 8):
        traj.commit(s, states[s])
    traj.delete(2)
    check(traj, states)
    traj.delete(1)
    check(traj, states)
    traj.gc()
    check(traj, states)


def test_a_fixed_count_trajectory_keeps_its_anchors_and_true_costs(runs, tmp_path):
    states = runs["rl"]
    traj = _commit_all(tmp_path / "t", states, anchor_every=4)
    traj.delete(4)
    traj.delete(6)
    check(traj, states, k=np.inf)
    check_depths(traj, 4)


def check_depths(traj, every: int) -> list[int]:
    """Every remaining step's chain is within the fixed count (distances below ``every``, as commits make them),
    its stored distance is its parent's plus one, and every anchor has a reason; the anchors by distance (a
    commit's or a delete's: reason "every")."""
    ro = ulstore.open(traj.url, mode="r")
    made = []
    for s in ro.steps:
        i = ro.info(s)
        assert i.anchor_distance < every, (s, i.anchor_distance)
        if i.anchor_distance:
            assert i.anchor_distance == ro.info(i.parent).anchor_distance + 1, s
            assert ro._reader.doc(s).anchoring is None or i.anchoring["anchor"] is None, s
        elif i.anchoring is not None:
            why = i.anchoring["anchor"]
            assert why is not None, s
            if why == {"policy": "every", "every": every}:
                made.append(s)
    return made


@pytest.mark.parametrize("kind", ["rl", "pretrain"])
def test_deleting_anchors_of_a_fixed_count_trajectory_keeps_chains_within_it(runs, tmp_path, kind):
    """rm of an anchor re-parents its children onto the end of the chain before: the step whose distance would
    reach N becomes an anchor (reason "every"), so every remaining step reads exactly within N steps, through
    deletes, gc and a reopen."""
    states, n = runs[kind], 4
    traj = _commit_all(tmp_path / "t", states, anchor_every=n)
    assert [s for s in traj.steps if traj.info(s).anchor_distance == 0] == list(range(0, len(states), n))
    every = set(check_depths(traj, n))
    traj.delete(4)  # its child 5 would be 3 + 1 = 4 steps from anchor 0
    assert set(check_depths(traj, n)) == every - {4} | {5}
    check(traj, states, k=np.inf)
    traj.delete(0)  # the root: its child is the root now
    traj.delete(8)  # 9 onto 7 (anchor 5): distance 3; 10 would reach 4
    assert set(check_depths(traj, n)) == every - {4, 8} | {5, 10}
    traj.gc()
    check(traj, states, k=np.inf)
    check_depths(traj, n)


def test_a_fixed_count_re_anchor_that_re_encodes_its_deltas(runs, tmp_path):
    """With a delta deleted before it, a deleted anchor's child lands at distance 3 (its chunks intra, taken from
    the anchor) and the grandchild, coded against it, reaches N = 4: its delta chunks are re-encoded intra, and
    its descendants' entries that were those blobs follow."""
    states = runs["rl"]
    traj = _commit_all(tmp_path / "t", states, anchor_every=4)
    traj.delete(3)
    traj.delete(4)
    assert traj.info(5).anchor_distance == 3
    assert check_depths(traj, 4) == [6, *range(8, len(states), 4)]
    check(traj, states, k=np.inf)
    traj.gc()
    check(traj, states, k=np.inf)


def test_a_fixed_count_trajectory_written_before_the_cost_model(runs, tmp_path):
    """Step documents with no ``anchoring`` (an older writer's): a delete still keeps chains within N, and the
    step it re-anchors says why."""
    states = runs["rl"][:10]
    traj = _commit_all(tmp_path / "t", states, anchor_every=4)
    for s in traj.steps:
        _rewrite(traj, s, anchoring=None)
    traj = ulstore.open(traj.url, mode="r+")
    traj.delete(4)
    assert check_depths(traj, 4) == [5]  # the others (no anchoring) say nothing
    assert traj.info(6).anchoring is None  # below the new anchor, unknown as before
    for s in traj.steps:
        assert_state_equal(ulstore.open(traj.url, mode="r").read(s), states[s])
    report = ulstore.open(traj.url, mode="r").verify(raise_on_error=False)
    assert report.ok and not report.warnings, (report.errors, report.warnings)


# -- verify: derived fields of a step document that disagree with what they derive from ----------------------


def _rewrite(traj, step: int, **fields) -> None:
    """Re-seal step ``step``'s document with ``fields`` replaced (a well-formed document, stale in some field)."""
    d = traj._reader.doc(step)
    traj._io.put(step_key(step), dataclasses.replace(d, **fields).to_bytes())
    traj._reader.forget_docs()


def test_verify_warns_of_stale_read_costs(runs, tmp_path):
    states = runs["rl"]
    traj = _commit_all(tmp_path / "t", states[:6])
    a = traj._reader.doc(3).anchoring
    _rewrite(traj, 3, anchoring=dataclasses.replace(a, cost=a.cost + 7))
    report = ulstore.open(traj.url, mode="r").verify(raise_on_error=False)
    assert report.ok, report.errors  # the data is intact
    # step 3's figures disagree with its parent's plus its own; step 4's with its parent's (3's stored cost)
    assert [(w["step"], w["error"]) for w in report.warnings] == [(3, "StaleReadCost"), (4, "StaleReadCost")]
    assert str(a.cost) in report.warnings[0]["message"] or str(a.cost + 7) in report.warnings[0]["message"]
    for s in range(6):
        assert_state_equal(ulstore.open(traj.url, mode="r").read(s), states[s])


def test_verify_warns_of_a_stale_chain_and_reads_never_return_wrong_values(runs, tmp_path):
    """A chain that names another step's directory as the parent's: verify warns; a read fails its content hash
    or reads exactly, never returns other values."""
    states = runs["rl"]
    traj = _commit_all(tmp_path / "t", states[:6])
    d4 = traj._reader.doc(4)
    d2 = traj._reader.doc(2)
    wrong = dataclasses.replace(d4.chain[0], packs=d2.packs, tables=d2.tables)  # step 3's entry, step 2's directory
    _rewrite(traj, 4, chain=(wrong, *d4.chain[1:]))
    report = ulstore.open(traj.url, mode="r").verify(raise_on_error=False)
    assert (4, "StaleChain") in [(w["step"], w["error"]) for w in report.warnings] or not report.ok
    try:
        got = ulstore.open(traj.url, mode="r").read(4)
    except IntegrityError:
        return
    assert_state_equal(got, states[4])


def test_the_cli_prints_verify_warnings(runs, tmp_path, capsys):
    states = runs["rl"]
    traj = _commit_all(tmp_path / "t", states[:4])
    a = traj._reader.doc(2).anchoring
    _rewrite(traj, 2, anchoring=dataclasses.replace(a, step_cost=a.step_cost + 1))
    assert cli.main(["verify", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "warning" in out and "StaleReadCost" in out, out
