"""The shared lower layer: object client, sealed JSON, safetensors parser, dtype table, torch bridge."""

from __future__ import annotations

import errno
import json
import os
import uuid

import ml_dtypes
import numpy as np
import pytest

from tests.helpers.bits import assert_bits_equal, awkward_floats
from ulstore.core import dtypes, formatting, local_disk, safetensors, sealed
from ulstore.core.objects import ObjectStore
from ulstore.errors import DtypeError, InvalidInputError


class AccessError(Exception):
    def __init__(self, message, key=None):
        super().__init__(message)
        self.key = key


@pytest.fixture(params=["local", "memory"])
def objects(request, tmp_path):
    url = str(tmp_path / "objs") if request.param == "local" else f"memory://core-{uuid.uuid4().hex}"
    return ObjectStore.from_url(url)


def test_objects_get_put_create_list_delete(objects):
    assert objects.get("a/b") is None and objects.list("a") == [] and objects.find("a") == []
    objects.put("a/b", b"1")
    objects.put("a/b", b"2")  # put replaces
    objects.create("a/c", b"3")
    with pytest.raises(FileExistsError):  # create does not
        objects.create("a/c", b"4")
    objects.put("a/d/e", b"5")
    assert objects.get("a/b") == b"2" and objects.get("a/c") == b"3"
    assert objects.list("a") == ["a/b", "a/c", "a/d"]
    assert sorted(objects.find("a")) == ["a/b", "a/c", "a/d/e"]
    assert objects.get("a/b/x") is None  # a key below an object is missing, not an error
    objects.delete("a/b")
    objects.delete("a/b")  # missing: ignored
    objects.delete_many(["a/c", "a/nothing"])
    assert sorted(objects.find("a")) == ["a/d/e"]
    assert objects.sweep_tmp() == 0


def test_local_get_and_list_answer_as_fsspec_does(tmp_path):
    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    for key in ("refs/main/00000000000000000001.json", "refs/main/00000000000000000000.json", "steps/3/zarr.json"):
        objects.put(key, key.encode())
    (tmp_path / "objs" / "refs" / "main" / "sub").mkdir()

    def plain(prefix):  # what the generic (fsspec) path answers
        try:
            paths = objects.fs.ls(objects.path(prefix), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(k for p in paths if (k := objects._key(p.rstrip("/"))) is not None)

    for prefix in ("refs/main", "refs/main/", "refs", "steps/3", "", "nothing", "refs/main/sub", "steps/3/zarr.json"):
        assert objects.list(prefix) == plain(prefix), prefix
    assert objects.list("steps/3/zarr.json/x") == []
    for key in ("steps/3/zarr.json", "steps/3", "steps/9/zarr.json", "steps/3/zarr.json/x"):
        try:
            expected = objects.fs.cat_file(objects.path(key))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            expected = None
        assert objects.get(key) == expected, key


def test_local_find_answers_as_fsspec_does_and_never_follows_a_symlink(tmp_path):
    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    for key in ("steps/3/zarr.json", "steps/10/zarr.json", "packs/a.pack", "zarr.json", "refs/main/0.json"):
        objects.put(key, b"x")
    (tmp_path / "objs" / "steps" / "11").mkdir()  # an empty directory lists nothing
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "zarr.json").write_bytes(b"secret")
    os.symlink(outside, tmp_path / "objs" / "steps" / "12")  # a directory planted as a symlink out of the root

    def plain(prefix):  # fsspec's generic walk
        try:
            paths = objects.fs.find(objects.path(prefix))
        except FileNotFoundError:
            return []
        return sorted(k for p in paths if (k := objects._key(p)) is not None)

    for prefix in ("", "steps", "steps/", "steps/3", "steps/3/zarr.json", "refs", "nothing", "steps/11"):
        want = [k for k in plain(prefix) if k != "steps/12" and not k.startswith("steps/12/")]
        want += ["steps/12"] if prefix in ("", "steps", "steps/") else []
        assert objects.find(prefix) == sorted(want), prefix
    assert objects.find("steps/12") == ["steps/12"]  # the symlink itself, never what it points to
    os.symlink(tmp_path / "objs", tmp_path / "alias")  # a root that is a symlink is followed, as the user asked
    assert ObjectStore.from_url(str(tmp_path / "alias")).find("") == objects.find("")


def test_local_deletes_remove_the_directories_they_empty(tmp_path):
    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    for key in ("pending/commit/3/4.json", "pending/commit/3/5.json", "steps/4/zarr.json", "packs/a.pack"):
        objects.put(key, b"x")
    objects.delete("pending/commit/3/4.json")
    assert (tmp_path / "objs" / "pending" / "commit" / "3").is_dir()  # 5.json is still there
    objects.delete_many(["pending/commit/3/5.json", "steps/4/zarr.json", "packs/a.pack"])
    # emptied directories go, up to the top-level ones
    assert sorted(os.listdir(tmp_path / "objs")) == [".tmp", "packs", "pending", "steps"]
    assert not os.listdir(tmp_path / "objs" / "pending") and not os.listdir(tmp_path / "objs" / "steps")


