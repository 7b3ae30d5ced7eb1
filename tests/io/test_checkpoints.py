"""Tests for ulstore.io.checkpoints: exact round trips and hostile inputs."""

from __future__ import annotations

import json
import struct
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import numpy as st_numpy

from tests.helpers.bits import assert_bits_equal
from ulstore.errors import DtypeError, InvalidInputError, NotFoundError
from ulstore.io import _safetensors as _st_files
from ulstore.io import checkpoints as ckpt

DTYPES = [
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype("<f2"),
    np.dtype("<f4"),
    np.dtype("<f8"),
    np.dtype("i1"),
    np.dtype("<i2"),
    np.dtype("<i4"),
    np.dtype("<i8"),
    np.dtype("u1"),
    np.dtype("?"),
]
SHAPES = [(3, 5), (), (0, 4)]


def random_array(dtype, shape, seed=0):
    """Random raw bits (NaN payloads, -0, subnormals included), exact-checkable."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    n = int(np.prod(shape))
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).reshape(shape).copy()


def all_dtypes_tensors():
    return {
        f"t{i}_{dt.name}_{len(s)}d": random_array(dt, s, seed=i)
        for i, (dt, s) in enumerate((dt, s) for dt in DTYPES for s in SHAPES)
    }


def assert_exact(got: dict, want: dict, *, in_order: bool = True):
    """``got`` holds exactly ``want``'s tensors, bit for bit, and in ``want``'s order.

    ``in_order=False`` where a file's writer chose the order: the safetensors writers lay
    tensors out by alignment, then name (the caller checks that order against the file).
    """
    if in_order:
        assert list(got) == list(want), f"tensor names or their order differ: {list(got)} != {list(want)}"
    else:
        assert sorted(got) == sorted(want), f"tensor names differ: {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        assert_bits_equal(got[name], w, name)


def test_assert_exact_fails_on_another_order_or_other_bits():
    a, b = np.zeros(2, np.float32), np.arange(3, dtype="<i2")
    assert_exact({"a": a, "b": b}, {"a": a, "b": b})
    with pytest.raises(AssertionError, match="order differ"):
        assert_exact({"b": b, "a": a}, {"a": a, "b": b})
    assert_exact({"b": b, "a": a}, {"a": a, "b": b}, in_order=False)
    with pytest.raises(AssertionError, match="names differ"):
        assert_exact({"a": a}, {"a": a, "b": b}, in_order=False)
    with pytest.raises(AssertionError, match=r"^a: 2 of 2 elements differ"):
        assert_exact({"a": -a, "b": b}, {"a": a, "b": b})  # -0.0 is not 0.0


def header_names(path) -> list[str]:
    """The tensor names of a safetensors file, in the order its header lists them."""
    return [name for name in header_of(path) if name != "__metadata__"]


def data_region(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8 + n :]


def header_of(path):
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])


def raw_safetensors(path, header, data=b"", header_len=None):
    """Write a hand-made safetensors file (header: dict or raw bytes)."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


# ------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_safetensors_roundtrip_each_dtype(tmp_path, dtype, shape):
    original = {"x": random_array(dtype, shape)}
    src = tmp_path / "src.safetensors"
    st_numpy.save_file(original, str(src))  # the reference writer makes the "original" file
    ck = ckpt.load(src)
    assert ck.tensors["x"].dtype == dtype  # bf16/fp8 come back as ml_dtypes, never uint16
    assert_exact(ck.tensors, original)
    out = tmp_path / "out.safetensors"
    ckpt.save_safetensors(ck.tensors, out, ck.metadata)
    assert data_region(out) == data_region(src)
    assert_exact(ckpt.load(out).tensors, original)


def test_safetensors_all_dtypes_one_file_with_metadata(tmp_path):
    original = all_dtypes_tensors()
    meta = {"format": "pt", "step": "1200"}
    src = tmp_path / "src.safetensors"
    st_numpy.save_file(original, str(src), metadata=meta)
    ck = ckpt.load(src)
    assert ck.metadata == meta and ck.aliases == {}
    assert_exact(ck.tensors, original, in_order=False)
    assert list(ck.tensors) == header_names(src)  # the file's order
    out = tmp_path / "out.safetensors"
    ckpt.save_safetensors(ck.tensors, out, ck.metadata)
    assert data_region(out) == data_region(src)
    # Same header up to JSON key order (the writer keeps __metadata__ in a hash map).
    assert header_of(out) == header_of(src)
    again = ckpt.load(out)
    assert again.metadata == meta
    assert_exact(again.tensors, original, in_order=False)
    assert list(again.tensors) == header_names(out) == header_names(src)


