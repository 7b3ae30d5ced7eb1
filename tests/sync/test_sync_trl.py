"""Interop with TRL's sparse_weight_patch layout: a TRL bucket written here independently (every index
variant, a partial anchor, a uint32 gap fallback) -> ulstore sync store -> TRL bucket again, exact at
every step (replayed with numpy), and readable the way TRL's vLLM-side loader reads it (safetensors.torch
+ torch indexing, where torch is installed).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save as st_save

from tests.helpers.sync import assert_same_bits, flat_bits, rl_states
from ulstore.errors import InvalidInputError
from ulstore.sync import Follower, export_trl, gap_decode, gap_encode, import_trl
from ulstore.sync.trl import read_trl_file

BF16 = np.dtype(ml_dtypes.bfloat16)
STEPS = 9
BIG = 200_000  # a parameter large enough for a gap above 65535 (uint32 fallback)


@pytest.fixture(scope="module")
def trajectory():
    """Real RL states of the tiny model plus one big parameter whose changes are far apart."""
    states = rl_states(STEPS)
    big = np.linspace(-1, 1, BIG).astype(BF16)
    for i, s in enumerate(states):
        b = big.copy()
        if i >= 4:
            b.view(np.uint16)[[3, 150_000]] ^= 1  # one gap of 149996: needs uint32
        if i >= 7:
            b.view(np.uint16)[10] ^= 2
        s["big.weight"] = b
    return states


# -- an independent TRL writer and reader (the format as the TRL branch writes it) ---------


def _meta(step, n_params, changed, total, **extra):
    return {
        "format": "sparse_weight_patch",
        "version": "1",
        "model_version": str(step),
        "num_changed_params": str(n_params),
        "total_changed_elements": str(changed),
        "total_elements": str(total),
        "sparsity": str(1 - changed / total),
        **extra,
    }


def _trl_gaps(idx):
    """TRL's gap_delta_encode, transcribed: delta[k] = idx[k] - idx[k-1] - 1 with idx[-1] := -1."""
    idx = idx.astype(np.int64)
    d = idx - np.concatenate([[-1], idx[:-1]]) - 1
    return d.astype(np.uint16 if d.max() <= 0xFFFF else np.uint32)


def write_trl_bucket(root, states):
    """Anchors at 0 (full) and 5 (partial: only what changed since 4); deltas in three index variants."""
    os.makedirs(f"{root}/anchors", exist_ok=True)
    os.makedirs(f"{root}/deltas", exist_ok=True)
    total = sum(v.size for v in states[0].values())
    with open(f"{root}/anchors/step_000000.safetensors", "wb") as f:
        f.write(st_save(dict(states[0]), metadata=_meta(0, len(states[0]), total, total, sparse="False")))
    for step in range(1, len(states)):
        prev, cur = states[step - 1], states[step]
        changed = {k: np.flatnonzero(flat_bits(cur[k]) != flat_bits(prev[k])) for k in cur}
        changed = {k: i for k, i in changed.items() if i.size}
        n = sum(i.size for i in changed.values())
        if step == 5:  # an early-style anchor that omits the unchanged parameters
            tensors = {k: cur[k] for k in changed}
            with open(f"{root}/anchors/step_{step:06d}.safetensors", "wb") as f:
                f.write(st_save(tensors, metadata=_meta(step, len(tensors), n, total, sparse="False")))
            continue
        tensors, extra = {}, {}
        for k, idx in changed.items():
            vals = cur[k].reshape(-1)[idx]
            if step <= 3:  # the first format: int32 .indices / .values, no encoding key
                tensors[k + ".indices"], tensors[k + ".values"] = idx.astype(np.int32), vals
            elif step == 7:  # .idx int32, encoding=raw
                tensors[k + ".idx"], tensors[k + ".val"] = idx.astype(np.int32), vals
                extra = {"sparse": "True", "encoding": "raw"}
            else:  # .idx gap-coded uint16 (uint32 fallback per parameter), encoding=gap_delta
                tensors[k + ".idx"], tensors[k + ".val"] = _trl_gaps(idx), vals
                extra = {"sparse": "True", "encoding": "gap_delta"}
        with open(f"{root}/deltas/step_{step:06d}.safetensors", "wb") as f:
            f.write(st_save(tensors, metadata=_meta(step, len(changed), n, total, **extra)))


_NUMPY_DTYPES = {
    "BF16": BF16,
    "U8": np.dtype(np.uint8),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}


