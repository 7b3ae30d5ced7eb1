"""Publisher.submit: the trainer's non-blocking publish (a host copy, then encode and commit in the background).

What it promises: versions committed strictly in the order submitted, at most
``max_in_flight`` in flight (submit waits for room), the caller's tensors free
to change as soon as submit returns, a background failure raised by the next
call (naming the version; nothing submitted after it is committed), and no
acknowledged version lost when the process is killed mid-upload.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.sync import ROOT, assert_same_bits
from ulstore.errors import InvalidInputError
from ulstore.sync import BucketAccessError, Follower, Publisher, PublishError
from ulstore.sync.publisher import Publisher as _Publisher

BF16 = ml_dtypes.bfloat16


def version_state(v: int, n: int = 4096) -> dict:
    """Version ``v`` of a small model: a few elements change per version, as in RL."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n).astype(BF16)
    b = rng.standard_normal((8, 16)).astype(np.float32)
    for k in range(1, v + 1):
        step = np.random.default_rng(k)
        w[step.integers(0, n, 40)] = step.standard_normal(40).astype(BF16)
        b[k % 8, k % 16] += 1
    return {"w": w, "b": b, "count": np.array(v, np.int64)}


def read_back(url: str, version: int) -> dict:
    return ulstore.open(url, mode="r").read(version)


class Gate:
    """Holds every background commit until opened; records how many versions were in flight at each."""

    def __init__(self, monkeypatch, fail: int | None = None):
        self.open_ = threading.Event()
        self.seen: list[tuple[int, int]] = []  # (version, in flight when its commit started)
        self.fail = fail
        real = _Publisher._commit_now

        def gated(pub, version, *args):
            self.seen.append((version, pub.in_flight))
            assert self.open_.wait(30)
            if version == self.fail:
                raise BucketAccessError(f"injected: the bucket refused version {version}")
            return real(pub, version, *args)

        monkeypatch.setattr(_Publisher, "_commit_now", gated)

    def release(self):
        self.open_.set()


def test_submitted_versions_commit_in_order_and_read_back_exactly(tmp_path):
    """The caller reuses its arrays, writing garbage into them right after each submit: every version reads back as
    it was when submitted, committed in the order submitted, each future and on_commit telling its own version."""
    url = str(tmp_path / "b")
    told = []
    state = version_state(0)
    with Publisher(url, anchor_every=3, max_in_flight=2, on_commit=lambda info: told.append(info.version)) as pub:
        futures = []
        for v in range(8):
            for k, value in version_state(v).items():
                np.copyto(state[k], value)  # in place: the very arrays the last copy was taken of
            futures.append(pub.submit(v, state, metadata={"step": v}))
            for arr in state.values():
                arr[...] = 3  # garbage, at once: the commit (later) must not see it
        pub.wait()
        assert [f.result().version for f in futures] == list(range(8))
        assert [f.result().kind for f in futures] == ["reset"] + ["delta"] * 7
        assert pub.in_flight == 0
    assert told == list(range(8))
    traj = ulstore.open(url, mode="r")
    assert [i.step for i in reversed(traj.log())] == list(range(8))
    for v in range(8):
        assert_same_bits(traj.read(v), version_state(v))
        assert traj.info(v).metadata == {"step": v}
    f = Follower(url)
    assert f.bootstrap() == 7
    assert_same_bits(f.state, version_state(7))


def test_a_submit_copies_the_state_before_returning(tmp_path, monkeypatch):
    """Held commits: the caller's arrays (numpy, and torch tensors by their bits) are overwritten after submit
    returned and before anything is encoded; what is committed is what they held at the submit."""
    torch = pytest.importorskip("torch")
    gate = Gate(monkeypatch)
    url = str(tmp_path / "b")
    want = version_state(0)
    state = {k: v.copy() for k, v in want.items()}
    state["t"] = torch.arange(100, dtype=torch.bfloat16)
    want["t"] = np.arange(100).astype(BF16)
    pub = Publisher(url, max_in_flight=2)
    future = pub.submit(0, state)
    for v in state.values():
        v[...] = 7
    assert not future.done()
    gate.release()
    assert future.result().version == 0
    assert_same_bits(read_back(url, 0), want)
    pub.close()


