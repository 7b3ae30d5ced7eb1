"""A commit's warning of tensors whose dtype or shape moved since the parent (FewSharedNamesWarning): given once
the step exists (a commit that fails stored nothing to warn of), by every way of committing (commit, piece
writers and finalize; DCP saves and publishes in tests/dcp and tests/sync), at the user's line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import ulstore
from ulstore.errors import FewSharedNamesWarning
from ulstore.store.commit import _finalize

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


def _traj(tmp_path):
    traj = ulstore.open(str(tmp_path / "t"), mode="w")
    traj.commit(0, {"w": np.ones((4, 8), F16), "b": np.zeros(8, F32)})
    return traj


def _retyped() -> dict:
    return {"w": np.full((4, 8), 2, F32), "b": np.ones(8, F32)}


def _few(record) -> list:
    return [w for w in record if issubclass(w.category, FewSharedNamesWarning)]


def test_a_commit_warns_of_a_retyped_tensor_at_the_callers_line(tmp_path):
    traj = _traj(tmp_path)
    with pytest.warns(FewSharedNamesWarning, match="'w' float16 4x8 -> float32 4x8") as got:
        traj.commit(1, _retyped())
    assert [w.filename for w in got] == [__file__]
    assert got[0].message.changed == {"w": (((4, 8), F16), ((4, 8), F32))} and got[0].message.parent == 0


def _failing_finalize(monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(_finalize.Finalizer, "_finalize", fail)


def test_a_commit_that_fails_does_not_warn(tmp_path, monkeypatch):
    traj = _traj(tmp_path)
    _failing_finalize(monkeypatch)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with pytest.raises(OSError, match="no space left"):
            traj.commit(1, _retyped())
    assert _few(got) == [] and 1 not in traj


def test_piece_writers_and_finalize_warn_as_a_commit_does(tmp_path, monkeypatch):
    traj = _traj(tmp_path)
    records = []
    for name, array in _retyped().items():  # one writer per tensor, as DCP ranks
        w = traj.piece_writer(1)
        w.write(name, array)
        records += w.close()
    with monkeypatch.context() as m:
        _failing_finalize(m)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            with pytest.raises(OSError):
                traj.finalize(1, records)
        assert _few(got) == []
    with pytest.warns(FewSharedNamesWarning, match="'w' float16 4x8 -> float32 4x8") as got:
        traj.finalize(1, records)
    assert [w.filename for w in got] == [__file__] and 1 in traj
