"""ulstore as a torch.distributed.checkpoint backend, in real multi-process jobs (gloo, CPU).

Each job is ``tests/helpers/dcp.py``: the toytrain language model sharded FSDP2-style with
real AdamW steps, TP-style DTensors beside it, non-tensor leaves, and an oracle gathered by
rank 0 after every save.  Module-scoped runs (one per world size) are shared by the tests:

- ``run2``: 5 steps saved at 2 ranks, reloaded at 2 in the same job and at 4 in another;
- ``run4``: 5 steps saved at 4 ranks, reloaded at 4 and at 2.
"""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import ulstore
from tests.helpers import dcp as jobs
from tests.helpers.bits import assert_bits_equal, bits_of
from ulstore.core.torch import from_tensor
from ulstore.io import storage_report

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # real multi-process jobs: the slow lane (CI=true, --slow)

STEPS = 5
OTHER = {2: 4, 4: 2}


class Run:
    def __init__(self, root: Path, world: int):
        self.root, self.world = root, world
        self.url = str(root / "traj")
        # anchor_every: the five steps stay one chain of deltas, which the tests below are about (every element
        # changes each step, so the default cost policy would make most of them anchors)
        self.storage = jobs.Storage("ulstore", self.url, {"anchor_every": 16})

    def truth(self, step: int) -> dict:
        return jobs.read_state(self.root / f"truth/step-{step}.pt")

    def loaded(self, world: int, step: int) -> dict:
        return jobs.read_state(self.root / f"load-w{world}/step-{step}.pt")