def test_a_local_write_places_its_file_again_if_its_directory_was_removed_meanwhile(tmp_path, monkeypatch):
    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    made = []
    real = local_disk.makedirs

    def makedirs_then_lose_it(d, durable):  # another process's delete finds the new directory empty, removes it
        real(d, durable)
        if d not in made:  # once per directory
            made.append(d)
            os.rmdir(d)

    monkeypatch.setattr(local_disk, "makedirs", makedirs_then_lose_it)
    objects.put("pending/commit/1/2.json", b"put")
    objects.create("pending/commit/7/8.json", b"created")
    assert made == [objects.path("pending/commit/1"), objects.path("pending/commit/7")]
    assert objects.get("pending/commit/1/2.json") == b"put" and objects.get("pending/commit/7/8.json") == b"created"
    with pytest.raises(FileExistsError):
        objects.create("pending/commit/7/8.json", b"again")
    assert not os.listdir(objects.local_tmp_dir())  # no staged file left behind


class _FullDisk:
    """A staging file whose write stores half of the data, then fails as a full disk does."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fault", ["write", "fsync", "makedirs", "place"])
@pytest.mark.parametrize("op", ["put", "create"])
def test_a_local_write_that_fails_leaves_no_staged_file(tmp_path, monkeypatch, op, fault):
    """ENOSPC (or any OSError) at any point of a local write propagates and leaves nothing in ``.tmp/``."""
    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    objects.put("seed", b"x")  # .tmp/ exists, and so does the root
    if fault == "write":
        monkeypatch.setattr(local_disk, "open", lambda path, mode: _FullDisk(open(path, mode)), raising=False)
    elif fault == "fsync":
        monkeypatch.setattr(local_disk.os, "fsync", _no_space)
    elif fault == "makedirs":
        monkeypatch.setattr(local_disk, "makedirs", lambda d, durable: _no_space())
    else:  # the rename (put) or the link (create) into place
        monkeypatch.setattr(os, "replace" if op == "put" else "link", _no_space)
    with pytest.raises(OSError) as raised:
        getattr(objects, op)("refs/main/00000000000000000001.json", b"a document" * 100)
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert os.listdir(objects.local_tmp_dir()) == []
    assert objects.get("refs/main/00000000000000000001.json") is None


@pytest.fixture(params=["local", "memory", "s3"])
def any_objects(request, tmp_path):
    if request.param == "local":
        return ObjectStore.from_url(str(tmp_path / "objs"))
    if request.param == "memory":
        return ObjectStore.from_url(f"memory://core-{uuid.uuid4().hex}")
    moto = request.getfixturevalue("moto_s3")
    return ObjectStore.from_url(f"s3://ulstore-test/core-{uuid.uuid4().hex}", moto.options)


def test_objects_byte_ranges_and_streaming_writes(any_objects):
    objects = any_objects
    data = bytes(range(256)) * 40_000  # ~10 MB: several S3 parts at a 5 MiB block size
    with objects.open_writer("p/x.pack", block_size=5 << 20) as w:
        for k in range(0, len(data), 1 << 20):
            assert w.write(data[k : k + (1 << 20)]) == k
        assert objects.get("p/x.pack") is None  # nothing visible before close
        assert w.tell() == len(data)
    assert objects.size("p/x.pack") == len(data)
    ranges = [(0, 10), (5, 5), (1000, 70_000), (len(data) - 3, len(data)), (len(data) - 3, len(data) + 50)]
    got = objects.get_ranges("p/x.pack", ranges)
    assert got == [data[a:b] for a, b in ranges]  # a range past the end comes back short
    assert objects.get_ranges("p/missing.pack", [(0, 1)]) is None
    assert objects.get_ranges("p/x.pack", []) == []
    with pytest.raises(ValueError):
        objects.get_ranges("p/x.pack", [(5, 4)])
    w = objects.open_writer("p/y.pack")
    w.write(b"half")
    w.abort()  # no object, no leftovers
    assert objects.get("p/y.pack") is None and objects.find("p") == ["p/x.pack"]
    with pytest.raises(RuntimeError), objects.open_writer("p/z.pack") as w:
        w.write(b"x")
        raise RuntimeError("the writer fails")
    assert objects.get("p/z.pack") is None


def test_local_reads_refuse_symlinks_and_fifos(tmp_path):
    """Range and whole-object reads (packs; step documents, ref entries) never leave the root nor block on a
    planted FIFO."""
    import os
    import threading

    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    objects.put("a", b"inside")
    secret = tmp_path / "secret"
    secret.write_bytes(b"outside the root")
    os.symlink(secret, tmp_path / "objs" / "link")
    os.mkfifo(tmp_path / "objs" / "fifo")
    assert objects.get_ranges("a", [(0, 6)]) == [b"inside"]
    assert objects.get("a") == b"inside"
    got = {}

    def reads():
        got["ranges"] = [objects.get_ranges(k, [(0, 7)]) for k in ("link", "fifo")]
        got["whole"] = [objects.get(k) for k in ("link", "fifo")]

    reader = threading.Thread(target=reads, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert got == {"ranges": [None, None], "whole": [None, None]}  # a symlink is never followed, a FIFO no object


def test_a_pickled_client_resolves_its_root_again(tmp_path):
    import pickle

    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    objects.put("a", b"inside")
    assert objects.get("a") == b"inside" and objects._real_root is not None
    again = pickle.loads(pickle.dumps(objects))
    assert again._real_root is None  # this machine's real path is not shipped to a worker
    assert again.get("a") == b"inside" and again._real_root == objects._real_root


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_get_with_a_limit_refuses_larger_objects_without_reading_them_whole(tmp_path, where, request):
    import errno

    options = None
    if where == "local":
        url = str(tmp_path / "objs")
    elif where == "memory":
        url = f"memory://limit-{uuid.uuid4().hex}"
    else:  # a ranged GET of limit + 1 bytes
        s3 = request.getfixturevalue("moto_s3")
        url, options = f"s3://{s3.bucket()}/objs", s3.options
    objects = ObjectStore.from_url(url, options)
    objects.put("doc", b"x" * 100)
    assert objects.get("doc", limit=100) == b"x" * 100
    with pytest.raises(OSError, match="'doc' holds more than 99 bytes") as info:
        objects.get("doc", limit=99)
    assert info.value.errno == errno.EFBIG
    assert objects.get("missing", limit=10) is None


def test_sweep_tmp_keeps_young_files_and_never_follows_symlinks(tmp_path):
    import os
    import time

    objects = ObjectStore.from_url(str(tmp_path / "objs"))
    objects.put("k", b"x")
    tmp = tmp_path / "objs" / ".tmp"
    (tmp / "young").write_bytes(b"a live writer's file")
    (tmp / "old").write_bytes(b"a killed writer's file")
    old = time.time() - 3600
    os.utime(tmp / "old", (old, old))
    assert objects.sweep_tmp(older_than=60) == 1 and sorted(os.listdir(tmp)) == ["young"]
    assert objects.sweep_tmp() == 1 and os.listdir(tmp) == []
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    os.rmdir(tmp)
    os.symlink(outside, tmp)  # .tmp planted as a symlink out of the root
    assert objects.sweep_tmp() == 0 and (outside / "precious").exists()
    with pytest.raises(OSError, match="not a real directory"):
        objects.put("k2", b"y")  # writes never stage through it either
    assert not (outside / "k2").exists() and len(os.listdir(outside)) == 1


def test_objects_map_backend_failures_only_when_asked(tmp_path):
    root = tmp_path / "file"
    root.write_bytes(b"not a directory")
    plain = ObjectStore.from_url(str(root))
    with pytest.raises(OSError):
        plain.put("k", b"x")
    mapped = ObjectStore.from_url(str(root), access_error=AccessError)
    with pytest.raises(AccessError, match="PUT failed") as e:
        mapped.put("k", b"x")
    assert e.value.key == "k" and isinstance(e.value.__cause__, OSError)
    with pytest.raises(AccessError, match="is a file"):
        mapped.probe()
    with pytest.raises(AccessError, match="cannot open"):
        ObjectStore.from_url("nosuchprotocol://x", access_error=AccessError)


def test_backend_errors_never_show_a_urls_credentials(monkeypatch):
    """#43: a backend's exception naming the path a URL's ``user:password@`` is part of is redacted, raised
    as it is or mapped; so are the client's url and repr, and the access error's message."""
    name = f"creds-{uuid.uuid4().hex}"
    url = f"memory://alice:hunter2pw@{name}"

    def failing(path, *args, **kwargs):
        raise OSError(errno.EIO, "backend broke", path)

    for access_error in (None, AccessError):
        objects = ObjectStore.from_url(url, access_error=access_error)
        assert objects.url == f"memory://***@{name}" and "hunter2pw" not in repr(objects)
        monkeypatch.setattr(objects.fs, "cat_file", failing)
        with pytest.raises(OSError if access_error is None else AccessError) as e:
            objects.get("steps/1/zarr.json")
        chain, x = [], e.value
        while x is not None:
            chain.append(f"{x} {x.args!r}")
            x = x.__cause__
        assert "***@" in chain[-1] and "backend broke" in chain[-1], chain
        assert not any("hunter2pw" in t or "alice" in t for t in chain), chain
        monkeypatch.undo()
    with pytest.raises(AccessError) as e:  # a URL fsspec cannot open: named, redacted
        ObjectStore.from_url("nosuchprotocol://alice:hunter2pw@x/y", access_error=AccessError)
    assert "nosuchprotocol://***@x/y" in str(e.value) and "hunter2pw" not in str(e.value)
    assert formatting.redact_url("https://TOKEN@github.com/a/b.git") == "https://***@github.com/a/b.git"


def test_sealed_documents_refuse_any_change():
    raw = sealed.seal({"format": "f", "n": 1})
    doc = json.loads(raw)
    assert sealed.canonical_json(doc) == raw and doc["checksum"] == sealed.address(
        sealed.canonical_json({"format": "f", "n": 1})
    )
    assert sealed.open_sealed(raw, ValueError) == doc
    for bad in (raw.replace(b'"n":1', b'"n":2'), raw.replace(b":", b": ", 1), raw[:-1], b"[]"):
        with pytest.raises(ValueError):
            sealed.open_sealed(bad, ValueError)
    assert len(sealed.address(b"")) == 64 and len(sealed.digest128(b"")) == 32


def test_safetensors_roundtrip_and_strict_header():
    tensors = {"w": np.linspace(-1, 1, 6).astype(ml_dtypes.bfloat16).reshape(2, 3), "i": np.arange(3, dtype=np.int64)}
    raw = safetensors.dumps(tensors, {"step": 7})
    back, meta = safetensors.loads(raw, ValueError)
    assert meta == {"step": "7"}
    for k in tensors:
        assert_bits_equal(back[k], tensors[k], k)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["w"]["extra"] = 1
    body = json.dumps(header).encode()
    with pytest.raises(ValueError, match="exactly dtype, shape and data_offsets"):
        safetensors.loads(len(body).to_bytes(8, "little") + body + raw[8 + n :], ValueError)
    with pytest.raises(ValueError, match="8-byte header"):
        safetensors.loads(b"\x01", ValueError)


def test_dtype_table():
    for name in ("bfloat16", "float8_e4m3fn", "float32", "int64", "uint8", "bool"):
        assert dtypes.dtype_name(dtypes.dtype_from_name(name)) == name
    assert dtypes.dtype_from_name("int16").byteorder in "<|="
    with pytest.raises(DtypeError, match="complex"):
        dtypes.dtype_name(np.complex64)
    with pytest.raises(DtypeError):
        dtypes.dtype_from_name("complex64")
    assert dtypes.numpy_dtype("float8_e5m2") == np.dtype(ml_dtypes.float8_e5m2)
    assert set(dtypes.RAW_BITS) <= dtypes.STORABLE and len(dtypes.SAFETENSORS_CODES) == len(dtypes.STORABLE)
    assert isinstance(DtypeError("x"), InvalidInputError)


def test_formatting():
    assert formatting.human_bytes(45_170_000) == "45.2 MB" and formatting.binary_bytes(4 << 20) == "4 MiB"
    assert formatting.plural(2, "step") == "2 steps"


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"])
def test_torch_bridge_is_bit_exact(name):
    pytest.importorskip("torch")
    from ulstore.core.torch import as_numpy, from_tensor, to_tensor

    x = awkward_floats(np.dtype(getattr(ml_dtypes, name, None) or name))
    t = to_tensor(x)
    assert str(t.dtype) == f"torch.{name}"
    assert_bits_equal(t, x, "to_tensor")
    assert_bits_equal(from_tensor(t), x, "from_tensor")
    zero_d = to_tensor(x[0].reshape(()))
    assert tuple(zero_d.shape) == ()
    assert_bits_equal(as_numpy(zero_d), x[0].reshape(()), "a 0-d tensor")
    assert as_numpy([1.0]) is None and as_numpy(x) is x


def test_local_ranges_past_the_end_come_back_short(tmp_path):
    # small reads take os.pread: an offset past the end (a crafted one up to 2**63 - 1) is a short read, not EINVAL
    objects = ObjectStore.from_url(str(tmp_path / "o"))
    objects.put("p/s.pack", b"small")
    ranges = [(1, 3), (3, 100), (10, 20), (2**63 - 2, 2**63 - 1), (2**63 - 1, 2**63 + 99)]
    assert objects.get_ranges("p/s.pack", ranges) == [b"ma", b"ll", b"", b"", b""]
