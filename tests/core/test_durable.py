"""Local writes reach the disk before they return (``ObjectStore(durable=True)``, the default)."""

from __future__ import annotations

import pytest

from tests.helpers.store import file_id, record_fsyncs
from ulstore.core.objects import ObjectStore


@pytest.fixture
def synced(monkeypatch):
    return record_fsyncs(monkeypatch)


@pytest.mark.parametrize("how", ["put", "create"])
def test_write_fsyncs_the_file_and_every_directory_it_changed(tmp_path, synced, how):
    io = ObjectStore.from_url(str(tmp_path / "root"))
    getattr(io, how)("a/b/c.json", b"{}")
    path = tmp_path / "root" / "a" / "b" / "c.json"
    # the object (same inode as the fsynced temp file: linked, not copied), its directory,
    # and the parent of each directory the write created
    for p in (path, path.parent, path.parent.parent, tmp_path / "root"):
        assert file_id(p) in synced, p


def test_a_streamed_object_is_fsynced_with_its_directories(tmp_path, synced):
    io = ObjectStore.from_url(str(tmp_path / "root"))
    with io.open_writer("a/b/p.pack") as w:
        w.write(b"x" * 100)
        w.write(b"y" * 100)
    path = tmp_path / "root" / "a" / "b" / "p.pack"
    assert path.read_bytes() == b"x" * 100 + b"y" * 100
    for p in (path, path.parent, path.parent.parent, tmp_path / "root"):
        assert file_id(p) in synced, p


def test_not_durable_skips_fsync(tmp_path, synced):
    io = ObjectStore.from_url(str(tmp_path / "root"), durable=False)
    io.put("a/b.json", b"{}")
    io.create("a/c.json", b"{}")
    with io.open_writer("a/d.pack") as w:
        w.write(b"{}")
    assert not synced
