"""Fixtures every test package shares: one moto S3 server per session; no test leaks environment variables."""

from __future__ import annotations

import os

import pytest

from tests.helpers import lanes
from tests.helpers.moto import MotoS3


def _slow_lane(config) -> bool:
    """Whether this run includes the slow lane: in CI (``CI=true``, as ``.ci/run`` runs), with ``--slow``, or
    when the command line selects by marker (``-m slow``)."""
    return lanes.configure(config)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the slow lane (tests marked slow); CI=true does too")


def pytest_configure(config):
    """Tell the helpers which lane runs (tests/helpers/lanes.py), in the controller and each xdist worker."""
    lanes.configure(config)


def pytest_collection_modifyitems(config, items):
    """The default run leaves out the slow lane (deselected, so it is not reported as skipped), unless a test
    was named on the command line by its node id."""
    if _slow_lane(config):
        return
    named = {a for a in config.args if "::" in a}
    keep, slow = [], []
    for item in items:
        (slow if item.get_closest_marker("slow") and item.nodeid not in named else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep


def pytest_terminal_summary(terminalreporter, config):
    if not _slow_lane(config):
        terminalreporter.write_line(
            "the slow lane was left out: `CI=true python -m pytest -q -n 2` (or --slow) runs every test"
        )


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


def _environment_kept():
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


#: Undo what a test, or a module's fixtures, changed in ``os.environ``.  distributed's Nanny sets
#: ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` to 1 in the environment of the
#: process that starts a cluster and leaves them there.  Subprocesses started by later tests then train
#: ``toytrain`` models on one BLAS thread while the test process uses two, and on AVX-512 machines
#: OpenBLAS's float32 products differ in their last bits between the two: a checkpoint a test recomputes
#: would not be the one its subprocess committed.
_environment_restored = pytest.fixture(autouse=True)(_environment_kept)
_environment_restored_per_module = pytest.fixture(autouse=True, scope="module")(_environment_kept)
