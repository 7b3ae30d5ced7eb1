"""ulstore.dcp in one process (``no_dist``): the protocol's edges, fast.

The multi-process jobs (FSDP2 on gloo, 2 and 4 ranks) are in ``test_dcp_jobs.py``; here one
process is coordinator and only rank, which is enough for what does not depend on sharding:
checkpoint ids, refused names and steps (before anything is written), non-tensor leaves,
failures and retries with the same ``Writer``, pickling, any ulstore step loaded through DCP.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from contextlib import contextmanager

import numpy as np
import pytest

import ulstore
from tests.helpers import dcp as jobs
from tests.helpers.bits import assert_bits_equal
from ulstore.core.torch import from_tensor
from ulstore.errors import InvalidInputError, StepExistsError

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
udcp = pytest.importorskip("ulstore.dcp")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    base = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    return {
        "model": {
            "w": base + 1e-3 * step * torch.randn(40, 30, generator=g),
            "h": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16) * (step + 1),
            "empty": torch.zeros(0, 3),
        },
        "trainer": jobs.trainer_leaves(step, 0.5 / (step + 1)),
    }


def _template() -> dict:
    return {
        "model": {"w": torch.zeros(40, 30), "h": torch.zeros(3, 4, dtype=torch.bfloat16), "empty": torch.ones(0, 3)},
        "trainer": jobs.trainer_leaves(-1, 0.0),
    }


def _save(state, writer, step=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return dcp.save(state, storage_writer=writer, checkpoint_id=step, no_dist=True, **kw)


def _load(state, reader, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True, **kw)
    return state


@contextmanager
def _fails(cls, match: str):
    """The save or load fails with ``cls`` matching ``match``, raised as is or gathered by DCP."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((cls, CheckpointException)) as e:
        yield
    errors = [x for x, _ in e.value.failures.values()] if isinstance(e.value, CheckpointException) else [e.value]
    assert any(isinstance(x, cls) and re.search(match, str(x)) for x in errors), errors


