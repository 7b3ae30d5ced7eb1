"""Writers that race each other: maintenance against maintenance, stale parents, lost answers, vanishing steps.

Every rewrite of an existing document is a compare-and-swap on what was
read; gc and delete exclude each other; a commit proves its parent at its
commit point; a create that finds its own bytes succeeded.  The other side
of each race is a real process, run at the critical call of this one
(``tests/helpers/other_side.py``), on local disk and on a moto S3 server.
"""

from __future__ import annotations

import errno
import threading
import uuid
import warnings

import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from tests.helpers.interleave import interleave
from tests.helpers.other_side import other_side
from tests.helpers.store import CHUNK, assert_state_equal, states_bf16
from ulstore.core.objects import ObjectStore
from ulstore.errors import ConflictError, StaleParentError, StepNotFoundError


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def where(request, tmp_path):
    """(url, storage_options) of a fresh trajectory on local disk and on moto S3."""
    if request.param == "local":
        return str(tmp_path / "traj"), None
    return f"s3://ulstore-test/{uuid.uuid4().hex}", request.getfixturevalue("moto_s3").options


def _open(where, mode="r+", **kw):
    url, options = where
    return ulstore.open(url, mode=mode, storage_options=options, **kw)


def _chain(where, n=7):
    """Steps 0..n-1 on main (anchor 0 only: every step is a delta of its parent), small packs."""
    states = states_bf16(20)
    traj = _open(where, "w", chunk_bytes=4 * CHUNK, anchor_every=0, pack_bytes=40_000)
    for i in range(n):
        traj.commit(i, states[i])
    return traj, states


def _all_exact(where, states, steps):
    ro = _open(where, "r")
    assert ro.steps == sorted(steps)
    for s in steps:
        assert_state_equal(ro.read(s), states[s])
    assert ro.verify().ok


# -- the primitive: compare-and-swap of a document -------------------------------------------


@pytest.mark.parametrize("backend", ["local", "memory", "s3"])
def test_replace_if_and_delete_if_are_compare_and_swap(backend, tmp_path, request):
    if backend == "local":
        io = ObjectStore.from_url(str(tmp_path / "o"))
    elif backend == "memory":
        io = ObjectStore.from_url(f"memory://cas-{uuid.uuid4().hex}")
    else:
        io = ObjectStore.from_url(f"s3://ulstore-test/{uuid.uuid4().hex}", request.getfixturevalue("moto_s3").options)
    io.put("d/x.json", b"one")
    assert io.replace_if("d/x.json", b"two", b"one")
    assert not io.replace_if("d/x.json", b"three", b"one")  # stale: it holds "two" now
    assert io.get("d/x.json") == b"two"
    assert not io.replace_if("d/missing.json", b"x", b"two") and io.get("d/missing.json") is None
    assert not io.delete_if("d/x.json", b"one") and io.get("d/x.json") == b"two"
    assert io.delete_if("d/x.json", b"two") and io.get("d/x.json") is None
    assert not io.replace_if("d/x.json", b"back", b"two")  # a removed document never comes back
    assert io.get("d/x.json") is None
    # create finds its own bytes (a lost answer, retried): success; other bytes: the other writer won
    io.create("d/y.json", b"mine")
    io.create("d/y.json", b"mine")
    with pytest.raises(FileExistsError):
        io.create("d/y.json", b"theirs")

    # no lost update: threads, each with its own client, increment a counter by compare-and-swap (each write
    # names its writer, as every document ulstore rewrites names fresh packs: equal bytes are one's own)
    io.put("d/n.json", b"0:-")
    url = io.url

    def worker(w, times):
        mine = ObjectStore(io.fs, io.root, url=url, protocol=io.protocol)
        for i in range(times):
            while True:
                old = mine.get("d/n.json")
                if mine.replace_if("d/n.json", b"%d:%d.%d" % (int(old.split(b":")[0]) + 1, w, i), old):
                    break

    threads = [threading.Thread(target=worker, args=(w, 25)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert io.get("d/n.json").split(b":")[0] == b"100"


def test_replace_if_excludes_other_processes_on_local_disk(tmp_path):
    """Two processes incrementing one counter by compare-and-swap lose no update (the flock of <root>/.lock)."""
    io = ObjectStore.from_url(str(tmp_path / "o"))
    io.put("n.json", b"0:-")
    body = """
import os
from ulstore.core.objects import ObjectStore
io = ObjectStore.from_url(url)
for i in range(100):
    while True:
        old = io.get("n.json")
        if io.replace_if("n.json", b"%d:%d.%d" % (int(old.split(b":")[0]) + 1, os.getpid(), i), old):
            break
result = "done"
"""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda _: other_side(str(tmp_path / "o"), None, body), range(2)))
    assert done == ["done", "done"] and io.get("n.json").split(b":")[0] == b"200"