def test_safetensors_written_by_torch_bf16(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    t = torch.randn(4, 6).to(torch.bfloat16)
    f8 = torch.randn(8).to(torch.float8_e4m3fn)
    src = tmp_path / "t.safetensors"
    save_file({"w": t, "f8": f8}, str(src), metadata={"format": "pt"})
    ck = ckpt.load(src)
    assert_bits_equal(ck.tensors["w"], t, "w")
    assert_bits_equal(ck.tensors["f8"], f8, "f8")
    out = tmp_path / "o.safetensors"
    ckpt.save_safetensors(ck.tensors, out, ck.metadata)
    assert data_region(out) == data_region(src)


def test_safetensors_foreign_tensor_order(tmp_path):
    # A file whose data is not in the library's order still loads exactly.
    a = np.arange(3, dtype="<i2")
    b = np.arange(2, dtype="<f8")
    header = {
        "a": {"dtype": "I16", "shape": [3], "data_offsets": [0, 6]},
        "b": {"dtype": "F64", "shape": [2], "data_offsets": [6, 22]},
    }
    src = raw_safetensors(tmp_path / "f.safetensors", header, a.tobytes() + b.tobytes())
    ck = ckpt.load(src)
    assert_exact(ck.tensors, {"a": a, "b": b})
    out = tmp_path / "o.safetensors"
    ckpt.save_safetensors(ck.tensors, out)
    assert_exact(ckpt.load(out).tensors, {"a": a, "b": b}, in_order=False)
    assert header_names(out) == ["b", "a"]  # rewritten in the library's order: 8-byte aligned first


def test_empty_checkpoint(tmp_path):
    ckpt.save_safetensors({}, tmp_path / "e.safetensors")
    assert ckpt.load(tmp_path / "e.safetensors").tensors == {}


def test_big_endian_and_noncontiguous_input(tmp_path):
    base = random_array(np.dtype("<f4"), (4, 6))
    wants = {"be": base, "strided": base[:, ::2], "transposed": base.T, "be_i8": np.arange(5, dtype="<i8")}
    given = {
        "be": base.astype(">f4"),
        "strided": base[:, ::2],
        "transposed": base.T,
        "be_i8": np.arange(5, dtype=">i8"),
    }
    ckpt.save_safetensors(given, tmp_path / "x.safetensors")
    ckpt.save_npz(given, tmp_path / "x.npz")
    for path in (tmp_path / "x.safetensors", tmp_path / "x.npz"):
        got = ckpt.load(path).tensors
        for name, w in wants.items():
            assert_bits_equal(got[name], w.astype(w.dtype.newbyteorder("<")), f"{path.name}: {name}")


# ------------------------------------------------------------------ sharding


def test_sharded_roundtrip(tmp_path):
    original = all_dtypes_tensors()
    meta = {"format": "pt"}
    single = tmp_path / "single.safetensors"
    ckpt.save_safetensors(original, single, meta)
    d = tmp_path / "sharded"
    ckpt.save_safetensors(original, d, meta, max_shard_size=64)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in d.glob("*.safetensors"))
    n = len(files)
    assert n > 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in original.values())
    assert not list(d.glob(".*"))  # no temporary files left over
    for path in (d, d / "model.safetensors.index.json"):
        ck = ckpt.load(path)
        assert list(ck.tensors) == list(original)
        assert_exact(ck.tensors, original)
        assert ck.metadata == {"format": "pt"}  # the shards' own metadata; the index is kept as it is
        assert ck.index_text == (d / "model.safetensors.index.json").read_text()
    # Re-sharding a loaded set does not trip over its stale total_size.
    ckpt.save_safetensors(ck.tensors, tmp_path / "again", ck.metadata, max_shard_size="1KiB")
    assert_exact(ckpt.load(tmp_path / "again").tensors, original)
    assert_exact(ckpt.load(single).tensors, ckpt.load(d).tensors, in_order=False)  # (one file: its writer's order)


