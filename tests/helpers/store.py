"""Helpers for the store and io tests: real toytrain trajectories, exact state comparison, read counting."""

from __future__ import annotations

import functools
import os

import numpy as np

from ulstore import toytrain

from .bits import bits_of

__all__ = [
    "states_bf16",
    "states_fp32",
    "assert_state_equal",
    "CountingFS",
    "env_threads",
    "CHUNK",
    "record_fsyncs",
    "file_id",
]

CHUNK = 4096  # small chunks: multi-chunk tensors from the tiny model


@functools.cache
def _trajectory(kind, steps, dtype):
    return toytrain.trajectory(kind, steps, preset="tiny", dtype=dtype)


def states_bf16(steps: int = 20):
    """A real bf16 fine-tuning trajectory of the tiny model (steps + 1 checkpoints)."""
    return _trajectory("finetune", steps, "bfloat16")


def states_fp32(steps: int = 20):
    """A real fp32 pre-training trajectory of the tiny model."""
    return _trajectory("pretrain", steps, "float32")


def assert_state_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        w = np.asarray(want[k])
        assert got[k].dtype == w.dtype, (k, got[k].dtype, w.dtype)
        assert got[k].shape == w.shape, k
        np.testing.assert_array_equal(bits_of(got[k]), bits_of(w), err_msg=k)


class CountingFS:
    """Wraps an fsspec filesystem's ``cat_file`` and records the paths read."""

    def __init__(self, fs):
        self.fs = fs
        self.reads: list[str] = []
        self._orig = fs.cat_file
        fs.cat_file = self._cat_file

    def _cat_file(self, path, *args, **kwargs):
        self.reads.append(str(path))
        return self._orig(path, *args, **kwargs)

    def blobs(self):
        return [p for p in self.reads if "/blobs/" in p]

    def manifests(self):
        return [p for p in self.reads if "/steps/" in p]

    def reset(self):
        self.reads.clear()


def env_threads():
    return int(os.environ.get("ULSTORE_TEST_THREADS", "2"))


def file_id(path) -> tuple[int, int]:
    """(device, inode) of a file or directory: what an fsync of any descriptor of it records."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def record_fsyncs(monkeypatch) -> set:
    """Patch ``os.fsync`` to record the :func:`file_id` of everything synced; returns the (live) set."""
    synced: set = set()
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced
