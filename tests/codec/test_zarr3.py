"""ULPack as a zarr v3 serializer (ulstore.codec.zarr3): plain zarr arrays, every float dtype, bit for bit."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr

from tests.helpers.bits import FLOAT_FORMATS, awkward_floats, bits_of
from ulstore.codec import decode, encode
from ulstore.codec.zarr3 import ULPack
from ulstore.errors import CorruptBlobError

ZARR_NAMES = {"bfloat16": "bfloat16", "float8_e5m2": "float8_e5m2", "float8_e4m3fn": "ulstore.float8_e4m3fn"}


def sample(name: str, shape=(13, 7, 5)) -> np.ndarray:
    """Awkward bit patterns first (NaN payloads, -0.0, subnormals, infinities), then random ones."""
    dtype = FLOAT_FORMATS[name][0]
    n = int(np.prod(shape))
    awkward = awkward_floats(dtype, n_random=n)  # fp8 has fewer distinct patterns than n: repeat them
    return np.resize(awkward, n).reshape(shape)


def write(path, x: np.ndarray, chunks=(4, 7, 3), **kw):
    a = zarr.create_array(
        store=str(path),
        shape=x.shape,
        chunks=chunks,
        dtype=x.dtype,
        serializer=ULPack(),
        compressors=None,
        config={"write_empty_chunks": True},
        **kw,
    )
    a[...] = x
    return a


@pytest.mark.parametrize("name", sorted(FLOAT_FORMATS))
def test_every_ulpack_dtype_round_trips_bit_exact(tmp_path, name):
    x = sample(name)
    write(tmp_path / "a.zarr", x)
    meta = json.loads((tmp_path / "a.zarr" / "zarr.json").read_text())
    assert meta["codecs"] == [{"name": "ulpack", "configuration": {"econd": True}}]
    assert meta["data_type"] == ZARR_NAMES.get(name, name)
    back = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    got = back[...]
    assert got.dtype == x.dtype and np.array_equal(bits_of(got), bits_of(x))
    # a slice across chunk edges
    assert np.array_equal(bits_of(back[3:11, 2:6, 1:4]), bits_of(x[3:11, 2:6, 1:4]))
    # each chunk on storage is one intra ULPack blob of that chunk's values (edge chunks padded by zarr)
    blob = (tmp_path / "a.zarr" / "c" / "0" / "0" / "0").read_bytes()
    assert np.array_equal(bits_of(decode(blob)), bits_of(x[:4, :7, :3]))


def test_other_dtypes_are_refused_when_the_array_is_created(tmp_path):
    with pytest.raises(ValueError, match="ulpack codec codes float16, bfloat16"):
        zarr.create_array(store={}, shape=(4,), dtype=np.int32, serializer=ULPack(), compressors=None)


def test_config_json_round_trip_and_pickle():
    codec = ULPack(econd=False)
    assert codec.to_dict() == {"name": "ulpack", "configuration": {"econd": False}}
    assert ULPack.from_dict(codec.to_dict()) == codec
    assert ULPack.from_dict({"name": "ulpack"}) == ULPack()
    assert pickle.loads(pickle.dumps(codec)) == codec
    with pytest.raises(ValueError, match="unknown ulpack codec configuration"):
        ULPack.from_dict({"name": "ulpack", "configuration": {"level": 3}})
    with pytest.raises(TypeError):
        ULPack(econd="yes")


def test_registered_through_the_zarr_codecs_entry_point():
    """The installed package names the codec in zarr's entry-point group, so zarr finds it without ulstore."""
    (ep,) = [e for e in entry_points(group="zarr.codecs") if e.name == "ulpack"]
    assert ep.value == "ulstore.codec.zarr3:ULPack" and ep.load() is ULPack
    assert zarr.registry.get_codec_class("ulpack") is ULPack


