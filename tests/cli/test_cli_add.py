"""``ulstore add`` warnings and clean failures, and progress bars on the commands that take a while."""

from __future__ import annotations

import json
import os

import pytest

import ulstore
from tests.cli.test_cli import assert_one_line_error, objects, run, write_steps
from tests.helpers.terminal import on_a_terminal


def test_failed_add_init_leaves_no_trajectory(tmp_path):
    good = write_steps(tmp_path, steps=(100,))[0]
    bad = tmp_path / "step_000200.safetensors"
    bad.write_bytes(good.read_bytes()[:-9])  # truncated: found only when the file is read
    # a missing file is found before anything is created
    assert_one_line_error(run("add", tmp_path / "a", tmp_path / "step_000999.safetensors", "--init"), "no such")
    assert not (tmp_path / "a").exists()
    # a damaged file is found while importing: what --init created is removed again
    assert_one_line_error(run("add", tmp_path / "b", bad, "--init"), "truncated")
    assert not (tmp_path / "b").exists()
    # a directory that was there before stays, empty, as it was
    (tmp_path / "c").mkdir()
    assert_one_line_error(run("add", tmp_path / "c", bad, "--init"), "truncated")
    assert (tmp_path / "c").is_dir() and not any((tmp_path / "c").iterdir())
    # a trajectory that existed before is never removed, even with --init
    run("add", tmp_path / "d", good, "--init", check=0)
    before = objects(tmp_path / "d")
    assert_one_line_error(run("add", tmp_path / "d", bad, "--init"), "truncated")
    assert objects(tmp_path / "d") == before
    # and a later success still works
    run("add", tmp_path / "b", good, "--init", check=0)
    assert ulstore.open(tmp_path / "b", mode="r").steps == [100]


def test_add_of_an_npz_member_that_is_not_npy_data_names_it(tmp_path):
    """#40: a member named ``*.npy`` holding other bytes was a raw AttributeError."""
    import zipfile

    import numpy as np

    path = tmp_path / "step_000300.npz"
    with zipfile.ZipFile(path, "w") as z:
        with z.open("w.npy", "w") as f:
            np.lib.format.write_array(f, np.ones(2, np.float32))
        z.writestr("opt.npy", b"\x00" * 40)
    p = run("add", tmp_path / "t", path, "--init")
    assert_one_line_error(p, str(path), "member 'opt.npy' is not npy data")
    assert "unexpected" not in p.stderr and not (tmp_path / "t").exists()


def test_add_below_its_parent_warns_that_the_branch_moves_back(tmp_path):
    paths = write_steps(tmp_path, steps=(100, 200, 300))
    url = tmp_path / "traj"
    run("add", url, *paths[1:], "--init", check=0)  # 200, 300
    p = run("add", url, paths[0], check=0)  # 100 after 300
    warning = [ln for ln in p.stderr.splitlines() if ln.startswith("ulstore: warning:")]
    assert len(warning) == 1, p.stderr
    assert "step 100 is below its parent 300" in warning[0] and "'main' moved back from 300 to 100" in warning[0]
    assert "--root --branch NAME" in warning[0]
    assert ulstore.open(url, mode="r").head() == 100  # what the warning says happened
    # the advice works: an older step on its own branch leaves main alone
    more = write_steps(tmp_path / "more", steps=(150,))
    p = run("add", url, more[0], "--parent", 100, "--branch", "old", check=0)
    assert "warning" not in p.stderr
    # with --json the warning is in the document; --quiet silences the text
    s50, s40, s45 = write_steps(tmp_path / "older", steps=(50, 40, 45))
    doc = json.loads(run("add", url, s50, "--json", check=0).stdout)
    assert len(doc["warnings"]) == 1 and "below its parent 100" in doc["warnings"][0]
    assert run("add", url, s40, "-q", check=0).stderr == ""
    # no warning when steps go up, nor for a failed add
    assert "warning" not in run("add", url, s45, check=0).stderr
    p = run("add", url, s40)
    assert "warning" not in p.stderr and p.returncode == 1


