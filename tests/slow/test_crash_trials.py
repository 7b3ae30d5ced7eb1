"""A few crash trials (tests/slow/crash_trials.py) in CI: SIGKILL at a random write of commit, delete, gc and
publish, then reopen, verify, read everything back bit-exact, finish the operation, gc, commit again."""

from __future__ import annotations

import uuid

import pytest

from tests.slow.crash_trials import OPS, run_trials


@pytest.mark.slow
@pytest.mark.parametrize("where, trials", [("local", 12), ("s3", 8)])
def test_crash_trials(where, trials, tmp_path, request):
    if where == "local":
        url, so = str(tmp_path / "traj"), None
    else:
        url, so = f"s3://ulstore-test/crash-{uuid.uuid4().hex}", request.getfixturevalue("moto_s3").options
    report = run_trials(trials, url, so)
    print(report.summary())
    assert sum(report.trials.values()) == trials and set(report.trials) == set(OPS)
    assert report.killed.total() > 0  # (the first trial of each operation is not killed: it counts its writes)
    assert not report.failures, report.summary()