# -- gc against delete ------------------------------------------------------------------------

#: how gc and delete rewrite a step document (``put``: what they did before compare-and-swap)
_REWRITE = ("replace_if", "put")

_GC = 'result = ulstore.open(url, mode="r+", storage_options=options).gc(repack_below=1.0)'


def _unseeing(kind: str) -> str:
    """A snippet that makes this child's listings of ``pending/`` miss the ``kind`` markers ("gcs", "deletes"),
    as on a store whose listings lag: the compare-and-swap of every document then keeps the two sides from
    overwriting each other."""
    return f"""
from ulstore.store import _pending
real = _pending.Pending.listing
def listing(self):
    out = real(self)
    if hasattr(out, "{kind}"):
        getattr(out, "{kind}").clear()
    return out
_pending.Pending.listing = listing
"""


_DELETE_UNSEEN = (
    _unseeing("gcs")
    + """
ulstore.open(url, mode="r+", storage_options=options).delete({step})
result = "deleted"
"""
)


def test_gc_defers_to_a_delete_in_flight(where):
    """A gc that starts while a delete rewrites documents removes and rewrites nothing; the data stays exact."""
    traj, states = _chain(where)
    with interleave(on=(_REWRITE, r"^steps/\d+/zarr\.json$"), run=lambda call: other_side(*where, _GC)) as il:
        traj.delete(3)
    (ran,) = il.results
    assert ran["deferred"].startswith("pending/delete/3.")
    assert ran["packs"] == ran["steps_rewritten"] == 0
    _all_exact(where, states, [0, 1, 2, 4, 5, 6])
    assert _open(where).gc(repack_below=1.0)["deferred"] is None  # once the delete is done, gc runs
    _all_exact(where, states, [0, 1, 2, 4, 5, 6])


def test_a_delete_refuses_while_a_gc_runs(where):
    traj, states = _chain(where)
    body = "ulstore.open(url, mode='r+', storage_options=options).delete(3)\nresult = 'deleted'"
    traj.delete(5)
    with interleave(on=(_REWRITE, r"^steps/\d+/zarr\.json$"), run=lambda call: other_side(*where, body)) as il:
        assert traj.gc(repack_below=1.0)["steps_rewritten"] > 0
    (ran,) = il.results
    assert ran["error"] == "ConflictError" and "a gc is in flight" in ran["message"]
    _all_exact(where, states, [0, 1, 2, 3, 4, 6])


def test_gc_never_overwrites_a_document_a_delete_rewrote(where):
    """The lost update of the review: delete re-parents a step while gc repacks it.  gc's rewrite is a
    compare-and-swap, so it leaves the delete's document (and the packs it names) as they are."""
    traj, states = _chain(where)
    traj.delete(5)  # step 6 now names a pack mostly dead: gc repacks it
    gc = _open(where)
    other = _DELETE_UNSEEN.format(step=4)
    with interleave(on=(_REWRITE, r"^steps/6/zarr\.json$"), run=lambda call: other_side(*where, other)) as il:
        gc.gc(repack_below=1.0)
    assert il.results == ["deleted"]
    assert _open(where, "r").info(6).parent == 3  # the delete's document stands, not gc's older rewrite
    _all_exact(where, states, [0, 1, 2, 3, 6])
    _open(where).gc(repack_below=1.0)  # and a later gc, past every grace, loses nothing either
    _all_exact(where, states, [0, 1, 2, 3, 6])