def _run(tmp_path_factory, world: int) -> Run:
    run = Run(tmp_path_factory.mktemp(f"dcp-w{world}"), world)
    r = run.root
    jobs.outcomes_ok(
        jobs.run_job(
            world,
            jobs.save_job,
            run.storage,
            range(STEPS),
            str(r / "truth"),
            workdir=r,
            kwargs={"reload": str(r / f"load-w{world}")},
        )
    )
    other = OTHER[world]
    jobs.outcomes_ok(
        jobs.run_job(other, jobs.load_job, run.storage, range(STEPS), str(r / f"load-w{other}"), workdir=r)
    )
    return run


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    return _run(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    return _run(tmp_path_factory, 4)


@pytest.fixture(params=[2, 4])
def run(request):
    return request.getfixturevalue(f"run{request.param}")


def _tensors(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_every_step_loads_exactly_at_the_same_and_at_another_world_size(run):
    for world in (run.world, OTHER[run.world]):
        for s in range(STEPS):
            jobs.assert_same_state(run.loaded(world, s), run.truth(s))
    # the oracle saw real training and the awkward layouts the tests are about
    first, last = run.truth(0), run.truth(STEPS - 1)
    for name in ("model.model.in_proj.weight", "optim.state.model.in_proj.weight.exp_avg", "model.logit_scale"):
        assert not np.array_equal(bits_of(first[name]), bits_of(last[name])), name
    assert float(last["optim.state.model.in_proj.weight.step"]) == STEPS
    assert last["model.model.in_proj.weight"].shape[0] % 4 != 0 and last["tp.empty"].numel() == 0


def test_every_step_reads_exactly_through_ulstore_open_in_one_plain_process(run):
    traj = ulstore.open(run.url, mode="r")
    assert traj.steps == list(range(STEPS))
    for s in range(STEPS):
        want = run.truth(s)
        got = traj.read(s)
        tensors = _tensors(want)
        assert sorted(got) == sorted(tensors)
        for name, w in tensors.items():
            assert_bits_equal(got[name], w, name)
        # non-tensor leaves: the torch.save bytes DCP wrote, loadable without unpickling code
        leaves = {k: v for k, v in want.items() if not isinstance(v, torch.Tensor)}
        for name, w in leaves.items():
            raw = traj.read_file(s, f"dcp/objects/{name}")
            jobs.assert_same_state({name: torch.load(io.BytesIO(raw), weights_only=True)}, {name: w})
    # a lazy slice across the shard boundaries (rows 38|76|114 at 4 ranks, 75 at 2)
    w = run.truth(STEPS - 1)["model.model.in_proj.weight"]
    lazy = traj[STEPS - 1]["model.model.in_proj.weight"]
    assert_bits_equal(lazy[30:80, 3:9], w[30:80, 3:9], "rows 30:80 across the shard boundaries")
    cols = traj[STEPS - 1]["tp.cols"]  # column-sharded bf16
    assert cols.dtype.name == "bfloat16"
    assert_bits_equal(cols[:, 2:9], run.truth(STEPS - 1)["tp.cols"][:, 2:9], "tp.cols")


def test_export_gives_full_tensors(run, tmp_path):
    from safetensors.torch import load_file

    from ulstore import cli

    out = tmp_path / "step4.safetensors"
    assert cli.main(["export", run.url, str(STEPS - 1), str(out)]) == 0

    got = load_file(out)
    want = {k: v for k, v in _tensors(run.truth(STEPS - 1)).items() if v.numel()}
    assert set(want) <= set(got)
    for name, w in want.items():
        assert_bits_equal(got[name], w, name)


def test_later_steps_are_deltas_as_small_as_unsharded_commits(run, tmp_path):
    """The same states committed whole through traj.commit (with the same files): within 2% per step."""
    traj = ulstore.open(run.url, mode="r")
    ref = ulstore.open(tmp_path / "unsharded", mode="w", anchor_every=16)
    for s in range(STEPS):
        files = {f: traj.read_file(s, f) for f in traj.files(s)}
        ref.commit(s, {k: from_tensor(v) for k, v in _tensors(run.truth(s)).items()}, files=files)
    sharded, whole = storage_report(traj)["steps"], storage_report(ref)["steps"]
    for s in range(1, STEPS):
        kinds = Counter(c.kind for c in traj.changes(s))
        assert kinds["intra"] == 0 and kinds["delta"] > 0, kinds  # deltas from the second step on
        ratio = sharded[s]["stored_bytes"] / whole[s]["stored_bytes"]
        got, want = sharded[s]["stored_bytes"], whole[s]["stored_bytes"]
        print(f"{run.world} ranks, step {s}: {got:,} B sharded vs {want:,} B unsharded ({ratio - 1:+.2%})")
        assert ratio <= 1.02
    assert sum(r["stored_bytes"] for r in sharded[1:]) < 0.9 * sum(r["raw_bytes"] for r in sharded[1:])


def test_a_rank_killed_mid_save_leaves_no_step_and_a_job_restarted_on_more_ranks_saves_it(tmp_path):
    """Rank 1 of 2 dies while writing step 3 (after other ranks closed packs); a job on 4 ranks
    resumes from step 2 and saves steps 3 and 4, coding step 3 against step 2's other sharding."""
    # anchor_every: step 3 must be a delta against step 2's other sharding, what this test is about (under the
    # read-cost default this dense toy state anchors: one dense delta reads over 2x an anchor)
    storage = jobs.Storage("ulstore", str(tmp_path / "traj"), {"pack_bytes": 1 << 20, "anchor_every": 16})
    outcomes = jobs.run_job(
        2,
        jobs.save_job,
        storage,
        range(4),
        str(tmp_path / "truth"),
        workdir=tmp_path,
        pg_timeout=30,
        kwargs={"die": (1, 3, 20)},
    )
    assert outcomes[1].exitcode == 17 and not outcomes[1].ok  # killed mid-save
    assert not outcomes[0].ok and outcomes[0].error  # the coordinator failed, did not hang
    traj = ulstore.open(storage.url, mode="r")
    assert traj.steps == [0, 1, 2] and traj.head() == 2  # no partial step
    assert traj.stats()["unreferenced_bytes"] > 0  # what was written before the kill is invisible

    jobs.outcomes_ok(
        jobs.run_job(
            4, jobs.save_job, storage, [3, 4], str(tmp_path / "truth2"), workdir=tmp_path, kwargs={"resume": 2}
        )
    )
    traj = ulstore.open(storage.url, mode="r+")
    traj.gc()  # the killed save's packs go; nothing else does
    assert traj.steps == [0, 1, 2, 3, 4] and traj.stats()["unreferenced_bytes"] == 0
    truths = {s: jobs.read_state(tmp_path / ("truth" if s < 3 else "truth2") / f"step-{s}.pt") for s in range(5)}
    for s, want in truths.items():
        got = traj.read(s)
        for name, w in _tensors(want).items():
            assert_bits_equal(got[name], w, f"step {s}: {name}")
    # step 3 is coded against step 2 although no piece of it has step 2's layout
    name = "model.model.in_proj.weight"
    layouts = {s: {p.layout[:2] for p in traj._reader.tensor(s, name).pieces} for s in (2, 3)}
    assert layouts[2].isdisjoint(layouts[3])
    feed = [c for c in traj.changes(3) if c.tensor == name]
    assert {c.kind for c in feed} == {"delta"} and {c.ref for c in feed} == {2}
    row = storage_report(traj)["steps"][3]
    assert row["resharded_chunks"] >= len(feed)
