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


@pytest.mark.parametrize("snapshot", [False, True])
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