def test_add_in_another_dtype_says_the_dtype_moved_not_the_names(tmp_path):
    """A checkpoint saved in fp32 after bf16 ones keeps every name: the warning names the dtype change
    (renaming would not help), and a shape change too; a checkpoint with other names still gets the rename hint."""
    import ml_dtypes
    import numpy as np

    from ulstore.io import checkpoints as ckpt

    w = np.random.default_rng(1).normal(0, 0.02, (64, 32)).astype(np.float32)
    files = {
        "step_1.safetensors": {"w": w.astype(ml_dtypes.bfloat16), "b": w[0].astype(ml_dtypes.bfloat16)},
        "step_2.safetensors": {"w": w, "b": w[0]},  # every name kept, fp32 now
        "step_3.safetensors": {"w": w[:32], "b": w[0]},  # fp32 kept, w lost half its rows
        "step_4.safetensors": {"x.w": w[:32], "x.b": w[0]},  # renamed
    }
    for name, state in files.items():
        ckpt.save_safetensors(state, tmp_path / name, None)
    url = tmp_path / "traj"
    run("add", url, tmp_path / "step_1.safetensors", "--init", check=0)
    p = run("add", url, tmp_path / "step_2.safetensors", check=0)
    (warning,) = [ln for ln in p.stderr.splitlines() if ln.startswith("ulstore: warning:")]
    assert "'w' bfloat16 64x32 -> float32 64x32" in warning and "rename" not in warning, warning
    assert "in the parent's dtype" in warning
    p = run("add", url, tmp_path / "step_3.safetensors", check=0)
    (warning,) = [ln for ln in p.stderr.splitlines() if ln.startswith("ulstore: warning:")]
    assert "1 tensor has another dtype or shape than in parent step 2 ('w' float32 64x32 -> float32 32x32)" in warning
    assert "step_3.safetensors: step 3:" in warning, warning
    assert "parent's dtype to" not in warning and "rename" not in warning
    p = run("add", url, tmp_path / "step_4.safetensors", check=0)
    (warning,) = [ln for ln in p.stderr.splitlines() if ln.startswith("ulstore: warning:")]
    assert "--rename-prefix x.=" in warning, warning


# nine commands on a pseudo-terminal, each a process (11 s of CPU): the slow lane; the fast lane keeps the progress
# bar of add and of the demo on a terminal (test_progress_bar_only_on_a_terminal, test_demo_shows_progress_...)
@pytest.mark.slow
def test_long_commands_show_what_they_are_doing_on_a_terminal(tmp_path):
    url = tmp_path / "traj"
    run("add", url, *write_steps(tmp_path), "--init", check=0)
    for args, shown in (
        (("verify", url), "verifying 3 steps"),
        (("verify", url, 200), "verifying step 200"),
        (("stats", url), "reading 3 step manifests"),
        (("rm", url, 200), "deleting step 200"),
        (("gc", url), "removing blobs no step uses"),
    ):
        err, _ = on_a_terminal(*args)
        assert shown in err, (args, err)
        err, _ = on_a_terminal(*args[:2], "--quiet") if args[0] != "rm" else ("", "")
        assert err == "", (args, err)


def test_demo_shows_progress_from_start_to_end(tmp_path):
    run("demo", "d", "--preset", "tiny", "--steps", 2, cwd=tmp_path, check=0)  # so that the next run replaces one
    err, out = on_a_terminal("demo", "d", "--preset", "tiny", "--steps", 4, cwd=tmp_path)
    positions = [err.find(s) for s in ("preparing", "training", "adding up the sizes", "verifying 5 steps")]
    assert -1 not in positions and positions == sorted(positions), err
    assert "Verify:" in out


def test_demo_suggests_a_plot_only_with_matplotlib(tmp_path):
    out = run("demo", "d", "--preset", "tiny", "--steps", 2, cwd=tmp_path, check=0).stdout
    assert "--plot sizes.png" in out and "pip install" not in out
    blocker = tmp_path / "block"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    out = run("demo", "d", "--preset", "tiny", "--steps", 2, cwd=tmp_path, env=env, check=0).stdout
    line = next(ln for ln in out.splitlines() if "ulstore stats" in ln)
    assert "--plot sizes.png" in line and "[plot]" in line and line.strip().startswith("ulstore stats d")


def test_log_shows_the_anchor_distance_after_rm(tmp_path):
    paths = write_steps(tmp_path, steps=(1, 2, 3, 4))
    url = tmp_path / "traj"
    run("add", url, *paths, "--init", "--anchor-every", 16, check=0)  # a fixed count: one chain of deltas
    assert [s["anchor_distance"] for s in json.loads(run("log", url, "--json", check=0).stdout)["steps"]] == [
        3,
        2,
        1,
        0,
    ]
    run("rm", url, 2, check=0)
    # steps 3 and 4 now reach the anchor (step 1) in 1 and 2 steps: their chunks were re-coded against step 1
    doc = json.loads(run("log", url, "--json", check=0).stdout)
    assert {s["step"]: s["anchor_distance"] for s in doc["steps"]} == {4: 2, 3: 1, 1: 0}
