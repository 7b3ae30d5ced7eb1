"""A version's SPARSE deltas are applied in place in a few compiled calls: all of them, or none.

Whatever chunk of a version is corrupt or does not fit the state held (first,
middle or last; in the compiled batch or decoded on its own), applying the
version raises and leaves every array of the state byte-identical to before,
and the replica still holds its version.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses

import numpy as np
import pytest

from tests.helpers.blobs import reseal
from tests.helpers.sync import assert_same_bits, columns_taken, rl_states
from ulstore.errors import IntegrityError
from ulstore.sync import Publisher
from ulstore.sync._fetch import fetch
from ulstore.sync._open import objects, trajectory
from ulstore.sync._replica import Replica

CHUNK = 1 << 12


@pytest.fixture(scope="module")
def states():
    return rl_states(4)


@pytest.fixture
def store(tmp_path, states):
    url = str(tmp_path / "store")
    with Publisher(url, anchor_every=0, chunk_elems=CHUNK) as pub:
        for v, s in enumerate(states):
            pub.publish(v, s)
    traj = trajectory(objects(url, None), "r", keep_parent=False)
    yield traj
    traj.close()


def replica_at(traj, version, pool, threads=2):
    rep = Replica(None, pool=pool, threads=threads)
    rep.load(fetch(traj, 0, snapshot=True))
    for v in range(1, version + 1):
        rep.apply(fetch(traj, v))
    return rep


def snapshot(rep) -> dict:
    return {k: np.asarray(v).copy() for k, v in rep.state.items()}


@pytest.mark.parametrize("threads", [1, 2])
def test_in_place_apply_matches_every_version(store, states, threads):
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(store, 0, pool, threads)
        for v in range(1, len(states)):
            f = fetch(store, v)
            assert any(c.kind == "delta" for c in f.changes)
            rep.apply(f)
            assert rep.version == v
            assert_same_bits(rep.state, states[v])
            assert not rep.verify()


def test_a_loaded_step_has_its_slots_ready_for_the_first_version(store, states, monkeypatch):
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(store, 0, pool)
        made = []
        slot = Replica._slot
        monkeypatch.setattr(Replica, "_slot", lambda self, *a: made.append(a) or slot(self, *a))
        f = fetch(store, 1)
        assert len(rep._in_place(list(zip([c for c in f.changes if c.kind != "unchanged"], f.blobs)))) == 1
        rep.apply(f)
        assert made == []  # every slot the version needed was made when step 0 was loaded
        assert_same_bits(rep.state, states[1])


def test_a_version_in_its_parents_layout_is_applied_from_columns_exactly_as_from_the_feed(store, states, monkeypatch):
    """Every changed chunk is a SPARSE delta the replica writes in place: from the first version after a load on,
    it goes through the change columns (no object per chunk), and leaves the very state and bookkeeping (content
    hashes, word sums) that the feed of ChunkChange objects leaves."""
    taken = columns_taken(monkeypatch)
    with cf.ThreadPoolExecutor(2) as pool:
        cols, feed = replica_at(store, 0, pool), replica_at(store, 0, pool)
        for v in range(1, len(states)):
            f = fetch(store, v)
            assert f.columns is not None
            cols.apply(f)
            feed.apply(dataclasses.replace(fetch(store, v), columns=None))
            for rep in (cols, feed):
                assert rep.version == v
                assert_same_bits(rep.state, states[v])
            assert cols._contents == feed._contents and cols._sums == feed._sums
            assert not cols.verify() and not cols.verify(sums=True)
    assert taken == [True] * (len(states) - 1)  # the first version after a load too: the layout loaded is known


def test_a_version_the_columns_do_not_take_goes_the_general_way(tmp_path, states, monkeypatch):
    """Intra chunks (an anchor step, in the parent's layout): columns are declined, nothing written, and the
    general path applies the version exactly; the next version goes through the columns again."""
    import ulstore

    traj = ulstore.open(str(tmp_path / "t"), mode="w", chunk_bytes=2 * CHUNK, anchor_every=0)
    for v in range(4):  # as a publisher commits (SPARSE deltas), step 2 an anchor: every changed chunk intra
        traj.commit(v, states[v], sparse=True, anchor=True if v == 2 else None)
    traj = ulstore.open(traj.url, mode="r")  # (a writer's own steps have no parsed table blocks)
    taken = columns_taken(monkeypatch)
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(traj, 3, pool)
        assert_same_bits(rep.state, states[3])
        assert not rep.verify()
    assert taken == [True, False, True]  # v2: intra chunks
    assert set(fetch(traj, 2).columns.ref.tolist()) == {-1}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("how", ["payload resealed", "crc", "truncated", "not sparse"])
def test_a_bad_chunk_anywhere_leaves_the_state_untouched(store, states, where, how):
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(store, 1, pool)
        f = fetch(store, 2)
        changed = [i for i, c in enumerate(c for c in f.changes if c.kind != "unchanged")]
        deltas = [i for i, c in zip(changed, [c for c in f.changes if c.kind != "unchanged"]) if c.kind == "delta"]
        assert len(deltas) >= 3
        i = {"first": deltas[0], "middle": deltas[len(deltas) // 2], "last": deltas[-1]}[where]
        blobs = list(f.blobs)
        blob = bytearray(blobs[i])
        if how == "payload resealed":
            blob[len(blob) // 2] ^= 0x24
            blob = bytearray(reseal(blob[:-4]))
        elif how == "crc":
            blob[-1] ^= 1
        elif how == "truncated":
            blob = bytearray(reseal(blob[: len(blob) // 2]))
        else:
            blob[6] = 2  # a dense-mode header on a sparse payload: decoded on its own, and rejected
            blob = bytearray(reseal(blob[:-4]))
        blobs[i] = bytes(blob)
        before = snapshot(rep)
        with pytest.raises(IntegrityError):
            rep.apply(dataclasses.replace(f, blobs=blobs))
        assert_same_bits(rep.state, before)
        assert rep.version == 1
        rep.apply(f)  # the good version still applies
        assert_same_bits(rep.state, states[2])


def test_a_state_that_diverged_at_a_changed_element_is_left_as_it_is(store, states):
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(store, 1, pool)
        f = fetch(store, 2)
        c = [c for c in f.changes if c.kind == "delta"][-1]
        name = c.tensor
        flat = rep.flat(name).view(np.uint16)
        ref, tgt = states[1][name].reshape(-1).view(np.uint16), states[2][name].reshape(-1).view(np.uint16)
        pos = int(np.flatnonzero(ref != tgt)[-1])
        flat[pos] ^= 1  # a foreign write where the delta changes an element: its checksums cannot hold
        before = snapshot(rep)
        with pytest.raises(IntegrityError):
            rep.apply(f)
        assert_same_bits(rep.state, before)


def test_a_feed_that_does_not_fit_the_held_tensors_is_refused_before_any_write(store):
    from ulstore.errors import CorruptManifestError
    from ulstore.sync._arrays import Spec
    from ulstore.sync._replica import ChainBroken

    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(store, 1, pool)
        before = snapshot(rep)
        f = fetch(store, 2)
        delta = next(c for c in f.changes if c.kind == "delta")
        held = next(c for c in f.changes if c.kind == "unchanged" and c.tensor != delta.tensor)

        def swap(old, new):
            return dataclasses.replace(f, feed=[new if c is old else c for c in f.changes], columns=None)

        def respec(name):
            s = f.specs[name]
            return dataclasses.replace(f, specs={**f.specs, name: Spec(name, (*s.shape, 1), s.dtype)})

        cases = [
            (swap(delta, dataclasses.replace(delta, ref=0)), ChainBroken, "coded against step 0"),
            (respec(delta.tensor), CorruptManifestError, "a delta of a tensor the held step does not hold"),
            (respec(held.tensor), CorruptManifestError, "not sent whole"),
        ]
        for bad, error, message in cases:
            with pytest.raises(error, match=message):
                rep.apply(bad)
            assert rep.version == 1
            assert_same_bits(snapshot(rep), before)
        rep.apply(f)
        assert rep.version == 2 and not rep.verify()


def test_specs_are_shared_between_versions_and_bounded():
    from ulstore.sync._arrays import Spec, _spec

    a = _spec("w", (3, 4), np.dtype(np.float32))
    assert a == Spec("w", (3, 4), np.dtype(np.float32)) and _spec("w", (3, 4), np.dtype("<f4")) is a
    assert _spec("w", (3, 5), np.dtype(np.float32)) != a and _spec("w", (3, 4), np.dtype(np.float16)) != a
    assert _spec.cache_info().maxsize is not None  # an unbounded cache would grow with every tensor ever seen


def test_fetched_blobs_are_read_only_views_of_the_same_bytes(store):
    f = fetch(store, 2)
    changed = [c for c in f.changes if c.kind != "unchanged"]
    copies = store.fetch_blobs(changed)
    assert all(isinstance(b, bytes) for b in copies)  # the public call still copies
    assert [bytes(b) for b in f.blobs] == copies and f.nbytes == sum(len(b) for b in copies)
    assert all(isinstance(b, memoryview) and b.readonly for b in f.blobs)


def test_the_kept_word_sums_find_what_the_content_hashes_find(store, states):
    """verify(sums=True) (the default mode's rotating scan) flags exactly the chunks BLAKE3 flags."""
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(store, 2, pool)
        keys = list(rep.chunk_bytes())
        summed = [k for k in keys if k in rep._sums]
        assert summed and rep.verify(sums=True) == [] == rep.verify()
        for name in {k[0] for k in keys}:  # one element flipped in each tensor, including any without a kept sum
            rep.flat(name).view(f"<u{rep.flat(name).dtype.itemsize}")[-1] ^= 1
        flagged = rep.verify(sums=True)
        assert flagged == rep.verify() and len(flagged) == len({k[0] for k in keys})


def test_specs_of_steps_with_the_same_tensors_are_one_dict_and_other_tensors_get_their_own(store):
    from ulstore.sync._arrays import Spec
    from ulstore.sync._arrays import specs_of as _specs

    tensors = store.tensors(2)
    specs = _specs(tensors)
    assert specs == {n: Spec(n, shape, dtype) for n, (shape, dtype) in tensors.items()}
    assert _specs(store.tensors(1)) is specs  # the same tensors: the dict a replica compares by identity
    name = next(iter(tensors))
    for other in (
        {**tensors, "extra": ((2,), np.dtype(np.float32))},
        {**tensors, name: ((*tensors[name][0], 1), tensors[name][1])},
        {n: v for n, v in tensors.items() if n != name},
    ):
        got = _specs(other)
        assert got is not specs and got == {n: Spec(n, shape, dtype) for n, (shape, dtype) in other.items()}
    assert _specs(tensors) == specs


@pytest.mark.parametrize("every", [8, 64])  # here: the first version fits in the reserve / outgrows it
def test_a_bootstrap_reserves_the_apply_buffers_and_the_first_version_writes_into_them(
    store, states, every, monkeypatch
):
    """The first version after a snapshot load finds its output buffers faulted in (1/RESERVE_EVERY of each float
    dtype's elements) and applies into them when it fits; a version that needs more grows them."""
    from ulstore.store.format._chunkcodec import codec_for
    from ulstore.sync import _in_place

    monkeypatch.setattr(_in_place, "RESERVE_EVERY", every)
    monkeypatch.setattr(_in_place, "RESERVE_MOST", 2000 if every == 8 else 1 << 26)  # the cap holds too
    fits = every == 8
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(store, 0, pool)
        elements, changed = {}, {}
        for name, spec in rep.specs.items():
            if codec_for(spec.dtype) == "ulpack":
                a, b = (np.asarray(s[name]).reshape(-1).view(f"<u{spec.dtype.itemsize}") for s in states[:2])
                elements[spec.dtype] = elements.get(spec.dtype, 0) + a.size
                changed[spec.dtype] = changed.get(spec.dtype, 0) + int(np.count_nonzero(a != b))
        assert elements and all(changed.values())
        reserved = {}
        for dtype, n in elements.items():
            pos, new, old = reserved[dtype] = rep._buffers[dtype][dtype.itemsize]
            assert len(pos) == len(new) == len(old) == min(n // every, _in_place.RESERVE_MOST) and pos.dtype == np.int64
        rep.apply(fetch(store, 1))
        assert_same_bits(rep.state, states[1])
        assert not rep.verify()
        for dtype, (pos, _, _) in reserved.items():
            kept = rep._buffers[dtype][dtype.itemsize][0]
            assert (changed[dtype] <= len(pos)) == fits
            if fits:
                assert kept is pos  # written into, not replaced
            else:
                assert len(kept) >= changed[dtype] > len(pos)


class _ShutDownPool(cf.ThreadPoolExecutor):
    """A decode pool shut down (``cancel_futures=True``, as ``Follower.close()`` does) while a version is
    applied: the compiled job's helpers are cancelled before they start, the way shutdown cancels what is
    queued (``cancel()``, never ``set_running_or_notify_cancel()``)."""

    def submit(self, fn, /, *args, **kwargs):
        if getattr(fn, "__name__", "") != "work":
            return super().submit(fn, *args, **kwargs)
        fut = cf.Future()
        fut.cancel()
        return fut


def test_a_helper_cancelled_by_the_pools_shutdown_neither_hangs_the_apply_nor_fails_it(store, states):
    import threading

    with cf.ThreadPoolExecutor(2) as pool, _ShutDownPool(2) as shut:
        rep = replica_at(store, 1, pool)
        rep.pool = shut
        f = fetch(store, 2)
        assert sum(c.kind == "delta" for c in f.changes) >= 2  # applied by this thread and at least one helper
        out: list = []

        def apply():
            try:
                out.append(rep.apply(f))
            except BaseException as e:  # noqa: BLE001 - reported below
                out.append(e)

        t = threading.Thread(target=apply, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "the apply waits forever for a helper the pool's shutdown cancelled"
        assert not isinstance(out[0], BaseException), out[0]
        assert rep.version == 2  # this thread took every blob: nothing was lost with the helper
        assert_same_bits(rep.state, states[2])


def test_chunk_sizes_follow_a_version_chunked_otherwise(tmp_path, states):
    """The sizes the default mode's scan walks are kept from version to version, and made again when a
    version's chunks have other boxes (a publisher resumed with another chunk size)."""
    url = str(tmp_path / "rechunked")
    with Publisher(url, anchor_every=0, chunk_elems=CHUNK) as pub:
        pub.publish(0, states[0])
        pub.publish(1, states[1])
    with Publisher(url, anchor_every=0, chunk_elems=CHUNK // 4) as pub:
        pub.publish(2, states[2])
    traj = trajectory(objects(url, None), "r", keep_parent=False)
    with cf.ThreadPoolExecutor(2) as pool:
        rep = replica_at(traj, 1, pool)
        before = rep.chunk_bytes()
        rep.apply(fetch(traj, 2))
        after = rep.chunk_bytes()
    traj.close()
    total = sum(a.nbytes for a in states[2].values())
    assert sum(before.values()) == total == sum(after.values())
    assert set(after) == set(rep._contents) and len(after) > len(before)
    assert_same_bits(rep.state, states[2])