def test_shard_size_greedy_and_oversize(tmp_path):
    t = {"a": np.zeros(10, "u1"), "b": np.zeros(10, "u1"), "big": np.zeros(100, "u1"), "c": np.zeros(5, "u1")}
    ckpt.save_safetensors(t, tmp_path, max_shard_size="0.02kB")  # 20 bytes
    wmap = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert wmap == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00001-of-00003.safetensors",
        "big": "model-00002-of-00003.safetensors",
        "c": "model-00003-of-00003.safetensors",
    }


@pytest.mark.parametrize("size", [0, -1, "lots", True])
def test_bad_shard_size(tmp_path, size):
    with pytest.raises(InvalidInputError):
        ckpt.save_safetensors({"a": np.zeros(1)}, tmp_path, max_shard_size=size)


def test_directory_with_single_model_file(tmp_path):
    t = {"w": random_array(np.dtype(ml_dtypes.bfloat16), (3, 3))}
    ckpt.save_safetensors(t, tmp_path / "model.safetensors", {"k": "v"})
    ck = ckpt.load(tmp_path)
    assert_exact(ck.tensors, t)
    assert ck.metadata == {"k": "v"}


def test_directory_without_model(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(InvalidInputError, match="neither"):
        ckpt.load(tmp_path)


def _sharded(tmp_path, max_shard_size=16):
    t = {"a": np.arange(4, dtype="<f4"), "b": np.arange(4, dtype="<i4")}
    ckpt.save_safetensors(t, tmp_path, max_shard_size=max_shard_size)
    return tmp_path / "model.safetensors.index.json"


def test_missing_shard(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(NotFoundError, match="model-00002-of-00002.safetensors"):
        ckpt.load(tmp_path)


def test_tensor_not_where_index_says(tmp_path):
    index = _sharded(tmp_path)
    doc = json.loads(index.read_text())
    doc["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match="'b' is mapped to model-00001"):
        ckpt.load(tmp_path)


def test_index_missing_a_tensor_is_refused(tmp_path):
    index = _sharded(tmp_path, max_shard_size=1000)  # one shard holding a and b
    doc = json.loads(index.read_text())
    del doc["weight_map"]["b"]
    index.write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match="weight_map does not map"):
        ckpt.load(index)


@pytest.mark.parametrize(
    "text", ["{not json", "[]", '{"weight_map": {"a": 3}}', '{"weight_map": {"a": "../evil.safetensors"}}']
)
def test_bad_index(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(InvalidInputError, match="model.safetensors.index.json"):
        ckpt.load(tmp_path)


# ----------------------------------------------------------------------- npz


def test_npz_roundtrip_all_dtypes(tmp_path):
    original = all_dtypes_tensors()
    original["file"] = np.ones(2)  # names np.savez could not take as keywords
    original["allow_pickle"] = np.ones(2)
    p = tmp_path / "x.npz"
    ckpt.save_npz(original, p)
    ck = ckpt.load(p)
    assert_exact(ck.tensors, original)
    # The convention: raw bits in unsigned ints, plus a JSON __dtypes__ member.
    with np.load(p, allow_pickle=False) as z:
        bf = next(k for k in original if "bfloat16" in k)
        assert z[bf].dtype == np.dtype("<u2")
        assert json.loads(str(z["__dtypes__"]))[bf] == "bfloat16"
    ckpt.save_npz(ck.tensors, tmp_path / "y.npz")
    assert_exact(ckpt.load(tmp_path / "y.npz").tensors, original)


def test_plain_npz_from_numpy(tmp_path):
    t = {"a": np.arange(6.0).reshape(2, 3), "b": np.array(True)}
    np.savez_compressed(tmp_path / "p.npz", **t)
    assert_exact(ckpt.load(tmp_path / "p.npz").tensors, t)


@pytest.mark.parametrize("dtypes_member", [np.array("not json"), np.array('{"a": "float128"}'), np.arange(3)])
def test_npz_bad_dtypes_member(tmp_path, dtypes_member):
    np.savez(tmp_path / "b.npz", a=np.zeros(2, np.uint16), __dtypes__=dtypes_member)
    with pytest.raises(InvalidInputError, match="b.npz"):
        ckpt.load(tmp_path / "b.npz")


def test_npz_dtypes_member_mismatch(tmp_path):
    np.savez(tmp_path / "b.npz", a=np.zeros(2, np.float32), __dtypes__=np.array('{"a": "bfloat16"}'))
    with pytest.raises(InvalidInputError, match="needs uint16"):
        ckpt.load(tmp_path / "b.npz")


def test_npz_unsupported_dtype_and_garbage(tmp_path):
    np.savez(tmp_path / "c.npz", a=np.zeros(2, np.complex128))  # (complex64 is C64 now)
    with pytest.raises(DtypeError, match="c.npz"):
        ckpt.load(tmp_path / "c.npz")
    (tmp_path / "g.npz").write_bytes(b"PK\x03\x04 garbage")
    with pytest.raises(InvalidInputError, match="g.npz"):
        ckpt.load(tmp_path / "g.npz")


# --------------------------------------------------------------------- torch


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_roundtrip_all_dtypes(tmp_path, shape):
    torch = pytest.importorskip("torch")
    original = {dt.name: random_array(dt, shape, seed=i) for i, dt in enumerate(DTYPES)}
    p = tmp_path / "sd.pt"
    ckpt.save_torch(original, p)
    sd = torch.load(p, weights_only=True)
    assert sd["bfloat16"].dtype == torch.bfloat16 and sd["float8_e5m2"].dtype == torch.float8_e5m2
    ck = ckpt.load(p)
    assert_exact(ck.tensors, original)
    ckpt.save_torch(ck.tensors, tmp_path / "again.bin")
    assert_exact(ckpt.load(tmp_path / "again.bin").tensors, original)


def test_torch_native_state_dict(tmp_path):
    torch = pytest.importorskip("torch")
    emb = torch.randn(5, 4).to(torch.bfloat16)
    sd = {
        "embed_tokens.weight": emb,
        "norm": torch.randn(4, 3).t(),  # non-contiguous
        "lm_head.weight": emb,
        "step": torch.tensor(7),
        "empty": torch.zeros(0, 3),
        "empty2": torch.zeros(0, 3),
        "half_view": torch.arange(10.0)[5:],
    }
    p = tmp_path / "m.pt"
    torch.save(sd, p)
    ck = ckpt.load(p)
    assert ck.aliases == {"lm_head.weight": "embed_tokens.weight"}  # tied; empties never tied
    assert list(ck.tensors) == ["embed_tokens.weight", "norm", "step", "empty", "empty2", "half_view"]
    assert_bits_equal(ck.tensors["embed_tokens.weight"], emb, "embed_tokens.weight")
    assert_bits_equal(ck.tensors["norm"], sd["norm"], "norm")
    assert ck.tensors["norm"].flags.c_contiguous and ck.tensors["step"].shape == ()
    assert_bits_equal(ck.tensors["half_view"], np.arange(5.0, 10.0, dtype=np.float32), "half_view")

    out = tmp_path / "out.pt"
    ckpt.save_torch(ck.tensors, out, aliases=ck.aliases)
    back = torch.load(out, weights_only=True)
    assert back["lm_head.weight"].data_ptr() == back["embed_tokens.weight"].data_ptr()  # sharing restored
    for name, t in sd.items():
        assert_bits_equal(back[name], t, name)
    assert ckpt.load(out).aliases == ck.aliases


def test_to_torch_alias_keeps_position_and_checks(tmp_path):
    pytest.importorskip("torch")
    w = np.ones(3, np.float32)
    sd = ckpt.to_torch({"a": w, "b": w.copy(), "c": w}, aliases={"b": "a"})
    assert list(sd) == ["a", "b", "c"] and sd["b"] is sd["a"]
    with pytest.raises(InvalidInputError, match="differs"):
        ckpt.to_torch({"a": w, "b": w * 2}, aliases={"b": "a"})
    with pytest.raises(InvalidInputError, match="not a tensor of its own"):
        ckpt.to_torch({"a": w}, aliases={"b": "zzz"})
    ro = np.frombuffer(w.tobytes(), np.float32)  # read-only buffer: copied, not shared
    assert ckpt.to_torch({"r": ro})["r"].tolist() == [1.0, 1.0, 1.0]


def test_torch_non_state_dict(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save([torch.zeros(2)], tmp_path / "l.pt")
    with pytest.raises(InvalidInputError, match="l.pt.*not a state dict"):
        ckpt.load(tmp_path / "l.pt")
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3}, tmp_path / "n.pt")
    with pytest.raises(InvalidInputError, match="n.pt.*not a tensor"):
        ckpt.load(tmp_path / "n.pt")
    (tmp_path / "junk.bin").write_bytes(b"\x00garbage")
    with pytest.raises(InvalidInputError, match="junk.bin"):
        ckpt.load(tmp_path / "junk.bin")


def test_torch_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    (tmp_path / "m.pt").write_bytes(b"x")
    with pytest.raises(InvalidInputError, match=r"pip install .*\[torch\]"):  # (the command for this install)
        ckpt.load(tmp_path / "m.pt")


# ------------------------------------------------------------------ bad input


def _one_line(excinfo, name):
    msg = str(excinfo.value)
    assert name in msg and "\n" not in msg, msg


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p.write_bytes(b"\x05\x00\x00"), "shorter than the 8-byte"),
        (lambda p: raw_safetensors(p, GOOD, bytes(8), header_len=10**6), "runs past the end"),
        (lambda p: raw_safetensors(p, b'{"a": {"dtype": "F32",', bytes(8)), "not valid JSON"),
        (lambda p: raw_safetensors(p, b"\xff\xfe{}"), "not valid JSON"),
        (lambda p: raw_safetensors(p, b"[1, 2]"), "not an object"),
        (lambda p: raw_safetensors(p, GOOD, bytes(5)), "truncated"),
        (lambda p: raw_safetensors(p, GOOD, bytes(9)), "belong to no tensor"),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
            "unknown dtype 'F31'",
        ),
        (
            lambda p: raw_safetensors(
                p,
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                bytes(8),
            ),
            "overlap",
        ),
        (lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "hole"),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
            "needs 12",
        ),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8)),
            "begin <= end",
        ),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)),
            "non-negative",
        ),
        (lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [2]}}, bytes(8)), "exactly dtype"),
        (lambda p: raw_safetensors(p, {**GOOD, "__metadata__": {"k": 1}}, bytes(8)), "__metadata__"),
        (
            lambda p: raw_safetensors(
                p,
                b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
                b' "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
                bytes(8),
            ),
            "duplicate key",
        ),
    ],
    ids=[
        "tiny",
        "header_len",
        "json",
        "utf8",
        "not_object",
        "truncated",
        "trailing",
        "dtype",
        "overlap",
        "hole",
        "size_mismatch",
        "reversed",
        "negative_dim",
        "missing_field",
        "metadata",
        "duplicate",
    ],
)
def test_bad_safetensors(tmp_path, make, match):
    p = tmp_path / "bad.safetensors"
    make(p)
    with pytest.raises(InvalidInputError, match=match) as ei:
        ckpt.load(p)
    _one_line(ei, "bad.safetensors")


