"""A step, ref, tensor or file that does not exist is named with what does: the closest matches (#38 item 6).

The CLI said which steps exist; Python said "no such step", and a mistyped tensor name was a bare
``KeyError('layers.0.atn.weight')`` from zarr.  Both now share one helper
(:func:`ulstore.core.formatting.missing_step_message`, :func:`~ulstore.core.formatting.close_matches`).
"""

from __future__ import annotations

import numpy as np
import pytest

import ulstore
from ulstore.errors import NotFoundError, StepNotFoundError, TensorNotFoundError

NAMES = ("embed.weight", "layers.0.attn.weight", "layers.0.mlp.weight", "layers.1.attn.weight", "enc/w")


@pytest.fixture
def traj(tmp_path):
    t = ulstore.open(tmp_path / "run", mode="w")
    for s in (0, 10, 20):
        t.commit(s, {n: np.full((4, 4), s + i, np.float32) for i, n in enumerate(NAMES)}, files={"config.json": b"{}"})
    return t


def test_a_missing_step_names_the_steps_that_exist(traj):
    url = traj.url
    calls = {
        "traj[999]": lambda: traj[999],
        "traj.read(999)": lambda: traj.read(999),
        "traj.read(999, names=...)": lambda: traj.read(999, names=["embed.weight"]),
        "traj.read_box(999, ...)": lambda: traj.read_box(999, "embed.weight", (0, 0), (1, 1)),
        "traj.read_boxes(999, ...)": lambda: traj.read_boxes(999, [("embed.weight", (0, 0), (1, 1))]),
        "traj.info(999)": lambda: traj.info(999),
        "traj.tensors(999)": lambda: traj.tensors(999),
    }
    for what, call in calls.items():
        with pytest.raises(StepNotFoundError) as e:
            call()
        assert str(e.value) == f"no step 999 in {url}; its steps are 0, 10, 20", what
        assert e.value.step == 999 and isinstance(e.value, KeyError), what
    with pytest.raises(StepNotFoundError, match="no step or ref named 'mian'.*did you mean 'main'"):
        traj["mian"]
    assert 999 not in traj and "mian" not in traj and 10 in traj


def test_a_missing_step_of_a_long_run_names_the_nearest(tmp_path):
    traj = ulstore.open(tmp_path / "long", mode="w")
    for s in range(0, 1000, 50):
        traj.commit(s, {"w": np.zeros(2, np.float32)})
    with pytest.raises(StepNotFoundError) as e:
        traj.read(420)
    assert "the nearest are 350, 400, 450, 500" in str(e.value) and "20 steps from 0 to 950" in str(e.value)


def test_a_mistyped_tensor_name_names_the_closest(traj):
    hint = "did you mean 'layers.0.attn.weight'"
    # zarr group access: a KeyError (TensorNotFoundError) that helps, not a bare KeyError('layers.0.atn.weight')
    with pytest.raises(TensorNotFoundError, match=hint) as e:
        traj[10]["layers.0.atn.weight"]
    assert isinstance(e.value, KeyError) and e.value.step == 10 and e.value.tensor == "layers.0.atn.weight"
    assert "5 tensors" in str(e.value) and "traj.tensors(10)" in str(e.value)
    with pytest.raises(TensorNotFoundError, match=hint):
        traj.read(10, names=["layers.0.atn.weight"])
    with pytest.raises(TensorNotFoundError, match=hint):
        traj.read_box(10, "layers.0.atn.weight", (0, 0), (1, 1))
    with pytest.raises(TensorNotFoundError, match=hint):
        traj.read_boxes(10, [("embed.weight", (0, 0), (1, 1)), ("layers.0.atn.weight", (0, 0), (1, 1))])
    with pytest.raises(TensorNotFoundError, match=hint):
        traj.pieces(10, "layers.0.atn.weight")
    with pytest.raises(TensorNotFoundError, match=hint):
        list(traj.changes(10, ["layers.0.atn.weight"]))
    # nested names: through the subgroup too
    with pytest.raises(TensorNotFoundError, match="did you mean 'enc/w'"):
        traj[10]["enc"]["x"]
    with pytest.raises(TensorNotFoundError, match="did you mean 'enc/w'"):
        traj[10]["enc/x"]
    # nothing close: no guess, but how to list them
    with pytest.raises(TensorNotFoundError, match=r"no tensor 'zzz' in step 10 \(5 tensors: ") as e:
        traj[10]["zzz"]
    assert "did you mean" not in str(e.value)
    with pytest.raises(NotFoundError, match="did you mean 'config.json'"):
        traj.read_file(10, "config.jsn")
    # what still works as before
    g = traj[10]
    assert "layers.0.atn.weight" not in g and g.get("layers.0.atn.weight") is None
    assert g["layers.0.attn.weight"][0, 0] == 11 and g["enc"]["w"][0, 0] == 14
    assert isinstance(g, __import__("zarr").Group)


def test_close_matches_is_one_public_helper():
    from ulstore.core.formatting import close_matches, missing_step_message

    assert close_matches("layers.0.atn.weight", NAMES)[:2] == ["layers.0.attn.weight", "layers.1.attn.weight"]
    assert close_matches("zzz", NAMES) == []
    assert missing_step_message("runs/a", 5, [1, 2]) == "no step 5 in runs/a; its steps are 1, 2"
    assert missing_step_message("runs/a", 5, []) == "no step 5: runs/a has no steps yet"
    assert missing_step_message("runs/a", "mian", [1], refs=["main"]) == (
        "no step or ref named 'mian' in runs/a; did you mean 'main'? (refs: main)"
    )
