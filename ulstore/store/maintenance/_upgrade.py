"""``ulstore upgrade SRC DEST``: convert a format-1 trajectory (JSON manifests + one object per blob) to format 2.

Format 1 is read by the small legacy reader below, kept only for this: it
checks every manifest (canonical JSON + blake2b-128 checksum), every blob
(blake2b-256 address) and every decoded chunk (blake2b-128 content hash),
and walks reference chains iteratively.  Every step is committed into DEST
through the one commit path, parents before children, keeping its step
number, parent, anchors, chunk grids, metadata and creation time; then every
ref is set.  The values are bit-exact; the blobs and manifests are new.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np

from ...core.dtypes import numpy_dtype
from ...core.objects import MAX_DOCUMENT_BYTES, ObjectStore
from ...core.sealed import canonical_json
from ...errors import ConflictError, CorruptBlobError, CorruptManifestError, InvalidInputError, NotFoundError
from ..format._chunk_tables import MAX_CHUNK_BYTES, chunk_nbytes
from ..format._chunkcodec import decode_chunk, le_bytes
from ..format._layout import ROOT_META, STEPS_DIR, chunk_grid, step_key

__all__ = ["upgrade", "LegacyTrajectory"]

_MAX_CHAIN = 1 << 16


def _count(n, least: int) -> int:
    """A shape (``least`` 0) or chunk (``least`` 1) extent read from a manifest."""
    if isinstance(n, bool) or not isinstance(n, int) or n < least or n >= 1 << 62:
        raise ValueError(f"extent {n!r} is not an int in [{least}, 2**62)")
    return n


def _b2(data, size: int) -> str:
    return hashlib.blake2b(data, digest_size=size).hexdigest()


class LegacyTrajectory:
    """Read-only access to a format-1 trajectory (for :func:`upgrade` only)."""

    def __init__(self, io: ObjectStore):
        self.io = io
        raw = io.get(ROOT_META, limit=MAX_DOCUMENT_BYTES)
        if raw is None:
            raise NotFoundError(f"no trajectory at {io.url!r}", key=ROOT_META)
        try:
            settings = json.loads(raw)["attributes"]["ulstore"]
        except Exception as e:
            raise CorruptManifestError(f"root zarr.json is not a trajectory's: {e}", key=ROOT_META) from e
        if settings.get("format") != 1:
            raise InvalidInputError(f"{io.url!r} is not a format-1 trajectory (format {settings.get('format')!r})")
        self.anchor_every = int(settings["anchor_every"])
        self.chunk_bytes = int(settings["chunk_bytes"])
        self._manifests: dict[int, dict] = {}
        self._prev: tuple[int, dict] | None = None  # the step decoded last: (step, {(name, coord): array})

    @property
    def steps(self) -> list[int]:
        out = []
        for k in self.io.find(STEPS_DIR):
            parts = k.split("/")
            if len(parts) == 3 and parts[2] == "zarr.json" and parts[1].isdigit() and parts[1].isascii():
                out.append(int(parts[1]))
        return sorted(out)

    @property
    def refs(self) -> dict[str, int]:
        out = {}
        for k in self.io.find("refs"):
            name = k[len("refs/") :]
            if "/" in name or not name.endswith(".json"):
                continue
            raw = self.io.get(k, limit=MAX_DOCUMENT_BYTES)
            try:
                out[name[: -len(".json")]] = int(json.loads(raw)["step"])  # type: ignore[arg-type]
            except Exception as e:
                raise CorruptManifestError(f"ref is damaged: {e}", key=k) from e
        return out

    def manifest(self, step: int) -> dict:
        """The checked manifest body of ``step`` (shapes, dtypes, chunks, entries)."""
        m = self._manifests.get(step)
        if m is not None:
            return m
        key = step_key(step)
        raw = self.io.get(key, limit=MAX_DOCUMENT_BYTES)
        if raw is None:
            raise CorruptManifestError("manifest is missing", step=step, key=key)
        try:
            doc = json.loads(raw)
            if canonical_json(doc) != bytes(raw):
                raise ValueError("not canonical")
            checksum = doc["attributes"].pop("ulstore_checksum")
            if checksum != _b2(canonical_json(doc), 16):
                raise ValueError("checksum")
            body = doc["attributes"]["ulstore"]
            if body["format"] != 1 or body["step"] != step:
                raise ValueError("format or step")
            for t in body["tensors"].values():
                t["shape"] = tuple(_count(n, 0) for n in t["shape"])
                t["chunks"] = tuple(_count(n, 1) for n in t["chunks"])
                t["dtype"] = numpy_dtype(t["dtype"])
                if len(t["chunks"]) != len(t["shape"]):
                    raise ValueError("chunks and shape differ in rank")
                if chunk_nbytes(t["shape"], t["chunks"], t["dtype"].itemsize) > MAX_CHUNK_BYTES:
                    raise ValueError(f"chunks {list(t['chunks'])} exceed {MAX_CHUNK_BYTES} bytes")
                if len(t["entries"]) != math.prod(chunk_grid(t["shape"], t["chunks"])):
                    raise ValueError("chunk table")
        except Exception as e:
            raise CorruptManifestError(
                f"format-1 manifest is damaged: {type(e).__name__}: {e}", step=step, key=key
            ) from e
        self._manifests[step] = body
        return body

    def read(self, step: int) -> dict[str, np.ndarray]:
        """Every tensor of ``step``, exact; chains walked iteratively (each chunk's chain once)."""
        m = self.manifest(step)
        prev = self._prev[1] if self._prev is not None else {}
        cur: dict = {}
        out = {}
        for name, t in m["tensors"].items():
            arr = np.empty(t["shape"], t["dtype"])
            for i, coord in enumerate(np.ndindex(*chunk_grid(t["shape"], t["chunks"]))):
                region = tuple(slice(c * k, min((c + 1) * k, n)) for c, k, n in zip(coord, t["chunks"], t["shape"]))
                value = self._chunk(step, name, i, prev, cur)
                if region:
                    arr[region] = value
                else:
                    arr[...] = value
                cur[(name, coord, t["entries"][i][2])] = value
            out[name] = arr
        self._prev = (step, cur)
        return out

    def _chunk(self, step: int, name: str, i: int, prev: dict, cur: dict) -> np.ndarray:
        chain: list[tuple] = []  # (step, tensor manifest, blob, content, coord), newest first
        s: int | None = step
        seen = set()
        value = None
        while s is not None:
            if s in seen or len(chain) > _MAX_CHAIN:
                raise CorruptManifestError("reference cycle in a format-1 trajectory", step=step, tensor=name)
            seen.add(s)
            t = self.manifest(s)["tensors"].get(name)
            if t is None:
                raise CorruptManifestError(f"reference step {s} has no tensor {name!r}", step=step, tensor=name)
            blob, ref, content = t["entries"][i]
            coord = tuple(np.unravel_index(i, chunk_grid(t["shape"], t["chunks"]))) if t["shape"] else ()
            hit = prev.get((name, tuple(int(c) for c in coord), content))
            if hit is not None:
                value = hit
                break
            chain.append((s, t, blob, content, coord))
            s = ref
        for s, t, blob, content, coord in reversed(chain):
            key = f"blobs/{blob[:2]}/{blob}"
            data = self.io.get(key) if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob) else None
            if data is None or _b2(data, 32) != blob:
                raise CorruptBlobError("format-1 blob is missing or damaged", step=s, tensor=name, key=key)
            shape = tuple(min((c + 1) * k, n) - c * k for c, k, n in zip(coord, t["chunks"], t["shape"]))
            value = decode_chunk(data, value, t["codec"], t["dtype"], shape, key=key)
            if _b2(le_bytes(value), 16) != content:
                raise CorruptBlobError("format-1 chunk fails its content hash", step=s, tensor=name, key=key)
        assert value is not None
        return value


