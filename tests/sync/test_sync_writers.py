"""Two writers on one branch, a writer killed mid-publish, a lost answer, a rollback: no acknowledged version
is lost, every loser gets an error, and a follower only ever holds versions of the branch.

The other writer is a real process, run at the critical call of this one (``tests/helpers/other_side.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

import ulstore
from tests.helpers.interleave import interleave
from tests.helpers.other_side import other_side
from tests.helpers.sync import assert_same_bits, rl_states, state_digest
from ulstore.errors import ConflictError, InvalidInputError, RefMovedError
from ulstore.sync import Follower, Publisher

CHUNK = 1 << 12


@pytest.fixture(scope="module")
def states():
    return rl_states(12)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def where(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "bucket"), None
    return f"s3://ulstore-test/{uuid.uuid4().hex}", request.getfixturevalue("moto_s3").options


def _publisher(where, **kw):
    url, options = where
    return Publisher(url, anchor_every=5, storage_options=options, chunk_elems=CHUNK, **kw)


def _follower(where):
    url, options = where
    return Follower(url, storage_options=options)


#: the other writer: a Publisher of its own publishing ``version`` with state ``index`` of the same run
_OTHER = """
from tests.helpers.sync import rl_states
from ulstore.sync import Publisher
pub = Publisher(url, anchor_every=5, storage_options=options, chunk_elems=1 << 12)
try:
    result = pub.publish({version}, rl_states(12)[{index}]).version
except Exception as e:
    result = {{"error": type(e).__name__, "message": str(e)}}
pub.close()
"""


def test_a_version_in_flight_is_no_orphan_to_another_publisher(states, where):
    """Split brain: B must not take A's version V (step created, branch not moved yet) for a leftover.  B
    refuses; A's publish returns; V is A's, and a follower holds A's V."""
    pub = _publisher(where)
    for v in range(3):
        pub.publish(v, states[v])
    other = _OTHER.format(version=3, index=9)
    with interleave(on=("create", r"^refs/main/"), run=lambda call: other_side(*where, other)) as il:
        info = pub.publish(3, states[3])
    (ran,) = il.results
    assert ran["error"] == "ConflictError" and "committed right now" in ran["message"]
    assert info.version == 3 and pub.latest == 3
    f = _follower(where)
    assert f.bootstrap() == 3
    assert_same_bits(f.state, states[3])
    pub.close()


def test_a_publisher_whose_lease_ran_out_loses_its_version_with_an_error(states, where, monkeypatch):
    """If A's intent has expired (a stalled writer), B may discard A's V: B fences the branch first, so A's
    branch move fails and A raises; the branch holds B's V, and nothing A was told is lost."""
    from ulstore.store import _pending

    pub = _publisher(where)
    for v in range(3):
        pub.publish(v, states[v])
    monkeypatch.setattr(_pending, "LEASE_SECONDS", -1.0)  # A's intents are born expired
    monkeypatch.setattr(_pending, "_HOST", "another-host")  # ... and B cannot ask whether A still runs
    other = _OTHER.format(version=3, index=9)
    with interleave(on=("create", r"^refs/main/"), run=lambda call: other_side(*where, other)) as il:
        with pytest.raises(RefMovedError, match="deleted it as an interrupted commit"):
            pub.publish(3, states[3])
    assert il.results == [3]
    f = _follower(where)
    assert f.bootstrap() == 3
    assert_same_bits(f.state, states[9])  # B's version 3
    assert ulstore.open(where[0], mode="r", storage_options=where[1]).verify().ok
    pub.close()


_KILLED = """
import os
from tests.helpers.sync import rl_states
from ulstore.sync import Publisher
pub = Publisher(url, anchor_every=5, storage_options=options, chunk_elems=1 << 12)
states = rl_states(12)
for v in range(3):
    pub.publish(v, states[v])
io = pub.trajectory._io
real = io.create
def create(key, data):
    if key.startswith("refs/main/"):
        os._exit(17)  # killed between the step document and the branch move
    return real(key, data)
io.create = create
pub.publish(3, states[3])
"""


