"""Round trips of reads at any depth (#35): a step document names its chain's table blocks, so a lazy slice and a
full read take the same few *dependent* requests on S3 whatever the step's depth; chains that are absent (older
documents), crafted or rewritten by gc and delete still read exactly or fail with a named error."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from tests.helpers.store import CHUNK, assert_state_equal, rewrite_step, states_bf16
from ulstore.core.objects import ObjectStore
from ulstore.errors import CorruptManifestError, IntegrityError
from ulstore.store.format._layout import step_key
from ulstore.store.format._stepdoc import (
    MAX_CHAIN_BLOCKS,
    MAX_CHAIN_STEPS,
    ChainStep,
    StepDoc,
    TableRef,
    chain_after,
)

NAME = "model.layers.0.mlp.up_proj.weight"
#: Every request is held this long: requests sent together overlap, one sent after another's answer does not.
#: Long enough that a thread of a parallel batch starting late on a loaded machine (one run at load 9 counted 5
#: rounds with 0.12 s) still overlaps the batch it belongs to.
_HOLD = 0.2
_READS = ("get", "get_ranges", "list", "find", "size", "exists")


class RoundTrips:
    """Every read request of every ObjectStore, timed: the longest chain of requests each sent after the one
    before it was answered is the number of *dependent* round trips (what latency multiplies)."""

    def __init__(self, monkeypatch):
        self.spans: list[tuple[float, float, str, str]] = []
        self._lock = threading.Lock()
        for name in _READS:
            monkeypatch.setattr(ObjectStore, name, self._timed(getattr(ObjectStore, name), name))

    def _timed(self, fn, what):
        def timed(store, *args, **kwargs):
            start = time.perf_counter()
            time.sleep(_HOLD)
            try:
                return fn(store, *args, **kwargs)
            finally:
                with self._lock:
                    self.spans.append((start, time.perf_counter(), what, str(args[0]) if args else ""))

        return timed

    def reset(self) -> None:
        self.spans.clear()

    @property
    def requests(self) -> int:
        return len(self.spans)

    @property
    def rounds(self) -> int:
        spans = sorted(self.spans)
        depth: list[int] = []
        for i, (start, *_) in enumerate(spans):
            depth.append(1 + max((depth[j] for j in range(i) if spans[j][1] <= start), default=0))
        return max(depth, default=0)


def _commit_all(url, states, steps, **options):
    traj = ulstore.open(url, mode="w", chunk_bytes=CHUNK, **options)
    for i in range(steps):
        traj.commit(i, states[i])
    return traj


def _counted_reads(url, step, want, counter, options=None):
    """(rounds, requests) of a lazy one-element slice and of a full read of ``step``, each from ``open``."""
    out = []
    for full in (False, True):
        counter.reset()
        ro = ulstore.open(url, mode="r", storage_options=options)
        if full:
            assert_state_equal(ro.read(step), want)
        else:
            assert_bits_equal(np.asarray(ro[step][NAME][17, 5]), np.asarray(want[NAME][17, 5]), NAME)
        out.append((counter.rounds, counter.requests))
    return out


# 56 commits to moto and ~100 held reads (15 s of CPU): the slow lane; the fast lane keeps 4 round trips at
# depths up to 10 after gc and delete (test_gc_and_delete_keep_every_chain_right)
@pytest.mark.slow
def test_round_trips_do_not_grow_with_depth(moto_s3, monkeypatch):
    states = states_bf16(40)
    bucket = moto_s3.bucket()
    anchored, long = f"s3://{bucket}/anchored", f"s3://{bucket}/long"
    _commit_all(anchored, states, 16, anchor_every=16, storage_options=moto_s3.options)
    _commit_all(long, states, 40, anchor_every=0, storage_options=moto_s3.options)
    counter = RoundTrips(monkeypatch)
    seen = {}
    for url, step in [(anchored, 0), (anchored, 1), (anchored, 7), (anchored, 15), (long, 39)]:
        assert ulstore.open(url, mode="r", storage_options=moto_s3.options).info(step).anchor_distance == step
        seen[step] = _counted_reads(url, step, states[step], counter, moto_s3.options)
    print("depth: (rounds, requests) of a one-element slice, of a full read:", seen)
    for step, ((slice_rounds, _), (full_rounds, _)) in seen.items():
        # settings at open, the step document, every table block of the chain, every blob of the chain
        assert slice_rounds == full_rounds == 4, (step, seen)
    # requests grow with depth (one block and one blob per step of the chain), round trips do not
    assert seen[39][0][1] > seen[7][0][1] > seen[0][0][1]


def _strip_chains(traj):
    """Every step document rewritten without its ``chain``: as commits wrote them before chains existed."""
    for s in traj.steps:
        d = traj._reader.stored_doc(s)
        traj._io.put(step_key(s), dataclasses.replace(d, chain=()).to_bytes())


def test_documents_without_a_chain_read_through_the_walk(monkeypatch):
    states = states_bf16(20)
    traj = _commit_all("memory://rtt-old", states, 9, anchor_every=0)
    assert len(traj._reader.stored_doc(8).chain) == 8  # the whole path back to the anchor
    assert traj._reader.stored_doc(0).chain == ()  # an anchor names none (its document as before chains)
    assert b'"chain"' not in traj._reader.stored_doc(0).to_bytes()
    _strip_chains(traj)
    counter = RoundTrips(monkeypatch)
    (slice_rounds, _), (full_rounds, _) = _counted_reads(traj.url, 8, states[8], counter)
    assert slice_rounds > 4 and full_rounds > 4  # the walk: a document, then its blocks, one step at a time
    ro = ulstore.open(traj.url, mode="r")
    for s in (0, 3, 8):
        assert_state_equal(ro.read(s), states[s])


def _chain_body(edit):
    """A ``body`` edit for :func:`rewrite_step` on the first table row of the chain's first entry (the parent)."""

    def body(b):
        edit(b["chain"]["steps"], b["chain"])

    return body


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda steps, _: steps[0][4][0].__setitem__(5, "0" * 32), CorruptManifestError, "fails its hash"),
        (lambda steps, _: steps[0][4][0].__setitem__(4, 1 << 40), CorruptManifestError, "bad pack, offset or length"),
        (lambda steps, _: steps[0][4][0].__setitem__(3, 1 << 30), IntegrityError, "shorter"),
        (lambda steps, _: steps[0][4][0].__setitem__(2, 7), CorruptManifestError, "bad pack, offset or length"),
        (lambda steps, _: steps.reverse(), CorruptManifestError, "parent path"),
        (lambda steps, _: steps.insert(0, [9, 3, "0" * 32, [0], []]), CorruptManifestError, "parent path"),
        (lambda steps, _: steps.__setitem__(1, list(steps[0])), CorruptManifestError, "parent path"),
        (lambda steps, _: steps.extend([steps[-1]] * MAX_CHAIN_STEPS), CorruptManifestError, "1 to 512 steps"),
        (lambda _, chain: chain["packs"].append(chain["packs"][0]), CorruptManifestError, "chain pack list"),
    ],
    ids=["hash", "huge-length", "past-the-pack", "pack-number", "order", "not-an-ancestor", "twice", "long", "packs"],
)
def test_a_crafted_chain_is_a_named_error(edit, error, match):
    states = states_bf16(20)
    traj = _commit_all(f"memory://rtt-crafted-{abs(hash(match))}", states, 5, anchor_every=0)
    rewrite_step(traj, 4, body=_chain_body(edit))
    for read in (lambda ro: ro.read(4), lambda ro: ro[4][NAME][17, 5]):
        with pytest.raises(error, match=match) as e:
            read(ulstore.open(traj.url, mode="r"))
        assert e.value.key is not None and e.value.step in (3, 4, None)  # (a short pack names only itself)
    ro = ulstore.open(traj.url, mode="r")
    assert_state_equal(ro.read(3), states[3])  # the others read as before


