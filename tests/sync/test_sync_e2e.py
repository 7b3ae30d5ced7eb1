"""End to end, in separate processes on a moto S3 bucket: a trainer trains for real and publishes
every step; followers track it bit for bit; a publisher killed mid-publish never exposes a partial version.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.helpers.store import CountingIO
from tests.helpers.sync import assert_same_bits, delta_modes, read_jsonl, rl_states, run_role, state_digest
from ulstore.sync import Follower, Publisher

pytestmark = pytest.mark.slow  # real multi-process jobs: the slow lane (CI=true, --slow)

STEPS = 32
ANCHOR_EVERY = 8


def _by_version(records):
    return {r["version"]: r["digest"] for r in records if "version" in r}


def _check_follower(log, trainer, last):
    """Every version the follower reports holds exactly the trainer's bits of that version."""
    seen = [r for r in log if "version" in r]
    assert seen, "the follower reported nothing"
    for r in seen:
        assert r["version"] in trainer, f"follower reported unpublished version {r['version']}"
        assert r["digest"] == trainer[r["version"]], f"version {r['version']}: weights differ from the trainer's"
    versions = [r["version"] for r in seen]
    assert versions == list(range(versions[0], last + 1)), "a follower must report every version after joining"
    done = log[-1]
    assert done.get("done") and done["stats"]["corrupt"] == 0 and done["stats"]["missing"] == 0
    assert done["verified"], "the whole state, re-hashed at the end, must be what the follower applied"
    return versions, done