def _read_numpy(path):
    """A safetensors file as numpy arrays, read here (not by the code under test; numpy's reader rejects bf16)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n :]
    return {
        k: np.frombuffer(data[v["data_offsets"][0] : v["data_offsets"][1]], dtype=_NUMPY_DTYPES[v["dtype"]]).reshape(
            v["shape"]
        )
        for k, v in header.items()
    }, meta


def _replay(root, read, positions, scatter, copy, to_numpy):
    """Rebuild every step of a TRL bucket: anchors replace tensors, deltas scatter values (the loader's logic).

    ``read(path) -> (tensors, metadata)``; ``positions(raw_idx, gap_coded)`` decodes an index array;
    ``scatter(tensor, positions, values)`` writes in place; ``copy`` and ``to_numpy`` per tensor.
    """
    steps = sorted(
        {int(n[5:11]) for d in ("anchors", "deltas") if os.path.isdir(f"{root}/{d}") for n in os.listdir(f"{root}/{d}")}
    )
    state, out, metas = {}, {}, {}
    for step in steps:
        a, d = f"{root}/anchors/step_{step:06d}.safetensors", f"{root}/deltas/step_{step:06d}.safetensors"
        if os.path.exists(a):
            tensors, meta = read(a)
            state.update({k: copy(v) for k, v in tensors.items()})
        else:
            tensors, meta = read(d)
            for name in sorted({k.rsplit(".", 1)[0] for k in tensors}):
                if name + ".val" in tensors:
                    idx = positions(tensors[name + ".idx"], meta.get("encoding") == "gap_delta")
                    vals = tensors[name + ".val"]
                else:
                    idx, vals = tensors[name + ".indices"], tensors[name + ".values"]
                scatter(state[name], idx, vals)
        metas[step] = meta
        out[step] = {k: to_numpy(v) for k, v in state.items()}
    return out, metas


def numpy_replay(root):
    """The replay with numpy: no torch needed."""

    def positions(raw_idx, gap_coded):
        return np.cumsum(raw_idx.astype(np.int64) + 1) - 1 if gap_coded else raw_idx

    def scatter(t, idx, vals):
        t.reshape(-1)[idx.astype(np.int64)] = vals

    return _replay(root, _read_numpy, positions, scatter, np.copy, np.copy)


def torch_replay(root):
    """The replay the way TRL's vLLM-side loader does it: safetensors.torch + torch indexing."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load

    def read(path):
        raw = open(path, "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        return load(raw), json.loads(raw[8 : 8 + n]).get("__metadata__", {})

    def positions(raw_idx, gap_coded):
        if gap_coded:  # TRL's gap_delta_decode
            return (torch.cumsum(raw_idx.long() + 1, dim=0) - 1).to(torch.int32)
        return raw_idx.to(torch.int32)

    def scatter(t, idx, vals):
        t.view(-1)[idx.long()] = vals

    return _replay(root, read, positions, scatter, torch.clone, lambda v: v.view(torch.int16).numpy().view(BF16).copy())


# -- tests ----------------------------------------------------------------------------


def test_gap_coding_definition():
    assert gap_encode([]).dtype == np.uint16 and gap_decode(gap_encode([])).size == 0
    assert gap_encode([0]).tolist() == [0] and gap_encode([5]).tolist() == [5]
    assert gap_encode([0, 1, 2, 65537]).tolist() == [0, 0, 0, 65534]
    assert gap_encode([0, 65536]).dtype == np.uint16 and gap_encode([0, 65536]).tolist() == [0, 65535]
    assert gap_encode([0, 65537]).dtype == np.uint32 and gap_encode([0, 65537]).tolist() == [0, 65536]
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = np.unique(rng.integers(0, 10**6, size=rng.integers(1, 500)))
        g = gap_encode(idx)
        assert g.tolist() == _trl_gaps(idx).tolist() and g.dtype == _trl_gaps(idx).dtype
        assert gap_decode(g).tolist() == idx.tolist()
    with pytest.raises(InvalidInputError):
        gap_encode([3, 3])
    with pytest.raises(InvalidInputError):
        gap_decode(np.array([1], np.int32))


def test_trl_to_ulstore_to_trl_is_exact(trajectory, tmp_path):
    """Acceptance 4: every step reproduces the same weights, in each index format."""
    src = tmp_path / "trl"
    write_trl_bucket(src, trajectory)
    reference, _ = numpy_replay(src)
    assert sorted(reference) == list(range(STEPS + 1))
    for step, state in reference.items():  # the TRL bucket itself encodes the trajectory
        assert_same_bits(state, trajectory[step])
    key = "deltas/step_000004.safetensors"
    kind, patch, meta = read_trl_file(open(src / key, "rb").read(), key)
    assert kind == "delta" and meta["encoding"] == "gap_delta" and patch["big.weight"][0].tolist() == [3, 150_000]

    store = str(tmp_path / "store")
    report = import_trl(str(src), store, anchor_every=4)
    assert report["versions"] == list(range(STEPS + 1)) and report["mismatches"] == []
    f = Follower(store)
    followed = []
    for v in f.follow(until=STEPS, timeout=1):
        assert f.version == v
        assert_same_bits(f.state, trajectory[v])  # the follower holds each imported version, exactly
        followed.append(v)
    assert followed and followed[-1] == STEPS
    f2 = Follower(store)
    f2.bootstrap()
    assert_same_bits(f2.state, trajectory[STEPS])
    assert f2.metadata["model_version"] == STEPS

    for fmt in ("gap_delta", "raw", "indices"):
        dest = tmp_path / f"out-{fmt}"
        out = export_trl(store, str(dest), index_format=fmt)
        assert out["versions"] == list(range(STEPS + 1)) and out["anchors"][0] == 0
        replayed, metas = numpy_replay(dest)
        for step in range(STEPS + 1):
            assert_same_bits(replayed[step], reference[step])
        assert metas[4]["sparse"] == "False"  # 4 is an anchor of the store: a full TRL anchor too...
        m = _st(dest / "deltas/step_000004.safetensors")[1]  # ...and a delta, for replicas in step
        assert m["format"] == "sparse_weight_patch" and m["model_version"] == "4" and m["sparse"] == "True"
        changed = sum(int((flat_bits(trajectory[4][k]) != flat_bits(trajectory[3][k])).sum()) for k in trajectory[4])
        total = sum(v.size for v in trajectory[4].values())
        assert int(m["total_changed_elements"]) == changed and int(m["total_elements"]) == total
        assert float(m["sparsity"]) == pytest.approx(1 - changed / total)
        assert int(m["num_changed_params"]) == sum(
            1 for k in trajectory[4] if (flat_bits(trajectory[4][k]) != flat_bits(trajectory[3][k])).any()
        )
        if fmt == "gap_delta":
            tensors, _ = _st(dest / "deltas/step_000004.safetensors")
            assert tensors["big.weight.idx"] == "U32" and tensors["lm_head.weight.idx"] == "U16"
            assert m["encoding"] == "gap_delta"
        elif fmt == "indices":
            assert "encoding" not in m
            assert _st(dest / "deltas/step_000004.safetensors")[0]["big.weight.indices"] == "I32"
    # anchors of the store become full TRL anchors (every parameter, never a partial one)
    tensors, meta = _st(tmp_path / "out-raw" / "anchors/step_000004.safetensors")
    assert set(tensors) == set(trajectory[0]) and meta["sparse"] == "False"


def test_trl_loader_reads_what_export_writes(trajectory, tmp_path):
    """TRL's own (torch) loader rebuilds the exported bucket exactly as the numpy replay does."""
    pytest.importorskip("torch")
    src = tmp_path / "trl"
    write_trl_bucket(src, trajectory)
    store = str(tmp_path / "store")
    import_trl(str(src), store, anchor_every=4)
    for bucket in (src, tmp_path / "out"):
        if bucket != src:
            export_trl(store, str(bucket), index_format="gap_delta")
        by_torch, by_numpy = torch_replay(bucket)[0], numpy_replay(bucket)[0]
        assert sorted(by_torch) == sorted(by_numpy) == list(range(STEPS + 1))
        for step in by_numpy:
            assert_same_bits(by_torch[step], by_numpy[step])
            assert_same_bits(by_numpy[step], trajectory[step])


def _st(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    return {k: v["dtype"] for k, v in header.items()}, meta


def test_malformed_trl_buckets_are_clear_errors(trajectory, tmp_path):
    src = tmp_path / "bad"
    os.makedirs(src / "deltas")
    with open(src / "deltas/step_000001.safetensors", "wb") as f:
        f.write(
            st_save(
                {"w.idx": np.array([0], np.int32), "w.val": np.ones(1, BF16)},
                metadata={"format": "sparse_weight_patch"},
            )
        )
    with pytest.raises(InvalidInputError, match="no anchor precedes"):
        import_trl(str(src), str(tmp_path / "s1"))
    raw = st_save({"w.idx": np.array([1], np.uint8)}, metadata={"encoding": "nvcomp_cascaded"})
    with pytest.raises(InvalidInputError, match="nvcomp"):
        read_trl_file(raw, "deltas/step_000002.safetensors")
    raw = st_save({"w.idx": np.array([4, 2], np.int32), "w.val": np.ones(2, BF16)})
    with pytest.raises(InvalidInputError, match="ascending"):
        read_trl_file(raw, "deltas/step_000002.safetensors")
    with pytest.raises(InvalidInputError, match="safetensors"):
        read_trl_file(b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "deltas/step_000002.safetensors")
    os.makedirs(src / "anchors")
    with open(src / "anchors/step_000000.safetensors", "wb") as f:
        f.write(st_save({"w": np.ones(4, BF16)}))
    with open(src / "deltas/step_000001.safetensors", "wb") as f:
        f.write(st_save({"w.indices": np.array([4], np.int32), "w.values": np.ones(1, BF16)}))
    with pytest.raises(InvalidInputError, match="out of range"):
        import_trl(str(src), str(tmp_path / "s2"))


# -- the checked layout of the TRL branch: changed_params + checksum_sha256 ----------------


class ChecksumMismatch(Exception):
    pass


def branch_checksum(state: dict) -> str:
    """The branch's checksum, written here from its definition: SHA-256 of each tensor's raw bytes, sorted names."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(np.ascontiguousarray(state[name]).tobytes())
    return h.hexdigest()


def branch_load(root, start: int, until: int) -> tuple[dict, list]:
    """A replica as the branch's loader works: the anchor of ``start``, checked, then every delta after it up to
    ``until``, each applied to the parameters its ``changed_params`` lists (``flat[indices] = values``) and the whole
    state checked against its ``checksum_sha256``.  Returns the state and the names each delta listed."""
    tensors, meta = _read_numpy(f"{root}/anchors/step_{start:06d}.safetensors")
    state = {k: np.array(v) for k, v in tensors.items()}
    assert json.loads(meta["changed_params"]) == sorted(state)
    if branch_checksum(state) != meta["checksum_sha256"]:
        raise ChecksumMismatch(start)
    listed = []
    for step in range(start + 1, until + 1):
        tensors, meta = _read_numpy(f"{root}/deltas/step_{step:06d}.safetensors")
        names = json.loads(meta["changed_params"])
        for name in names:
            if name + ".indices" in tensors:  # the branch's own layout
                idx, vals = tensors[name + ".indices"].astype(np.int64), tensors[name + ".values"]
            else:  # its later .idx/.val layout, indices as "encoding" says
                idx, vals = tensors[name + ".idx"].astype(np.int64), tensors[name + ".val"]
                if meta.get("encoding") == "gap_delta":
                    idx = np.cumsum(idx + 1) - 1
            state[name].reshape(-1)[idx] = vals
        if branch_checksum(state) != meta["checksum_sha256"]:
            raise ChecksumMismatch(step)
        listed.append(names)
    return state, listed


@pytest.mark.parametrize("fmt", ["indices", "raw", "gap_delta"])
def test_exports_carry_changed_params_and_checksum_as_the_trl_branch_reads_them(trajectory, tmp_path, fmt):
    store = str(tmp_path / "store")
    import ulstore

    traj = ulstore.open(store, mode="w", anchor_every=4)
    for v, state in enumerate(trajectory):
        traj.commit(v, state)
    dest = tmp_path / "out"
    export_trl(store, str(dest), index_format=fmt)
    # a replica in step from the first anchor, and a late one from the anchor of step 4
    for start in (0, 4):
        state, listed = branch_load(dest, start, STEPS)
        assert_same_bits(state, trajectory[STEPS])
        for names, step in zip(listed, range(start + 1, STEPS + 1)):
            changed = [
                k
                for k in sorted(trajectory[step])
                if (flat_bits(trajectory[step][k]) != flat_bits(trajectory[step - 1][k])).any()
            ]
            assert names == changed
    for step in range(STEPS + 1):  # every file's checksum is that of the exact state of its step
        key = f"deltas/step_{step:06d}.safetensors" if step else "anchors/step_000000.safetensors"
        assert _st(dest / key)[1]["checksum_sha256"] == branch_checksum(trajectory[step])
    # the check can fail: one value of one delta changed, and the loader refuses that step
    path = dest / "deltas/step_000006.safetensors"
    raw = bytearray(open(path, "rb").read())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    values = next(v for k, v in header.items() if k.endswith((".val", ".values")))
    raw[8 + n + values["data_offsets"][0]] ^= 0x01  # (a low mantissa bit of one value)
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ChecksumMismatch, match="6"):
        branch_load(dest, 4, STEPS)
