"""A read-only zarr Store presenting the *logical* hierarchy of a trajectory.

Keys it serves (``<step>`` is a decimal step number)::

    zarr.json                          root group
    <step>/zarr.json                   the step's group: attributes = user metadata
                                       + {"ulstore": {step, parent, ...}}
    <step>/<a>/zarr.json               an intermediate group of a tensor name with "/"
    <step>/<tensor>/zarr.json          array metadata: real dtype, plain ``bytes`` codec
    <step>/<tensor>/c/<i>/<j>          a decoded chunk, padded to the full chunk shape

The array metadata declares only the ``bytes`` codec: zarr sees raw values,
and all ULPack decoding, reference walking, checking and caching happens in
:class:`~._reader.ChunkReader`, because a zarr codec never learns which chunk
it is decoding (see ``docs/layout.md``).  A tensor stored in several pieces
(shards) is presented with the chunk grid of its first piece; a chunk that
straddles pieces is assembled from the stored chunks it overlaps.  This class subclasses
:class:`zarr.abc.store.Store` directly: a ``WrapperStore`` forwards
``get_sync`` in zarr 3.4 and would bypass this ``get``.

Store methods run on zarr's event loop; every step document fetch and chunk decode
is sent to a thread (``asyncio.to_thread``) so the loop keeps serving other
chunks while the compiled kernels (which release the GIL) work.
"""

from __future__ import annotations

import asyncio
import builtins
import json
from collections.abc import AsyncIterator, Iterable

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.dtype.common import HasEndianness

from ..errors import NotFoundError, ReadOnlyError
from ._layout import chunk_grid
from ._reader import ChunkReader
from ._stepdoc import StepDoc
from ._tables import TensorTable
from ._zarr_dtypes import zarr_dtype

__all__ = ["LogicalStore", "array_metadata"]

_ROOT = {"zarr_format": 3, "node_type": "group", "attributes": {"ulstore": {"kind": "trajectory"}}}


def logical_chunks(t: TensorTable) -> tuple[int, ...]:
    """The chunk grid the zarr view presents: the first piece's (the only one's, unsharded)."""
    return t.pieces[0].chunks


def array_metadata(t: TensorTable, name: str) -> dict:
    """Zarr v3 array metadata of a stored tensor as the logical store presents it."""
    z = zarr_dtype(t.dtype)
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(t.shape),
        "data_type": z.to_json(zarr_format=3),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(logical_chunks(t))}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": _jsonable(z.to_json_scalar(z.default_scalar(), zarr_format=3)),
        # dtypes of one byte have no byte order: zarr rejects an ``endian`` for them
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]
        if isinstance(z, HasEndianness)
        else [{"name": "bytes"}],
        "attributes": {"ulstore": {"codec": t.codec, "tensor": name}},
    }


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v