def test_damaged_chunk_raises(tmp_path):
    x = sample("float32", (8, 7, 3))
    write(tmp_path / "a.zarr", x)
    chunk = tmp_path / "a.zarr" / "c" / "1" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    a = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    assert np.array_equal(bits_of(a[:4]), bits_of(x[:4]))  # the other chunk still reads
    with pytest.raises(CorruptBlobError):
        a[4:]


# one interpreter each (1.3 s of CPU): float16 (found by its entry point) and bfloat16 (registered by the import) in
# the fast lane, every format in the slow lane
@pytest.mark.parametrize(
    "name",
    [n if n in ("float16", "bfloat16") else pytest.param(n, marks=pytest.mark.slow) for n in sorted(FLOAT_FORMATS)],
)
def test_reopens_in_a_fresh_interpreter(tmp_path, name):
    """float16/32/64 in an interpreter that never imported ulstore (zarr finds the codec by its entry point);
    bfloat16 and fp8 after ``import ulstore.codec.zarr3``, which registers their data types (zarr 3.1 never
    loads data types from entry points)."""
    x = sample(name, (9, 9, 5))
    write(tmp_path / "a.zarr", x)
    np.save(tmp_path / "want.npy", bits_of(x))
    needs_ulstore = name not in ("float16", "float32", "float64")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    code = f"""
        import sys, numpy as np, zarr
        {"import ulstore.codec.zarr3" if needs_ulstore else "assert 'ulstore' not in sys.modules"}
        a = zarr.open_array({str(tmp_path / "a.zarr")!r}, mode="r")
        got, want = a[...], np.load({str(tmp_path / "want.npy")!r})
        print(type(a.metadata.codecs[0]).__module__, got.dtype, np.array_equal(got.view(want.dtype), want))
        """
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["ulstore.codec.zarr3", name, "True"]


def test_fill_value_skipping_is_zarrs_and_documented(tmp_path):
    """Without write_empty_chunks zarr drops a chunk equal *in value* to the fill value before any codec runs.

    This pins the behaviour the ULPack docstring warns about: -0.0 in a bf16 array filled with 0.0.
    """
    x = np.full((4,), -0.0, ml_dtypes.bfloat16)
    a = zarr.create_array(store={}, shape=x.shape, dtype=x.dtype, serializer=ULPack(), compressors=None)
    a[:] = x
    assert bits_of(a[:]).tolist() == [0, 0, 0, 0]  # +0.0: zarr skipped the chunk
    b = zarr.create_array(
        store={},
        shape=x.shape,
        dtype=x.dtype,
        serializer=ULPack(),
        compressors=None,
        config={"write_empty_chunks": True},
    )
    b[:] = x
    assert bits_of(b[:]).tolist() == [0x8000] * 4
    assert "write_empty_chunks" in (ULPack.__doc__ or "")


def test_the_docs_example_runs_as_written(tmp_path):
    """docs/zarr.md's Python blocks (ULPack in a plain array; a step's store with xarray and dask), each in a
    fresh interpreter in a scratch directory."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "zarr.md").read_text()
    code, *more = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert "serializer=ULPack()" in code and "compressors=None" in code
    assert len(more) == 1 and "traj.zarr_store(1200)" in more[0]
    for block in (code, *more):
        p = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
    assert zarr.open_array(str(tmp_path / "weights.zarr")).metadata.to_dict()["codecs"][0]["name"] == "ulpack"


def test_chunk_declaring_another_shape_is_refused(tmp_path):
    """The serializer passes the chunk's shape to decode: a chunk blob of the right size but
    another shape (here the chunk flattened) is refused, not reshaped."""
    x = sample("float32", (8, 7, 3))
    write(tmp_path / "a.zarr", x)
    chunk = tmp_path / "a.zarr" / "c" / "0" / "0" / "0"
    chunk.write_bytes(encode(np.ascontiguousarray(x[:4]).reshape(-1)))
    a = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    with pytest.raises(CorruptBlobError, match="expected"):
        a[:4]
