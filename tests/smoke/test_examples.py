"""Run every script in examples/ on tiny models, as CI does; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
import uuid
from pathlib import Path

import numpy as np
import pytest

import ulstore
from tests.helpers.bits import assert_bits_equal
from tests.helpers.moto import MotoS3
from ulstore.io import to_torch

pytestmark = pytest.mark.slow  # real multi-process jobs: the slow lane (CI=true, --slow)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name, *args, env=None, cwd=None):
    """Run an example; it must succeed and leave nothing in the temporary directory (#38: examples clean up
    after themselves).  It runs with a temporary directory of its own (``TMPDIR``), empty before and after."""
    scratch = Path(tempfile.mkdtemp(prefix=f"example-{Path(name).stem}-"))
    try:
        p = subprocess.run(
            [sys.executable, str(EXAMPLES / name), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
            # a crash in a child (e.g. a torch worker aborting) prints every thread's Python stack
            env={**os.environ, "PYTHONFAULTHANDLER": "1", "TMPDIR": str(scratch), **(env or {})},
        )
        assert p.returncode == 0, f"{name} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
        # (torch creates its compile cache, torchinductor_<user>, in the temporary directory on import: torch's,
        # shared by every torch program, not the example's)
        left = sorted(
            str(q.relative_to(scratch))
            for q in scratch.rglob("*")
            if not q.relative_to(scratch).parts[0].startswith("torchinductor_")
        )
        assert not left, f"{name} left in the temporary directory: {left[:10]}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return p.stdout


def documented(name) -> list[list[str]]:
    """The command lines an example's docstring documents (``python examples/NAME ...``), as argument lists."""
    doc = (EXAMPLES / name).read_text().split('"""')[1]
    commands = []
    for line in doc.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line.startswith(f"python examples/{name}"):
            commands.append(shlex.split(line)[2:])
    assert commands, f"{name} documents no command"
    return commands


def test_every_example_documents_its_command():
    for path in sorted(EXAMPLES.glob("*.py")):
        assert documented(path.name), path.name


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


def test_every_example_is_in_the_examples_readme():
    listed = set(re.findall(r"^\| \[`(\w+\.py)`\]", (EXAMPLES / "README.md").read_text(), re.M))
    assert listed == {p.name for p in EXAMPLES.glob("*.py")}, listed


def test_pytorch_training_loop(tmp_path):
    pytest.importorskip("torch")
    (args,) = documented("pytorch_training_loop.py")  # --steps 200 --every 20 --out runs/loop
    out = run_example("pytorch_training_loop.py", *args, cwd=tmp_path)
    assert "outputs identical: True" in out
    traj = ulstore.open(tmp_path / "runs" / "loop", mode="r")
    assert traj.steps == list(range(0, 201, 20)) and "loss" in traj.info(80).metadata


def test_fsdp_training(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    for _ in range(2):  # run again: it starts over (steps are immutable; it used to fail on its old steps)
        out = run_example("fsdp_training.py", "--steps", 3, "--world", 2, "--out", tmp_path / "fsdp")
        assert "outputs identical: True" in out and "restored step 3 on 1 process" in out
    traj = ulstore.open(tmp_path / "fsdp", mode="r")
    assert traj.steps == [0, 1, 2, 3] and traj.info(3).metadata["dcp"] == {"world_size": 2}


def test_hf_trainer_callback_script(tmp_path):
    pytest.importorskip("torch")
    (args,) = documented("hf_trainer_callback.py")  # --out runs/hf --steps 20 --every 5
    for _ in range(2):  # run again, as a newcomer does: it starts over instead of finding its old steps
        out = run_example("hf_trainer_callback.py", *args, cwd=tmp_path)
        assert "committed steps [0, 5, 10, 15, 20]" in out and "verified: True" in out


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
    assert_bits_equal(got, expected[4], "weight")

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
    """The documented command: the base ends on an anchor, so both checks hold."""
    (args,) = documented("finetune_branch.py")  # --out runs/branches --base-steps 32 --ft-steps 10
    out = run_example("finetune_branch.py", *args, cwd=tmp_path)
    assert "heads exact: True" in out and "branches cheaper than stored alone: True" in out
    assert "base head 32 is 0 step(s) past an anchor" in out
    traj = ulstore.open(tmp_path / "runs" / "branches", mode="r")
    assert traj.refs == {"main": 32, "ft-a": 1010, "ft-b": 2010}
    assert traj.info(1001).parent == 32 and traj.info(2001).parent == 32


def test_finetune_branch_reports_the_two_checks_separately(tmp_path):
    """A base head 14 steps past an anchor: the branches are exact but pay for an anchor, and the script says so."""
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_branch.py"), "--preset", "tiny", "--base-steps", "30"]
        + ["--ft-steps", "10", "--out", str(tmp_path / "br")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "heads exact: True" in p.stdout and "branches cheaper than stored alone: False" in p.stdout
    assert "base head 30 is 14 step(s) past an anchor" in p.stdout and "an anchor fell inside a branch" in p.stdout
    main_row = next(line.split() for line in p.stdout.splitlines() if line.startswith("main "))
    assert main_row[1:3] == ["31", "2"], main_row  # 31 base steps, anchors at 0 and 16


@pytest.fixture(scope="module")
def s3_endpoint():
    s3 = MotoS3()
    yield s3.endpoint
    s3.stop()


def test_s3_lazy_slice(tmp_path, s3_endpoint):
    """The documented local-endpoint command, pointed at this test's moto server and a fresh prefix."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    url = f"s3://examples/{uuid.uuid4().hex}"
    local = [c for c in documented("s3_lazy_slice.py") if "--endpoint-url" in c]
    assert local == [["s3://test/run", "--endpoint-url", "http://127.0.0.1:5000", "--create-bucket"]]
    args = [url if a == "s3://test/run" else s3_endpoint if a == "http://127.0.0.1:5000" else a for a in local[0]]
    out = run_example("s3_lazy_slice.py", *args, env=env)
    assert "equal to the same slice of the fully decoded tensor: True" in out
    assert "fetched only what the slice needs: True" in out
    # a second run reads the existing trajectory without writing
    out = run_example("s3_lazy_slice.py", url, "--endpoint-url", s3_endpoint, env=env)
    assert "wrote" not in out and "True" in out
    traj = ulstore.open(
        url, mode="r", storage_options={"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    )
    assert len(traj.steps) > 1
    step = traj.steps[len(traj.steps) // 2]
    assert np.asarray(traj[step]["lm_head.weight"][0:2, 0:2]).shape == (2, 2)


def test_weight_sync_http_documented_command(tmp_path):
    """``python examples/weight_sync_http.py``: trainer and replica on localhost, as documented."""
    commands = documented("weight_sync_http.py")
    assert [] in commands  # the plain command
    out = run_example("weight_sync_http.py", cwd=tmp_path)
    assert "all versions exact: True" in out and "DIFFERENT" not in out


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


def test_weight_sync_http_with_its_default_store_leaves_nothing_behind():
    """The documented command with no --url stores in a temporary directory: removed at the end (#38: it
    left a ``weight-sync-*`` directory in /tmp per run)."""
    (args, _) = documented("weight_sync_http.py")  # (no arguments), --steps 20 --url s3://my-bucket/run-1
    assert args == []
    out = run_example("weight_sync_http.py", *args, "--steps", 3)
    assert "all versions exact: True" in out
