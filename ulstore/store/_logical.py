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
it is decoding (see ``docs/layout.md``).  This class subclasses
:class:`zarr.abc.store.Store` directly: a ``WrapperStore`` forwards
``get_sync`` in zarr 3.4 and would bypass this ``get``.

Store methods run on zarr's event loop; every manifest fetch and chunk decode
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
from ._manifest import Manifest, TensorManifest
from ._reader import ChunkReader
from ._zarr_dtypes import zarr_dtype

__all__ = ["LogicalStore", "array_metadata"]

_ROOT = {"zarr_format": 3, "node_type": "group", "attributes": {"ulstore": {"kind": "trajectory"}}}


def array_metadata(t: TensorManifest, name: str) -> dict:
    """Zarr v3 array metadata of a stored tensor as the logical store presents it."""
    z = zarr_dtype(t.dtype)
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(t.shape),
        "data_type": z.to_json(zarr_format=3),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(t.chunks)}},
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


def step_attributes(m: Manifest) -> dict:
    """The step group's attributes: the user's metadata plus ``ulstore`` bookkeeping."""
    info = {"step": m.step, "parent": m.parent, "anchor_distance": m.anchor_distance, "created": m.created}
    return {**m.metadata, "ulstore": info}


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

    def _manifest(self, part: str) -> Manifest | None:
        if not part.isdigit() or not part.isascii():
            return None
        try:
            return self.reader.manifest(int(part))
        except NotFoundError:
            return None

    @staticmethod
    def _find_chunk(m: Manifest, rest: str):
        """Split ``<tensor>/c/<i>/<j>`` into (tensor, coord), or None."""
        parts = rest.split("/")
        for i, p in enumerate(parts):
            if p != "c":
                continue
            name = "/".join(parts[:i])
            t = m.tensors.get(name)
            if t is None:
                continue
            idx = parts[i + 1 :]
            if len(idx) != len(t.shape) or not all(s.isdigit() and s.isascii() for s in idx):
                return None
            coord = tuple(int(s) for s in idx)
            if any(c >= g for c, g in zip(coord, t.grid)):
                return None
            return name, coord
        return None

    @staticmethod
    def _is_group(m: Manifest, node: str) -> bool:
        head = node + "/"
        return any(name.startswith(head) for name in m.tensors)

    def _resolve(self, key: str) -> bytes | None:
        """The bytes of logical ``key``, or None (runs in a worker thread)."""
        if key == "zarr.json":
            return json.dumps(_ROOT).encode()
        step, _, rest = key.partition("/")
        m = self._manifest(step)
        if m is None or not rest:
            return None
        if rest == "zarr.json":
            return json.dumps(_group(step_attributes(m))).encode()
        if rest.endswith("/zarr.json"):
            node = rest[: -len("/zarr.json")]
            t = m.tensors.get(node)
            if t is not None:
                return json.dumps(array_metadata(t, node)).encode()
            return json.dumps(_group({})).encode() if self._is_group(m, node) else None
        found = self._find_chunk(m, rest)
        if found is None:
            return None
        name, coord = found
        t = m.tensors[name]
        arr = self.reader.chunk(m.step, name, coord)
        if arr.shape != t.chunks:  # zarr expects whole chunks: pad edge chunks with the fill value (0)
            full = np.zeros(t.chunks, dtype=t.dtype)
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
        m = await asyncio.to_thread(self._manifest, step)
        return m is not None and self._find_chunk(m, rest) is not None

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
        m = self._manifest(step)
        if m is None:
            return []
        if node in m.tensors:
            return ["zarr.json", "c"]
        head = node + "/" if node else ""
        names = {n[len(head) :].split("/")[0] for n in m.tensors if n.startswith(head)}
        return ["zarr.json", *sorted(names)] if names or not node else []

    def _all_keys(self, prefix: str) -> builtins.list[str]:
        keys = ["zarr.json"]
        for step in self._steps():
            if not (step + "/").startswith(prefix[: len(step) + 1]) and not prefix.startswith(step):
                continue
            m = self._manifest(step)
            if m is None:
                continue
            keys.append(f"{step}/zarr.json")
            groups: set[str] = set()
            for name, t in m.tensors.items():
                parts = name.split("/")
                groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
                keys.append(f"{step}/{name}/zarr.json")
                keys += [f"{step}/{name}/" + "/".join(["c", *map(str, c)]) for c in t.coords()]
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
