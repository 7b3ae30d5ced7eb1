"""Inputs the codec must refuse with a named error, not a crash from numpy or torch (issue 14)."""

from __future__ import annotations

import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from ulstore import ULPack
from ulstore.errors import InvalidInputError

torch = pytest.importorskip("torch")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(
    "make, hint",
    [
        (lambda: torch.empty(3, 4, device="meta"), "meta"),
        (lambda: torch.eye(3).to_sparse(), "to_dense"),
        (lambda: torch.eye(3).to_sparse_csr(), "to_dense"),
    ],
    ids=["meta", "sparse-coo", "sparse-csr"],
)
def test_tensors_without_plain_data_are_refused(make, hint):
    t = make()
    with pytest.raises(InvalidInputError, match=hint):
        ulstore.encode(t)
    traj = ulstore.open("memory://inputs-torch", mode="w")
    with pytest.raises(InvalidInputError, match=hint) as e:
        traj.commit(0, {"w": t})
    assert e.value.tensor == "w"


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_np_matrix_codes_as_its_array():
    m = np.matrix([[1.0, -0.0], [np.nan, 3.5]], dtype=np.float32)
    blob = ulstore.encode(m)
    back = ulstore.decode(blob)
    assert type(back) is np.ndarray and back.shape == (2, 2)
    assert_bits_equal(back, np.asarray(m))
    assert bytes(ULPack().encode(m)) == bytes(blob)


@pytest.mark.parametrize("dtype, n", [("bfloat16", 3), ("float32", 6), ("float64", 12), ("float16", 1)])
def test_bytes_not_a_whole_number_of_elements(dtype, n):
    with pytest.raises(InvalidInputError, match="multiple"):
        ULPack(dtype=dtype).encode(b"\x01" * n)
    with pytest.raises(InvalidInputError, match="multiple"):
        ULPack(dtype=dtype).encode(np.ones(n, np.uint8), reference=np.ones(n, np.uint8))
