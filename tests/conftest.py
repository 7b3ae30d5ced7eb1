"""Fixtures every test package shares: one moto S3 server per session."""

from __future__ import annotations

import pytest

from tests.helpers.moto import MotoS3


@pytest.fixture(scope="session")
def moto_s3():
    """A moto S3 server on 127.0.0.1 holding the bucket ``ulstore-test``.

    A :class:`~tests.helpers.moto.MotoS3`: ``.options`` (storage_options for
    fsspec), ``.endpoint``, ``.bucket()`` (a fresh bucket).
    """
    s3 = MotoS3()
    s3.bucket("ulstore-test")
    yield s3
    s3.stop()
