"""``ulstore.io.to_torch`` of lazy slices and arrays (bf16/fp8 ``ml_dtypes`` arrays torch cannot read)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from ulstore.errors import InvalidInputError
from ulstore.io import to_torch

torch = pytest.importorskip("torch")


@pytest.fixture
def traj(tmp_path):
    rng = np.random.default_rng(1)
    t = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=64)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    w.view(np.uint32)[0, :3] = (0x7FC00001, 0xFFC00123, 0x80000000)  # NaN payloads, -0.0
    t.commit(
        0,
        {
            "bf16": w.astype(ml_dtypes.bfloat16),
            "e4m3": w.astype(ml_dtypes.float8_e4m3fn),
            "e5m2": w.astype(ml_dtypes.float8_e5m2),
            "f32": w,
        },
    )
    return t


@pytest.mark.parametrize(
    "name, dtype",
    [("bf16", "bfloat16"), ("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2"), ("f32", "float32")],
)
def test_a_lazy_slice_goes_to_torch_bit_exact(traj, name, dtype):
    piece = traj[0][name][2:7, 1:5]  # an ml_dtypes array for bf16/fp8
    if name != "f32":
        with pytest.raises(TypeError):  # what users hit: torch cannot read ml_dtypes arrays
            torch.from_numpy(piece)
    before = piece.copy()
    t = to_torch(piece)
    assert t.dtype == getattr(torch, dtype)
    assert_bits_equal(t, before, name)
    t[0, 0] = 0  # writable; it shares the slice's memory (as torch.from_numpy), never the trajectory's cache
    assert_bits_equal(traj[0][name][2:7, 1:5], before, name)


def test_whole_lazy_arrays_scalars_and_dicts(traj):
    z = traj[0]["bf16"]  # a zarr array: read whole
    t = to_torch(z)
    assert t.dtype == torch.bfloat16
    assert_bits_equal(t, traj.read(0)["bf16"])
    s = to_torch(traj[0]["bf16"][3, 4])  # a 0-d value
    assert s.shape == () and s.dtype == torch.bfloat16
    state = to_torch(traj.read(0))  # a dict of arrays: a state dict
    assert set(state) == {"bf16", "e4m3", "e5m2", "f32"} and state["e4m3"].dtype == torch.float8_e4m3fn
    assert to_torch(traj, 0)["f32"].dtype == torch.float32  # the step form is unchanged


def test_read_only_arrays_are_copied_and_bad_calls_are_named(traj):
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    t = to_torch(a)
    t[0] = 9
    assert a[0] == 0
    with pytest.raises(InvalidInputError, match="step"):
        to_torch(traj)  # a trajectory without a step
    with pytest.raises(InvalidInputError, match="step"):
        to_torch(a, 3)  # an array with a step
    with pytest.raises(InvalidInputError, match="list"):
        to_torch([1.0, 2.0])
