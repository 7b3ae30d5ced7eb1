"""tests/helpers/interleave.py forces an interleaving: the other side runs once, at the chosen call, in another
process, on local disk and on moto S3; a child is killed at its Nth write."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import pytest

import ulstore
from tests.helpers.interleave import hooked_methods, interleave, is_write, run_python
from tests.helpers.sides import run_side
from ulstore.core.objects import ObjectStore

#: A child that reports what it sees of the trajectory: its pid, steps and refs.
LOOK = """
import json, os, sys
import ulstore
traj = ulstore.open(sys.argv[1], mode="r", storage_options=json.loads(sys.argv[2]))
print(json.dumps({"pid": os.getpid(), "steps": traj.steps, "refs": traj.refs}))
"""


def _location(where, request, tmp_path):
    if where == "local":
        return str(tmp_path / "traj"), None
    return f"s3://ulstore-test/{uuid.uuid4().hex}", request.getfixturevalue("moto_s3").options


def _state(v: float) -> dict:
    return {"w": np.full((4, 8), v, np.float32)}


def _look(url, so, call):
    import json

    return run_python(LOOK, url, json.dumps(so))


def test_every_public_method_is_hooked():
    names = hooked_methods()
    assert {"get", "get_ranges", "put", "create", "delete", "delete_many", "find", "open_writer"} <= set(names)
    assert "path" not in names and "from_url" not in names
    with interleave():
        for name in names:  # the class's methods are wrappers while an interleaving is active...
            assert getattr(ObjectStore, name).__wrapped__ is not None
    for name in names:  # ...and the originals afterwards
        assert not hasattr(getattr(ObjectStore, name), "__wrapped__")


@pytest.mark.parametrize(
    "where, when",
    [
        ("local", "before"),
        ("local", "after"),
        # the same hook on moto (2.5 s of CPU each): the slow lane
        pytest.param("s3", "before", marks=pytest.mark.slow),
        pytest.param("s3", "after", marks=pytest.mark.slow),
    ],
)
def test_the_other_side_runs_once_at_the_chosen_call_in_another_process(where, when, request, tmp_path):
    url, so = _location(where, request, tmp_path)
    traj = ulstore.open(url, mode="w", storage_options=so, threads=1)
    traj.commit(0, _state(0))
    traj.commit(1, _state(1))
    with interleave(on=("create", r"^steps/\d+/zarr\.json$"), run=lambda call: _look(url, so, call), when=when) as il:
        traj.commit(2, _state(2))
        traj.commit(3, _state(3))
    assert [c.key for c in il.matched] == ["steps/2/zarr.json", "steps/3/zarr.json"]
    assert len(il.fired) == 1 and il.fired[0].key == "steps/2/zarr.json" and il.fired[0].index == 1
    (seen,) = il.results
    assert seen["pid"] != os.getpid()
    if when == "before":  # the commit point had not happened yet
        assert seen["steps"] == [0, 1] and seen["refs"] == {"main": 1}
    else:  # step created, branch not moved yet
        assert seen["steps"] == [0, 1, 2] and seen["refs"] == {"main": 1}
    assert traj.steps == [0, 1, 2, 3] and traj.refs == {"main": 3}
    # the calls in between were recorded in order: the step document's create comes before the ref's
    methods = [(c.method, c.key) for c in il.calls]
    doc = methods.index(("create", "steps/2/zarr.json"))
    assert any(m == "create" and k.startswith("refs/main/") for m, k in methods[doc + 1 :])


def test_nth_and_times_pick_the_calls(tmp_path):
    traj = ulstore.open(str(tmp_path / "t"), mode="w", threads=1)
    fired = []
    with interleave(on=("create", r"^steps/"), run=lambda c: fired.append(c.key), nth=2, times=2) as il:
        for s in range(4):
            traj.commit(s, _state(s))
    assert fired == ["steps/1/zarr.json", "steps/2/zarr.json"] and len(il.matched) == 4


def test_a_callback_runs_while_other_threads_wait_and_its_own_calls_are_not_counted(tmp_path):
    traj = ulstore.open(str(tmp_path / "t"), mode="w", threads=1)
    traj.commit(0, _state(0))
    io = traj._io
    seen = {}

    def callback(call):
        other = threading.Thread(target=lambda: seen.setdefault("exists", io.exists("other-thread")), name="other")
        other.start()
        other.join(timeout=0.5)
        seen["waited"] = other.is_alive()  # blocked at the gate while this callback runs
        seen["own"] = io.get("own-call")  # the callback's own call: not counted
        seen["thread"] = other

    with interleave(on=("put", r"^pending/commit/"), run=callback) as il:
        traj.commit(1, _state(1))
    seen["thread"].join(timeout=30)
    assert seen["waited"] and seen["own"] is None and seen["exists"] is False
    assert len(il.fired) == 1
    keys = [c.key for c in il.calls]
    assert "own-call" not in keys
    marker = next(k for k in keys if k.startswith("pending/commit/0/1."))  # (a token per writer)
    assert keys.index("other-thread") > keys.index(marker)  # it started during the callback


def test_a_child_is_killed_at_its_nth_write(tmp_path):
    url = str(tmp_path / "t")
    traj = ulstore.open(url, mode="w", threads=1)
    traj.commit(0, _state(0))
    from tests.helpers.sides import save_state

    path = save_state(_state(1), str(tmp_path))
    counted = run_side("commit", url, step=1, state=path)
    assert counted["ok"] and counted["writes"] >= 4  # pack, intent, step document, ref, intent removed
    traj.delete(1)
    env = {**os.environ, "ULSTORE_KILL_AT": "1:^create steps/"}  # killed before its step document is created
    proc = run_python("import sys; from tests.helpers.sides import main; main(sys.argv[1:])",
                      f'{{"op": "commit", "url": "{url}", "step": 1, "state": "{path}"}}', env=env,
                      check=False)  # fmt: skip
    assert proc.returncode == -9, proc.stderr
    assert traj.steps == [0] and traj.refs == {"main": 0}


def test_is_write_knows_reads():
    from tests.helpers.interleave import Call

    assert not is_write(Call("get", "k", ("k",), "u")) and is_write(Call("put", "k", ("k",), "u"))
    assert is_write(Call("replace_if", "k", ("k",), "u"))  # a method it does not know may write
