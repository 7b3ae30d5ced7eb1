"""Many small tensors (the MoE shape of issue 39): exact round trips, and the same bytes whatever the threads.

The commit path batches and groups per-tensor work; these tests pin that nothing of it shows in what
is stored: the blobs, the tables and the step documents of a trajectory are byte-identical whether it
was written with one thread or several, and every tensor reads back bit for bit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ulstore
from ulstore.store.commit._commit import _layouts

BF16 = np.dtype(ml_dtypes.bfloat16)


def _moe_like(rng: np.random.Generator, experts: int = 40) -> dict[str, np.ndarray]:
    """A small MoE-shaped state: per-expert projections, a router, norms, attention, an embedding."""
    h, inter = 16, 6
    shapes = {"embed.weight": (300, h), "norm.weight": (h,), "scalar": ()}
    for layer in range(3):
        p = f"layers.{layer}."
        shapes |= {p + "attn.q.weight": (h, h), p + "attn.k.weight": (4, h), p + "ln.weight": (h,)}
        shapes[p + "router.weight"] = (experts, h)
        for e in range(experts):
            shapes |= {p + f"experts.{e}.{n}.weight": s for n, s in (("gate", (inter, h)), ("up", (inter, h)),
                       ("down", (h, inter)))}  # fmt: skip
    state = {n: (0.02 * rng.standard_normal(s)).astype(BF16) for n, s in shapes.items()}
    state["mask"] = rng.integers(0, 2, (7, 3)).astype(np.int32)  # a non-float tensor among them
    return state


def _rl_step(state: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A few ULPs on ~2% of each float tensor's elements (some tensors unchanged)."""
    out = {}
    for i, (n, v) in enumerate(state.items()):
        if v.dtype != BF16 or i % 5 == 0:
            out[n] = v.copy()
            continue
        bits = v.view(np.uint16).copy().reshape(-1)
        hit = rng.random(bits.size) < 0.02
        bits[hit] += rng.integers(1, 4, int(hit.sum())).astype(np.uint16)
        out[n] = bits.view(BF16).reshape(v.shape)
    return out


