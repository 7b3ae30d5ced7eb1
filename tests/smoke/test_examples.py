"""Run every script in examples/ on tiny models, as CI does; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
import uuid
from pathlib import Path

import numpy as np
import pytest

import ulstore
from tests.helpers.moto import MotoS3
from ulstore.io import to_torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name, *args, env=None, cwd=None):
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    assert p.returncode == 0, f"{name} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name.removesuffix('.py')}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_run_by_a_test():
    """Each script in examples/ is named by some test module (here, or the one its author added)."""
    mine = {"pytorch_training_loop.py", "hf_trainer_callback.py", "finetune_branch.py", "s3_lazy_slice.py"}
    tests_text = "\n".join(p.read_text() for p in Path(__file__).parents[1].rglob("test_*.py"))
    names = {p.name for p in EXAMPLES.glob("*.py")}
    assert mine <= names
    assert [n for n in sorted(names) if n not in tests_text] == []


def test_pytorch_training_loop(tmp_path):
    pytest.importorskip("torch")
    out = run_example("pytorch_training_loop.py", "--steps", 12, "--every", 4, "--width", 32, "--out", tmp_path / "run")
    assert "outputs identical: True" in out
    traj = ulstore.open(tmp_path / "run", mode="r")
    assert traj.steps == [0, 4, 8, 12] and "loss" in traj.info(8).metadata


def test_fsdp_training(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    out = run_example("fsdp_training.py", "--steps", 3, "--world", 2, "--out", tmp_path / "fsdp")
    assert "outputs identical: True" in out and "restored step 3 on 1 process" in out
    traj = ulstore.open(tmp_path / "fsdp", mode="r")
    assert traj.steps == [0, 1, 2, 3] and traj.info(3).metadata["dcp"] == {"world_size": 2}


def test_hf_trainer_callback_script(tmp_path):
    pytest.importorskip("torch")
    out = run_example("hf_trainer_callback.py", "--steps", 7, "--every", 3, "--out", tmp_path / "hf")
    assert "committed steps [0, 3, 6, 7]" in out and "verified: True" in out


def test_hf_trainer_callback_with_fake_trainer_objects(tmp_path):
    """Drive the callback the way transformers' CallbackHandler does, with minimal stand-ins."""
    torch = pytest.importorskip("torch")
    example = load_example("hf_trainer_callback.py")
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    control = types.SimpleNamespace(should_save=False, should_training_stop=False)
    state = types.SimpleNamespace(global_step=0, epoch=0.0, log_history=[], is_world_process_zero=True)

    cb = example.UlstoreCallback(tmp_path / "t", every=2)
    if example._trainer_callback_base() is not None:  # transformers installed: a real TrainerCallback
        assert isinstance(cb, example._trainer_callback_base())
    # the Trainer calls every event by name; unknown ones are no-ops
    for event in (
        "on_init_end",
        "on_epoch_begin",
        "on_log",
        "on_evaluate",
        "on_prediction_step",
        "on_optimizer_step",
        "on_some_future_event",
    ):
        assert getattr(cb, event)(args, state, control, model=model) is None
    with pytest.raises(AttributeError):
        cb.not_an_event  # noqa: B018

    cb.on_train_begin(args, state, control, model=model)
    expected = {}
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.add_(0.01)
        state.global_step = step
        state.log_history.append({"loss": 1.0 / step, "learning_rate": 1e-3, "step": step})
        cb.on_step_end(args, state, control, model=model)
        expected[step] = model.weight.detach().clone()
    cb.on_train_end(args, state, control, model=model)
    traj = ulstore.open(tmp_path / "t", mode="r")
    assert traj.steps == [0, 2, 4, 5] == cb.committed
    assert traj.info(4).metadata == {"global_step": 4, "loss": 0.25, "learning_rate": 1e-3, "epoch": 0.0}
    got = to_torch(traj, 4)["weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), expected[4].view(torch.int16))

    # a resumed run skips stored steps; other ranks never write; every=None commits on save
    again = example.UlstoreCallback(tmp_path / "t", every=2)
    state.global_step = 4
    again.on_step_end(args, state, control, model=model)
    assert again.committed == []
    rank1 = example.UlstoreCallback(tmp_path / "t1", every=1)
    rank1.on_step_end(args, types.SimpleNamespace(global_step=1, is_world_process_zero=False), control, model=model)
    assert not (tmp_path / "t1").exists()
    on_save = example.UlstoreCallback(tmp_path / "t2", every=None, include_initial=False)
    state.global_step = 10
    on_save.on_step_end(args, state, control, model=model)
    on_save.on_save(args, state, control, model=model)
    on_save.on_train_end(args, state, control, model=model)
    assert on_save.committed == [10]


def test_finetune_branch(tmp_path):
    out = run_example(
        "finetune_branch.py", "--preset", "tiny", "--base-steps", 6, "--ft-steps", 3, "--out", tmp_path / "br"
    )
    assert "branches cheaper than standalone, heads exact: True" in out
    traj = ulstore.open(tmp_path / "br", mode="r")
    assert traj.refs == {"main": 6, "ft-a": 1003, "ft-b": 2003}
    assert traj.info(1001).parent == 6 and traj.info(2001).parent == 6


@pytest.fixture(scope="module")
def s3_endpoint():
    s3 = MotoS3()
    yield s3.endpoint
    s3.stop()


def test_s3_lazy_slice(tmp_path, s3_endpoint):
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    url = f"s3://examples/{uuid.uuid4().hex}"
    out = run_example("s3_lazy_slice.py", url, "--endpoint-url", s3_endpoint, "--create-bucket", "--steps", 5, env=env)
    assert "equal to the same slice of the fully decoded tensor: True" in out
    assert "fetched only what the slice needs: True" in out
    # a second run reads the existing trajectory without writing
    out = run_example("s3_lazy_slice.py", url, "--endpoint-url", s3_endpoint, env=env)
    assert "wrote" not in out and "True" in out
    traj = ulstore.open(
        url, mode="r", storage_options={"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    )
    assert traj.steps == list(range(6))
    assert np.asarray(traj[3]["lm_head.weight"][0:2, 0:2]).shape == (2, 2)


def test_readme_python_example(tmp_path):
    """The README's Python block runs as written (in a scratch directory)."""
    pytest.importorskip("torch")
    readme = (EXAMPLES.parent / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    assert blocks, "README has no python example"
    for code in blocks:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
    traj = ulstore.open(tmp_path / "runs" / "my-run", mode="r")
    assert traj.steps == list(range(0, 101, 10))
