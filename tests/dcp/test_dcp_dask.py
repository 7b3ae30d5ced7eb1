"""ulstore.dcp with dask: chunks encoded on worker processes, steps read on worker processes.

``Writer(url, executor=client.get_executor())`` hands every chunk's encoding to a
``distributed.Client`` (the store's ``executor=``); a ``Reader`` pickles as its arguments, so
worker processes load a step through DCP or read boxes of it themselves.
"""

from __future__ import annotations

import os
import warnings

import pytest

import ulstore
from tests.helpers import dcp as jobs
from tests.helpers.bits import assert_bits_equal

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
distributed = pytest.importorskip("distributed")
udcp = pytest.importorskip("ulstore.dcp")

# a dask LocalCluster of two worker processes (13 s of CPU): the slow lane; the fast lane keeps DCP in one process
# (tests/dcp/test_dcp_local.py) and a commit on a dask cluster (tests/store/test_store.py)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


class _Counting:
    """Hands every task to ``inner`` and counts them: a save that ignored ``executor=`` counts none."""

    def __init__(self, inner):
        self.inner, self.submitted = inner, []

    def submit(self, fn, /, *args, **kwargs):
        self.submitted.append(fn.__name__)
        return self.inner.submit(fn, *args, **kwargs)


def _state(step: int) -> dict:
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(step + 1)
    return {
        "w": base + 1e-3 * step * torch.randn(64, 48, generator=g),
        "h": (torch.arange(96, dtype=torch.float32).reshape(8, 12) * (1 + step / 8)).to(torch.bfloat16),
        "epoch": step,
        "tag": f"step-{step}",
    }


@pytest.fixture(scope="module")
def saved(client, tmp_path_factory):
    """Three steps saved through DCP with every chunk encoded on the dask workers."""
    url = str(tmp_path_factory.mktemp("dask") / "t")
    executor = _Counting(client.get_executor())
    writer = udcp.Writer(url, executor=executor, chunk_bytes=2048, anchor_every=16)  # deltas (a fixed count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled": one process
        for s in range(3):
            dcp.save(_state(s), storage_writer=writer, checkpoint_id=s, no_dist=True)
    return url, executor


def test_a_dcp_save_encodes_its_chunks_on_dask_worker_processes(saved):
    url, executor = saved
    traj = ulstore.open(url, mode="r")
    chunks = sum(len(traj.changes(s)) for s in range(3))
    assert set(executor.submitted) == {"encode_chunk"} and len(executor.submitted) >= chunks // 2
    assert {c.kind for c in traj.changes(2)} <= {"delta", "unchanged"}
    for s in range(3):
        got = traj.read(s)
        for name in ("w", "h"):
            assert_bits_equal(got[name], _state(s)[name], f"step {s}: {name}")


def test_worker_processes_load_a_step_through_a_pickled_reader(client, saved):
    url, _ = saved
    reader = udcp.Reader(url, step=2)
    template = {"w": ((64, 48), "float32"), "h": ((8, 12), "bfloat16"), "epoch": -1, "tag": ""}
    futures = [client.submit(jobs.load_on_worker, reader, template, pure=False) for _ in range(2)]
    want = _state(2)
    pids = set()
    for pid, state in client.gather(futures):
        pids.add(pid)
        assert sorted(state) == sorted(want) and (state["epoch"], state["tag"]) == (2, "step-2")
        for name in ("w", "h"):
            assert_bits_equal(state[name], want[name], name)
    bands = [client.submit(jobs.box_on_worker, reader, "w", (r, 5), (16, 30), pure=False) for r in range(0, 64, 16)]
    for r, (pid, box) in zip(range(0, 64, 16), client.gather(bands)):
        pids.add(pid)
        assert_bits_equal(box, want["w"][r : r + 16, 5:35], f"box at row {r}")
    assert os.getpid() not in pids and pids <= set(_worker_pids(client))


def _worker_pids(client) -> list[int]:
    return list(client.run(os.getpid).values())