def test_at_most_max_in_flight_versions_are_held(tmp_path, monkeypatch):
    """With commits held, submit returns for the first max_in_flight versions and then waits for room; the
    versions in flight never exceed the bound, the copies are reused, and all commit once released."""
    gate = Gate(monkeypatch)
    url = str(tmp_path / "b")
    pub = Publisher(url, anchor_every=0, max_in_flight=2)
    futures = [pub.submit(0, version_state(0)), pub.submit(1, version_state(1))]
    assert pub.in_flight == 2
    third: list = []
    waiter = threading.Thread(target=lambda: third.append(pub.submit(2, version_state(2))))
    waiter.start()
    time.sleep(0.3)
    assert third == [] and waiter.is_alive()  # no room: submit waits (and has copied nothing yet)
    assert pub.in_flight == 2
    gate.release()
    waiter.join(30)
    futures += third
    for v in range(3, 9):
        futures.append(pub.submit(v, version_state(v)))
        assert pub.in_flight <= 2
    pub.wait()
    assert [f.result().version for f in futures] == list(range(9))
    assert max(n for _, n in gate.seen) <= 2
    assert len(pub._spare) <= 2  # the host copies kept for reuse stay within the bound too
    for v in range(9):
        assert_same_bits(read_back(url, v), version_state(v))
    pub.close()


def test_a_background_failure_is_raised_by_the_next_call_and_nothing_after_it_is_committed(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, fail=2)
    url = str(tmp_path / "b")
    pub = Publisher(url, anchor_every=0, max_in_flight=4)
    futures = [pub.submit(v, version_state(v)) for v in range(4)]  # 2 will fail, 3 is queued behind it
    late = futures[3]
    gate.release()
    late.exception(30)
    with pytest.raises(PublishError, match=r"version 2 was not published .*injected.*\[3\]") as e:
        pub.submit(4, version_state(4))  # the next call: raised, and 4 not submitted
    assert e.value.version == 2 and e.value.refused == (3,)
    assert isinstance(e.value.__cause__, BucketAccessError)
    assert isinstance(futures[2].exception(), BucketAccessError)
    with pytest.raises(PublishError, match="version 3 was not committed: version 2"):
        late.result()
    assert pub.latest == 1  # order: 3 is not on the branch without 2
    pub.wait()  # reported once
    # the publisher goes on from the branch as it is
    assert pub.submit(5, version_state(5)).result().kind == "delta"
    assert [i.step for i in reversed(ulstore.open(url, mode="r").log())] == [0, 1, 5]
    assert_same_bits(read_back(url, 5), version_state(5))
    f = Follower(url)
    assert f.bootstrap() == 5
    assert_same_bits(f.state, version_state(5))
    pub.close()


def test_wait_and_close_raise_a_background_failure(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, fail=1)
    url = str(tmp_path / "b")
    pub = Publisher(url, anchor_every=0)
    pub.submit(0, version_state(0))
    pub.submit(1, version_state(1))
    gate.release()
    with pytest.raises(PublishError, match="version 1 was not published"):
        pub.wait()
    pub.submit(2, version_state(2))
    pub.close()
    assert pub.latest == 2
    gate.fail = 3
    pub = Publisher(url, anchor_every=0)
    pub.submit(3, version_state(3))
    with pytest.raises(PublishError, match="version 3 was not published"):
        pub.close()
    with pytest.raises(InvalidInputError, match="closed"):
        pub.submit(4, version_state(4))


def test_publish_waits_for_submitted_versions_and_keeps_its_errors(tmp_path):
    url = str(tmp_path / "b")
    with Publisher(url, anchor_every=0) as pub:
        pub.submit(0, version_state(0))
        assert pub.publish(1, version_state(1)).version == 1  # after 0, blocking
        with pytest.raises(InvalidInputError, match="smaller than version 1"):
            pub.submit(0, version_state(0))
        with pytest.raises(InvalidInputError, match="not greater than the latest"):
            pub.publish(0, version_state(0))  # raised by publish itself, and only there
        assert pub.submit(2, version_state(2)).result().version == 2
    assert_same_bits(read_back(url, 2), version_state(2))


