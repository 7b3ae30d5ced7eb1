"""Helpers for the store and io tests: real toytrain trajectories, exact state comparison, read counting."""

from __future__ import annotations

import functools
import os

import numpy as np

from ulstore import toytrain

from .bits import assert_bits_equal

__all__ = [
    "states_bf16",
    "states_fp32",
    "commit_states",
    "assert_state_equal",
    "CountingIO",
    "env_threads",
    "CHUNK",
    "entries",
    "flip_at",
    "rewrite_step",
    "Crash",
    "CrashAfter",
    "record_fsyncs",
    "file_id",
]

CHUNK = 4096  # small chunks: multi-chunk tensors from the tiny model


@functools.cache
def _trajectory(kind, steps, dtype):
    return toytrain.trajectory(kind, steps, preset="tiny", dtype=dtype)


def states_bf16(steps: int = 20):
    """A real bf16 fine-tuning trajectory of the tiny model (steps + 1 checkpoints)."""
    return _trajectory("finetune", steps, "bfloat16")


def states_fp32(steps: int = 20):
    """A real fp32 pre-training trajectory of the tiny model."""
    return _trajectory("pretrain", steps, "float32")


def commit_states(url, states, chunk_bytes: int = 1 << 14, **options):
    """A new trajectory at ``url`` with ``states[s]`` committed as step ``s``, in order; returned open."""
    import ulstore

    traj = ulstore.open(url, mode="w", chunk_bytes=chunk_bytes, **options)
    for s, state in enumerate(states):
        traj.commit(s, state)
    return traj


def assert_state_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert_bits_equal(got[k], np.asarray(want[k]), k)


class CountingIO:
    """Wraps an ObjectStore's reads and records them: ``(key, None)`` for a GET, ``(key, (start, end))`` per range."""

    def __init__(self, io):
        self.io = io
        self.reads: list = []
        self._get, self._ranges = io.get, io.get_ranges
        io.get = self._get_one
        io.get_ranges = self._get_ranges

    def _get_one(self, key, **kwargs):
        self.reads.append((key, None))
        return self._get(key, **kwargs)

    def _get_ranges(self, key, ranges):
        self.reads += [(key, tuple(r)) for r in ranges]
        return self._ranges(key, ranges)

    def packs(self):
        """Range reads of packs (table blocks and blobs), as (key, (start, end))."""
        return [r for r in self.reads if r[0].startswith("packs/")]

    def docs(self):
        """Step documents read."""
        return [k for k, _ in self.reads if k.startswith("steps/")]

    def reset(self):
        self.reads.clear()


def entries(traj, step):
    """Every chunk entry of ``step``: dicts with tensor, piece, coord, content, ref, blob and snapshot locations."""
    reader = traj._reader
    d = reader.doc(step)
    out = []
    for name, t in reader.tables(step).items():
        for j, p in enumerate(t.pieces):
            for i, coord in enumerate(p.coords()):
                snap = p.snapshot(i)
                out.append(
                    {
                        "tensor": name,
                        "piece": j,
                        "coord": coord,
                        "content": p.content[i].tobytes(),
                        "ref": None if p.ref[i] < 0 else int(p.ref[i]),
                        "blob": (d.packs[int(p.pack[i])], int(p.off[i]), int(p.length[i])),
                        "snapshot": None if snap is None else (d.packs[snap[0]], snap[1], snap[2]),
                    }
                )
    return out


def flip_at(io, key: str, pos: int, mask: int = 0x01) -> bytes:
    """Flip bits ``mask`` of byte ``pos`` of object ``key``; returns the original bytes (to put back)."""
    data = io.get(key)
    bad = bytearray(data)
    bad[pos] ^= mask
    io.put(key, bytes(bad))
    return data


def env_threads():
    return int(os.environ.get("ULSTORE_TEST_THREADS", "2"))


