"""bfloat16 and fp8 as zarr v3 data types (ulstore.codec.zarr3): names, fill values, pickling."""

from __future__ import annotations

import json
import pickle

import ml_dtypes
import numpy as np
import pytest
import zarr
from zarr.core.dtype import get_data_type_from_json

import ulstore
from tests.helpers.bits import bits_of
from ulstore.codec.zarr3 import ZARR_NAMES, zarr_dtype

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)


def scalar(bits: int, dtype) -> np.generic:
    return np.array([bits], f"<u{np.dtype(dtype).itemsize}").view(dtype)[0]


def test_names_are_the_zarr_extensions_ones():
    """bfloat16 and float8_e5m2 are registered names; float8_e4m3fn is not, and the registry's
    float8_e4m3 is another format (IEEE-like, with infinities), so it gets a namespaced name."""
    assert ZARR_NAMES == {
        "bfloat16": "bfloat16",
        "float8_e5m2": "float8_e5m2",
        "float8_e4m3fn": "ulstore.float8_e4m3fn",
    }
    for name, zname in ZARR_NAMES.items():
        z = zarr_dtype(np.dtype(getattr(ml_dtypes, name)))
        assert z.to_json(zarr_format=3) == zname
        assert get_data_type_from_json(zname, zarr_format=3) == z
        assert get_data_type_from_json({"name": zname, "configuration": {}}, zarr_format=3) == z
    # the registry's float8_e4m3 is not float8_e4m3fn: 0x78 is +inf there and 256 here
    assert float(scalar(0x78, ml_dtypes.float8_e4m3)) == float("inf")
    assert float(scalar(0x78, E4M3FN)) == 256.0


@pytest.mark.parametrize(
    "dtype, text, bits",
    [
        (BF16, "0x7fc1", 0x7FC1),  # a NaN with a payload
        (BF16, "0xffc0", 0xFFC0),  # a negative NaN
        (BF16, "0x3f80", 0x3F80),  # 1.0 (not float16's 0x3f80 = 1.875)
        (BF16, "NaN", 0x7FC0),
        (BF16, "-Infinity", 0xFF80),
        (BF16, -0.0, 0x8000),
        (BF16, 1.5, 0x3FC0),
        (E4M3FN, "0x7f", 0x7F),
        (E4M3FN, "0xff", 0xFF),
        (E4M3FN, "0x78", 0x78),
        (E4M3FN, "NaN", 0x7F),
        (E5M2, "0x7f", 0x7F),
        (E5M2, "0x7c", 0x7C),  # +inf
        (E5M2, "NaN", 0x7E),
        (E5M2, "Infinity", 0x7C),
    ],
)
def test_fill_values_from_json_keep_their_bits(dtype, text, bits):
    z = zarr_dtype(dtype)
    value = z.from_json_scalar(text, zarr_format=3)
    assert int(np.asarray(value).reshape(1).view(f"<u{dtype.itemsize}")[0]) == bits
    # and back: the canonical NaN as "NaN", any other NaN in hex, numbers as numbers
    back = z.to_json_scalar(value, zarr_format=3)
    assert z.from_json_scalar(json.loads(json.dumps(back)), zarr_format=3).tobytes() == value.tobytes()


def test_nan_payloads_are_written_in_hex():
    z = zarr_dtype(BF16)
    assert z.to_json_scalar(scalar(0x7FC0, BF16), zarr_format=3) == "NaN"
    assert z.to_json_scalar(scalar(0x7FC1, BF16), zarr_format=3) == "0x7fc1"
    assert z.to_json_scalar(scalar(0xFFC0, BF16), zarr_format=3) == "0xffc0"
    assert zarr_dtype(E5M2).to_json_scalar(scalar(0x7F, E5M2), zarr_format=3) == "0x7f"
    assert zarr_dtype(E4M3FN).to_json_scalar(scalar(0xFF, E4M3FN), zarr_format=3) == "0xff"


@pytest.mark.parametrize(
    "dtype, text, match",
    [
        (BF16, "0x7f", "4 hex digits"),
        (E5M2, "0x7fc0", "2 hex digits"),
        (E4M3FN, "Infinity", "no infinities"),
        (BF16, "lots", "not a bfloat16 value"),
    ],
)
def test_bad_fill_values_are_refused(dtype, text, match):
    with pytest.raises(ValueError, match=match):
        zarr_dtype(dtype).from_json_scalar(text, zarr_format=3)


def test_a_bf16_nan_fill_value_keeps_its_payload_through_an_array(tmp_path):
    fill = scalar(0x7FC5, BF16)
    a = zarr.create_array(store=str(tmp_path / "a.zarr"), shape=(6,), chunks=(3,), dtype=BF16, fill_value=fill)
    a[:3] = np.ones(3, BF16)
    meta = json.loads((tmp_path / "a.zarr" / "zarr.json").read_text())
    assert meta["data_type"] == "bfloat16" and meta["fill_value"] == "0x7fc5"
    back = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    assert bits_of(back[:]).tolist() == [0x3F80] * 3 + [0x7FC5] * 3  # the unwritten chunk is the fill value
    assert bits_of(np.asarray(back.fill_value)).tolist() == 0x7FC5


def test_dtypes_and_arrays_pickle(tmp_path):
    for dtype in (BF16, E4M3FN, E5M2):
        z = zarr_dtype(dtype)
        assert pickle.loads(pickle.dumps(z)) == z
    traj = ulstore.open(tmp_path / "t", mode="w")
    traj.commit(0, {"w": np.arange(6, dtype=np.float32).astype(BF16)})
    meta = traj[0]["w"].metadata
    assert pickle.loads(pickle.dumps(meta)) == meta  # the array metadata holds the dtype class
