"""The CLI tells the user what happened: JSON errors, suggestions, missing steps, exit statuses, no ANSI codes."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

import ulstore
from tests.cli.test_cli import assert_one_line_error, run, write_steps
from ulstore import cli
from ulstore.io import checkpoints as ckpt

ERROR_KEYS = {"type", "message", "exit_status", "step", "tensor", "key"}


@pytest.fixture
def store(tmp_path):
    paths = write_steps(tmp_path)
    url = tmp_path / "traj"
    run("add", url, *paths, "--init", check=0)
    return url


def json_error(p, status: int) -> dict:
    """stderr holds exactly one JSON document of the one error shape, and the exit status agrees."""
    assert p.returncode == status, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "usage:" not in p.stderr
    doc = json.loads(p.stderr)
    assert set(doc) == {"error"} and set(doc["error"]) == ERROR_KEYS, doc
    assert doc["error"]["exit_status"] == status and doc["error"]["message"]
    assert "\n" not in doc["error"]["message"]
    return doc["error"]


def test_errors_under_json_are_json_on_stderr(tmp_path, store):
    # usage errors, found by argparse and after parsing
    e = json_error(run("lgo", store, "--json"), 2)
    assert e["type"] == "UsageError" and "did you mean 'log'?" in e["message"]
    e = json_error(run("log", store, "--json", "--frmat"), 2)
    assert "unrecognized arguments: --frmat" in e["message"]
    e = json_error(run("log", store, "-o", "noequals", "--json"), 2)
    assert "-o expects KEY=VALUE" in e["message"]
    e = json_error(run("export", store, 300, tmp_path / "x.h5", "--json"), 2)
    assert "cannot tell the export format" in e["message"]
    # data errors carry the step they are about
    e = json_error(run("ls", store, 150, "--json"), 1)
    assert e["type"] == "StepNotFoundError" and e["step"] == 150
    assert e["message"] == f"no step 150 in {store}; its steps are 100, 200, 300"
    e = json_error(run("log", tmp_path / "nowhere", "--json"), 1)
    assert e["type"] == "NotFoundError" and "ulstore init" in e["message"]
    e = json_error(run("add", store, tmp_path / "step_000900.safetensors", "--json"), 1)
    assert "no such checkpoint" in e["message"]
    # verify: the report on stdout, the error on stderr
    blob = max((store / "packs").rglob("*.pack"), key=lambda f: f.stat().st_size)  # the pack holding blobs
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    p = run("verify", store, "--json")
    assert json.loads(p.stdout)["ok"] is False
    e = json_error(p, 1)
    assert blob.name in e["message"] and e["key"] and blob.name in e["key"]
    # its type is the first damaged object's error class, public (#38: it was the CLI's private `_Damaged`)
    assert e["type"] in ulstore.errors.__all__, e["type"]
    assert issubclass(getattr(ulstore.errors, e["type"]), ulstore.errors.IntegrityError)
    assert e["type"] == json.loads(p.stdout)["errors"][0]["error"]


def _public(name: str) -> bool:
    """A type name a --json reader can look up: ulstore's error tree or a public package's export, the
    documented "UsageError", a built-in, or a class at a public path of a third-party package."""
    import builtins
    import importlib
    import inspect

    if name in ulstore.errors.__all__ or name == "UsageError" or isinstance(getattr(builtins, name, None), type):
        return True
    for package in ("store", "io", "sync", "dcp", "integrations.vllm"):
        if name in getattr(importlib.import_module(f"ulstore.{package}"), "__all__", ()):
            return True
    for module in ("botocore.exceptions", "aiohttp", "fsspec.exceptions"):
        found = getattr(importlib.import_module(module), name, None)
        if inspect.isclass(found) and not name.startswith("_"):
            return True
    return False


def _exception_classes():
    """Every exception class any module of ulstore defines (private ones included)."""
    import importlib
    import inspect
    import pkgutil

    seen = []
    for info in pkgutil.walk_packages(ulstore.__path__, "ulstore."):
        if info.name.endswith(("__main__", ".demo")):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency's module
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("ulstore") and cls not in seen:
                seen.append(cls)
    return seen


def _bare(cls):
    """An instance of ``cls`` without running its ``__init__`` (only its class matters here)."""
    for base in cls.__mro__:
        try:
            return base.__new__(cls)
        except TypeError:  # "LookupError.__new__(StepNotFoundError) is not safe": the next base's
            continue
    raise AssertionError(cls)


def test_every_error_type_under_json_is_a_public_name():
    """#38: ``--json`` named the private ``_Damaged``.  Whatever class an error has, the type reported is the
    nearest public one (its own if public), so a script can look it up."""
    from ulstore.cli._ui import error_document

    classes = _exception_classes()
    assert any(c.__name__.startswith("_") for c in classes)  # the private ones are really there
    for cls in classes:
        e = _bare(cls)
        name = error_document(e, 1, "message")["error"]["type"]
        assert _public(name), (cls, name)
        if cls.__name__ in ulstore.errors.__all__:
            assert name == cls.__name__

    class _Private(ulstore.errors.StepNotFoundError):
        pass

    assert error_document(_Private("x"), 1)["error"]["type"] == "StepNotFoundError"
    assert error_document(KeyError("x"), 1)["error"]["type"] == "KeyError"
    assert error_document(None, 2, "bad option")["error"]["type"] == "UsageError"


def test_interrupt_under_json(tmp_path, monkeypatch, capsys):
    def interrupted(args, ui):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli._commands, "_cmd_log", interrupted)
    assert cli.main(["log", str(tmp_path), "--json"]) == 130
    doc = json.loads(capsys.readouterr().err)
    assert doc["error"]["type"] == "KeyboardInterrupt" and doc["error"]["exit_status"] == 130


def test_did_you_mean(store):
    p = run("lgo", store)
    assert p.returncode == 2 and "usage: ulstore" in p.stderr
    assert "did you mean 'log'?" in p.stderr.splitlines()[-1]
    p = run("log", store, "--jsn")
    assert p.returncode == 2 and "usage: ulstore log" in p.stderr and "did you mean '--json'?" in p.stderr
    p = run("export", store, 300, "o.pt", "--format", "trch")
    assert p.returncode == 2 and "did you mean 'torch'?" in p.stderr
    p = run("zzzzzz", store)
    assert p.returncode == 2 and "did you mean" not in p.stderr  # nothing close: no guess
    # the names other tools give a command (git show, dvc list, docker rm...): no typo, but the same need
    for other, ours in [("show", "ls"), ("history", "log"), ("import", "add"), ("delete", "rm")]:
        p = run(other, store)
        assert p.returncode == 2 and f"did you mean {ours!r}?" in p.stderr.splitlines()[-1], (other, p.stderr)


def test_a_negative_step_says_what_to_write_instead(store):
    """``traj[-1]`` is the newest step in Python; on the command line -1 was taken for a malformed ref name."""
    for args in (("ls", store, "-1"), ("export", store, "-2", "o.safetensors"), ("rm", store, "-1")):
        p = run(*args)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and "usage: ulstore" in p.stderr and "ref names" not in p.stderr, p.stderr
        assert f"ulstore {args[0]}: error: argument STEP:" in last and "a step here is its number" in last, last
        assert "`main`" in last and "`ulstore log URL`" in last
    assert ulstore.open(store, mode="r").steps == [100, 200, 300]


def test_init_over_a_trajectory_says_how_to_add_to_it(store):
    assert_one_line_error(run("init", store), "a trajectory already exists", f"use `ulstore add {store} CHECKPOINT...`")
    assert ulstore.open(store, mode="r").steps == [100, 200, 300]


def test_errors_name_the_option_not_the_python_argument(tmp_path, store):
    (tmp_path / "o.safetensors").write_bytes(b"mine")
    p = run("export", store, 300, tmp_path / "o.safetensors")
    assert_one_line_error(p, "already exists", "pass --force to replace it")
    assert "overwrite=" not in p.stderr and "CLI:" not in p.stderr
    assert (tmp_path / "o.safetensors").read_bytes() == b"mine"


def test_missing_step_shows_the_steps_that_exist(tmp_path, store):
    p = run("ls", store, 250)
    assert_one_line_error(p, f"no step 250 in {store}; its steps are 100, 200, 300")
    assert "zarr.json" not in p.stderr and "key" not in p.stderr  # no internal key
    assert_one_line_error(run("ls", store, "mian"), "no step or ref named 'mian'", "did you mean 'main'?", "refs: main")
    assert_one_line_error(run("log", store, 7), "no step 7", "100, 200, 300")
    assert_one_line_error(run("verify", store, 7), "no step 7")
    ckpt.save_safetensors({"model.w": np.ones((4, 4), np.float32)}, tmp_path / "step_000400.safetensors")
    assert_one_line_error(run("add", store, tmp_path / "step_000400.safetensors", "--parent", 7), "no step 7")
    # a long run: the nearest steps and where to find the rest
    paths = write_steps(tmp_path / "many", steps=range(10, 130, 10))
    run("add", tmp_path / "many" / "traj", *paths, "--init", check=0)
    p = run("export", tmp_path / "many" / "traj", 55, tmp_path / "o.safetensors")
    assert_one_line_error(p, "no step 55", "the nearest are 40, 50, 60, 70", "12 steps from 10 to 120", "ulstore log")


def test_checkpoints_given_where_a_trajectory_goes_are_named_with_the_add_that_imports_them(tmp_path):
    """A newcomer's first try: ``ulstore log ckpts/`` on the checkpoints themselves.  The error says what
    the path holds and the ``ulstore add`` that makes a trajectory of it, not ``ulstore init ckpts``."""
    ckpts = tmp_path / "ckpts"
    paths = write_steps(ckpts, steps=(100, 200))
    (ckpts / "notes.txt").write_text("lr 1e-3")
    p = run("log", ckpts)
    assert_one_line_error(p, "a directory of checkpoint files", f"ulstore add --init runs/NAME {ckpts}/*.safetensors")
    assert "ulstore init" not in p.stderr
    assert_one_line_error(run("ls", paths[0], 100), "a checkpoint file", f"ulstore add --init runs/NAME {paths[0]}")
    trainer = tmp_path / "out"
    (trainer / "checkpoint-500").mkdir(parents=True)
    assert_one_line_error(run("diff", trainer, 1, 2), "Trainer checkpoints", f"{trainer}/checkpoint-*/")
    # init or add --init would put a trajectory among the checkpoints; add without its trajectory argument
    # takes the first checkpoint for it: usage errors that say so, and nothing is written
    p = run("init", ckpts)
    assert_one_line_error(p, "a trajectory goes in a directory of its own", "ulstore add --init runs/NAME", status=2)
    p = run("add", "--init", ckpts, paths[0])
    assert_one_line_error(p, "add's first argument is the trajectory", status=2)
    assert_one_line_error(run("add", *paths), f"{str(paths[0])!r} is a checkpoint file", status=2)
    assert sorted(q.name for q in ckpts.iterdir()) == sorted([*(q.name for q in paths), "notes.txt"])
    # the advice works
    run("add", "--init", tmp_path / "runs" / "a", *sorted(ckpts.glob("*.safetensors")), check=0)
    # anything else that is not a trajectory still gets the init hint
    (tmp_path / "other").mkdir()
    assert_one_line_error(run("log", tmp_path / "other"), "no trajectory at", "ulstore init")


def test_ls_without_a_step_lists_the_head_and_an_empty_trajectory_says_it_has_no_steps(tmp_path, store):
    head = run("ls", store, check=0).stdout.splitlines()[-1]
    assert head == run("ls", store, "main", check=0).stdout.splitlines()[-1] and head.endswith("(step 300)"), head
    run("init", tmp_path / "empty", check=0)
    for argv in (["ls", tmp_path / "empty"], ["export", tmp_path / "empty", 5, tmp_path / "x.safetensors"]):
        assert_one_line_error(run(*argv), f"{tmp_path / 'empty'} has no steps yet", "ulstore add")


def test_torch_weights_only_error_reaches_the_user_plainly(tmp_path, store):
    torch = pytest.importorskip("torch")
    path = tmp_path / "step_000400.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=1e-3)}, path)  # not a weights-only type
    p = run("add", store, path)
    assert_one_line_error(p, "holds objects other than tensors", "weights_only=True", "state_dict")
    assert "\x1b" not in p.stderr and "[1m" not in p.stderr


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["add", "{store}", "{a}", "{b}", "--step", "5"], "--step applies to one CHECKPOINT"),
        (["add", "{store}", "{plain}"], "cannot tell the step"),
        (["add", "{store}", "{a}", "{a}"], "are both step"),
        (["add", "{store}", "{a}", "--rename-prefix", "nothing"], "expected OLD=NEW"),
        (["export", "{store}", "300", "{tmp}/o.h5"], "cannot tell the export format"),
        (["export", "{store}", "300", "{tmp}/o", "--shard-size", "lots"], "not a byte count"),
        (["export", "{store}", "300", "{tmp}/o.pt", "--shard-size", "5GB"], "sharded output is a directory"),
        (["stats", "{store}", "--top", "-1"], "non-negative integer"),
        (["log", "{store}", "-o", "x"], "-o expects KEY=VALUE"),
    ],
)
def test_usage_errors_exit_2(tmp_path, store, argv, fragment):
    ckpt.save_npz({"w": np.ones(2, np.float32)}, tmp_path / "plain.npz")
    names = {
        "store": store,
        "tmp": tmp_path,
        "a": tmp_path / "step_000100.safetensors",
        "b": tmp_path / "step_000200.safetensors",
        "plain": tmp_path / "plain.npz",
    }
    p = run(*[a.format(**names) for a in argv])
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert fragment in p.stderr.strip().splitlines()[-1] and "Traceback" not in p.stderr


# -- credentials in URLs (#43) -------------------------------------------------------


def _chain(e: BaseException) -> str:
    """The text of ``e`` and of every exception it was raised from or during (what a traceback shows)."""
    texts = []
    while e is not None and len(texts) < 16:
        texts.append(f"{type(e).__name__}: {e} {e.args!r}")
        e = e.__cause__ or e.__context__
    return "\n".join(texts)


@pytest.mark.slow
def test_credentials_in_a_url_are_never_shown(tmp_path, moto_s3, caplog):
    """``http://user:secret@host/...`` and ``s3://KEY:SECRET@bucket/...``: no message, ``url``, repr, log line
    or CLI output (plain or --json) shows the credentials; over http they still reach the server."""
    import logging

    import ulstore
    from tests.helpers.http import AuthRangeServer
    from ulstore.errors import InvalidInputError, NotFoundError
    from ulstore.sync import Follower, Publisher

    with Publisher(tmp_path / "bucket", anchor_every=4) as pub:
        pub.publish(0, {"w": np.zeros(64, np.float32)})
        pub.publish(1, {"w": np.ones(64, np.float32)})
    server = AuthRangeServer(tmp_path, "alice", "hunter2pw")  # answers only with these credentials
    secrets = ("alice", "hunter2pw")
    try:
        url, missing = server.url("bucket"), server.url("nothing")
        shown = f"http://***@127.0.0.1:{server.port}/bucket"
        # Python: the trajectory, a follower, their log lines and errors
        caplog.set_level(logging.DEBUG, logger="ulstore")
        traj = ulstore.open(url, mode="r")
        assert traj.url == shown and shown in repr(traj) and traj._io.url == shown
        assert float(traj.read(1)["w"][0]) == 1.0  # the credentials are still sent
        follower = Follower(url)
        assert follower.poll() == 1 and follower.url == shown and shown in repr(follower)
        with pytest.raises(NotFoundError) as e:
            ulstore.open(missing, mode="r")
        assert "http://***@127.0.0.1" in str(e.value)
        texts = [repr(traj), repr(follower), _chain(e.value), *(r.getMessage() for r in caplog.records)]
        assert any(shown in r.getMessage() for r in caplog.records)  # the follower logged its events
        # the CLI, plain and --json: success and error
        for args in (["log", url], ["ls", url, "1"], ["log", missing], ["log", url, "7"]):
            for extra in ([], ["--json"]):
                p = run(*args, *extra)
                ok = args in (["log", url], ["ls", url, "1"])
                assert p.returncode == (0 if ok else 1), p.stderr
                if extra or not ok:  # a JSON document names the URL, and so does each error
                    assert "***@127.0.0.1" in p.stdout + p.stderr, (args, extra, p.stdout, p.stderr)
                texts += [p.stdout, p.stderr]
    finally:
        server.close()
    # s3fs takes no credentials from a URL (they would name the bucket): refused, and shown redacted
    s3url = "s3://AKIAKEYID:wJalrSECRETKEY@ulstore-test/run"
    s3secrets = ("AKIAKEYID", "wJalrSECRETKEY")
    for make in (
        lambda: ulstore.open(s3url, storage_options=moto_s3.options),
        lambda: Publisher(s3url, storage_options=moto_s3.options),
        lambda: Follower(s3url, storage_options=moto_s3.options),
    ):
        with pytest.raises(InvalidInputError) as e:
            make()
        assert "s3://***@ulstore-test/run" in str(e.value) and "storage_options" in str(e.value)
        texts.append(_chain(e.value))
    env = {"ULSTORE_STORAGE_OPTIONS": json.dumps(moto_s3.options)}
    for extra in ([], ["--json"]):
        p = run("log", s3url, *extra, env=env)
        assert p.returncode == 1 and "s3://***@ulstore-test/run" in p.stderr, p.stderr
        texts += [p.stdout, p.stderr]
    leaks = [t for t in texts if any(s in t for s in secrets + s3secrets)]
    assert not leaks, leaks


@pytest.mark.slow
def test_a_missing_bucket_is_named(moto_s3, tmp_path):
    """#43: ``log`` on a bucket that does not exist says so (not "create one with ulstore init"), and ``init``
    refuses with an ulstore error naming the bucket, plain and --json; so does ``ulstore.open``."""
    import ulstore
    from ulstore.errors import NotFoundError

    url = "s3://no-such-bucket-43/run"
    for mode in ("r", "a", "w", "w-"):
        with pytest.raises(NotFoundError, match="bucket 'no-such-bucket-43' does not exist"):
            ulstore.open(url, mode=mode, storage_options=moto_s3.options)
    env = {"ULSTORE_STORAGE_OPTIONS": json.dumps(moto_s3.options)}
    for command in ("log", "init", "verify"):
        p = run(command, url, env=env)
        assert_one_line_error(p, "bucket 'no-such-bucket-43' does not exist", "create")
        assert "ulstore init" not in p.stderr
        e = json_error(run(command, url, "--json", env=env), 1)
        assert e["type"] == "NotFoundError" and "bucket 'no-such-bucket-43' does not exist" in e["message"]
    # #38: `add` too (it said "no trajectory ... create it with `ulstore init`")
    (checkpoint,) = write_steps(tmp_path / "ckpt", steps=(100,))
    for extra in ([], ["--init"]):
        p = run("add", url, checkpoint, *extra, env=env)
        assert_one_line_error(p, "bucket 'no-such-bucket-43' does not exist", "create")
        assert "ulstore init" not in p.stderr
    # a bucket that exists but holds no trajectory there: the advice to init stays, and init works
    e = json_error(run("log", "s3://ulstore-test/empty-43", "--json", env=env), 1)
    assert "ulstore init" in e["message"]
    run("init", "s3://ulstore-test/empty-43", env=env, check=0)


def _no_aws_credentials(monkeypatch, home) -> dict:
    """The environment of a machine with no AWS credentials anywhere (no env vars, no ~/.aws, no instance
    metadata): botocore raises NoCredentialsError.  Returns it, for subprocesses."""
    import os

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    nowhere = str(home / "no-such-file")
    for name, value in {
        "HOME": str(home),
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
        "AWS_CONFIG_FILE": nowhere,
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)
    return dict(os.environ)


def test_no_credentials_is_an_access_error_naming_the_url_and_the_fix(moto_s3, tmp_path, monkeypatch):
    """#38: ``NoCredentialsError`` came out raw from ``ulstore.open``, the CLI and (as "listing the bucket
    failed") the sync layer.  Now: a StorageAccessError (an OSError) naming the URL, what is wrong and how to
    give credentials (env vars, storage_options key/secret, anon=True for public buckets)."""
    import botocore.exceptions

    import ulstore
    from ulstore.errors import StorageAccessError
    from ulstore.sync import BucketAccessError, Publisher

    env = _no_aws_credentials(monkeypatch, tmp_path)
    options = {"client_kwargs": moto_s3.options["client_kwargs"]}  # the endpoint, no key or secret
    url = "s3://ulstore-test/run-38"
    fixes = ("AWS_ACCESS_KEY_ID", "storage_options={'key': ..., 'secret': ...}", "anon=True")
    for mode in ("r", "a", "w", "w-"):
        with pytest.raises(StorageAccessError) as e:
            ulstore.open(url, mode=mode, storage_options=options)
        text = str(e.value)
        assert isinstance(e.value, OSError) and f"no credentials for {url!r}" in text, text
        assert all(fix in text for fix in fixes), text
        assert isinstance(e.value.__cause__, botocore.exceptions.NoCredentialsError)
    with pytest.raises(BucketAccessError) as e:  # the sync layer's access error is one of these
        Publisher(url, storage_options=options)
    assert isinstance(e.value, StorageAccessError) and all(fix in str(e.value) for fix in fixes), str(e.value)

    env["ULSTORE_STORAGE_OPTIONS"] = json.dumps(options)
    (checkpoint,) = write_steps(tmp_path / "ckpt", steps=(100,))
    for command in (["log", url], ["init", url], ["add", url, checkpoint, "--init"], ["verify", url]):
        p = run(*command, env=env)
        assert_one_line_error(p, f"no credentials for {url!r}", "-o key=... -o secret=...", "-o anon=true")
        assert not p.stderr.startswith("ulstore: error: NoCredentialsError"), p.stderr  # not the raw error
        e = json_error(run(*command, "--json", env=env), 1)
        assert e["type"] == "StorageAccessError" and f"no credentials for {url!r}" in e["message"]