def test_trainer_and_two_followers_bit_exact(moto_s3, tmp_path):
    """Acceptance 1: ≥30 real RL steps published to S3; an early and a late follower match every version."""
    url = f"s3://{moto_s3.bucket()}/rl-run"
    opts = json.dumps(moto_s3.options)
    early_out, late_out, log = tmp_path / "early.jsonl", tmp_path / "late.jsonl", tmp_path / "trainer.jsonl"
    early = run_role(
        "follower", "--url", url, "--opts", opts, "--out", early_out, "--until", STEPS, "--state", "numpy", wait=False
    )
    trainer = run_role(
        "trainer",
        "--url",
        url,
        "--opts",
        opts,
        "--log",
        log,
        "--steps",
        STEPS,
        "--anchor-every",
        ANCHOR_EVERY,
        "--delay",
        0.05,
        wait=False,
    )
    late = run_role(
        "follower",
        "--url",
        url,
        "--opts",
        opts,
        "--out",
        late_out,
        "--until",
        STEPS,
        "--join-after",
        17,
        "--state",
        "torch",
        "--trust-state",
        wait=False,
    )  # applies by position only
    procs = {"trainer": trainer, "early": early, "late": late}
    for name, p in procs.items():
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, f"{name} failed:\n{err[-3000:]}"

    records = read_jsonl(log)
    trainer_digests = _by_version(records)
    assert sorted(trainer_digests) == list(range(STEPS + 1)) and records[-1].get("done")
    # the RL regime: ~98% of bf16 weights bit-identical from one step to the next
    fractions = [r["changed"] / r["total"] for r in records if r.get("changed") is not None]
    assert len(fractions) == STEPS and max(fractions) < 0.05 and min(fractions) > 0

    early_versions, _ = _check_follower(read_jsonl(early_out), trainer_digests, STEPS)
    assert early_versions[0] <= 5, "the early follower should track from (nearly) the start"
    late_versions, late_done = _check_follower(read_jsonl(late_out), trainer_digests, STEPS)
    joined_at = late_done["joined_at"]
    assert joined_at >= 17 and late_versions[0] >= 17
    # it started from the nearest anchor at or before the version it joined at, not from version 0
    kind, anchor, _ = late_done["events"][0]
    assert kind == "bootstrap" and anchor == (late_versions[0] // ANCHOR_EVERY) * ANCHOR_EVERY and anchor >= 16
    # what they applied were SPARSE deltas (the publisher's default): applied by position
    with Follower(url, storage_options=moto_s3.options) as f:
        modes = delta_modes(f, STEPS)
    assert "sparse" in modes, modes


def test_publisher_killed_mid_publish(moto_s3, tmp_path):
    """Acceptance 2: real SIGKILLs mid-publish; followers stay on the last complete version, then resume."""
    url = f"s3://{moto_s3.bucket()}/killed"
    opts = json.dumps(moto_s3.options)
    log = tmp_path / "trainer.jsonl"
    common = ["--url", url, "--opts", opts, "--log", log, "--steps", 20, "--anchor-every", ANCHOR_EVERY]

    # 1. killed at version 12 just before the branch moves: the pack and step document of 12 are written
    p = run_role("trainer", *common, "--kill-at", "12:refs/")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    digests = _by_version(read_jsonl(log))
    f = Follower(url, storage_options=moto_s3.options, poll_interval=0.01)
    assert f.bootstrap() == 11 and state_digest(f.state) == digests[11]
    assert f.trajectory._io.exists("steps/12/zarr.json"), "the kill should have left an orphan step 12"
    assert f.poll() is None and f.version == 11

    # 2. restarted (resumes from the store, drops the orphan 12), killed at version 16 after writing
    #    its pack (deltas + snapshot), before its step document
    p = run_role("trainer", *common, "--kill-at", "16:steps/")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    digests = _by_version(read_jsonl(log))
    assert f.poll() == 15 and state_digest(f.state) == digests[15]
    assert f.poll() is None

    # 3. restarted, killed at an arbitrary moment by another process
    p = run_role("trainer", *common, "--delay", 0.02, wait=False)
    t0 = time.monotonic()
    while max(_by_version(read_jsonl(log)), default=0) < 17 and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    time.sleep(0.013)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)
    digests = _by_version(read_jsonl(log))
    v = f.poll() or f.version
    assert state_digest(f.state) == digests[v], "a follower must only ever hold a complete version"

    # 4. restarted to the end: the follower reports every version, each exact
    p = run_role("trainer", *common)
    assert p.returncode == 0, p.stderr[-3000:]
    digests = _by_version(read_jsonl(log))
    reached = []
    if f.version < 20:  # (the random kill may have come after the last publish)
        for v in f.follow(until=20, timeout=30):
            assert state_digest(f.state) == digests[v]
            reached.append(v)
        assert reached == list(range(reached[0], 21))
    assert f.version == 20 and state_digest(f.state) == digests[20]
    assert f.stats.corrupt == f.stats.missing == 0
    f.close()
    # the run is a trajectory: every published version, verifiable (orphan packs are gc's business)
    import ulstore

    traj = ulstore.open(url, mode="r", storage_options=moto_s3.options)
    assert [i.step for i in reversed(traj.log())] == list(range(21))
    assert traj.verify().errors == []


def test_a_follower_handed_each_document_reads_one_range_per_version_from_s3(moto_s3):
    """The control message carries the version's step document: on S3 a follower one version behind makes one
    GET per version (a range of its pack), bit-exact; without the document, two."""
    url = f"s3://{moto_s3.bucket()}/handed"
    states = rl_states(6)
    with Publisher(url, anchor_every=20, chunk_elems=4096, storage_options=moto_s3.options) as pub:
        pub.publish(0, states[0])
        handed = Follower(url, storage_options=moto_s3.options, trust_state=True)
        told = Follower(url, storage_options=moto_s3.options, trust_state=True)
        assert handed.bootstrap() == 0 and told.bootstrap() == 0
        counted = {"handed": CountingIO(handed.trajectory._io), "told": CountingIO(told.trajectory._io)}
        for v in range(1, len(states)):
            info = pub.publish(v, states[v])
            for c in counted.values():
                c.reset()
            assert handed.poll(to=v, document=info.document) == v and told.poll(to=v) == v
            assert len(counted["handed"].reads) == 1 and counted["handed"].packs(), counted["handed"].reads
            assert counted["told"].docs() == [f"steps/{v}/zarr.json"] and len(counted["told"].reads) == 2
            assert_same_bits(handed.state, states[v])
            assert_same_bits(told.state, states[v])
    handed.close()
    told.close()