def _topological(legacy: LegacyTrajectory, steps: list[int]) -> list[int]:
    """Parents before children (step numbers need not grow along a chain)."""
    present = set(steps)
    children: dict[int | None, list[int]] = {}
    for s in steps:
        p = legacy.manifest(s)["parent"]
        children.setdefault(p if p in present else None, []).append(s)
    order: list[int] = []
    stack = sorted(children.get(None, []), reverse=True)
    while stack:
        s = stack.pop()
        order.append(s)
        stack += sorted(children.get(s, []), reverse=True)
    if len(order) != len(steps):
        raise CorruptManifestError("the parents of a format-1 trajectory form a cycle")
    return order


def upgrade(src, dest, *, storage_options: dict | None = None, dest_storage_options: dict | None = None, progress=None):
    """Convert the format-1 trajectory at ``src`` into a new format-2 trajectory at ``dest``.

    Parameters
    ----------
    src, dest : str or os.PathLike
        fsspec URLs or local paths; ``dest`` must not hold a trajectory.
    storage_options, dest_storage_options : dict, optional
        For ``src`` and ``dest`` (``dest`` defaults to ``storage_options``).
    progress : callable, optional
        Called as ``progress(done, total)`` after each step.

    Returns
    -------
    Trajectory
        ``dest``, opened read/write.

    Raises
    ------
    InvalidInputError
        ``src`` is not a format-1 trajectory.
    ConflictError
        ``dest`` holds a trajectory already.
    IntegrityError
        A manifest or blob of ``src`` is damaged (nothing is committed past it).
    """
    from ..trajectory import open as _open

    legacy = LegacyTrajectory(ObjectStore.from_url(os.fspath(src), storage_options))
    options = dest_storage_options if dest_storage_options is not None else storage_options
    dest_io = ObjectStore.from_url(os.fspath(dest), options)
    if dest_io.get(ROOT_META) is not None:
        raise ConflictError(
            f"{os.fspath(dest)!r} holds a trajectory already; upgrade into a new location", key=ROOT_META
        )
    traj = _open(
        dest, mode="w-", storage_options=options, anchor_every=legacy.anchor_every, chunk_bytes=legacy.chunk_bytes
    )
    steps = legacy.steps
    order = _topological(legacy, steps)
    for done, s in enumerate(order, 1):
        m = legacy.manifest(s)
        arrays = legacy.read(s)
        parent = m["parent"] if m["parent"] in set(steps) else None
        traj._committer._commit(
            s,
            arrays,
            parent=parent,
            # an anchor stays one; so does a step whose chunks are all intra (a delete re-coded them)
            is_anchor=parent is None
            or m["anchor_distance"] == 0
            or all(e[1] is None for t in m["tensors"].values() for e in t["entries"]),
            branch=None,
            metadata=m["metadata"],
            files={},
            chunks={name: t["chunks"] for name, t in m["tensors"].items()},
            created=m.get("created") or None,
        )
        if progress is not None:
            progress(done, len(order))
    for name, step in sorted(legacy.refs.items()):
        if step in traj:
            traj._move_ref(name, step, None)  # a new trajectory: create each ref
    return traj
