"""A few runs of tests/slow/publisher_stress.py in CI: two Publishers on one branch with overlapping version
numbers and a Follower, on local disk and on moto S3; every acknowledged version stays, readable and on the
branch, every loser gets an error, the follower only holds versions of the branch."""

from __future__ import annotations

import pytest

from tests.slow.publisher_stress import run_stress, summary


@pytest.mark.slow
@pytest.mark.parametrize("where, runs", [("local", 3), ("s3", 1)])
def test_two_publishers_and_a_follower(where, runs, tmp_path, request):
    if where == "local":
        url, so = str(tmp_path), None
    else:
        url, so = "s3://ulstore-test/stress", request.getfixturevalue("moto_s3").options
    totals = run_stress(runs, url, so, versions=6)
    print(summary(totals))
    assert totals["runs"] == runs and totals["acks"] >= 6 * runs  # every version was published by one of them
    assert not totals["failures"], summary(totals)
