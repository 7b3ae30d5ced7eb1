"""Every dtype a commit accepts comes back out: commit -> read -> to_torch -> export (safetensors) -> import.

A dtype that could not make the whole round trip is refused at commit, with the dtype and the alternative named.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from ulstore.errors import DtypeError
from ulstore.io import checkpoints as ckpt
from ulstore.io import export_checkpoint, import_checkpoint, to_torch

torch = pytest.importorskip("torch")

COMMITTABLE = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    np.complex64,
]


def _random_bits(dtype, shape, seed) -> np.ndarray:
    """Every bit pattern may occur (NaN payloads, -0.0, subnormals, infinities); bool is 0 or 1."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


@pytest.mark.parametrize("dtype", COMMITTABLE, ids=lambda d: np.dtype(d).name)
def test_every_committable_dtype_round_trips_bit_exact(tmp_path, dtype):
    a = _random_bits(dtype, (5, 7), 0)
    b = _random_bits(dtype, (5, 7), 1)
    b[0] = a[0]  # some rows unchanged, some changed: deltas and reuse both
    traj = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=16)
    traj.commit(1, {"x": a})
    traj.commit(2, {"x": b})
    for step, want in ((1, a), (2, b)):
        got = traj.read(step)["x"]  # read
        assert_bits_equal(got, want, f"read {step}")
        assert_bits_equal(traj[step]["x"][1:3], want[1:3], f"lazy slice of {step}")
        assert_bits_equal(to_torch(traj, step)["x"], want, f"to_torch of {step}")
        assert_bits_equal(to_torch(traj[step]["x"][2:]), want[2:], f"to_torch of a slice of {step}")
        out = tmp_path / f"step_{step}.safetensors"
        export_checkpoint(traj, step, out)  # export
        assert_bits_equal(ckpt.load(out).tensors["x"], want, f"export of {step}")
        back = ulstore.open(tmp_path / "back", mode="a")
        import_checkpoint(back, out)  # import
        assert_bits_equal(back.read(step)["x"], want, f"import of {step}")
    # torch's own loader reads the export (complex64 is the safetensors dtype C64)
    from safetensors.torch import load_file

    assert_bits_equal(load_file(tmp_path / "step_2.safetensors")["x"], b, "safetensors.torch.load_file")


@pytest.mark.parametrize("dtype", [np.complex128, np.clongdouble], ids=lambda d: np.dtype(d).name)
def test_dtypes_no_export_holds_are_refused_at_commit(tmp_path, dtype):
    traj = ulstore.open(tmp_path / "t", mode="w")
    x = np.ones((2, 3), dtype)
    with pytest.raises(DtypeError, match=rf"{np.dtype(dtype).name}.*complex64.*view") as e:
        traj.commit(0, {"z": x})
    assert e.value.tensor == "z"
    assert traj.steps == []
    with pytest.raises(DtypeError, match=np.dtype(dtype).name):  # the piece writer (distributed saves) too
        with traj.piece_writer(0) as w:
            w.write("z", x)


def test_the_suggested_alternative_is_exact(tmp_path):
    z = (np.arange(6) + 1j * np.arange(6)[::-1]).astype(np.complex128).reshape(2, 3)
    traj = ulstore.open(tmp_path / "t", mode="w")
    traj.commit(0, {"z": z.view(np.float64)})
    assert_bits_equal(traj.read(0)["z"].view(np.complex128), z)
