"""Fixtures of the store tests: a fresh trajectory location on every backend."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(params=["local", "memory", "s3"])
def backend_url(request, tmp_path):
    """(url, storage_options) of a fresh trajectory location on each backend."""
    if request.param == "local":
        return str(tmp_path / "traj"), None
    if request.param == "memory":
        return f"memory://ulstore-{uuid.uuid4().hex}", None
    return f"s3://ulstore-test/{uuid.uuid4().hex}", request.getfixturevalue("moto_s3").options