def _group(attributes: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def step_attributes(d: StepDoc) -> dict:
    """The step group's attributes: the user's metadata plus ``ulstore`` bookkeeping."""
    info = {
        "step": d.step,
        "parent": d.parent,
        "anchor_distance": d.anchor_distance,
        "created": d.created,
        "content": d.content,
    }
    return {**d.metadata, "ulstore": info}


class LogicalStore(Store):
    """Read-only zarr store over a :class:`ChunkReader`.

    Parameters
    ----------
    reader : ChunkReader
        Shared with the :class:`~ulstore.store.Trajectory`, so its caches serve
        ``traj[step]`` and ``traj.read`` alike.
    """

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, reader: ChunkReader):
        super().__init__(read_only=True)
        self.reader = reader

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogicalStore) and other.reader is self.reader

    def __hash__(self) -> int:
        return id(self.reader)

    def __repr__(self) -> str:
        return f"LogicalStore({self.reader.io!r})"

    # -- resolving keys ---------------------------------------------------------

    def _doc(self, part: str) -> StepDoc | None:
        if not part.isdigit() or not part.isascii():
            return None
        try:
            return self.reader.doc(int(part))
        except NotFoundError:
            return None

    def _tensor(self, d: StepDoc, name: str) -> TensorTable | None:
        try:
            return self.reader.tensor(d.step, name)
        except NotFoundError:
            return None

    def _find_chunk(self, d: StepDoc, rest: str):
        """Split ``<tensor>/c/<i>/<j>`` into (tensor table, coord), or None."""
        parts = rest.split("/")
        for i, p in enumerate(parts):
            if p != "c":
                continue
            name = "/".join(parts[:i])
            t = self._tensor(d, name) if name else None
            if t is None:
                continue
            idx = parts[i + 1 :]
            if len(idx) != len(t.shape) or not all(s.isdigit() and s.isascii() for s in idx):
                return None
            coord = tuple(int(s) for s in idx)
            if any(c >= g for c, g in zip(coord, chunk_grid(t.shape, logical_chunks(t)))):
                return None
            return t, coord
        return None

    def _is_group(self, d: StepDoc, node: str) -> bool:
        head = node + "/"
        return any(name.startswith(head) for name in self.reader.tables(d.step))

    def _resolve(self, key: str) -> bytes | None:
        """The bytes of logical ``key``, or None (runs in a worker thread)."""
        if key == "zarr.json":
            return json.dumps(_ROOT).encode()
        step, _, rest = key.partition("/")
        d = self._doc(step)
        if d is None or not rest:
            return None
        if rest == "zarr.json":
            return json.dumps(_group(step_attributes(d))).encode()
        if rest.endswith("/zarr.json"):
            node = rest[: -len("/zarr.json")]
            t = self._tensor(d, node)
            if t is not None:
                return json.dumps(array_metadata(t, node)).encode()
            return json.dumps(_group({})).encode() if self._is_group(d, node) else None
        found = self._find_chunk(d, rest)
        if found is None:
            return None
        t, coord = found
        chunks = logical_chunks(t)
        lo = tuple(i * c for i, c in zip(coord, chunks))
        hi = tuple(min(a + c, n) for a, c, n in zip(lo, chunks, t.shape))
        arr = self.reader.box(d.step, t.name, lo, hi) if len(t.pieces) > 1 else self.reader.chunk(d.step, t.name, coord)
        if arr.shape != chunks:  # zarr expects whole chunks: pad edge chunks with the fill value (0)
            full = np.zeros(chunks, dtype=t.dtype)
            full[tuple(slice(0, n) for n in arr.shape)] = arr
            arr = full
        return np.ascontiguousarray(arr).tobytes()

    # -- Store API --------------------------------------------------------------

    async def get(self, key: str, prototype, byte_range: ByteRequest | None = None):
        data = await asyncio.to_thread(self._resolve, key)
        if data is None:
            return None
        if byte_range is not None:
            data = _slice(data, byte_range)
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(self, prototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]):
        return await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges))

    async def exists(self, key: str) -> bool:
        if key.endswith("zarr.json"):
            return await asyncio.to_thread(self._resolve, key) is not None
        step, _, rest = key.partition("/")

        def find():
            d = self._doc(step)
            return d is not None and self._find_chunk(d, rest) is not None

        return await asyncio.to_thread(find)

    async def set(self, key: str, value) -> None:
        raise ReadOnlyError("a trajectory step is read-only; commit a new step instead", key=key)

    async def set_if_not_exists(self, key: str, value) -> None:
        raise ReadOnlyError("a trajectory step is read-only; commit a new step instead", key=key)

    async def delete(self, key: str) -> None:
        raise ReadOnlyError("a trajectory step is read-only; use Trajectory.delete", key=key)

    async def list(self) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._all_keys, ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._all_keys, prefix):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        for name in await asyncio.to_thread(self._children, prefix.rstrip("/")):
            yield name

    # -- listing ----------------------------------------------------------------

    def _steps(self) -> builtins.list[str]:
        from ._layout import STEPS_DIR

        keys = self.reader.io.find(STEPS_DIR)
        return sorted({k.split("/")[1] for k in keys if k.count("/") == 2 and k.endswith("/zarr.json")}, key=int)

    def _children(self, prefix: str) -> builtins.list[str]:
        if prefix == "":
            return ["zarr.json", *self._steps()]
        step, _, node = prefix.partition("/")
        d = self._doc(step)
        if d is None:
            return []
        tensors = self.reader.tables(d.step)
        if node in tensors:
            return ["zarr.json", "c"]
        head = node + "/" if node else ""
        names = {n[len(head) :].split("/")[0] for n in tensors if n.startswith(head)}
        return ["zarr.json", *sorted(names)] if names or not node else []

    def _all_keys(self, prefix: str) -> builtins.list[str]:
        keys = ["zarr.json"]
        for step in self._steps():
            if not (step + "/").startswith(prefix[: len(step) + 1]) and not prefix.startswith(step):
                continue
            d = self._doc(step)
            if d is None:
                continue
            keys.append(f"{step}/zarr.json")
            groups: set[str] = set()
            for name, t in self.reader.tables(d.step).items():
                parts = name.split("/")
                groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
                keys.append(f"{step}/{name}/zarr.json")
                grid = chunk_grid(t.shape, logical_chunks(t))
                keys += [f"{step}/{name}/" + "/".join(["c", *map(str, c)]) for c in np.ndindex(*grid)]
            keys += [f"{step}/{g}/zarr.json" for g in sorted(groups)]
        return [k for k in keys if k.startswith(prefix)]


def _slice(data: bytes, r: ByteRequest) -> bytes:
    if isinstance(r, RangeByteRequest):
        return data[r.start : r.end]
    if isinstance(r, OffsetByteRequest):
        return data[r.offset :]
    if isinstance(r, SuffixByteRequest):
        return data[-r.suffix :] if r.suffix else b""
    raise TypeError(f"unexpected byte range {r!r}")
