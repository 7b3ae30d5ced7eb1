"""``ulstore diff URL A B``: the store's Trajectory.diff as text and JSON; --plot a tensors x steps heatmap."""

from __future__ import annotations

import json

import numpy as np
import pytest

import ulstore
from ulstore import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def url(tmp_path):
    rng = np.random.default_rng(3)
    state = {f"model.layers.{i}.w": rng.normal(size=(8, 8)).astype(np.float32) for i in (0, 1, 2, 10)}
    state["model.embed.weight"] = np.zeros((4, 8), np.float32)
    traj = ulstore.open(tmp_path / "t", mode="w")
    traj.commit(0, state)
    for step in (1, 2, 3):
        state = {k: v.copy() for k, v in state.items()}
        state[f"model.layers.{step - 1}.w"][:step] += np.float32(0.5)  # layer step-1 moves, step rows of 8
        traj.commit(step, state)
    traj.commit(9, state, parent=0, branch="side")  # not on main's line
    return str(tmp_path / "t")


def _main(capsys, *argv, status=0):
    assert cli.main(list(argv)) == status
    return capsys.readouterr()


def test_diff_json_is_the_python_diff(url, capsys):
    doc = json.loads(_main(capsys, "diff", url, "0", "main", "--json").out)
    want = ulstore.open(url, mode="r").diff(0, 3)
    assert (doc["a"], doc["b"]) == (0, 3)
    assert doc["tensors"] == [d.to_dict() for d in want]
    assert [t["name"] for t in doc["tensors"][:3]] == ["model.layers.2.w", "model.layers.1.w", "model.layers.0.w"]
    assert [t["changed"] for t in doc["tensors"][:3]] == [24, 16, 8]
    assert doc["total"] == {"tensors": 5, "tensors_changed": 3, "elements": 4 * 64 + 32, "changed": 48}


def test_diff_text(url, capsys):
    out = _main(capsys, "diff", url, "0", "3", "--top", "2").out.splitlines()
    assert out[0].split()[:4] == ["tensor", "dtype", "shape", "changed"]
    assert out[1].split()[:4] == ["model.layers.2.w", "float32", "8x8", "37.50%"]
    assert out[3] == "... 3 more (--top 0 lists all)"
    assert out[-1] == "step 3 against step 0: 3 of 5 tensors changed, 48 of 288 elements (16.67%)"


def test_diff_text_shows_what_a_tensor_of_another_dtype_or_shape_was(tmp_path, capsys):
    """bf16 weights saved as fp32 next time, or an embedding grown by a row: the table says from what to
    what, and the summary counts them instead of "0 of 0 elements"."""
    w = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    traj = ulstore.open(tmp_path / "t", mode="w")
    traj.commit(0, {"w": w.astype(np.float16), "emb": w})
    with pytest.warns(ulstore.FewSharedNamesWarning, match="'w' float16 6x4 -> float32 6x4"):
        traj.commit(1, {"w": w, "emb": np.concatenate([w, w[:1]])})
    out = _main(capsys, "diff", str(tmp_path / "t"), "0", "1").out.splitlines()
    rows = {line.split()[0]: line.split()[1:4] for line in out[1:-1]}
    assert rows == {
        "w": [
            "float16->float32",
            "6x4",
            "new",
        ],
        "emb": ["float32", "6x4->7x4", "reshaped"],
    }, out
    assert out[-1] == (
        "step 1 against step 0: 2 of 2 tensors changed (2 of another dtype or shape: not compared element by element)"
    )
    traj.commit(2, {"w": w, "new": w})
    assert _main(capsys, "diff", str(tmp_path / "t"), "1", "2").out.splitlines()[-1] == (
        "step 2 against step 1: 2 of 3 tensors changed, 0 of 24 elements (0.00%) (1 added, 1 removed: "
        "not compared element by element)"
    )


def test_diff_plot_draws_every_step_between(url, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from ulstore.cli import _plot

    drawn = {}
    real = _plot.plot_diff

    def spy(columns, out, title, metric="changed"):
        drawn.update(steps=[s for s, _ in columns], metric=metric)
        return real(columns, out, title, metric)

    monkeypatch.setattr(cli._commands, "plot_diff", spy)
    png = tmp_path / "heat.png"
    doc = json.loads(_main(capsys, "diff", url, "0", "3", "--plot", str(png), "--metric", "rel_l2", "--json").out)
    assert png.read_bytes()[:8] == PNG_MAGIC and doc["plot"] == str(png)
    assert drawn == {"steps": [1, 2, 3], "metric": "rel_l2"}
    err = _main(capsys, "diff", url, "9", "3", "--plot", str(png), status=1).err
    assert "not an ancestor" in err and "ulstore log" in err


def test_layers_group_rows_in_natural_order():
    from ulstore.cli._plot import _natural, layer_of

    names = ["model.layers.10.w", "model.layers.2.b", "model.embed.weight", "model.layers.2.a"]
    got = sorted(names, key=lambda n: (_natural(layer_of(n)), _natural(n)))
    assert got == ["model.embed.weight", "model.layers.2.a", "model.layers.2.b", "model.layers.10.w"]


def test_missing_steps_are_named(url, capsys):
    err = _main(capsys, "diff", url, "0", "77", status=1).err
    assert "no step 77" in err