def _flat(state: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def _same(got: dict, want: dict) -> None:
    jobs.assert_same_state(_flat(got), _flat(want))


def test_steps_saved_and_loaded_through_dcp_are_plain_ulstore_steps(tmp_path):
    url = str(tmp_path / "t")
    writer = udcp.Writer(url, metadata={"run": "local"})
    for s in range(3):
        _save(_state(s), writer, s)
    traj = ulstore.open(url, mode="r")
    assert traj.steps == [0, 1, 2] and traj.head() == 2
    assert traj.info(2).metadata == {"run": "local", "dcp": {"world_size": 1}}
    assert [c.kind for c in traj.changes(1) if c.tensor == "model.w"] == ["delta"] * len(traj.pieces(1, "model.w"))
    for s in range(3):
        _same(_load(_template(), udcp.Reader(url, step=s)), _state(s))
        got = traj.read(s)
        for name, want in _flat(_state(s)).items():
            if isinstance(want, torch.Tensor):
                assert_bits_equal(got[name], want, name)
    # non-tensor leaves are step files holding DCP's torch.save bytes; dcp/metadata.json is unchanged
    assert "dcp/objects/trainer.tag" in traj.files(2)
    assert torch.load(io.BytesIO(traj.read_file(2, "dcp/objects/trainer.tag")), weights_only=True) == "run-α/2"
    assert traj.read_file(1, "dcp/metadata.json") == traj.read_file(2, "dcp/metadata.json")
    # no step given: the head of the branch
    _same(_load(_template(), udcp.Reader(url)), _state(2))


@pytest.mark.parametrize("group_bytes", [None, 1])
def test_a_rank_reads_its_boxes_together_in_bounded_groups(tmp_path, monkeypatch, group_bytes):
    """A load plan's tensor boxes are read with read_boxes (coalesced range reads), all of them in one call, or
    one call per group of about GROUP_BYTES (here 1 byte: a box each), straight into the destination tensors'
    memory; the load is exact either way."""
    from ulstore.dcp import _storage_reader
    from ulstore.store import Trajectory

    url = str(tmp_path / "t")
    _save(_state(1), udcp.Writer(url), 1)
    if group_bytes is not None:
        monkeypatch.setattr(_storage_reader, "GROUP_BYTES", group_bytes)
    calls, outs = [], []
    real = Trajectory.read_boxes

    def spy(self, step, boxes, *, out=None):
        calls.append(len(boxes))
        outs.extend(out)
        return real(self, step, boxes, out=out)

    monkeypatch.setattr(Trajectory, "read_boxes", spy)
    template = _template()
    _same(_load(template, udcp.Reader(url, step=1)), _state(1))
    assert calls == ([2] if group_bytes is None else [1, 1])  # model.w and model.h (DCP reads no empty tensor)
    for tensor in (template["model"]["w"], template["model"]["h"]):
        assert any(np.shares_memory(o, from_tensor(tensor)) for o in outs)  # decoded into the model's tensors


def test_a_destination_of_another_dtype_or_layout_gets_the_values_converted(tmp_path):
    """A destination of another dtype is filled through a copy, as DCP's FileSystemReader does (the values
    converted exactly as torch converts them); a strided destination (a transposed view) through its strides."""
    url = str(tmp_path / "t")
    _save(_state(2), udcp.Writer(url), 2)
    template = _template()
    template["model"]["h"] = torch.zeros(3, 4, dtype=torch.float64)
    template["model"]["w"] = torch.zeros(30, 40).t()
    got = _load(template, udcp.Reader(url, step=2))
    want = _state(2)["model"]
    assert_bits_equal(got["model"]["h"], want["h"].to(torch.float64), "model.h")
    assert_bits_equal(got["model"]["w"].contiguous(), want["w"], "model.w")


def test_a_step_committed_without_dcp_loads_through_dcp(tmp_path):
    traj = ulstore.open(tmp_path / "t", mode="w")
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    traj.commit(7, {"layer.w": w})
    state = _load({"layer": {"w": torch.zeros(3, 4)}}, udcp.Reader(str(tmp_path / "t"), step=7))
    assert_bits_equal(state["layer"]["w"], w)


def test_bad_names_and_existing_steps_are_refused_before_anything_is_written(tmp_path):
    url = str(tmp_path / "t")
    writer = udcp.Writer(url)
    with _fails(InvalidInputError, "rename this state dict entry"):
        _save({"ok": torch.ones(2), "bad": {"a/__x": torch.ones(2)}}, writer, 0)
    traj = ulstore.open(url, mode="r")
    assert traj.steps == [] and traj.stats()["unreferenced_bytes"] == 0
    _save(_state(0), writer, 0)
    with _fails(StepExistsError, "already exists"):
        _save(_state(1), udcp.Writer(url), 0)
    with pytest.raises(InvalidInputError, match="step number"):
        udcp.Writer(url, step="latest")
    assert not udcp.Writer.validate_checkpoint_id("x") and udcp.Writer.validate_checkpoint_id("12")
    with _fails(InvalidInputError, "checkpoint_id=N"):
        _save(_state(1), udcp.Writer(url))  # no step anywhere


def test_a_save_into_a_directory_of_other_files_is_refused(tmp_path):
    """DCP's usual checkpoint directory (``.distcp`` files) given to ulstore's writer by mistake: refused,
    naming what is there, nothing written; an empty directory becomes a trajectory."""
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir()
    for name in (".metadata", "__0_0.distcp"):
        (ckpts / name).write_bytes(b"dcp")
    with _fails(InvalidInputError, r"holds 2 entries .*not a trajectory"):
        _save(_state(0), udcp.Writer(str(ckpts)), 0)
    assert sorted(p.name for p in ckpts.iterdir()) == [".metadata", "__0_0.distcp"]
    (tmp_path / "empty").mkdir()
    _save(_state(0), udcp.Writer(str(tmp_path / "empty")), 0)
    assert ulstore.open(str(tmp_path / "empty"), mode="r").steps == [0]


def test_a_failed_save_leaves_no_step_and_the_same_writer_retries_it(tmp_path, monkeypatch):
    """write_data failing (no pieces kept) and finish failing (this rank's pieces written, no step)."""
    url = str(tmp_path / "t")
    writer = udcp.Writer(url)
    _save(_state(0), writer, 0)
    with _fails(RuntimeError, "resolve 3"):
        _save(_state(1), writer, 1, planner=_FailingPlanner(3))
    real = ulstore.Trajectory.finalize
    calls = []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("the bucket went away")
        return real(self, *a, **k)

    monkeypatch.setattr(ulstore.Trajectory, "finalize", flaky)
    with _fails(OSError, "the bucket went away"):
        _save(_state(1), writer, 1)
    assert ulstore.open(url, mode="r").steps == [0]
    _save(_state(2), writer, 1)  # the retry (other values: it must not code against the failed attempt)
    _save(_state(3), writer, 2)
    traj = ulstore.open(url, mode="r")
    assert traj.steps == [0, 1, 2] and traj.verify().ok
    for s, values in ((1, 2), (2, 3)):
        _same(_load(_template(), udcp.Reader(url, step=s)), _state(values))


class _FailingPlanner(dcp.DefaultSavePlanner):
    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls = n, 0

    def resolve_data(self, write_item):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError(f"resolve {self.n}")
        return super().resolve_data(write_item)


def test_writer_and_reader_pickle_as_their_arguments(tmp_path):
    url = str(tmp_path / "t")
    writer = udcp.Writer(url, step=0, branch="dev", threads=1)
    _save(_state(0), writer)
    copy = pickle.loads(pickle.dumps(writer))
    assert (copy.url, copy.branch, copy.open_options, copy.step) == (url, "dev", {"threads": 1}, 0)
    copy.reset(1)
    _save(_state(1), copy)
    reader = pickle.loads(pickle.dumps(udcp.Reader(url, step="dev")))
    _same(_load(_template(), reader), _state(1))
    with pytest.raises(InvalidInputError, match="pass the url"):
        pickle.dumps(udcp.Writer(ulstore.open(url, mode="a")))


def test_one_chunk_per_tensor_in_the_metadata_whatever_the_pieces(tmp_path):
    url = str(tmp_path / "t")
    traj = ulstore.open(url, mode="w")
    w = np.arange(20, dtype=np.float32).reshape(5, 4)
    records = []
    for a, b in ((0, 2), (2, 5)):
        pw = traj.piece_writer(0)
        pw.write("w", w[a:b], offset=(a, 0), shape=w.shape)
        records += pw.close()
    traj.finalize(0, records)
    md = udcp.Reader(url, step=0).read_metadata()
    chunks = md.state_dict_metadata["w"].chunks
    assert len(chunks) == 1 and list(chunks[0].sizes) == [5, 4] and md.planner_data is None
    state = _load({"w": torch.zeros(5, 4)}, udcp.Reader(url, step=0))
    assert_bits_equal(state["w"], w)


def test_a_save_warns_of_a_tensor_whose_dtype_moved_as_a_commit_does(tmp_path):
    """A tensor saved in another dtype than in the parent step is stored whole (no delta): the save says so, as
    ``Trajectory.commit`` does, at the line of ``dcp.save``, and only once the step exists."""
    url = str(tmp_path / "t")
    _save(_state(0), udcp.Writer(url), 0)
    state = _state(1)
    state["model"]["w"] = state["model"]["w"].to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        dcp.save(state, storage_writer=udcp.Writer(url), checkpoint_id=1, no_dist=True)
    few = [w for w in got if issubclass(w.category, ulstore.FewSharedNamesWarning)]
    assert [str(w.message).split(" (a delta")[0] for w in few] == [
        "step 1: 1 tensor has another dtype or shape than in parent step 0 ('model.w' float32 40x30 -> bfloat16 "
        "40x30), so it is stored whole, not as a delta against it"
    ]
    assert few[0].filename == __file__
    assert_bits_equal(ulstore.open(url)[1]["model.w"][:], from_tensor(state["model"]["w"]))