def test_a_chain_entry_referring_to_a_nearer_step_is_no_ancestor():
    """An ancestor's directory (as a descendant's chain copies it) whose chunks refer to a step nearer the
    descendant: a crafted chain, refused by name (never followed into a loop or a wrong value)."""
    states = states_bf16(20)
    traj = _commit_all("memory://rtt-nearer", states, 4, anchor_every=0)

    def point_at_2(tables, append):
        for t in tables.values():
            for p in t.pieces:
                if t.codec == "ulpack":
                    p.ref[:] = 2

    rewrite_step(traj, 1, point_at_2)  # step 3's chain: [2, 1 (refers to 2), 0]
    ro = ulstore.open(traj.url, mode="r")
    with pytest.raises(CorruptManifestError, match="no ancestor of step 1"):
        ro.read(3)
    with pytest.raises(CorruptManifestError, match="cycle"):  # step 2's chain has no step 2: the walk meets it
        ulstore.open(traj.url, mode="r")[2][NAME][17, 5]


def _chains_in_line(traj):
    """Every stored chain is the one its parent's stored document gives."""
    docs = {s: traj._reader.stored_doc(s) for s in traj.steps}
    for s, d in docs.items():
        want = chain_after(docs[d.parent]) if d.anchor_distance and d.parent in docs else ()
        assert d.chain == want, f"step {s}'s chain is stale"