def test_a_delete_never_overwrites_a_document_gc_rewrote(where):
    """The other way round: gc repacks while a delete re-parents; the delete's compare-and-swap fails, it
    reads again and finishes on gc's documents; nothing named is removed later."""
    traj, states = _chain(where)
    traj.delete(5)
    # (with a grace period, as the docs ask of a gc beside writers: the delete's new pack is not named yet)
    body = (
        _unseeing("deletes")
        + """
result = ulstore.open(url, mode="r+", storage_options=options).gc(repack_below=1.0, older_than=3600)
"""
    )
    d = _open(where)
    with interleave(on=(_REWRITE, r"^steps/\d+/zarr\.json$"), run=lambda call: other_side(*where, body)) as il:
        d.delete(3)
    assert il.results[0]["steps_rewritten"] > 0
    # gc's rewrites stand: no document names a pack gc emptied (a stale PUT of the delete would name one again)
    retired = {k.rsplit("/", 1)[-1] for k in d._io.find("gc/retired")}
    ro = _open(where, "r")
    assert retired and not retired & {p for s in ro.steps for p in ro._reader.doc(s).packs}
    _all_exact(where, states, [0, 1, 2, 4, 6])
    _open(where).gc(repack_below=1.0)
    _all_exact(where, states, [0, 1, 2, 4, 6])


def test_a_deleted_step_does_not_come_back_through_gc(where):
    traj, states = _chain(where)
    traj.delete(5)
    gc = _open(where)
    other = _DELETE_UNSEEN.format(step=6)
    with interleave(on=(_REWRITE, r"^steps/6/zarr\.json$"), run=lambda call: other_side(*where, other)) as il:
        gc.gc(repack_below=1.0)
    assert il.results == ["deleted"]
    assert 6 not in _open(where, "r").steps
    _all_exact(where, states, [0, 1, 2, 3, 4])


# -- commits: the parent proven at the commit point -------------------------------------------


def test_a_commit_on_a_parent_deleted_and_committed_again_is_refused(where):
    """ABA: while this process encodes step 2 against its step 1, another deletes 1 and commits a different 1.
    Step 2's deltas were coded against values the parent no longer holds: the commit must not land."""
    states = states_bf16(20)
    a = _open(where, "w", chunk_bytes=4 * CHUNK)
    a.commit(0, states[0])
    a.commit(1, states[1])
    body = """
from tests.helpers.store import states_bf16
traj = ulstore.open(url, mode="r+", storage_options=options)
traj.delete(1)
traj.commit(1, states_bf16(20)[7])
result = traj.head()
"""
    with interleave(on=("open_writer", r"^packs/"), run=lambda call: other_side(*where, body)) as il:
        with pytest.raises(StaleParentError, match="parent step 1"):
            a.commit(2, states[2])
    assert il.results == [1]
    assert 2 not in _open(where, "r").steps and a.head() == 1
    assert a.commit(2, states[2]) == 2  # again: the parent is read anew
    ro = _open(where, "r")
    assert_state_equal(ro.read(2), states[2])
    assert_state_equal(ro.read(1), states[7])
    assert ro.verify().ok
    # and a commit that starts after the parent was replaced codes against the parent as stored
    other_side(*where, body.replace("[7]", "[8]"))
    assert a.commit(3, states[3], parent=1) == 3
    assert_state_equal(_open(where, "r").read(3), states[3])


# -- maintenance: a commit past its commit point returns ---------------------------------------


