"""A follower of some tensors (``Follower(tensors=...)``): a replica of part of a model, such as a pipeline stage.

It holds exactly those tensors, bit for bit, at every version (in step, caught
up, re-bootstrapped), downloads only their chunks, applies the usual version
from its change columns, and refuses names that are not published.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.sync import assert_same_bits, columns_taken, rl_states
from ulstore.errors import InvalidInputError
from ulstore.sync import Follower, Publisher

CHUNK = 1 << 12


@pytest.fixture(scope="module")
def states():
    return rl_states(6)


def part(state: dict, names) -> dict:
    return {n: state[n] for n in names}


def halves(states) -> tuple[list, list]:
    names = sorted(states[0])
    return names[::2], names[1::2]


def test_a_follower_of_some_tensors_holds_exactly_them_at_every_version(states, tmp_path, monkeypatch):
    taken = columns_taken(monkeypatch)
    url = str(tmp_path / "s")
    first, second = halves(states)
    pub = Publisher(url, anchor_every=0, chunk_elems=CHUNK)
    pub.publish(0, states[0])
    parts = [Follower(url, tensors=first, trust_state=True), Follower(url, tensors=second)]
    whole = Follower(url, trust_state=True)
    for f in (*parts, whole):
        f.bootstrap()
    with pub:
        for v in range(1, len(states)):
            pub.publish(v, states[v])
            for f, names in zip(parts, (first, second)):
                assert f.poll() == v
                f.wait_scan()
                assert_same_bits(f.state, part(states[v], names))
                assert f.verify()
            assert whole.poll() == v
    # every version after the bootstrap from the columns, and each part downloaded only its own chunks
    assert taken.count(True) == 3 * (len(states) - 1) and False not in taken
    got = [f.stats.bytes_downloaded for f in parts]
    assert 0 < got[0] < whole.stats.bytes_downloaded and 0 < got[1] < whole.stats.bytes_downloaded
    assert got[0] + got[1] == whole.stats.bytes_downloaded
    for f in (*parts, whole):
        f.close()


def test_a_part_bound_to_the_callers_arrays_catches_up_and_rebootstraps(states, tmp_path):
    """The caller's own arrays (exactly the tensors followed); far behind it catches up in one poll, and past
    max_replay it bootstraps again from the newest snapshot: the same bits either way."""
    url = str(tmp_path / "s")
    first, _ = halves(states)
    mine = {n: np.zeros_like(states[0][n]) for n in first}
    with Publisher(url, anchor_every=3, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        with Follower(url, state=mine, tensors=first) as f, Follower(url, tensors=first, max_replay=1) as late:
            f.bootstrap()
            for v in range(1, len(states)):
                pub.publish(v, states[v])
            assert f.poll() == late.poll() == len(states) - 1
            assert f.state is mine and late.stats.bootstraps == 1
            for got in (mine, late.state):
                assert_same_bits(got, part(states[-1], first))


def test_a_name_that_is_not_published_is_refused_at_the_bootstrap(states, tmp_path):
    url = str(tmp_path / "s")
    with Publisher(url, anchor_every=0, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
    name = sorted(states[0])[0]
    with Follower(url, tensors=[name, "no.such.weight"]) as f:
        with pytest.raises(InvalidInputError, match="step 0 has no tensor 'no.such.weight'"):
            f.bootstrap()
        assert f.version is None and f.state == {}
    for bad in (name, [], [name, 3], 5, [[name]]):
        with pytest.raises(InvalidInputError, match="tensors must be"):
            Follower(url, tensors=bad)
    other = sorted(states[0])[1]
    with pytest.raises(InvalidInputError, match=f"exactly the tensors followed: not in state \\['{other}'\\]"):
        Follower(url, state={name: states[0][name].copy()}, tensors=[name, other])


def synthetic(v: int, drop=()) -> dict:
    """Three float32 tensors and one with no elements, each changed at every 40th element by version ``v``."""
    out = {n: np.arange(4000, dtype=np.float32) + np.float32(v) * (np.arange(4000) % 40 == 0) for n in "abc"}
    out["empty"] = np.zeros((0, 4), np.float32)
    return {n: x.astype(np.float32) for n, x in out.items() if n not in drop}


def test_a_tensor_with_no_elements_is_followed_like_any_other(tmp_path):
    """It has no chunk (no row in the change columns) but is a tensor of every step: followed, not refused."""
    url = str(tmp_path / "s")
    with Publisher(url, anchor_every=0, chunk_elems=1024) as pub:
        pub.publish(0, synthetic(0))
        with Follower(url, tensors=["a", "empty"]) as f:
            f.bootstrap()
            for v in range(1, 4):
                pub.publish(v, synthetic(v))
                assert f.poll() == v and f.stats.rebootstraps == 0
                assert_same_bits(f.state, part(synthetic(v), ["a", "empty"]))
            assert f.trajectory.change_columns(2, ["empty"]).changed.tolist() == []


def test_a_tensor_dropped_by_the_publisher_stays_dropped_through_a_rebootstrap(tmp_path):
    """Dropped from the part at the version that removed it; a later bootstrap (past max_replay) from a snapshot
    without it goes on with the rest; a version without any of the tensors followed is an error, not a follower
    of nothing."""
    url = str(tmp_path / "s")
    with Publisher(url, anchor_every=3, chunk_elems=1024) as pub:
        pub.publish(0, synthetic(0))
        with Follower(url, tensors=["a", "b"], max_replay=2) as f:
            f.bootstrap()
            pub.publish(1, synthetic(1, drop="a"))
            assert f.poll() == 1 and sorted(f.state) == ["b"]
            for v in range(2, 8):
                pub.publish(v, synthetic(v, drop="a"))
            assert f.poll() == 7 and f.stats.bootstraps == 2
            assert_same_bits(f.state, part(synthetic(7), ["b"]))
            pub.publish(8, synthetic(8, drop="ab"))
            with pytest.raises(InvalidInputError, match="step 8 has none of the tensors followed"):
                f.poll()
            assert f.version == 7
            assert_same_bits(f.state, part(synthetic(7), ["b"]))
        with pytest.raises(InvalidInputError, match="has no tensor 'a'"), Follower(url, tensors=["a", "b"]) as late:
            late.bootstrap()


def test_a_tensor_the_publisher_stops_sending_is_dropped_from_the_part(states, tmp_path):
    url = str(tmp_path / "s")
    first, _ = halves(states)
    gone = first[0]
    with Publisher(url, anchor_every=0, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        with Follower(url, tensors=first) as f:
            f.bootstrap()
            pub.publish(1, {n: a for n, a in states[1].items() if n != gone})
            assert f.poll() == 1
            assert sorted(f.state) == first[1:]
            assert_same_bits(f.state, part(states[1], first[1:]))
            pub.publish(2, {n: a for n, a in states[2].items() if n != gone})
            assert f.poll() == 2
            assert_same_bits(f.state, part(states[2], first[1:]))


def test_a_part_follows_a_run_on_s3_reading_less_than_a_whole_replica(states, moto_s3):
    """On a moto S3 server: each version's pack bytes read by a part are fewer than a whole follower's (its own
    blobs and the step's table block), its values exact."""
    from tests.helpers.store import CountingIO

    url = f"s3://{moto_s3.bucket()}/run"
    first, _ = halves(states)
    opts = moto_s3.options
    with Publisher(url, anchor_every=0, storage_options=opts, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        with Follower(url, storage_options=opts, tensors=first) as f, Follower(url, storage_options=opts) as whole:
            read = {}
            for g in (f, whole):
                g.bootstrap()
                read[g] = CountingIO(g._io)
            for v in range(1, len(states)):
                pub.publish(v, states[v])
                for g in (f, whole):
                    read[g].reset()
                    assert g.poll(to=v) == v
                assert_same_bits(f.state, part(states[v], first))
                assert_same_bits(whole.state, states[v])
                part_bytes, whole_bytes = (sum(b - a for _, (a, b) in read[g].packs()) for g in (f, whole))
                assert 0 < part_bytes < whole_bytes
