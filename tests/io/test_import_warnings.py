"""An import's warnings (FewSharedNamesWarning): given at the caller's line, not import_checkpoint's, and only
once the step exists (an import whose commit failed stored nothing to warn of)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import ulstore
from ulstore import io as uio
from ulstore.io import checkpoints
from ulstore.store.commit import _finalize


@pytest.fixture
def files(tmp_path):
    """ckpt_0 (fp16), ckpt_1 (the same names in fp32), ckpt_2 (other names: nothing to delta-code against)."""
    a = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    checkpoints.save_npz({"w": a.astype(np.float16), "v": a[0].astype(np.float16)}, tmp_path / "ckpt_0.npz")
    checkpoints.save_npz({"w": a, "v": a[0]}, tmp_path / "ckpt_1.npz")
    checkpoints.save_npz({"other.w": a.astype(np.float16), "other.v": a[0]}, tmp_path / "ckpt_2.npz")
    traj = ulstore.open(str(tmp_path / "t"), mode="w")
    uio.import_checkpoint(traj, tmp_path / "ckpt_0.npz")
    return traj, tmp_path


@pytest.mark.parametrize("name, says", [("ckpt_1.npz", "'w' float16 8x8 -> float32 8x8"), ("ckpt_2.npz", "match 0%")])
def test_an_import_warns_at_the_callers_line(files, name, says):
    traj, d = files
    with pytest.warns(uio.FewSharedNamesWarning, match=says) as got:
        uio.import_checkpoint(traj, d / name)
    assert [w.filename for w in got] == [__file__], [(w.filename, str(w.message)) for w in got]


@pytest.mark.parametrize("name", ["ckpt_1.npz", "ckpt_2.npz"])
def test_an_import_that_fails_does_not_warn(files, name, monkeypatch):
    traj, d = files

    def fail(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(_finalize.Finalizer, "_finalize", fail)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with pytest.raises(OSError, match="no space left"):
            uio.import_checkpoint(traj, d / name)
    assert [w for w in got if issubclass(w.category, uio.FewSharedNamesWarning)] == []
    assert traj.steps == [0]
