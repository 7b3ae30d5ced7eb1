"""Tests for ulstore.io: checkpoint file -> trajectory step -> checkpoint file, byte for byte."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from ulstore import io as uio
from ulstore.errors import (
    DtypeError,
    InvalidInputError,
    NotFoundError,
    StepExistsError,
    StepNotFoundError,
)
from ulstore.io import _export
from ulstore.io import _safetensors as _st_files
from ulstore.io import checkpoints as ckpt


def rand(dtype, shape, seed=0):
    """Random raw bits (NaN payloads, -0, subnormals): only an exact path reproduces them."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    n = int(np.prod(shape))
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).reshape(shape).copy()


def mixed_state(seed=0):
    """Every dtype the issue names, a 0-d and zero-size tensors, in a non-sorted order."""
    return {
        "z.layer.weight": rand(ml_dtypes.bfloat16, (8, 6), seed),
        "a.half": rand(np.float16, (5, 3), seed + 1),
        "m.float": rand(np.float32, (4, 4), seed + 2),
        "ids": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
        "count": np.array(7, dtype=np.int32),
        "mask": rand(np.bool_, (3, 2), seed),
        "bytes": rand(np.uint8, (5,), seed),
        "empty": np.zeros((0, 4), ml_dtypes.bfloat16),
        "empty_int": np.zeros((0,), np.int64),
        "fp8": rand(ml_dtypes.float8_e4m3fn, (2, 3), seed),
        "scalar": np.array(1.5, np.float32),
    }


def assert_exact(got: dict, want: dict, order=True):
    if order:
        assert list(got) == list(want)
    assert set(got) == set(want)
    for name, w in want.items():
        assert_bits_equal(got[name], w, name)