def test_a_commit_whose_marker_cleanup_fails_returns_and_a_retry_is_idempotent(tmp_path):
    states = states_bf16(20)
    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=4 * CHUNK)
    traj.commit(0, states[0])
    real = traj._io.delete

    def delete(key):
        if key.startswith("pending/"):
            raise OSError(errno.EIO, "injected")
        return real(key)

    traj._io.delete = delete
    with pytest.warns(UserWarning, match="removing its marker"):
        assert traj.commit(1, states[1]) == 1
    traj._io.delete = real
    assert traj.head() == 1
    assert traj.commit(1, states[1]) == 1  # the same state again: nothing to do
    with pytest.raises(ConflictError, match="different"):
        traj.commit(1, states[2])
    traj.gc()
    assert traj._io.find("pending") == [] and traj.verify().ok
    assert_state_equal(traj.read(1), states[1])


# -- scans beside deletes ----------------------------------------------------------------------


def test_verify_and_stats_skip_a_step_deleted_during_the_scan(where):
    traj, states = _chain(where)
    body = "ulstore.open(url, mode='r+', storage_options=options).delete(4)\nresult = 'deleted'"
    ro = _open(where, "r")
    with interleave(on=("get", r"^steps/4/zarr\.json$"), run=lambda call: other_side(*where, body)) as il:
        report = ro.verify(raise_on_error=False)
    assert il.results == ["deleted"] and report.ok and report.steps == 6
    traj2 = _open(where, "r")
    five = body.replace("(4)", "(5)")
    with interleave(on=("get", r"^steps/5/zarr\.json$"), run=lambda call: other_side(*where, five)) as il:
        assert traj2.stats()["steps"] == 5
    assert il.results == ["deleted"]
    _all_exact(where, states, [0, 1, 2, 3, 6])


def test_a_long_lived_reader_follows_documents_rewritten_by_another_process(where):
    """A reader that read steps before another process deleted an ancestor and collected its packs reads the
    documents anew: exact values (or StepNotFoundError for the deleted step), never "pack is missing"."""
    traj, states = _chain(where)
    ro = _open(where, "r", cache_bytes=0, keep_parent=False)
    assert_state_equal(ro.read(5), states[5])  # documents and tables of 0..5 are cached now
    body = """
traj = ulstore.open(url, mode="r+", storage_options=options)
traj.delete(3)
result = traj.gc(repack_below=1.0)
"""
    assert other_side(*where, body)["packs"] > 0
    assert_state_equal(ro.read(4), states[4])
    name = sorted(states[5])[0]
    assert_bits_equal(ro[5][name][...], states[5][name], name)
    with pytest.raises(StepNotFoundError):
        ro.read(3)


# -- a lost answer --------------------------------------------------------------------------


def test_a_create_whose_answer_was_lost_succeeds_once_it_finds_its_own_bytes(moto_s3):
    """The PUT landed, its answer was lost, botocore retried and got 412 from our own object."""
    from tests.helpers.lossy_proxy import LossyProxy

    with LossyProxy(moto_s3.endpoint, drop=r"^PUT /ulstore-test/[0-9a-f]+/refs/main/") as proxy:
        options = {**moto_s3.options, "client_kwargs": {**moto_s3.options["client_kwargs"], "endpoint_url": proxy.url}}
        url = f"s3://ulstore-test/{uuid.uuid4().hex}"
        states = states_bf16(20)
        traj = ulstore.open(url, mode="w", storage_options=options, chunk_bytes=4 * CHUNK)
        traj.commit(0, states[0])
        assert proxy.dropped == 1  # the answer to the first branch entry was lost, and the write was retried
        proxy.arm(r"^PUT /ulstore-test/[0-9a-f]+/(steps/1/zarr\.json|refs/main/)")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert traj.commit(1, states[1]) == 1
        assert proxy.dropped == 2 and traj.head() == 1
    ro = ulstore.open(url, mode="r", storage_options=moto_s3.options)
    assert ro.head() == 1 and ro.verify().ok
    assert_state_equal(ro.read(1), states[1])