def test_real_file_truncated(tmp_path):
    p = tmp_path / "t.safetensors"
    ckpt.save_safetensors(all_dtypes_tensors(), p)
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(InvalidInputError, match="truncated"):
        ckpt.load(p)


@pytest.mark.parametrize("name", ["nope.safetensors", "nope.pt", "nope.npz", "nope.safetensors.index.json"])
def test_missing_file(tmp_path, name):
    with pytest.raises(NotFoundError, match="nope"):
        ckpt.load(tmp_path / name)
    with pytest.raises(FileNotFoundError):  # NotFoundError is one, for plain callers
        ckpt.load(tmp_path / name)


def test_unknown_suffix(tmp_path):
    (tmp_path / "w.h5").write_bytes(b"x")
    with pytest.raises(InvalidInputError, match="w.h5"):
        ckpt.load(tmp_path / "w.h5")


def test_save_rejects_bad_input(tmp_path):
    p = tmp_path / "x.safetensors"
    with pytest.raises(DtypeError):
        ckpt.save_safetensors({"c": np.zeros(2, np.complex128)}, p)  # safetensors has no C128
    with pytest.raises(DtypeError):
        ckpt.save_npz({"o": np.array([None])}, tmp_path / "x.npz")
    with pytest.raises(InvalidInputError, match="reserved"):
        ckpt.save_safetensors({"__metadata__": np.zeros(1)}, p)
    with pytest.raises(InvalidInputError, match="reserved"):
        ckpt.save_npz({"__dtypes__": np.zeros(1)}, tmp_path / "x.npz")
    with pytest.raises(InvalidInputError, match="metadata"):
        ckpt.save_safetensors({"a": np.zeros(1)}, p, {"step": 3})
    with pytest.raises(InvalidInputError, match="not a numpy array"):
        ckpt.save_safetensors({"a": [1, 2]}, p)
    with pytest.raises(InvalidInputError, match="directory"):
        ckpt.save_safetensors({"a": np.zeros(1)}, tmp_path)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(InvalidInputError, match="is a file"):
        ckpt.save_safetensors({"a": np.zeros(1)}, tmp_path / "f", max_shard_size=10)
    (tmp_path / "f").unlink()
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------- atomic