def _steps(n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(39)
    states = [_moe_like(rng)]
    for _ in range(n - 1):
        states.append(_rl_step(states[-1], rng))
    return states


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _tree(root: Path) -> dict[str, str]:
    """Path -> sha256 of every stored object except refs' and packs' random names (by content, sorted)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 64])
def test_many_small_tensors_round_trip(tmp_path, chunk_bytes):
    """Every tensor of every step reads back exactly (fresh reader and the writer's own), anchors and deltas."""
    states = _steps(4)
    t = ulstore.open(str(tmp_path / "t"), mode="w", anchor_every=3, chunk_bytes=chunk_bytes)
    for k, s in enumerate(states):
        t.commit(k, s)
    for reader in (t, ulstore.open(str(tmp_path / "t"), mode="r")):
        for k, s in enumerate(states):
            got = reader.read(k)
            assert set(got) == set(s)
            bad = [n for n in s if not _same(np.asarray(got[n]), s[n])]
            assert not bad, f"step {k}: {bad[:5]}"


def _open_pinned(root, monkeypatch, threads: int, batch: int):
    """A new trajectory at ``root`` on ``threads`` commit threads whose workers take ``batch`` bytes at a time,
    its pack ids numbered 0, 1, ... (so two runs' trees compare byte for byte)."""
    import ulstore.store.commit._piece_writer as piece_writer
    import ulstore.store.format._packs as packs

    monkeypatch.setattr(piece_writer, "BATCH_BYTES", batch)
    counter = iter(range(10**6))
    monkeypatch.setattr(packs, "new_pack_id", lambda: f"{next(counter):032x}")
    return ulstore.open(str(root), mode="w", anchor_every=0, chunk_bytes=1024, threads=threads)


def test_many_tensors_bytes_do_not_depend_on_threads(tmp_path, monkeypatch):
    """Blobs, tables and step documents are byte-identical with 1 and 2 threads, and whether the workers
    take one chunk or many at a time (pack ids aside)."""
    import ulstore.store.commit._finalize as finalize
    import ulstore.store.commit._piece_writer as piece_writer

    states = _steps(3)
    digests = []
    monkeypatch.setattr(finalize, "_now", lambda: "2026-12-07T00:00:00+00:00")
    default = piece_writer.BATCH_BYTES
    for threads, batch in ((1, default), (2, 1), (2, 512), (2, default)):
        root = tmp_path / f"t{threads}-{batch}"
        t = _open_pinned(root, monkeypatch, threads, batch)
        for k, s in enumerate(states):
            t.commit(k, s, metadata={"k": k})
        t.close()
        digests.append({p: d for p, d in _tree(root).items() if "/refs/" not in f"/{p}"})
    assert sum("pack" in p for p in digests[0]) >= 3 and sum("step" in p for p in digests[0]) >= 3, sorted(digests[0])
    for other in digests[1:]:
        assert other.keys() == digests[0].keys()
        differ = [p for p in digests[0] if digests[0][p] != other[p]]
        assert not differ, differ[:5]


def test_layouts_groups_records_by_name():
    """The kept step keeps exactly the pieces the records name, for the tensors committed."""

    class R:
        def __init__(self, name, layout):
            self.name, self.layout = name, layout

    records = [R("a", 1), R("b", 2), R("a", 3), R("c", 4)]
    assert _layouts(records, ["a", "b", "d"]) == {"a": {1, 3}, "b": {2}, "d": set()}


# four thread and batch settings each (3 s of CPU): with snapshots in the slow lane
@pytest.mark.parametrize("snapshot", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tied_tensors_are_one_blob_whatever_the_threads(tmp_path, monkeypatch, snapshot):
    """Tensors of equal values (tied weights) in one commit share one blob (and one snapshot), whichever worker
    encodes it first, and the stored bytes do not depend on the threads or on how chunks are batched."""
    import ulstore.store.commit._finalize as finalize
    import ulstore.store.commit._piece_writer as piece_writer

    rng = np.random.default_rng(7)
    base = _steps(3)
    names = sorted(n for n in base[0] if base[0][n].dtype == BF16 and base[0][n].ndim == 2)
    tie = {f"tied.{k}": names[int(rng.integers(0, 4 + 4 * k))] for k in range(len(names) // 4)}
    states = [s | {t: s[n] for t, n in tie.items()} for s in base]  # tied names: the same arrays
    monkeypatch.setattr(finalize, "_now", lambda: "2026-12-07T00:00:00+00:00")
    digests, blobs = [], []
    for threads, batch in ((1, piece_writer.BATCH_BYTES), (2, 1), (2, 300), (2, piece_writer.BATCH_BYTES)):
        root = tmp_path / f"t{threads}-{batch}"
        t = _open_pinned(root, monkeypatch, threads, batch)
        for k, s in enumerate(states):
            t.commit(k, s, snapshot=snapshot and k > 0)
        blobs.append(t.stats()["blobs"])
        for k, s in enumerate(states):
            got = ulstore.open(str(root), mode="r").read(k)
            assert all(_same(np.asarray(got[n]), s[n]) for n in s), k
        t.close()
        digests.append({p: d for p, d in _tree(root).items() if "/refs/" not in f"/{p}"})
    assert len(set(blobs)) == 1, blobs
    for other in digests[1:]:
        assert other == digests[0]
    # a tied tensor adds no blob: the same commits without the tied names store as many
    root = tmp_path / "untied"
    t = ulstore.open(str(root), mode="w", anchor_every=0, chunk_bytes=1024, threads=2)
    for k, s in enumerate(base):
        t.commit(k, s, snapshot=snapshot and k > 0)
    assert t.stats()["blobs"] == blobs[0]


def test_a_blob_claimed_by_a_later_job_is_placed_where_the_first_chunk_is(tmp_path, monkeypatch):
    """A later job that encodes a shared blob first (the earlier one held up) gives it to the earlier chunk:
    the pack holds it once, at the earlier chunk's place, as with one thread (intra, delta and snapshot)."""
    import time

    import ulstore.store.commit._finalize as finalize
    import ulstore.store.commit._piece_writer as piece_writer
    import ulstore.store.format._packs as packs

    rng = np.random.default_rng(3)
    x = (0.02 * rng.standard_normal((32, 32))).astype(BF16)
    y = x.copy()
    y.view(np.uint16)[::5] += np.uint16(1)
    states = [{"a": x, "b": x, "c": x[:4]}, {"a": y, "b": y, "c": x[:4]}]
    monkeypatch.setattr(finalize, "_now", lambda: "2026-12-07T00:00:00+00:00")
    monkeypatch.setattr(piece_writer, "BATCH_BYTES", 1)  # one chunk a job
    real_jobs, real_claimed = piece_writer.PieceWriter._jobs, piece_writer.PieceWriter._claimed
    claimed = []

    def held_up(self, job):
        if any(st.name == "a" for st, _, _ in job.chunks):
            time.sleep(0.3)  # "b"'s job claims the blob first
        return real_jobs(self, job)

    def counted(self, key):
        claimed.append(key)
        return real_claimed(self, key)

    monkeypatch.setattr(piece_writer.PieceWriter, "_jobs", held_up)
    monkeypatch.setattr(piece_writer.PieceWriter, "_claimed", counted)
    trees = []
    for threads in (1, 2):
        counter = iter(range(10**6))
        monkeypatch.setattr(packs, "new_pack_id", lambda: f"{next(counter):032x}")
        root = tmp_path / f"t{threads}"
        t = ulstore.open(str(root), mode="w", anchor_every=0, chunk_bytes=1 << 20, threads=threads)
        t.commit(0, states[0])
        t.commit(1, states[1], snapshot=True)
        assert t.stats()["blobs"] == 2 + 2, t.stats()  # a's intra and c's; a's delta and its snapshot
        for k, s in enumerate(states):
            got = ulstore.open(str(root), mode="r").read(k)
            assert all(_same(np.asarray(got[n]), s[n]) for n in s), k
        t.close()
        trees.append({p: d for p, d in _tree(root).items() if "/refs/" not in f"/{p}"})
    assert len(claimed) == 3, claimed  # the intra blob, the delta and its snapshot
    assert trees[1] == trees[0]


def _held_up_trees(tmp_path, monkeypatch, states, kwargs, hold: str) -> list[dict[str, str]]:
    """The stored trees of ``states`` committed (step k with ``kwargs[k]``) with one thread, then with two
    threads one chunk a job, the jobs of tensor ``hold`` held up (the main thread writes the tensors after it
    meanwhile), each checked to read back exactly."""
    import time

    import ulstore.store.commit._finalize as finalize
    import ulstore.store.commit._piece_writer as piece_writer

    monkeypatch.setattr(finalize, "_now", lambda: "2026-12-07T00:00:00+00:00")
    real_jobs = piece_writer.PieceWriter._jobs

    def held_up(self, job):
        if any(st.name == hold for st, _, _ in job.chunks):
            time.sleep(0.2)
        return real_jobs(self, job)

    monkeypatch.setattr(piece_writer.PieceWriter, "_jobs", held_up)
    trees = []
    for threads in (1, 2):
        root = tmp_path / f"t{threads}"
        t = _open_pinned(root, monkeypatch, threads, 1)
        for k, s in enumerate(states):
            t.commit(k, s, **kwargs[k])
        for k, s in enumerate(states):
            got = ulstore.open(str(root), mode="r").read(k)
            assert all(_same(np.asarray(got[n]), s[n]) for n in s), k
        t.close()
        trees.append({p: d for p, d in _tree(root).items() if "/refs/" not in f"/{p}"})
    return trees


@pytest.mark.parametrize("case", ["anchor", "integers", "snapshot"])
@pytest.mark.parametrize("order", ["ab", "ba"])
@pytest.mark.parametrize("rows", [4, 64])
def test_a_chunk_never_dedups_against_a_later_tensors_parent_entry(tmp_path, monkeypatch, case, order, rows):
    """Tensor "a" takes the values tensor "b" had (and keeps) in the parent, an intra entry there.  Whether a's
    chunks reuse b's parent entry depends only on plan order (b written before a, or after), never on whether
    a worker ran a's chunks after the main thread had written b: one thread and two store the same bytes.
    ``anchor``: an anchor commit (intra chunks); ``integers``: Zstd chunks of a delta commit; ``snapshot``: the
    snapshots of a delta commit's chunks.  ``rows``: one chunk per tensor, or several."""
    rng = np.random.default_rng(rows)
    if case == "integers":
        x, y = (rng.integers(0, 1000, (rows, 32)).astype(np.int32) for _ in range(2))
    else:
        x, y = ((0.02 * rng.standard_normal((rows, 32))).astype(BF16) for _ in range(2))
    first, then = {"a": x, "b": y}, {"a": y.copy(), "b": y}
    if order == "ba":
        first, then = {"b": y, "a": x}, {"b": y, "a": y.copy()}
    kwargs = [{}, {"anchor": True} if case == "anchor" else {"snapshot": case == "snapshot"}]
    trees = _held_up_trees(tmp_path, monkeypatch, [first, then], kwargs, hold="a")
    assert sum("pack" in p for p in trees[0]) >= 2, sorted(trees[0])
    differ = [p for p in trees[0] if trees[0][p] != trees[1].get(p)]
    assert trees[1].keys() == trees[0].keys() and not differ, differ


def _shuffled_chunks(seed: int, tensors: int = 60, steps: int = 3) -> list[dict[str, np.ndarray]]:
    """Steps of many one-chunk tensors drawn from a few chunk values (bf16 and int32), each step also copying
    values of the previous step's other tensors: cross-tensor duplicates, within a step and against its parent."""
    rng = np.random.default_rng(seed)
    states: list[dict[str, np.ndarray]] = []
    for _ in range(steps):
        floats = [(0.02 * rng.standard_normal(16)).astype(BF16) for _ in range(5)]
        ints = [rng.integers(0, 5, 16).astype(np.int32) for _ in range(5)]
        s = {f"t{n:02d}": (ints if n % 3 == 0 else floats)[int(rng.integers(0, 5))] for n in range(tensors)}
        if states:
            prev = states[-1]
            for n in s:
                m = f"t{int(rng.integers(0, tensors)) // 3 * 3 + (int(n[1:]) % 3 > 0):02d}"
                if rng.random() < 0.5 and m in prev and prev[m].dtype == s[n].dtype:
                    s[n] = prev[m]
        states.append(s)
    return states


@pytest.mark.parametrize("seed", range(3))
def test_cross_tensor_duplicates_store_the_same_bytes_whatever_the_threads(tmp_path, monkeypatch, seed):
    """Many one-chunk tensors whose values repeat across tensors and steps (anchors and deltas, snapshots):
    the stored bytes with two threads (one chunk a job, or many) are those of one thread."""
    import ulstore.store.commit._finalize as finalize
    import ulstore.store.commit._piece_writer as piece_writer

    states = _shuffled_chunks(seed)
    kwargs = [{}, {"anchor": True}, {"snapshot": True}]
    monkeypatch.setattr(finalize, "_now", lambda: "2026-12-07T00:00:00+00:00")
    trees = []
    for threads, batch in ((1, piece_writer.BATCH_BYTES), (2, 1), (2, 100), (2, piece_writer.BATCH_BYTES)):
        root = tmp_path / f"t{threads}-{batch}"
        t = _open_pinned(root, monkeypatch, threads, batch)
        for k, s in enumerate(states):
            t.commit(k, s, **kwargs[k])
        t.close()
        trees.append({p: d for p, d in _tree(root).items() if "/refs/" not in f"/{p}"})
    for other in trees[1:]:
        differ = [p for p in trees[0] if trees[0][p] != other.get(p)]
        assert other.keys() == trees[0].keys() and not differ, differ


def test_a_commit_pauses_the_garbage_collector_and_restores_it(tmp_path, monkeypatch):
    """The collector is off during a commit (nested and concurrent pauses share one) and back as it was after,
    also when the commit fails; a collector the caller turned off stays off."""
    import gc

    from ulstore.store.commit import _commit

    seen = []
    real = _commit.Committer._commit_paused

    def spy(self, *a, **kw):
        seen.append(gc.isenabled())
        with _commit._gc_paused():  # nested: still off inside, and the outer pause still owns the resume
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
        return real(self, *a, **kw)

    monkeypatch.setattr(_commit.Committer, "_commit_paused", spy)
    states = _steps(2)
    t = ulstore.open(str(tmp_path / "t"), mode="w", anchor_every=0)
    assert gc.isenabled()
    t.commit(0, states[0])
    assert seen == [False, False, False] and gc.isenabled()
    from ulstore.store.commit._piece_writer import PieceWriter

    def fail(self):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(PieceWriter, "flush", fail)
        with pytest.raises(RuntimeError, match="injected"):
            t.commit(1, states[1])
    assert gc.isenabled()
    gc.disable()
    try:
        t.commit(1, states[1])
        assert not gc.isenabled()  # (not turned on by the commit)
    finally:
        gc.enable()
    assert seen[-3:] == [False, False, False]
    assert _commit._gc_pausers == 0


def test_a_pause_that_ends_under_another_collects_the_young_generations(monkeypatch):
    """Overlapping commits keep the collector off until the last ends: each earlier end collects generations
    0 and 1 once, so other threads' cyclic garbage does not wait for writers that never stop overlapping."""
    import gc

    from ulstore.store.commit import _commit

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    outer = _commit._gc_paused()
    outer.__enter__()
    try:
        with _commit._gc_paused():
            assert not gc.isenabled()
        assert calls == [1] and not gc.isenabled()  # the other pause still holds it
    finally:
        outer.__exit__(None, None, None)
    assert calls == [1] and gc.isenabled()  # the last end resumes it, with no extra collection