# -- free-running trials ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend,trials", [("local", 20), ("s3", 5)])
def test_free_running_gc_delete_commit_and_read_lose_nothing(backend, trials, tmp_path, request):
    """gc, delete, commits and reads, each in its own process, free-running on one trajectory: every trial ends
    with every step that was not deleted (and every acknowledged commit) reading back exactly."""
    import multiprocessing

    from tests.helpers import maintenance_races as mr

    options = request.getfixturevalue("moto_s3").options if backend == "s3" else None
    roles = ["deleter", "collector", "committer", "reader"]
    outcomes = []
    with multiprocessing.get_context("spawn").Pool(len(roles)) as pool:
        for t in range(trials):
            url = str(tmp_path / f"t{t}") if backend == "local" else f"s3://ulstore-test/{uuid.uuid4().hex}"
            mr.prepare(url, options)
            done = pool.starmap(mr.role, [(r, url, options, 1000 * t + i) for i, r in enumerate(roles)])
            outcomes.append({d["role"]: d for d in done})
            ro = ulstore.open(url, mode="r", storage_options=options)
            want = [s for s in mr.MAIN_STEPS if s not in mr.DELETED] + done[2]["committed"]
            assert ro.steps == sorted(want)
            assert ro.head("side") == want[-1] and ro.head("main") == 11
            for s in want:
                assert_state_equal(ro.read(s), mr.expected_state(s))
            assert ro.verify().ok
            _open((url, options)).gc(repack_below=0.9)
            ro = ulstore.open(url, mode="r", storage_options=options)
            for s in want:
                assert_state_equal(ro.read(s), mr.expected_state(s))
    assert sum(o["reader"]["reads"] for o in outcomes) > 0
    print(
        f"{backend}: {trials} trials; gc deferred {sum(o['collector']['deferred'] for o in outcomes)} times, "
        f"rewrote {sum(o['collector']['rewritten'] for o in outcomes)} documents; "
        f"{sum(o['reader']['reads'] for o in outcomes)} exact reads beside them"
    )


def test_a_failed_create_that_cannot_be_checked_says_its_outcome_is_unknown(moto_s3, monkeypatch):
    """A PUT that fails without an answer on S3: if reading the object back shows our bytes, it landed; if that
    read fails too, OutcomeUnknownError (retry the same call); if the object is absent, the PUT's own error."""
    from ulstore.errors import OutcomeUnknownError

    io = ObjectStore.from_url(f"s3://ulstore-test/{uuid.uuid4().hex}", moto_s3.options)
    real_create, real_get = io._create, io.get

    def landed_then_lost(key, data):
        real_create(key, data)
        raise OSError(errno.ECONNRESET, "connection reset by peer")

    monkeypatch.setattr(io, "_create", landed_then_lost)
    io.create("a.json", b"mine")  # the write landed: success
    assert real_get("a.json") == b"mine"

    monkeypatch.setattr(io, "get", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ETIMEDOUT, "timed out")))
    with pytest.raises(OutcomeUnknownError, match="may or may not have happened"):
        io.create("b.json", b"mine")

    def lost(key, data):
        raise OSError(errno.ECONNRESET, "connection reset by peer")

    monkeypatch.setattr(io, "_create", lost)
    monkeypatch.setattr(io, "get", real_get)
    with pytest.raises(OSError, match="connection reset"):
        io.create("c.json", b"mine")
    assert real_get("c.json") is None


def test_a_create_refused_by_another_writers_larger_object_is_file_exists(tmp_path):
    """The read-back after a refused create must not fail on the other writer's larger object (a Publisher's
    client turns backend errors into BucketAccessError: a loser of a race got that instead of StepExistsError)."""
    from ulstore.sync import BucketAccessError

    io = ObjectStore.from_url(str(tmp_path / "o"), access_error=BucketAccessError)
    io.create("steps/3/zarr.json", b"x" * 1000)
    with pytest.raises(FileExistsError):
        io.create("steps/3/zarr.json", b"a shorter document")