def test_gc_and_delete_keep_every_chain_right(moto_s3, monkeypatch):
    states = states_bf16(20)
    url = f"s3://{moto_s3.bucket()}/maintained"
    traj = _commit_all(url, states, 12, anchor_every=0, storage_options=moto_s3.options)
    traj.delete(5)  # inside the chain: 6 re-parented onto 4, chunks coded against 5 re-encoded
    traj.delete(1)
    report = traj.gc(repack_below=1.0)  # every pack with a dead byte repacked: blocks move
    assert report["repacked"] > 0 and report["steps_rewritten"] > 0
    _chains_in_line(traj)
    counter = RoundTrips(monkeypatch)
    for s in (2, 9, 11):
        for rounds, _ in _counted_reads(url, s, states[s], counter, moto_s3.options):
            assert rounds == 4, s
    monkeypatch.undo()
    assert ulstore.open(url, mode="r", storage_options=moto_s3.options).verify().ok


def _doc(step, parent, rows, chain=()):
    tables = tuple(TableRef(f"t{i:05d}", f"t{i:05d}", 0, 64 * i, 64, "0" * 32) for i in range(rows))
    return StepDoc(step, parent, "1" * 32, "2" * 32, 1, ("3" * 32,), tables, chain=chain)


def test_a_chain_is_bounded_whatever_the_path():
    """A document copies at most MAX_CHAIN_STEPS ancestors and MAX_CHAIN_BLOCKS directory rows; a reader walks
    the documents beyond (a 10k-tensor model's document stays a few hundred KiB however long its chain)."""
    long = tuple(ChainStep(s, s - 1, "1" * 32, ("3" * 32,), ()) for s in range(MAX_CHAIN_STEPS + 99, 99, -1))
    chain = chain_after(_doc(MAX_CHAIN_STEPS + 100, MAX_CHAIN_STEPS + 99, 1, long))
    assert len(chain) == MAX_CHAIN_STEPS and chain[0].step == MAX_CHAIN_STEPS + 100
    wide = tuple(ChainStep(s, s - 1, "1" * 32, ("3" * 32,), _doc(s, s - 1, 100).tables) for s in range(99, 0, -1))
    chain = chain_after(_doc(100, 99, 100, wide))
    assert sum(len(e.tables) for e in chain) <= MAX_CHAIN_BLOCKS < sum(len(e.tables) for e in wide) + 100
    doc = _doc(101, 100, 1, chain)
    assert StepDoc.from_bytes(doc.to_bytes(), key="k", step=101) == doc  # what is written reads back
