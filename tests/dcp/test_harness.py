"""The multi-process harness itself, on DCP's own FileSystemWriter/Reader (the control backend).

If these fail, the ulstore DCP tests that use the same jobs prove nothing: the oracle must see
real training (weights and Adam moments move, uneven and empty shards exist), loading at
another world size must reproduce it bit for bit, and a rank killed mid-save must end its job
with an error on the other ranks rather than a hang.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import dcp as jobs
from tests.helpers.bits import bits_of

pytest.importorskip("torch.distributed.checkpoint")


@pytest.mark.slow
def test_fsdp_job_saved_with_filesystemwriter_loads_exactly_at_another_world_size(tmp_path):
    storage = jobs.Storage("fs", str(tmp_path / "ckpt"))
    jobs.outcomes_ok(jobs.run_job(2, jobs.save_job, storage, range(3), str(tmp_path / "truth"), workdir=tmp_path))
    jobs.outcomes_ok(jobs.run_job(4, jobs.load_job, storage, [0, 2], str(tmp_path / "w4"), workdir=tmp_path))
    first, last = (jobs.read_state(tmp_path / f"truth/step-{s}.pt") for s in (0, 2))
    for s in (0, 2):
        jobs.assert_same_state(
            jobs.read_state(tmp_path / f"w4/step-{s}.pt"), jobs.read_state(tmp_path / f"truth/step-{s}.pt")
        )
    # the oracle saw real training: weights and moments moved, counters counted
    for name in ("model.model.in_proj.weight", "optim.state.model.in_proj.weight.exp_avg", "model.logit_scale"):
        assert not np.array_equal(bits_of(first[name]), bits_of(last[name])), name
    assert float(last["optim.state.model.in_proj.weight.step"]) == 3.0
    assert last["trainer.step"] == 2 and last["trainer.neg_zero"] == 0.0 and str(last["trainer.neg_zero"]) == "-0.0"
    # shards were uneven (150 rows over 4 ranks) and one parameter has empty shards
    assert last["model.model.in_proj.weight"].shape[0] % 4 != 0 and last["model.logit_scale"].shape == (1,)


def test_a_rank_killed_mid_save_ends_the_job_with_an_error_not_a_hang(tmp_path):
    storage = jobs.Storage("fs", str(tmp_path / "ckpt"))
    outcomes = jobs.run_job(
        2, jobs.save_job, storage, range(2), None, workdir=tmp_path, pg_timeout=30, kwargs={"die": (1, 1, 3)}
    )
    assert outcomes[1].exitcode == 17 and not outcomes[1].ok
    assert not outcomes[0].ok and outcomes[0].error is not None