def tensor_bytes(path) -> dict[str, bytes]:
    """name -> (dtype code, shape, raw data bytes) read straight from a safetensors file."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in header.items()}


def file_metadata(path) -> dict:
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]).get("__metadata__", {})


@pytest.fixture
def traj(tmp_path):
    return ulstore.open(tmp_path / "traj", mode="w", chunk_bytes=64)


def objects(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# -------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_is_byte_exact(tmp_path, traj):
    state = mixed_state()
    src = tmp_path / "step_000010.safetensors"
    ckpt.save_safetensors(state, src, {"format": "pt", "note": "ünïcode"})
    assert uio.import_checkpoint(traj, src) == 10
    out = tmp_path / "out.safetensors"
    result = uio.export_checkpoint(traj, 10, out)
    assert result["format"] == "safetensors" and result["files"] == [str(out)]
    assert tensor_bytes(out) == tensor_bytes(src)
    assert file_metadata(out) == {"format": "pt", "note": "ünïcode"}
    # in memory, in the file's order, through a fresh read-only handle
    again = ulstore.open(tmp_path / "traj", mode="r")
    assert_exact(uio.to_numpy(again, 10), ckpt.load(src).tensors)


def test_delta_steps_round_trip(tmp_path, traj):
    """Later steps are delta-coded against earlier ones: still exact."""
    base = mixed_state(0)
    for i, step in enumerate((100, 200, 300)):
        state = {k: v.copy() for k, v in base.items()}
        state["z.layer.weight"] = rand(ml_dtypes.bfloat16, (8, 6), 10 + i)
        state["m.float"][0, :2] += np.float32(i)
        ckpt.save_safetensors(state, tmp_path / f"step_{step:06d}.safetensors")
        uio.import_checkpoint(traj, tmp_path / f"step_{step:06d}.safetensors")
    assert traj.info(300).parent == 200
    for step in (100, 200, 300):
        out = tmp_path / f"out{step}.safetensors"
        uio.export_checkpoint(traj, step, out)
        assert tensor_bytes(out) == tensor_bytes(tmp_path / f"step_{step:06d}.safetensors")


# ------------------------------------------------------------------------ sharded


def test_sharded_round_trip(tmp_path, traj):
    state = {f"model.layers.{i}.weight": rand(ml_dtypes.bfloat16, (16, 16), i) for i in range(5)}
    state["model.embed.weight"] = rand(np.float16, (32, 8), 9)
    state["model.position_ids"] = np.arange(16, dtype=np.int64)
    state["model.empty"] = np.zeros((0, 16), np.float32)
    state["model.scale"] = np.array(0.5, np.float32)
    src = tmp_path / "checkpoint-1200"
    ckpt.save_safetensors(state, src, {"format": "pt"}, max_shard_size=1200)
    n_shards = len(list(src.glob("model-*.safetensors")))
    assert n_shards >= 3
    assert uio.import_checkpoint(traj, src) == 1200
    meta = traj.info(1200).metadata["checkpoint"]
    assert meta["format"] == "sharded" and meta["source"] == "checkpoint-1200"

    out = tmp_path / "export" / "checkpoint-1200"
    result = uio.export_checkpoint(traj, 1200, out)
    assert result["format"] == "sharded"
    # shards as the source was sharded, same index, same tensor bytes, same file metadata
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    assert json.loads((out / "model.safetensors.index.json").read_text()) == json.loads(
        (src / "model.safetensors.index.json").read_text()
    )
    for shard in src.glob("model-*.safetensors"):
        assert tensor_bytes(out / shard.name) == tensor_bytes(shard)
        assert file_metadata(out / shard.name) == {"format": "pt"}


def test_sharded_import_by_index_and_reshard(tmp_path, traj):
    state = {f"w{i}": rand(np.float32, (10, 10), i) for i in range(4)}
    src = tmp_path / "ckpt" / "step-7"
    ckpt.save_safetensors(state, src, max_shard_size=800)
    uio.import_checkpoint(traj, src / "model.safetensors.index.json")
    assert 7 in traj
    # one file from a sharded import, and a re-shard with another limit
    single = tmp_path / "one.safetensors"
    uio.export_checkpoint(traj, 7, single)
    assert set(tensor_bytes(single)) == set(state)
    assert "total_size" not in file_metadata(single)
    resharded = tmp_path / "two"
    uio.export_checkpoint(traj, 7, resharded, max_shard_size=1000)
    assert len(list(resharded.glob("model-*.safetensors"))) == 2
    assert_exact(ckpt.load(resharded).tensors, state)


def test_directory_export_of_unsharded_step_writes_model_safetensors(tmp_path, traj):
    traj.commit(3, {"w": np.ones((2, 2), np.float32)})
    out = tmp_path / "hf"
    uio.export_checkpoint(traj, 3, out)
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert_exact(ckpt.load(out).tensors, {"w": np.ones((2, 2), np.float32)})


# -------------------------------------------------------------------------- torch


def torch_state(torch):
    emb = torch.randn(10, 4).to(torch.bfloat16)
    return {
        "embed.weight": emb,
        "block.weight": torch.randn(4, 4, dtype=torch.float16),
        "block.bias": torch.randn(4),
        "lm_head.weight": emb,  # tied: the very same tensor
        "bn.num_batches_tracked": torch.tensor(12, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "ids": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }


def test_torch_round_trip_keeps_tied_storage(tmp_path, traj):
    torch = pytest.importorskip("torch")
    sd = torch_state(torch)
    src = tmp_path / "step_5.pt"
    torch.save(sd, src)
    assert uio.import_checkpoint(traj, src) == 5
    assert traj.info(5).metadata["checkpoint"]["aliases"] == {"lm_head.weight": "embed.weight"}
    assert "lm_head.weight" not in traj.tensors(5)  # stored once

    out = tmp_path / "out.pt"
    uio.export_checkpoint(traj, 5, out)
    back = torch.load(out, weights_only=True)
    assert list(back) == list(sd)
    for k, v in sd.items():
        assert_bits_equal(back[k], v, k)
    assert back["lm_head.weight"].data_ptr() == back["embed.weight"].data_ptr()

    mem = uio.to_torch(traj, 5)
    assert mem["lm_head.weight"] is mem["embed.weight"]
    assert mem["embed.weight"].dtype == torch.bfloat16


def test_torch_state_exports_to_safetensors_with_alias_copies(tmp_path, traj):
    torch = pytest.importorskip("torch")
    sd = torch_state(torch)
    torch.save(sd, tmp_path / "ckpt_1.bin")
    uio.import_checkpoint(traj, tmp_path / "ckpt_1.bin")
    out = tmp_path / "m.safetensors"
    uio.export_checkpoint(traj, 1, out)
    got = tensor_bytes(out)
    assert set(got) == set(sd)
    assert got["lm_head.weight"] == got["embed.weight"]
    arrays = uio.to_numpy(traj, 1)
    assert arrays["lm_head.weight"] is arrays["embed.weight"]


# ---------------------------------------------------------------------------- npz


def test_npz_round_trip(tmp_path, traj):
    state = mixed_state(3)
    src = tmp_path / "iter_40.npz"
    ckpt.save_npz(state, src)
    assert uio.import_checkpoint(traj, src) == 40
    out = tmp_path / "out.npz"
    uio.export_checkpoint(traj, 40, out)
    assert_exact(ckpt.load(out).tensors, state)
    with np.load(out) as raw:  # bf16 as raw bits, exactly as the source file holds them
        with np.load(src) as want:
            assert raw.files == want.files
            for k in want.files:
                assert_bits_equal(raw[k], want[k], k)


def test_cross_format_exports(tmp_path, traj):
    state = mixed_state(5)
    ckpt.save_safetensors(state, tmp_path / "step_2.safetensors")
    uio.import_checkpoint(traj, tmp_path / "step_2.safetensors")
    uio.export_checkpoint(traj, 2, tmp_path / "x.npz")
    assert_exact(ckpt.load(tmp_path / "x.npz").tensors, ckpt.load(tmp_path / "step_2.safetensors").tensors)
    torch = pytest.importorskip("torch")
    uio.export_checkpoint(traj, 2, tmp_path / "x.pt")
    back = ckpt.load(tmp_path / "x.pt").tensors
    assert_exact(back, ckpt.load(tmp_path / "step_2.safetensors").tensors)
    assert torch.load(tmp_path / "x.pt", weights_only=True)["z.layer.weight"].dtype == torch.bfloat16


def test_directly_committed_steps_export_too(tmp_path, traj):
    traj.commit(0, {"b": np.ones(2, np.float32), "a": np.zeros(3, ml_dtypes.bfloat16)}, metadata={"loss": 1.0})
    ck = uio.read_checkpoint(traj, 0)
    assert list(ck.tensors) == ["a", "b"] and ck.metadata == {} and ck.aliases == {}
    uio.export_checkpoint(traj, "main", tmp_path / "m.safetensors")
    assert file_metadata(tmp_path / "m.safetensors") == {}


# ---------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "path, step",
    [
        ("step_001200.safetensors", 1200),
        ("runs/a/step-7.pt", 7),
        ("out/checkpoint-1200", 1200),
        ("out/checkpoint-1200/", 1200),
        ("out/checkpoint-1200/model.safetensors", 1200),
        ("out/checkpoint-1200/model.safetensors.index.json", 1200),
        ("out/checkpoint-1200/pytorch_model.bin", 1200),
        ("global_step500/consolidated.pt", 500),
        ("llama3-8b-ckpt3000.npz", 3000),
        ("model_40.npz", 40),
        ("epoch3-step900.safetensors", 900),
        ("model.safetensors", None),
        ("llama3-8b.safetensors", None),
    ],
)
def test_step_from_path(path, step):
    assert uio.step_from_path(path) == step


@pytest.mark.parametrize(
    "out, fmt",
    [
        ("m.safetensors", "safetensors"),
        ("m.pt", "torch"),
        ("m.PTH", "torch"),
        ("pytorch_model.bin", "torch"),
        ("m.npz", "npz"),
        ("dir/", "sharded"),
        ("checkpoint-5", "sharded"),
    ],
)
def test_output_format(out, fmt):
    assert uio.output_format(out) == fmt


def test_output_format_errors():
    with pytest.raises(InvalidInputError, match="suffix"):
        uio.output_format("m.h5")
    with pytest.raises(InvalidInputError, match="directory"):
        uio.output_format("m.safetensors", max_shard_size="1GB")
    with pytest.raises(InvalidInputError, match="unknown export format"):
        uio.output_format("x", format="onnx")


# --------------------------------------------------------------------- bad input


def write_raw_safetensors(path, header: dict, data: bytes):
    h = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + data)


def bad_files(tmp_path) -> dict[str, Path]:
    good = tmp_path / "good.safetensors"
    ckpt.save_safetensors({"w": np.ones((4, 4), np.float32)}, good)
    raw = good.read_bytes()
    out = {}
    out["truncated"] = tmp_path / "step_1.safetensors"
    out["truncated"].write_bytes(raw[: len(raw) - 10])
    out["short"] = tmp_path / "step_2.safetensors"
    out["short"].write_bytes(raw[:5])
    out["malformed"] = tmp_path / "step_3.safetensors"
    out["malformed"].write_bytes(struct.pack("<Q", 9) + b"{not json")
    out["dtype"] = tmp_path / "step_4.safetensors"
    write_raw_safetensors(out["dtype"], {"w": {"dtype": "F7", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0")
    out["npz"] = tmp_path / "step_5.npz"
    out["npz"].write_bytes(b"PK\x03\x04 not a zip")
    out["npz member"] = tmp_path / "step_6.npz"  # a zip whose member named *.npy holds other bytes
    with zipfile.ZipFile(out["npz member"], "w") as z:
        with z.open("w.npy", "w") as f:
            np.lib.format.write_array(f, np.ones(2, np.float32))
        z.writestr("b.npy", b"not npy data")
    return out


@pytest.mark.parametrize(
    "kind, match",
    [
        ("truncated", "truncated"),
        ("short", "shorter than"),
        ("malformed", "not valid JSON"),
        ("dtype", "unknown dtype 'F7'"),
        ("npz", "cannot read"),
        ("npz member", "member 'b.npy' is not npy data"),
    ],
)
def test_bad_files_leave_nothing(tmp_path, kind, match):
    root = tmp_path / "traj"
    traj = ulstore.open(root, mode="w")
    traj.commit(0, {"w": np.ones((4, 4), np.float32)})
    before = objects(root)
    with pytest.raises(InvalidInputError, match=match) as e:
        uio.import_checkpoint(traj, bad_files(tmp_path)[kind])
    assert "\n" not in str(e.value)
    assert objects(root) == before
    assert traj.steps == [0]


def test_missing_file_and_unknown_format(tmp_path, traj):
    with pytest.raises(NotFoundError, match="no such checkpoint"):
        uio.import_checkpoint(traj, tmp_path / "step_1.safetensors")
    (tmp_path / "step_1.h5").write_bytes(b"x")
    with pytest.raises(InvalidInputError, match="cannot tell the checkpoint format"):
        uio.import_checkpoint(traj, tmp_path / "step_1.h5")
    ckpt.save_safetensors({"w": np.ones(2, np.float32)}, tmp_path / "final.safetensors")
    with pytest.raises(InvalidInputError, match="cannot tell the step"):
        uio.import_checkpoint(traj, tmp_path / "final.safetensors")
    assert traj.steps == []


def test_existing_step_is_refused_before_reading(tmp_path, traj, monkeypatch):
    ckpt.save_safetensors({"w": np.ones(2, np.float32)}, tmp_path / "step_3.safetensors")
    uio.import_checkpoint(traj, tmp_path / "step_3.safetensors")
    before = objects(tmp_path / "traj")
    monkeypatch.setattr(ckpt, "load", lambda p: pytest.fail("the file must not be read"))
    with pytest.raises(StepExistsError):
        uio.import_checkpoint(traj, tmp_path / "step_3.safetensors")
    assert objects(tmp_path / "traj") == before


def test_unsupported_dtype_and_reserved_metadata(tmp_path, traj):
    torch = pytest.importorskip("torch")
    torch.save({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "step_1.pt")  # complex64 is stored
    with pytest.raises(DtypeError):
        uio.import_checkpoint(traj, tmp_path / "step_1.pt")
    ckpt.save_npz({"w": np.ones(2, np.float32)}, tmp_path / "step_2.npz")
    with pytest.raises(InvalidInputError, match="reserved"):
        uio.import_checkpoint(traj, tmp_path / "step_2.npz", metadata={"checkpoint": 1})
    assert traj.steps == []


def test_export_refuses_to_overwrite_and_missing_steps(tmp_path, traj):
    traj.commit(1, {"w": np.ones(2, np.float32)})
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(InvalidInputError, match="already exists"):
        uio.export_checkpoint(traj, 1, out)
    assert out.read_bytes() == b"keep me"
    uio.export_checkpoint(traj, 1, out, overwrite=True)
    assert set(tensor_bytes(out)) == {"w"}
    with pytest.raises(StepNotFoundError):
        uio.export_checkpoint(traj, 2, tmp_path / "n.safetensors")
    assert not (tmp_path / "n.safetensors").exists()


def test_failed_sharded_export_leaves_nothing(tmp_path, traj, monkeypatch):
    traj.commit(1, {f"w{i}": np.full(100, i, np.float32) for i in range(4)})
    real = _st_files._write_safetensors_file
    calls = []

    def flaky(arrays, path, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise InvalidInputError("disk full (simulated)")
        return real(arrays, path, metadata)

    monkeypatch.setattr(_st_files, "_write_safetensors_file", flaky)
    with pytest.raises(InvalidInputError, match="simulated"):
        uio.export_checkpoint(traj, 1, tmp_path / "out", max_shard_size=800)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traj"]
    # an existing export survives a failed overwrite
    monkeypatch.setattr(_st_files, "_write_safetensors_file", real)
    uio.export_checkpoint(traj, 1, tmp_path / "out", max_shard_size=800)
    before = objects(tmp_path / "out")
    calls.clear()
    monkeypatch.setattr(_st_files, "_write_safetensors_file", flaky)
    with pytest.raises(InvalidInputError):
        uio.export_checkpoint(traj, 1, tmp_path / "out", max_shard_size=800, overwrite=True)
    assert objects(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "traj"]


# ----------------------------------------------------------------------- reports


def test_storage_report_adds_up(tmp_path):
    from ulstore import toytrain

    traj = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=4096)
    states = toytrain.trajectory("finetune", 4, preset="tiny", warmup_steps=5)
    for i, st in enumerate(states):
        traj.commit(i, st)
    report = uio.storage_report(traj)
    stats = traj.stats()
    total = report["total"]
    assert total["steps"] == 5 == len(report["steps"])
    assert total["stored_bytes"] == stats["stored_bytes"]
    assert total["raw_bytes"] == stats["raw_bytes"]
    assert total["unreferenced_bytes"] == 0
    assert sum(r["stored_bytes"] for r in report["tensors"]) == stats["blob_bytes"]
    assert report["steps"][0]["parent"] is None and report["steps"][1]["parent"] == 0
    # the anchor step costs the most; deltas cost fewer bits per weight than bf16's 16
    assert report["steps"][0]["stored_bytes"] > report["steps"][1]["stored_bytes"]
    assert all(r["bits_per_weight"] < 16 for r in report["steps"][1:])
    traj.delete(2)
    assert uio.storage_report(traj)["total"]["unreferenced_bytes"] > 0


def _save_in_bands(traj, step: int, state: dict, cuts: list[int]) -> None:
    """Commit ``state`` as several writers would, each holding one row band of every tensor."""
    records = []
    for a, b in zip([0, *cuts], [*cuts, None]):
        w = traj.piece_writer(step)
        for name, v in state.items():
            w.write(name, np.ascontiguousarray(v[a:b]), offset=(a, 0), shape=v.shape)
        records += w.close()
    traj.finalize(step, records)


def test_storage_report_counts_chunks_coded_against_another_sharding(tmp_path):
    rng = np.random.default_rng(0)
    states = [{"w": rng.standard_normal((24, 8)).astype(np.float32)}]
    for _ in range(3):
        states.append({"w": states[-1]["w"] + np.float32(1e-3) * rng.standard_normal((24, 8), dtype=np.float32)})
    # 4 rows of 8 floats per chunk; a fixed count keeps every step a delta (every element changes each step)
    traj = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=128, anchor_every=16)
    _save_in_bands(traj, 0, states[0], [12])  # two ranks
    _save_in_bands(traj, 1, states[1], [12])  # the same two bands: co-located references
    _save_in_bands(traj, 2, states[2], [8, 16])  # three ranks: every band is new
    traj.commit(3, states[3])  # unsharded: one piece, also new
    rows = uio.storage_report(traj)["steps"]
    moved = [sum(1 for c in traj.changes(s) if c.kind == "delta") for s in range(4)]
    assert [r["resharded_chunks"] for r in rows] == [0, 0, moved[2], moved[3]] and moved[2] == 6 == moved[3]
    assert uio.storage_report(traj)["total"]["resharded_chunks"] == 12


def test_export_reports_progress(tmp_path, traj, monkeypatch):
    state = {f"w{i}": np.full((10, 10), i, np.float32) for i in range(5)}
    traj.commit(1, state)
    monkeypatch.setattr(_export, "_PROGRESS_BYTES", 800)  # two tensors per group
    seen = []
    uio.export_checkpoint(traj, 1, tmp_path / "m.safetensors", progress=seen.append)
    assert seen == [800, 800, 400]
    assert_exact(ckpt.load(tmp_path / "m.safetensors").tensors, state)