def rewrite_step(traj, step, mutate=None, *, body=None, recompute_content=False):
    """Rewrite ``step``'s tables and step document on storage, as a crafted store would: checksums recomputed.

    ``mutate(tables, append)`` edits the tables (name -> TensorTable, columns writable);
    ``append(blob_bytes)`` stores new bytes and returns ``(pack number, offset, length)``.
    ``body(dict)`` edits the step document's fields last.  The descendants whose step documents copy
    ``step``'s table directory in their ``chain`` get the new one (as a thorough crafter would: so that
    reads through chains meet the crafted tables too).
    """
    import dataclasses

    from ulstore.store.format._chunk_tables import Piece, content_checksum
    from ulstore.store.format._chunkcodec import digest
    from ulstore.store.format._layout import step_key
    from ulstore.store.format._packs import PackStream
    from ulstore.store.format._stepdoc import TableRef
    from ulstore.store.format._table_block import encode_block
    from ulstore.store.read._chunk_reader import ChunkReader

    io = traj._io
    reader = ChunkReader(io, 0, 1)
    d = reader.doc(step)
    tables = {}
    for name, t in reader.tables(step).items():
        pieces = tuple(
            Piece(p.offset, p.shape, p.chunks, p.content.copy(), p.ref.copy(), p.pack.copy(), p.off.copy(),
                  p.length.copy(), None if p.snap is None else p.snap.copy())
            for p in t.pieces
        )  # fmt: skip
        tables[name] = dataclasses.replace(t, pieces=pieces)
    stream = PackStream(io, 1 << 40)
    packs = list(d.packs)

    def append(data):
        pid, off, n = stream.append(data)
        if pid not in packs:
            packs.append(pid)
        return packs.index(pid), off, n

    if mutate is not None:
        mutate(tables, append)
    refs = []
    names = sorted(tables)
    for ref in d.tables:
        block = [tables[n] for n in names if ref.first <= n <= ref.last]
        raw = encode_block(block)
        pack, off, n = append(raw)
        refs.append(TableRef(block[0].name, block[-1].name, pack, off, n, digest(raw).hex()))
    stream.close()
    content = d.content
    if recompute_content:
        content = content_checksum(tables.values(), {k: f.hash for k, f in d.files.items()}, d.metadata)
    new = dataclasses.replace(d, packs=tuple(packs), tables=tuple(refs), content=content)
    raw = new.to_bytes()
    if body is not None:
        import json

        from ulstore.core.sealed import canonical_json

        doc = json.loads(raw)
        del doc["attributes"]["ulstore_checksum"]
        body(doc["attributes"]["ulstore"])
        if doc["attributes"]["ulstore"]["parent"] != d.parent:  # the chain copied the old parent path: gone
            doc["attributes"]["ulstore"].pop("chain", None)
        doc["attributes"]["ulstore_checksum"] = digest(canonical_json(doc)).hex()
        raw = canonical_json(doc)
    io.put(step_key(step), raw)
    _rechain_descendants(io, step, raw)
    return raw


def _rechain_descendants(io, step, raw):
    """Put the step documents whose ``chain`` names ``step`` again with ``step``'s new directory (``raw``)."""
    from ulstore.errors import CorruptManifestError
    from ulstore.store.format._layout import step_key
    from ulstore.store.format._stepdoc import StepDoc
    from ulstore.store.maintenance._relocate import rechained

    try:
        new = StepDoc.from_bytes(raw, key=step_key(step), step=step)
    except CorruptManifestError:
        return  # crafted into damage: nothing else to keep in line with it
    docs = {}
    for key in io.find("steps"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "zarr.json" and parts[1].isdigit() and int(parts[1]) != step:
            try:
                docs[int(parts[1])] = StepDoc.from_bytes(io.get(key), key=key, step=int(parts[1]))
            except CorruptManifestError:
                continue
    docs[step] = new
    for d in rechained(docs, []):
        if any(e.step == step for e in docs[d.step].chain) or any(e.step == step for e in d.chain):
            io.put(step_key(d.step), d.to_bytes())


class Crash(RuntimeError):
    """The failure :class:`CrashAfter` injects."""


class CrashAfter:
    """Make ObjectStore ``io`` raise :class:`Crash` after ``k`` mutating calls.

    Counted: every pack write and close, put, create, delete and delete_many.
    ``crashed`` says whether it fired; ``restore()`` puts the real methods back.
    """

    def __init__(self, io, k: int):
        self.io, self.k, self.n, self.crashed = io, k, 0, False
        self.real = {n: getattr(io, n) for n in ("put", "create", "delete", "delete_many", "open_writer")}
        for n in ("put", "create", "delete", "delete_many"):
            setattr(io, n, self._wrap(self.real[n]))
        io.open_writer = self._open_writer

    def _tick(self):
        if self.n >= self.k:
            self.crashed = True
            raise Crash(f"crash after {self.k} writes")
        self.n += 1

    def _wrap(self, fn):
        def call(*a, **kw):
            self._tick()
            return fn(*a, **kw)

        return call

    def _open_writer(self, key, **kw):
        w = self.real["open_writer"](key, **kw)
        w.write, w.close = self._wrap(w.write), self._wrap(w.close)
        return w

    def restore(self):
        for n, fn in self.real.items():
            setattr(self.io, n, fn)


def file_id(path) -> tuple[int, int]:
    """(device, inode) of a file or directory: what an fsync of any descriptor of it records."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def record_fsyncs(monkeypatch) -> set:
    """Patch ``os.fsync`` to record the :func:`file_id` of everything synced; returns the (live) set."""
    synced: set = set()
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced
