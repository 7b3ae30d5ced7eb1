"""A Trajectory as a Sequence-like view of its steps: iteration in step order, negative indexing."""

from __future__ import annotations

import numpy as np
import pytest

import ulstore
from ulstore.errors import InvalidInputError, StepNotFoundError


@pytest.fixture
def traj(tmp_path):
    t = ulstore.open(tmp_path / "t", mode="w")
    for s in (300, 10, 200):  # committed out of order: a step's number, not its age, orders the view
        t.commit(s, {"w": np.full(3, s, np.float32)}, parent=None if s == 300 else 300)
    return t


def test_iteration_is_over_step_numbers_in_order(traj):
    assert list(traj) == [10, 200, 300] == traj.steps
    assert [s for s in traj] == [10, 200, 300]
    assert list(reversed(traj)) == [300, 200, 10]
    assert len(traj) == 3


def test_non_negative_index_is_a_step_number_negative_counts_from_the_newest(traj):
    assert traj[200]["w"][0] == 200  # a step NUMBER, as before
    assert traj[-1]["w"][0] == 300  # the last step by number
    assert traj[-3]["w"][0] == 10
    assert traj[-1].path == traj[300].path
    with pytest.raises(StepNotFoundError, match=r"traj\[-4\].*3 steps"):
        traj[-4]
    with pytest.raises(StepNotFoundError):
        traj[5]  # not a position: step 5 does not exist


def test_negative_index_of_an_empty_trajectory(tmp_path):
    t = ulstore.open(tmp_path / "e", mode="w")
    assert list(t) == []
    with pytest.raises(StepNotFoundError, match="no steps"):
        t[-1]


def test_in_tests_step_numbers_and_refs(traj):
    assert 200 in traj and "main" in traj
    assert 5 not in traj and -1 not in traj and "no-such-ref" not in traj


def test_slices_are_refused_clearly(traj):
    with pytest.raises(InvalidInputError, match="slice"):
        traj[-2:]
