"""Trajectory.diff: per tensor, elements changed (bits), relative L2 change and largest change, exactly."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import ulstore
from ulstore.errors import StepNotFoundError, TensorNotFoundError

# shapes and dtypes change mid-chain on purpose here: the commit's warning about it is tested in
# tests/store/test_features.py and tests/cli/test_cli_diff.py
pytestmark = pytest.mark.filterwarnings("ignore::ulstore.errors.FewSharedNamesWarning")


def _expected(a: np.ndarray, b: np.ndarray) -> dict:
    """The definition, on whole arrays: bits for `changed`, float64 (complex128) for the rest, NaN/inf pairs out."""
    n = a.dtype.itemsize
    changed = int(np.count_nonzero(a.reshape(-1).view(f"u{n}") != b.reshape(-1).view(f"u{n}")))
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    x, y = a.astype(wide).ravel(), b.astype(wide).ravel()
    ok = np.isfinite(x) & np.isfinite(y)
    d = np.abs(y[ok] - x[ok])
    dd, aa = float(np.sum(d**2)), float(np.sum(np.abs(x[ok]) ** 2))
    rel = 0.0 if dd == 0 else (math.sqrt(dd) / math.sqrt(aa) if aa > 0 else math.inf)
    return {
        "changed": changed,
        "fraction_changed": changed / a.size,
        "rel_l2": rel,
        "max_abs_change": float(d.max()) if d.size else 0.0,
        "nonfinite": int(np.count_nonzero(~ok)),
    }


@pytest.fixture
def states():
    rng = np.random.default_rng(7)
    w = rng.normal(size=(64, 8)).astype(np.float32)
    w[40, 3] = np.nan  # a NaN in an unchanged chunk of both steps
    w[2, 0] = 0.0
    w2 = w.copy()
    w2[0:3] += np.float32(0.25)  # first chunk
    w2[2, 0] = -0.0  # -0.0 against 0.0: a change of bits, none of value
    w2[9, 1] = np.inf  # becomes infinite: out of the norms
    w2[10, 5] = np.nan
    h = rng.normal(size=(16, 16)).astype(ml_dtypes.bfloat16)
    h2 = h.copy()
    h2[::3] = (h2[::3].astype(np.float32) * 1.01).astype(ml_dtypes.bfloat16)
    ids = np.arange(24, dtype=np.int64)
    ids2 = ids.copy()
    ids2[[1, 5]] = [100, -7]
    c = (rng.normal(size=6) + 1j * rng.normal(size=6)).astype(np.complex64)
    c2 = c.copy()
    c2[4] += np.complex64(0.5 - 0.25j)
    zero = np.zeros(5, np.float32)
    zero2 = zero.copy()
    zero2[1] = 3.0
    flag = np.array([True, False, True, True])
    a = {
        "w": w, "h": h, "ids": ids, "c": c, "zero": zero, "flag": flag,
        "same": np.ones((3, 3), np.float16), "gone": np.ones(2, np.float32), "resh": np.ones(4, np.float32),
    }  # fmt: skip
    b = {
        "w": w2, "h": h2, "ids": ids2, "c": c2, "zero": zero2, "flag": ~flag,
        "same": np.ones((3, 3), np.float16), "new": np.ones(3, np.int8), "resh": np.ones((2, 2), np.float32),
    }  # fmt: skip
    return a, b


@pytest.fixture
def traj(tmp_path, states):
    t = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=128)  # w: 16 chunks of 4 rows
    t.commit(10, states[0])
    t.commit(20, states[1])
    return t


def test_numbers_are_the_definition_on_every_compared_tensor(traj, states):
    a, b = states
    got = {d.name: d for d in traj.diff(10, 20)}
    for name in ("w", "h", "ids", "c", "zero", "flag", "same"):
        want = _expected(a[name], b[name])
        d = got[name]
        assert d.status == "compared" and d.shape == a[name].shape and d.elements == a[name].size
        assert d.dtype == a[name].dtype.name
        assert (d.changed, d.nonfinite, d.max_abs_change) == (
            want["changed"],
            want["nonfinite"],
            want["max_abs_change"],
        )
        assert d.fraction_changed == want["fraction_changed"]
        assert d.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12, abs=0), name
    assert got["w"].nonfinite == 3  # the NaN kept in both, the inf and the NaN that appeared
    assert got["zero"].rel_l2 == math.inf and got["same"].changed == 0 and got["same"].rel_l2 == 0.0
    assert got["w"].changed == 3 * 8 + 2  # rows 0-2 (with 0.0 -> -0.0), the inf, the NaN
    assert got["flag"].fraction_changed == 1.0 and got["flag"].max_abs_change == 1.0


def test_added_removed_reshaped_and_the_order(traj):
    d = traj.diff(10, 20)
    status = {x.name: (x.status, x.fraction_changed, x.rel_l2) for x in d}
    assert status["gone"] == ("removed", 1.0, None)
    assert status["new"] == ("added", 1.0, None)
    assert status["resh"] == ("reshaped", 1.0, None)
    (resh,) = [x for x in d if x.name == "resh"]  # what it was in step 10 rides along; the others have none
    a, b = traj.tensors(10)["resh"], traj.tensors(20)["resh"]
    assert (resh.shape_a, resh.dtype_a) == (tuple(a[0]), a[1].name) and (resh.shape, resh.dtype) == (b[0], b[1].name)
    assert resh.to_dict()["shape_a"] == list(a[0])
    assert all(x.shape_a is None and x.dtype_a is None for x in d if x.status != "reshaped")
    keys = [(-x.fraction_changed, -(x.rel_l2 if x.rel_l2 is not None else math.inf), x.name) for x in d]
    assert keys == sorted(keys) and d[-1].name == "same"
    assert d[0].to_dict()["shape"] == list(d[0].shape)


def test_only_the_changed_chunks_of_b_are_decoded(traj, monkeypatch):
    asked = []
    real = traj.read_boxes

    def spy(step, boxes):
        asked.extend((step, *box) for box in boxes)
        return real(step, boxes)

    monkeypatch.setattr(traj, "read_boxes", spy)
    traj.diff(10, 20, names=["w", "same"])
    # w: chunks of 4 rows; rows 0-2 (chunk 0) and rows 9, 10 (chunk 2) changed; "same" not at all
    assert asked == [(20, "w", (0, 0), (4, 8)), (20, "w", (8, 0), (4, 8))]


def test_refs_names_and_errors(traj):
    assert [d.name for d in traj.diff("main", 10, names=["ids"])] == ["ids"]
    assert traj.diff(10, 10, names=["w"])[0].changed == 0
    with pytest.raises(TensorNotFoundError, match="nope"):
        traj.diff(10, 20, names=["nope"])
    with pytest.raises(StepNotFoundError):
        traj.diff(10, 11)