def _crash_mid_write(arrays, path, metadata):
    with open(path, "wb") as f:
        f.write(b'\x10\x00\x00\x00\x00\x00\x00\x00{"half')
    raise OSError("disk full")


def test_atomic_write_leaves_nothing_on_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(_st_files, "_write_safetensors_file", _crash_mid_write)
    p = tmp_path / "m.safetensors"
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_safetensors({"a": np.zeros(4)}, p)
    assert list(tmp_path.iterdir()) == []  # neither the final name nor a temp file


def test_atomic_write_keeps_old_file_on_crash(tmp_path, monkeypatch):
    p = tmp_path / "m.safetensors"
    ckpt.save_safetensors({"old": np.arange(3.0)}, p)
    before = p.read_bytes()
    monkeypatch.setattr(_st_files, "_write_safetensors_file", _crash_mid_write)
    with pytest.raises(OSError):
        ckpt.save_safetensors({"new": np.zeros(4)}, p)
    assert p.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir()] == ["m.safetensors"]


def test_atomic_sharded_crash_writes_no_index(tmp_path, monkeypatch):
    calls = []

    def second_shard_fails(arrays, path, metadata):
        calls.append(path)
        if len(calls) == 2:
            _crash_mid_write(arrays, path, metadata)
        st_numpy.save_file(arrays, path)

    monkeypatch.setattr(_st_files, "_write_safetensors_file", second_shard_fails)
    with pytest.raises(OSError):
        ckpt.save_safetensors({"a": np.zeros(4), "b": np.zeros(4)}, tmp_path / "d", max_shard_size=32)
    assert sorted(x.name for x in (tmp_path / "d").iterdir()) == ["model-00001-of-00002.safetensors"]


