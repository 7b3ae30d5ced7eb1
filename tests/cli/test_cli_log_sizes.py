"""``ulstore log`` shows what each step stored (the bytes it added) and the total."""

from __future__ import annotations

import json

import numpy as np
import pytest

import ulstore
from ulstore import cli
from ulstore.core.formatting import human_bytes
from ulstore.io import storage_report


@pytest.fixture
def url(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    traj = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=1024)
    traj.commit(300, {"w": w})  # a root with a large number
    traj.commit(5, {"w": w}, parent=300, branch="copy")  # a child numbered below its parent: adds no blob
    w2 = w.copy()
    w2[:4] += np.float32(1e-3)
    traj.commit(400, {"w": w2}, parent=300)  # changes 4 rows of 64
    return str(tmp_path / "t")


def _run(capsys, *argv):
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_log_json_has_stored_bytes_per_step_and_the_total(url, capsys):
    doc = json.loads(_run(capsys, "log", url, "--json"))
    got = {s["step"]: s["stored_bytes"] for s in doc["steps"]}
    report = {r["step"]: r for r in storage_report(ulstore.open(url, mode="r"))["steps"]}
    # step 5 reuses every chunk of its parent 300: it stored only its step document and table block
    assert got[5] == report[5]["manifest_bytes"] and report[5]["blob_bytes"] == 0
    assert got[300] > got[400] > got[5]  # 300 holds the blobs, 400 a delta of 4 rows
    assert got == {s: r["stored_bytes"] for s, r in report.items()}
    assert doc["total"] == {
        "steps": 3,
        "raw_bytes": sum(s["raw_bytes"] for s in doc["steps"]),
        "stored_bytes": sum(got.values()),
    }
    # the ancestry of one step: its steps and their total
    doc = json.loads(_run(capsys, "log", url, "400", "--json"))
    assert [s["step"] for s in doc["steps"]] == [400, 300]
    assert doc["total"]["stored_bytes"] == got[400] + got[300]


def test_log_text_has_a_stored_column_and_a_total_line(url, capsys):
    out = _run(capsys, "log", url).splitlines()
    header = out[0].split()
    assert header[:6] == ["step", "parent", "anchor", "tensors", "raw", "stored"]
    doc = json.loads(_run(capsys, "log", url, "--json"))
    for line, step in zip(out[1:4], doc["steps"]):
        assert line.split()[0] == str(step["step"])
        assert human_bytes(step["stored_bytes"]) in line
    total = doc["total"]
    assert out[-1] == (
        f"3 steps: raw {human_bytes(total['raw_bytes'])}, stored {human_bytes(total['stored_bytes'])}"
        f" ({total['raw_bytes'] / total['stored_bytes']:.1f}x)"
    )


def test_log_n_lists_the_newest_steps_and_says_how_many_more(url, capsys):
    """``-n N`` as ``git log -n``: the N newest steps (of the trajectory, or of STEP's ancestry), their totals,
    and how many older ones were left out."""
    out = _run(capsys, "log", url, "-n", "2")
    assert [line.split()[0] for line in out.splitlines()[1:3]] == ["400", "300"]
    assert "... and 1 older step (-n 2; without -n, all)" in out and out.strip().endswith(")")
    assert "2 steps: raw" in out
    doc = json.loads(_run(capsys, "log", url, "--max-count", "1", "--json"))
    assert [s["step"] for s in doc["steps"]] == [400] and doc["not_listed"] == 2 and doc["total"]["steps"] == 1
    doc = json.loads(_run(capsys, "log", url, "5", "-n", "1", "--json"))  # the ancestry of 5: 5, 300
    assert [s["step"] for s in doc["steps"]] == [5] and doc["not_listed"] == 1
    doc = json.loads(_run(capsys, "log", url, "-n", "0", "--json"))
    assert [s["step"] for s in doc["steps"]] == [400, 300, 5] and doc["not_listed"] == 0
