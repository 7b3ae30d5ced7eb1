"""Tests for the ``ulstore`` command line: every command (a subprocess in CI, see :func:`run`), errors, exit codes,
docs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ulstore
from tests.helpers import lanes
from tests.helpers.bits import assert_bits_equal
from tests.helpers.store import entries
from tests.helpers.terminal import on_a_terminal
from ulstore import cli
from ulstore.io import checkpoints as ckpt

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(
    *args, cwd=None, env=None, check=None, stdin=subprocess.DEVNULL, process=None, **kw
) -> subprocess.CompletedProcess:
    """``ulstore ARGS`` with stderr not a TTY (no progress bars).

    ``python -m ulstore.cli`` in a subprocess in the slow lane (CI), when ``process``, or when ``env`` sets another
    PYTHONPATH; in the fast lane, :func:`ulstore.cli.main` in this process with the same environment, directory,
    empty stdin and captured output: about 1 s of CPU less a command (no interpreter to start, no numpy, zarr and
    ml_dtypes to import).  CI runs every command as a real process.
    """
    full_env = {k: v for k, v in os.environ.items() if k != "ULSTORE_STORAGE_OPTIONS"}
    full_env.update({"COLUMNS": "100", **(env or {})})
    if process is None:  # another PYTHONPATH (hiding a module from the command) only acts on a new interpreter
        process = lanes.slow_lane() or full_env.get("PYTHONPATH") != os.environ.get("PYTHONPATH")
    if process:
        p = subprocess.run(
            [sys.executable, "-m", "ulstore.cli", *map(str, args)],
            cwd=cwd,
            env=full_env,
            capture_output=True,
            text=True,
            stdin=stdin,
            timeout=300,
            **kw,
        )
    else:
        assert stdin is subprocess.DEVNULL and not kw, "a command with input or options runs with process=True"
        p = _in_process([str(a) for a in args], cwd, full_env)
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def _in_process(argv: list[str], cwd, env: dict) -> subprocess.CompletedProcess:
    """``cli.main(argv)`` as the subprocess would run it: ``env`` is the whole environment, ``cwd`` the directory,
    stdin empty, stdout and stderr captured (not TTYs); everything put back after."""
    saved_env, out, err = dict(os.environ), io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    try:
        with (
            contextlib.chdir(cwd or os.getcwd()),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            _stdin(io.StringIO()),
        ):
            try:
                status = cli.main(argv)
            except SystemExit as e:  # as `python -m ulstore.cli` would exit
                status = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["ulstore", *argv], status, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _stdin(stream):
    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def assert_one_line_error(p, *fragments, status=1):
    assert p.returncode == status, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("ulstore: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def write_steps(d: Path, steps=(100, 200, 300)) -> list[Path]:
    """Small safetensors checkpoints with every interesting dtype, changing a little each step."""
    rng = np.random.default_rng(0)
    base = rng.normal(0, 0.02, (32, 16)).astype(np.float32)
    paths = []
    for i, s in enumerate(steps):
        state = {
            "model.w": (base + np.float32(1e-3 * i)).astype(ml_dtypes.bfloat16),
            "model.h": (base[:4] * (i + 1)).astype(np.float16),
            "model.f": base[:2] + np.float32(i),
            "model.ids": np.arange(6, dtype=np.int64) + i,
            "model.empty": np.zeros((0, 3), ml_dtypes.bfloat16),
        }
        p = d / f"step_{s:06d}.safetensors"
        ckpt.save_safetensors(state, p, {"format": "pt"})
        paths.append(p)
    return paths


def objects(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def store(tmp_path):
    """A trajectory with steps 100, 200, 300 imported through the CLI."""
    paths = write_steps(tmp_path)
    url = tmp_path / "traj"
    run("init", url, "--chunk-bytes", 256, check=0)
    run("add", url, *paths, check=0)
    return url


# ----------------------------------------------------------------------- help


@pytest.mark.parametrize(
    "command", [None, "init", "add", "log", "ls", "export", "verify", "stats", "diff", "gc", "rm", "upgrade", "demo"]
)
def test_help_for_every_command(command, capsys):
    argv = [command, "--help"] if command else ["--help"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ulstore{' ' + command if command else ''}")
    if command:
        assert "examples:" in out and "--json" in out


def test_console_script_and_version():
    p = subprocess.run(["ulstore", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"ulstore {ulstore.__version__}"


def test_usage_errors_exit_2(tmp_path):
    for argv in (
        ["bogus"],
        ["-q"],  # options but no command (a bare `ulstore` prints the help: tests/cli/test_cli_entry.py)
        ["add", str(tmp_path)],
        ["export", "x", "notastep?", "o.safetensors", "--nope"],
        ["demo", "--steps", "0"],
    ):
        p = run(*argv)
        assert p.returncode == 2, (argv, p.stderr)
        assert "usage: ulstore" in p.stderr and "Traceback" not in p.stderr
    # usage errors only found after parsing exit 2 as well, with one line (docs/cli.md, README)
    assert_one_line_error(run("log", "memory://x", "-o", "noequals"), "-o expects KEY=VALUE", status=2)
    assert_one_line_error(run("log", "memory://x", env={"ULSTORE_STORAGE_OPTIONS": "[1]"}), "JSON object", status=2)


# ------------------------------------------------------------- the commands


def test_init_and_add_steps_from_names(tmp_path):
    paths = write_steps(tmp_path)
    url = tmp_path / "traj"
    p = run("init", url, "--anchor-every", 8, "--json", check=0)
    assert json.loads(p.stdout) == {
        "url": str(url),
        "anchor_every": 8,
        "anchor_cost": None,  # a fixed count given: no cost policy
        "chunk_bytes": 4 << 20,
        "steps": 0,
    }
    p = run("init", url)
    assert_one_line_error(p, "already exists")
    p = run("add", url, *reversed(paths), "--json", check=0)
    added = json.loads(p.stdout)["added"]
    assert [r["step"] for r in added] == [100, 200, 300]
    assert [r["parent"] for r in added] == [None, 100, 200]
    assert p.stderr == ""  # not a TTY: no progress bar
    traj = ulstore.open(url, mode="r")
    assert traj.steps == [100, 200, 300] and traj.head() == 300 and traj.anchor_every == 8


def test_init_takes_the_cost_policys_k_or_a_fixed_count_not_both(tmp_path):
    p = run("init", tmp_path / "k", "--anchor-cost", "3.5", "--json", check=0)
    assert json.loads(p.stdout)["anchor_cost"] == 3.5
    assert ulstore.open(tmp_path / "k", mode="r").anchor_cost == 3.5
    for bad in ("0", "-1", "nan", "inf", "x"):
        p = run("init", tmp_path / f"bad{bad}", "--anchor-cost", bad)
        assert p.returncode == 2 and "expected a positive number" in p.stderr, (bad, p.stderr)
    p = run("init", tmp_path / "both", "--anchor-cost", "2", "--anchor-every", "8")
    assert p.returncode == 2 and "not allowed with argument" in p.stderr, p.stderr
    assert not (tmp_path / "both").exists()


def test_add_directory_branch_parent_and_step(tmp_path, store):
    # a sharded HF directory named by step, on a branch off step 200
    state = {f"layer{i}": np.full((8, 8), i, np.float32) for i in range(3)}
    ckpt.save_safetensors(state, tmp_path / "out" / "checkpoint-1200", max_shard_size=300)
    p = run("add", store, tmp_path / "out" / "checkpoint-1200", "--parent", 200, "--branch", "sft", check=0)
    assert "step 1200" in p.stdout and "sharded" in p.stdout
    # an unnamed file needs --step
    ckpt.save_npz({"w": np.ones(3, np.float32)}, tmp_path / "final.npz")
    assert_one_line_error(run("add", store, tmp_path / "final.npz"), "cannot tell the step", "--step", status=2)
    run("add", store, tmp_path / "final.npz", "--step", 1300, "--branch", "sft", check=0)
    traj = ulstore.open(store, mode="r")
    assert traj.refs == {"main": 300, "sft": 1300}
    assert traj.info(1200).parent == 200 and traj.info(1300).parent == 1200
    # --step with several files is a user error; --init creates a missing trajectory
    assert_one_line_error(
        run("add", store, tmp_path / "final.npz", tmp_path / "final.npz", "--step", 5), "--step", status=2
    )
    assert_one_line_error(run("add", tmp_path / "new", tmp_path / "final.npz", "--step", 1), "ulstore init")
    run("add", tmp_path / "new", tmp_path / "final.npz", "--step", 1, "--init", check=0)


def test_log(store):
    p = run("log", store, check=0)
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["step", "parent", "anchor", "tensors", "raw", "stored", "created", "refs", "details"]
    assert [ln.split()[0] for ln in lines[1:-1]] == ["300", "200", "100"]
    assert lines[-1].startswith("3 steps: raw ")
    assert "main" in lines[1] and "step_000300.safetensors" in lines[1] and "anchor" in lines[3]
    doc = json.loads(run("log", store, 200, "--json", check=0).stdout)
    assert [s["step"] for s in doc["steps"]] == [200, 100]
    assert doc["steps"][0]["source"] == "step_000200.safetensors"


def test_ls(store):
    p = run("ls", store, 200, check=0)
    assert "model.w" in p.stdout and "bfloat16" in p.stdout and "32x16" in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("5 tensors")
    doc = json.loads(run("ls", store, "main", "--json", check=0).stdout)
    assert doc["step"] == 300
    assert {t["name"]: t["shape"] for t in doc["tensors"]}["model.empty"] == [0, 3]


def test_export_every_format_byte_exact(tmp_path, store):
    src = ckpt.load(tmp_path / "step_000200.safetensors")
    for out in ("m.safetensors", "hf", "m.pt", "m.npz"):
        p = run("export", store, 200, tmp_path / "x" / out, check=0)
        assert f"wrote step 200 to {tmp_path / 'x' / out}" in p.stdout
        if out == "hf":  # what it is, not the --format name of it ("sharded", even for one shard)
            assert f"to {tmp_path / 'x' / out} (Hugging Face directory, " in p.stdout and "sharded" not in p.stdout
        got = ckpt.load(tmp_path / "x" / out)
        assert set(got.tensors) == set(src.tensors)
        for k, v in src.tensors.items():
            assert_bits_equal(got.tensors[k], v, f"{out}: {k}")
    assert ckpt.load(tmp_path / "x" / "m.safetensors").metadata == {"format": "pt"}
    doc = json.loads(run("export", store, 300, tmp_path / "sh", "--shard-size", "600", "--json", check=0).stdout)
    assert doc["format"] == "sharded" and len(doc["files"]) >= 3
    # existing output: refused, untouched; --force replaces it
    before = (tmp_path / "x" / "m.npz").read_bytes()
    assert_one_line_error(
        run("export", store, 300, tmp_path / "x" / "m.npz"), "already exists", "pass --force to replace it"
    )
    assert (tmp_path / "x" / "m.npz").read_bytes() == before
    run("export", store, 300, tmp_path / "x" / "m.npz", "--force", check=0)
    assert_one_line_error(run("export", store, 999, tmp_path / "y.safetensors"), "no step 999", "100, 200, 300")
    assert_one_line_error(run("export", store, 300, tmp_path / "y.h5"), "cannot tell the export format", status=2)
    assert not (tmp_path / "y.safetensors").exists()
    assert not any(p.name.startswith(".") for p in (tmp_path / "x").iterdir())


def test_verify_ok_and_damaged(store):
    p = run("verify", store, check=0)
    assert p.stdout.startswith("OK: 3 steps")
    assert json.loads(run("verify", store, 200, "--json", check=0).stdout)["ok"] is True
    traj = ulstore.open(store, mode="r")
    pid, off, n = next(e["blob"] for e in entries(traj, 200) if e["blob"][2] > 64)
    pack = store / "packs" / f"{pid}.pack"
    data = bytearray(pack.read_bytes())
    data[off + n // 2] ^= 0x40
    pack.write_bytes(bytes(data))
    p = run("verify", store)
    assert p.returncode == 1 and p.stdout.startswith("DAMAGED: 1 object failed the checks") and pid in p.stdout
    p = run("verify", store, "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["ok"] is False


def test_stats_and_plot(tmp_path, store):
    p = run("stats", store, "--plot", tmp_path / "plots" / "sizes.png", check=0)
    assert "per step:" in p.stdout and "per tensor" in p.stdout and "bits/w" in p.stdout
    png = (tmp_path / "plots" / "sizes.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 1000
    doc = json.loads(run("stats", store, "--json", check=0).stdout)
    traj_stats = ulstore.open(store, mode="r").stats()
    assert doc["total"]["stored_bytes"] == traj_stats["stored_bytes"]
    assert [s["step"] for s in doc["steps"]] == [100, 200, 300]
    assert {t["name"] for t in doc["tensors"]} == {"model.w", "model.h", "model.f", "model.ids", "model.empty"}


def test_stats_says_when_a_step_was_coded_against_another_sharding(tmp_path, capsys):
    w = np.arange(96, dtype=np.float32).reshape(24, 4)
    traj = ulstore.open(tmp_path / "t", mode="w", chunk_bytes=64)
    traj.commit(0, {"w": w})
    records = []
    for a, b in ((0, 10), (10, 24)):  # step 1 from two writers (ranks): two pieces where step 0 had one
        pw = traj.piece_writer(1)
        pw.write("w", w[a:b] + 1, offset=(a, 0), shape=w.shape)
        records += pw.close()
    traj.finalize(1, records)
    assert cli.main(["stats", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["step", "parent"])
    assert header.split()[-1] == "resharded" and "assembled from the parent's other pieces" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()][:2]
    assert rows[0][-1] == "0" and int(rows[1][-1]) == sum(c.kind == "delta" for c in traj.changes(1)) > 0


def test_stats_plot_without_matplotlib(tmp_path, store):
    blocker = tmp_path / "block"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    p = run("stats", store, "--plot", tmp_path / "s.png", env={"PYTHONPATH": str(blocker)})
    from ulstore.core.install import install_command

    assert_one_line_error(p, "matplotlib", install_command("plot"))  # (#38: the command for this install)
    assert not (tmp_path / "s.png").exists()


def test_rm_and_gc(store):
    before = len(objects(store / "packs"))
    p = run("rm", store, 300, check=0)
    assert "deleted step 300" in p.stdout
    traj = ulstore.open(store, mode="r")
    assert traj.steps == [100, 200] and traj.head() == 200
    doc = json.loads(run("gc", store, "--json", check=0).stdout)
    assert doc["packs"] > 0 and doc["bytes"] > 0
    assert len(objects(store / "packs")) == before - doc["packs"] + (1 if doc["repacked"] else 0)
    run("verify", store, check=0)
    assert_one_line_error(run("rm", store, 300), "no step 300", "its steps are 100, 200")


def test_gc_older_than_takes_an_age_with_a_unit(store, monkeypatch):
    """``--older-than 1h`` (as people write ages), or seconds as before; a malformed age is a usage error."""
    seen = []
    real = ulstore.Trajectory.gc

    def gc(self, *args, **kwargs):
        seen.append(kwargs.get("older_than"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ulstore.Trajectory, "gc", gc)
    for age, seconds in [("3600", 3600.0), ("90s", 90.0), ("30m", 1800.0), ("1.5h", 5400.0), ("2d", 172800.0)]:
        assert cli.main(["gc", str(store), "--older-than", age, "-q"]) == 0
        assert seen.pop() == seconds
    for bad in ("1y", "-5m", "h", "nan"):
        p = run("gc", store, f"--older-than={bad}")
        assert p.returncode == 2 and "expected an age" in p.stderr.splitlines()[-1], (bad, p.stderr)


def test_upgrade_format1(tmp_path):
    old = Path(__file__).resolve().parent.parent / "fixtures" / "store_format1"
    p = run("log", old)
    assert p.returncode == 1 and f"ulstore upgrade {old}" in p.stderr
    new = tmp_path / "new"
    doc = json.loads(run("upgrade", old, new, "--json", check=0).stdout)
    assert doc["steps"] == 7 and doc["refs"] == {"main": 6, "side": 100, "v1": 4}
    assert "OK" in run("verify", new, check=0).stdout
    p = run("upgrade", old, new)  # never into an existing trajectory
    assert p.returncode == 1 and "already" in p.stderr


@pytest.mark.parametrize(
    ("anchors", "every", "said"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7], None, "Every step is an anchor (coded without a reference, where reading the next"),
        ([0, 2, 4, 6], None, "Steps 0, 2, 4, 6 are anchors"),
        ([0, 1, 2, 3, 6], None, "Steps 0-3, 6 are anchors"),
        ([0, 1, 3, 4, 5], None, "Steps 0, 1, 3-5 are anchors"),
        ([0], None, "Step 0 is an anchor"),
        ([0, 4], 4, "Steps 0, 4 are anchors (coded without a reference, so that no read walks back more than 4"),
    ],
)
def test_demo_says_why_anchors_are_many(anchors, every, said):
    """The demo's anchor line: which steps (runs of three or more as ranges), why; under the read-cost policy
    with many anchors (the demo's dense first phase), why so many, in plain words.  Not for a fixed count, nor when
    anchors are rare."""
    import types

    from ulstore.cli import demo

    traj = types.SimpleNamespace(anchor_cost=None if every else 2.0, anchor_every=every or 16)
    lines: list[str] = []
    demo._say_anchors(traj, anchors, 8, lines.append)
    lines = "\n".join(lines).splitlines()
    text = " ".join(" ".join(lines).split())
    assert text.startswith(said), text
    assert ("all others are deltas" in text) == (len(anchors) < 8), text
    many = every is None and len(anchors) > 2
    assert ("Why so many: anchors are chosen by read cost" in text) == many, text
    if many:
        assert "Where nearly every weight changes each step (a high learning rate), decoding the delta" in text
        assert "where few weights change (fine-tuning, RL), deltas are small and cheap to apply" in text
        assert "each step's changes are sampled, so the first step after the learning rate drops is a delta" in text
    assert all(len(line) <= 88 for line in lines), lines


def test_demo_tiny(tmp_path):
    p = run("demo", "--preset", "tiny", "--steps", 4, cwd=tmp_path, check=0)
    out = p.stdout
    for fragment in (
        "raw safetensors files",
        "zstd -3 of each file",
        "ulstore trajectory",
        "bits/weight",
        "Lazy read of an old step",
        "bit-exact",
        "Verify:",
        "OK",
        "The data lives in",
    ):
        assert fragment in out, fragment
    assert ulstore.open(tmp_path / "ulstore-demo", mode="r").steps == [0, 1, 2, 3, 4]
    # why its anchors are anchors: the default policy (read cost), not a fixed count it does not follow (four
    # cheap deltas after the root: nothing to explain about their number; test_demo_says_why_anchors_are_many)
    said = " ".join(out.split())
    assert "would cost more than 2x reading an anchor" in said and "Why so many" not in said, out
    # the tour of the directory names what is there
    listed = re.findall(r"^  ([a-z]+)/", out.split("The data lives in", 1)[1], flags=re.M)
    assert listed and all((tmp_path / "ulstore-demo" / d).is_dir() for d in listed), listed
    # runs again over its own earlier demo; refuses anything else
    doc = json.loads(
        run("demo", "ulstore-demo", "--preset", "tiny", "--steps", 2, "--json", cwd=tmp_path, check=0).stdout
    )
    assert doc["steps"] == 3 and doc["slice_equal"] and doc["verified"]
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("x")
    assert_one_line_error(
        run("demo", tmp_path / "precious", "--preset", "tiny", "--steps", 2), "not an earlier ulstore demo"
    )
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "x"


# ------------------------------------------------------------- bad input


def bad_checkpoints(d: Path) -> dict[str, Path]:
    good = d / "good.safetensors"
    ckpt.save_safetensors({"model.w": np.ones((4, 4), np.float32)}, good)
    raw = good.read_bytes()
    out = {"missing": d / "step_000900.safetensors"}
    out["truncated"] = d / "step_000901.safetensors"
    out["truncated"].write_bytes(raw[:-7])
    out["malformed"] = d / "step_000902.safetensors"
    bad_json = b'{"a": [1, 2'
    out["malformed"].write_bytes(struct.pack("<Q", len(bad_json)) + bad_json)
    out["dtype"] = d / "step_000903.safetensors"
    header = json.dumps({"model.w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}).encode()
    out["dtype"].write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    return out


@pytest.mark.parametrize(
    "kind, fragment",
    [
        ("missing", "no such checkpoint"),
        ("truncated", "truncated"),
        ("malformed", "not valid JSON"),
        ("dtype", "unknown dtype 'Q4'"),
        ("exists", "step already exists"),
    ],
)
def test_bad_input_one_line_and_nothing_written(tmp_path, store, kind, fragment):
    before = objects(store)
    path = tmp_path / "step_000200.safetensors" if kind == "exists" else bad_checkpoints(tmp_path)[kind]
    p = run("add", store, path)
    assert_one_line_error(p, fragment)
    assert objects(store) == before
    # several files: checked before the first commit
    if kind in ("missing", "exists"):
        good = tmp_path / "step_000150.safetensors"
        ckpt.save_safetensors({"model.w": np.ones((4, 4), np.float32)}, good)
        assert_one_line_error(run("add", store, good, path), fragment)
        assert objects(store) == before


def test_debug_shows_traceback(tmp_path, store):
    p = run("add", store, tmp_path / "step_000999.safetensors", "--debug")
    assert p.returncode == 1 and "Traceback" in p.stderr and "ulstore: error:" in p.stderr.splitlines()[-1]


def test_unexpected_errors_and_interrupts_are_one_line(tmp_path, monkeypatch, capsys):
    def boom(args, ui):
        raise RuntimeError("something broke\n  in two lines")

    monkeypatch.setattr(cli._commands, "_cmd_log", boom)
    assert cli.main(["log", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: something broke in two lines" in err and "--debug" in err

    def interrupted(args, ui):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli._commands, "_cmd_log", interrupted)
    assert cli.main(["log", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "ulstore: interrupted\n"


def test_missing_trajectory_and_unreachable_url(tmp_path):
    assert_one_line_error(run("log", tmp_path / "nowhere"), "no trajectory", "ulstore init")
    assert not (tmp_path / "nowhere").exists()
    p = run(
        "log",
        "s3://ulstore-test/unreachable",
        "-o",
        "endpoint_url=http://127.0.0.1:9",
        "-o",
        "key=k",
        "-o",
        "secret=s",
        "-o",
        'config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2}',
    )
    assert_one_line_error(p, "127.0.0.1:9")
    assert_one_line_error(run("init", "nosuchprotocol://x/y"), "nosuchprotocol")
    p = run("log", "memory://x", env={"ULSTORE_STORAGE_OPTIONS": "{not json"})
    assert_one_line_error(p, "ULSTORE_STORAGE_OPTIONS", status=2)


def test_s3_store_through_cli(tmp_path, moto_s3):
    paths = write_steps(tmp_path, steps=(1, 2))
    url = f"s3://ulstore-test/cli-{uuid.uuid4().hex}"
    env = {"ULSTORE_STORAGE_OPTIONS": json.dumps(moto_s3.options)}
    run("init", url, env=env, check=0)
    run("add", url, *paths, env=env, check=0)
    assert "step_000002" in run("log", url, env=env, check=0).stdout
    run("export", url, 2, tmp_path / "back.safetensors", env=env, check=0)
    assert_bits_equal(
        ckpt.load(tmp_path / "back.safetensors").tensors["model.w"], ckpt.load(paths[1]).tensors["model.w"], "model.w"
    )
    endpoint = moto_s3.endpoint
    opts = ["-o", "key=testing", "-o", "secret=testing", "-o", f'client_kwargs={{"endpoint_url": "{endpoint}"}}']
    assert json.loads(run("stats", url, "--json", *opts, check=0).stdout)["total"]["steps"] == 2


def test_progress_bar_only_on_a_terminal(tmp_path, store):
    """With a TTY on stderr `add` draws a bar there; --quiet turns it off."""
    ckpt.save_safetensors({"model.w": np.ones((4, 4), np.float32)}, tmp_path / "step_000400.safetensors")
    ckpt.save_safetensors({"model.w": np.ones((4, 4), np.float32)}, tmp_path / "step_000500.safetensors")

    err, out = on_a_terminal("add", store, tmp_path / "step_000400.safetensors")
    # (stderr also says that model.w's dtype and shape moved since the store's step 300: stored whole)
    assert "importing" in err and "step 400" in out and not re.search(r"step 400 +<-", err)
    err, out = on_a_terminal("add", store, tmp_path / "step_000500.safetensors", "--quiet")
    assert err == "" and "step 500" in out


# ------------------------------------------------------------------- docs


def test_docs_are_generated_from_the_code():
    """docs/cli.md and docs/api.md match what docs/_gen_api.py renders now."""
    p = subprocess.run(
        [sys.executable, str(REPO / "docs" / "_gen_api.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_docs_pages_exist():
    for page in ("quickstart", "concepts", "api", "cli", "performance", "faq", "architecture"):
        assert (REPO / "docs" / f"{page}.md").stat().st_size > 200, page
    readme = (REPO / "README.md").read_text()
    assert "pip install -e . && ulstore demo" in readme
    ci = (REPO / ".ci" / "run").read_text()
    test_cmd = 'pip install -e ".[test]" && python -m pytest -q -n 2'
    assert test_cmd in readme
    assert test_cmd in ci  # CI runs the README's command verbatim
    assert "<!-- bench:codec -->" in readme


def test_ls_names_a_tied_tensor_without_widening_the_size_column(tmp_path):
    torch = pytest.importorskip("torch")
    emb = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    torch.save({"model.embed.weight": emb, "lm_head.weight": emb, "model.bias": torch.ones(8)}, tmp_path / "t.pt")
    url = tmp_path / "traj"
    run("add", "--init", url, tmp_path / "t.pt", "--step", 1, check=0)
    lines = run("ls", url, 1, check=0).stdout.splitlines()
    tied = next(ln for ln in lines if ln.startswith("lm_head.weight"))
    assert "(= model.embed.weight)" in tied and tied.split()[-1] == "tied", tied
    sizes = [ln for ln in lines[1:] if ln.startswith("model.")]
    assert len(sizes) == 2 and len({len(ln) for ln in sizes + [lines[0]]}) == 1, lines  # one width: right-aligned
    assert lines[len(sizes) + 2].startswith("2 tensors (+1 tied)"), lines