def test_atomic_torch(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")

    def half_save(obj, f):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04half")
        raise OSError("boom")

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(OSError):
        ckpt.save_torch({"a": np.zeros(3)}, tmp_path / "a.pt")
    assert list(tmp_path.iterdir()) == []


def test_atomic_npz(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("boom")

    monkeypatch.setattr(np.lib.format, "write_array", boom)
    with pytest.raises(OSError):
        ckpt.save_npz({"a": np.zeros(3)}, tmp_path / "a.npz")
    assert list(tmp_path.iterdir()) == []


def test_written_files_get_umask_permissions(tmp_path):
    """Saved checkpoints get the same permissions as any file the user creates (not 0600)."""
    import os
    import stat

    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    expected = stat.S_IMODE(os.stat(plain).st_mode)
    arrays = {"w": np.arange(6, dtype=np.float32)}
    ckpt.save_safetensors(arrays, tmp_path / "one.safetensors")
    ckpt.save_safetensors(arrays, tmp_path / "sharded", max_shard_size=8)
    ckpt.save_npz(arrays, tmp_path / "a.npz")
    written = [tmp_path / "one.safetensors", tmp_path / "a.npz", *sorted((tmp_path / "sharded").iterdir())]
    for f in written:
        assert stat.S_IMODE(os.stat(f).st_mode) == expected, f
