"""Fixtures for the store tests (imported by tests/test_store*.py; tests/conftest.py belongs to the codec tests)."""
from __future__ import annotations

import functools
import logging
import os
import uuid

import numpy as np
import pytest

from ulstore import toytrain

__all__ = ["states_bf16", "states_fp32", "assert_state_equal", "bits", "MotoS3", "moto_s3", "backend_url", "CountingFS"]

CHUNK = 4096  # small chunks: multi-chunk tensors from the tiny model


@functools.lru_cache(maxsize=None)
def _trajectory(kind, steps, dtype):
    return toytrain.trajectory(kind, steps, preset="tiny", dtype=dtype)


def states_bf16(steps: int = 20):
    """A real bf16 fine-tuning trajectory of the tiny model (steps + 1 checkpoints)."""
    return _trajectory("finetune", steps, "bfloat16")


def states_fp32(steps: int = 20):
    """A real fp32 pre-training trajectory of the tiny model."""
    return _trajectory("pretrain", steps, "float32")


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" and a.dtype.itemsize in (1, 2, 4, 8) else a


def assert_state_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        w = np.asarray(want[k])
        assert got[k].dtype == w.dtype, (k, got[k].dtype, w.dtype)
        assert got[k].shape == w.shape, k
        np.testing.assert_array_equal(bits(got[k]), bits(w), err_msg=k)


class MotoS3:
    """A moto S3 server on 127.0.0.1 (moto, boto3 and s3fs are test dependencies: missing, they fail)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.options = {"key": "testing", "secret": "testing",
                        "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given) and return its name."""
        import boto3

        name = name or f"sync-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return name

    def stop(self):
        self.server.stop()


@pytest.fixture(scope="session")
def moto_s3():
    """A moto S3 server on 127.0.0.1 with the bucket ``ulstore-test``; yields its storage_options."""
    s3 = MotoS3()
    s3.bucket("ulstore-test")
    yield s3.options
    s3.stop()


@pytest.fixture(params=["local", "memory", "s3"])
def backend_url(request, tmp_path):
    """(url, storage_options) of a fresh trajectory location on each backend."""
    if request.param == "local":
        return str(tmp_path / "traj"), None
    if request.param == "memory":
        return f"memory://ulstore-{uuid.uuid4().hex}", None
    so = request.getfixturevalue("moto_s3")
    return f"s3://ulstore-test/{uuid.uuid4().hex}", so


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