def test_a_restarted_publisher_discards_the_version_its_killed_predecessor_left(states, where):
    url, options = where
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    code = "import json, sys\nurl, options = sys.argv[1], json.loads(sys.argv[2])\n" + _KILLED
    import json

    proc = subprocess.run([sys.executable, "-c", code, url, json.dumps(options)], env=env, capture_output=True)
    assert proc.returncode == 17, proc.stderr[-2000:]
    traj = ulstore.open(url, mode="r", storage_options=options)
    assert 3 in traj and traj.head() == 2  # the orphan: created, never published
    pub = _publisher(where)  # the restarted trainer publishes a later version
    assert pub.publish(4, states[4]).version == 4
    f = _follower(where)
    assert f.bootstrap() == 4
    assert_same_bits(f.state, states[4])
    traj = ulstore.open(url, mode="r", storage_options=options)
    assert 3 not in traj and [i.step for i in traj.log()] == [4, 2, 1, 0] and traj.verify().ok
    pub.close()


def test_publishing_the_latest_version_again_is_idempotent(states, where):
    pub = _publisher(where)
    pub.publish(0, states[0])
    first = pub.publish(1, states[1], metadata={"loss": 1.5})
    again = pub.publish(1, states[1], metadata={"loss": 1.5})  # a retry after a lost answer
    assert (again.version, again.kind, again.document) == (first.version, first.kind, first.document)
    with pytest.raises(InvalidInputError, match="not greater"):
        pub.publish(1, states[2], metadata={"loss": 1.5})
    with pytest.raises(InvalidInputError, match="not greater"):
        pub.publish(0, states[0])
    assert [i.step for i in ulstore.open(where[0], mode="r", storage_options=where[1]).log()] == [1, 0]
    pub.close()


def test_a_publish_whose_branch_answer_is_lost_returns(states, moto_s3):
    """The response to the branch entry's PUT is lost; botocore retries and gets 412 from our own entry.
    publish() returns, the head is the version, and a follower applies it."""
    from tests.helpers.lossy_proxy import LossyProxy

    url = f"s3://ulstore-test/{uuid.uuid4().hex}"
    with LossyProxy(moto_s3.endpoint) as proxy:
        options = {**moto_s3.options, "client_kwargs": {**moto_s3.options["client_kwargs"], "endpoint_url": proxy.url}}
        pub = Publisher(url, anchor_every=5, storage_options=options, chunk_elems=CHUNK)
        pub.publish(0, states[0])
        proxy.arm(r"^PUT /ulstore-test/[0-9a-f]+/refs/main/")
        assert pub.publish(1, states[1]).version == 1
        assert proxy.dropped == 1 and pub.latest == 1
        pub.close()
    f = Follower(url, storage_options=moto_s3.options)
    assert f.bootstrap() == 1
    assert_same_bits(f.state, states[1])


def test_a_follower_moves_on_after_the_branch_is_rolled_back_to_a_snapshot(states, tmp_path):
    """set_ref rolls the branch back to snapshot 5; the follower re-bootstraps onto it, and then follows the
    versions published after it (it used to wait forever for a snapshot newer than the rolled-back head)."""
    url = str(tmp_path / "bucket")
    with Publisher(url, anchor_every=5, chunk_elems=CHUNK) as pub:
        for v in range(8):
            pub.publish(v, states[v])
    f = Follower(url)
    assert f.bootstrap() == 7
    ulstore.open(url, mode="r+").set_ref("main", 5)
    assert f.poll() == 5
    assert_same_bits(f.state, states[5])
    with Publisher(url, anchor_every=5, chunk_elems=CHUNK) as pub:
        pub.publish(6, states[9])  # a new version 6 (the rolled-back run's 6 is kept off the branch)
    assert f.poll() == 6
    assert_same_bits(f.state, states[9])
    assert [e.kind for e in f.events][-1] == "apply"


def test_a_second_writer_that_loses_the_race_raises(states, where):
    """Two publishers both publish version 3 on version 2: B creates it first, A's create is refused and A
    raises; the branch and a follower hold B's version 3."""
    pub = _publisher(where)
    for v in range(3):
        pub.publish(v, states[v])
    other = _OTHER.format(version=3, index=9)
    with interleave(on=("create", r"^steps/3/zarr\.json$"), run=lambda call: other_side(*where, other)) as il:
        with pytest.raises(ConflictError):
            pub.publish(3, states[3])
    assert il.results == [3]
    f = _follower(where)
    assert f.bootstrap() == 3
    assert_same_bits(f.state, states[9])
    assert state_digest(f.state) == state_digest(states[9])
    pub.close()