CHILD = textwrap.dedent(
    """
    import sys
    from tests.sync.test_sync_submit import version_state
    from ulstore.sync import Publisher

    url = sys.argv[1]
    pub = Publisher(url, anchor_every=4, max_in_flight=2,
                    on_commit=lambda info: print("acked", info.version, flush=True))
    for v in range(10**6):
        pub.submit(v, version_state(v, n=1 << 18))
    """
)


def test_a_process_killed_mid_upload_loses_no_acknowledged_version(tmp_path):
    """A real trainer process, killed with SIGKILL while versions are in flight: the branch holds the last
    acknowledged version or a later one, every version on it reads back bit-exact, and a new publisher goes on."""
    url = str(tmp_path / "b")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, url], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        for line in child.stdout:
            acked.append(int(line.split()[1]))
            if len(acked) == 6:
                break
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    assert acked == list(range(6)), acked
    traj = ulstore.open(url, mode="r")
    head = traj.head("main")
    assert head >= acked[-1]
    on_branch = [i.step for i in reversed(traj.log())]
    assert on_branch == list(range(head + 1))
    for v in on_branch:
        assert_same_bits(traj.read(v), version_state(v, n=1 << 18))
    with Publisher(url, anchor_every=4) as pub:  # a leftover of the version killed mid-commit is discarded
        assert pub.submit(head + 1, version_state(head + 1, n=1 << 18)).result().kind == "delta"
    assert_same_bits(ulstore.open(url, mode="r").read(head + 1), version_state(head + 1, n=1 << 18))


def test_on_commit_cannot_wait_for_itself(tmp_path):
    """on_commit runs on the committing thread: a submit or wait there would wait for itself; refused, logged."""
    errors = []

    def tell(info):
        try:
            pub.wait()
        except InvalidInputError as e:
            errors.append(str(e))

    pub = Publisher(str(tmp_path / "b"), on_commit=tell)
    pub.submit(0, version_state(0)).result(30)
    pub.close()
    assert errors == ["wait or close cannot be called from on_commit (the thread that commits versions)"]


def test_a_submit_without_copy_takes_the_callers_arrays(tmp_path, monkeypatch):
    """copy=False: nothing copied (the commit reads the caller's arrays, which it must leave alone until the
    future resolves), and they are never reused as the buffers of a later copy."""
    gate = Gate(monkeypatch)
    url = str(tmp_path / "b")
    pub = Publisher(url, anchor_every=0)
    owned = version_state(0)
    future = pub.submit(0, owned, copy=False)
    owned["w"][:5] = 1  # (a caller breaking the contract: the commit sees it, as no copy was made)
    gate.release()
    future.result(30)
    assert_same_bits(read_back(url, 0), owned)
    assert pub._spare == []
    pub.submit(1, version_state(1)).result(30)
    assert pub._spare and all(a is not owned[k] for k, a in pub._spare[0].items())
    pub.close()


def test_the_copy_split_over_threads_covers_every_byte_once(tmp_path, monkeypatch):
    """Byte ranges cut across tensors of every word size (parts of 1000 bytes here): each element copied, no other
    memory touched."""
    import ulstore.sync.publisher as publisher

    monkeypatch.setattr(publisher, "COPY_PART_BYTES", 1000)
    rng = np.random.default_rng(1)
    sizes = [1, 7, 1000, 3, 50_001, 0, 2049]
    words_of = [np.uint8, np.uint16, np.uint32, np.uint64]
    src = [rng.integers(0, 255, n * 8, dtype=np.uint8).view(words_of[i % 4])[:n] for i, n in enumerate(sizes)]
    dst = [np.zeros(n + 2, a.dtype) for n, a in zip(sizes, src)]  # a guard word each side
    with Publisher(str(tmp_path / "b"), threads=4) as pub:
        assert pub._workers.threads == 4
        pub._copy([(d[1:-1], s) for d, s in zip(dst, src)])
    for d, s in zip(dst, src):
        assert np.array_equal(d[1:-1], s) and d[0] == 0 and d[-1] == 0
