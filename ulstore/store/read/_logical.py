"""A read-only zarr Store presenting the *logical* hierarchy of a trajectory.

Keys it serves (``<step>`` is a decimal step number)::

    zarr.json                          root group
    <step>/zarr.json                   the step's group: attributes = user metadata
                                       + {"ulstore": {step, parent, ...}}
    <step>/<a>/zarr.json               an intermediate group of a tensor name with "/"
    <step>/<tensor>/zarr.json          array metadata: real dtype, plain ``bytes`` codec
    <step>/<tensor>/c/<i>/<j>          a decoded chunk, padded to the full chunk shape

Steps and chunk indices are canonical decimal numbers: ``00/zarr.json`` or
``c/00/0`` name nothing (one key per object, no aliases).
:meth:`~ulstore.store.Trajectory.zarr_store` gives a store rooted at one step
(its keys are the ones above without ``<step>/``).

Every array has ``dimension_names`` ``["<tensor>.dim_0", "<tensor>.dim_1", ...]``
(the full tensor name, so no two tensors of a step share a dimension: xarray
opens a step as a Dataset, or a DataTree for names with ``/``, without size
conflicts between tensors).

The store is read-only (zarr's conventions: constructed with ``read_only=True``
only, writes raise zarr's ``ValueError``, which is also a
:class:`~ulstore.errors.ReadOnlyError`), and picklable: a pickled store
carries the trajectory's location, not its caches, so arrays of a step travel
to dask workers (``processes=True``, ``distributed``) that can reach the same
storage.

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

from ...codec.zarr3 import zarr_dtype
from ...errors import InvalidInputError, NotFoundError, ReadOnlyError
from ..format._chunk_tables import TensorTable
from ..format._layout import chunk_grid
from ..format._stepdoc import StepDoc
from ._chunk_reader import ChunkReader

__all__ = ["LogicalStore", "array_metadata", "dimension_names"]

_WRITE = "store was opened in read-only mode and does not support writing"  # zarr's wording (StoreTests match it)


class StoreReadOnlyError(ReadOnlyError, ValueError):
    """A write to the logical store: zarr's ``ValueError`` and ulstore's :class:`ReadOnlyError` at once."""


def _canonical(part: str) -> bool:
    """``part`` is a decimal number written the one way (no sign, no leading zero)."""
    return part.isascii() and part.isdigit() and (part == "0" or part[0] != "0")


_ROOT = {"zarr_format": 3, "node_type": "group", "attributes": {"ulstore": {"kind": "trajectory"}}}


def logical_chunks(t: TensorTable) -> tuple[int, ...]:
    """The chunk grid the zarr view presents: the first piece's (the only one's, unsharded)."""
    return t.pieces[0].chunks


def dimension_names(name: str, ndim: int) -> list[str]:
    """The dimension names of tensor ``name``: ``<name>.dim_<i>`` (unique within a step)."""
    return [f"{name}.dim_{i}" for i in range(ndim)]


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
        "dimension_names": dimension_names(name, len(t.shape)),
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
    """Read-only zarr store presenting the steps of a trajectory as plain zarr v3 arrays.

    Get one with :meth:`Trajectory.zarr_store <ulstore.store.Trajectory.zarr_store>`
    (``traj[step]`` opens a group on it).

    Parameters
    ----------
    source : Trajectory or ChunkReader
        The trajectory (its chunk reader, so its caches serve ``traj[step]``
        and ``traj.read`` alike).
    step : int, optional
        Root the store at this step (keys ``zarr.json``, ``<tensor>/c/0/0``);
        default: the whole trajectory (keys ``<step>/...``).
    read_only : bool, default True
        Must be True: steps are immutable (``False`` raises ``ValueError``).
    """

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, source, *, step: int | None = None, read_only: bool = True):
        if not read_only:
            raise ValueError("a trajectory's zarr store is read-only (read_only=True): commit a new step instead")
        super().__init__(read_only=True)
        reader = getattr(source, "_reader", source)
        if not isinstance(reader, ChunkReader):
            raise InvalidInputError(f"LogicalStore needs a Trajectory or a ChunkReader, got {type(source).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise InvalidInputError(f"step must be an int >= 0, got {step!r}")
        self.reader = reader
        self.step = step
        self._prefix = "" if step is None else f"{step}/"

    def _where(self) -> tuple:
        """What a store reads: equal for a store and its unpickled copy (fsspec's tokens are not)."""
        io = self.reader.io
        return (type(io.fs), getattr(io.fs, "storage_options", None), io.root, self.step)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogicalStore) and (other.reader is self.reader or other._where() == self._where())

    def __hash__(self) -> int:
        return hash((self.reader.io.root, self.step))

    def __repr__(self) -> str:
        at = "" if self.step is None else f", step={self.step}"
        return f"LogicalStore({self.reader.io.url!r}{at})"

    def with_read_only(self, read_only: bool = False) -> LogicalStore:
        """A new (unopened) store over the same steps; ``read_only=False`` is not possible."""
        if not read_only:
            raise NotImplementedError(
                f"with_read_only is not implemented for the {type(self)} store type. "
                "A trajectory's steps are immutable: commit a new step instead."
            )
        return type(self)(self.reader, step=self.step, read_only=True)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_is_open"] = False  # zarr's stores unpickle unopened; zarr opens them on first use
        return state

    # -- resolving keys ---------------------------------------------------------

    def _full(self, key: str) -> str:
        """The trajectory-level key of ``key`` (``key`` itself unless rooted at a step)."""
        if not self._prefix:
            return key
        return self._prefix + key if key else self._prefix[:-1]

    def _doc(self, part: str) -> StepDoc | None:
        if not _canonical(part):
            return None
        try:
            return self.reader.doc(int(part))
        except NotFoundError:
            return None

    def _tensor(self, d: StepDoc, name: str) -> TensorTable | None:
        try:
            # a zarr array is opened to read its chunks next: its table blocks along the whole reference
            # chain come with its own, in one parallel batch (no round trip per step of the chain)
            return self.reader.tensor(d.step, name, chain=True)
        except NotFoundError:
            return None

    def _find_chunk(self, d: StepDoc, rest: str, *, partial: bool = False):
        """Split ``<tensor>/c/<i>/<j>`` into (tensor table, coord), or None.

        With ``partial``, a prefix of a chunk key (``<tensor>/c/<i>``) is
        accepted too: the coord then has fewer entries than the tensor has axes.
        """
        parts = rest.split("/")
        for i, p in enumerate(parts):
            if p != "c":
                continue
            name = "/".join(parts[:i])
            t = self._tensor(d, name) if name else None
            if t is None:
                continue
            idx = parts[i + 1 :]
            if len(idx) > len(t.shape) or (len(idx) < len(t.shape) and not partial):
                return None
            if not all(_canonical(s) for s in idx):
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
        return self.reader.settled(lambda: self._bytes(self._full(key)))

    def _bytes(self, key: str) -> bytes | None:
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
        if byte_range is not None and not isinstance(
            byte_range, (RangeByteRequest, OffsetByteRequest, SuffixByteRequest)
        ):
            raise TypeError(f"Unexpected byte_range, got {byte_range!r}")
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
        step, _, rest = self._full(key).partition("/")

        def find():
            d = self._doc(step)
            return d is not None and self._find_chunk(d, rest) is not None

        return await asyncio.to_thread(find)

    def _refuse(self, key: str, hint: str = "commit a new step instead"):
        raise StoreReadOnlyError(f"{_WRITE}: a trajectory step is read-only; {hint}", key=self._full(key))

    async def set(self, key: str, value) -> None:
        self._refuse(key)

    async def set_if_not_exists(self, key: str, value) -> None:
        self._refuse(key)

    async def delete(self, key: str) -> None:
        self._refuse(key, "use Trajectory.delete")

    async def delete_dir(self, prefix: str) -> None:
        self._refuse(prefix, "use Trajectory.delete")

    async def clear(self) -> None:
        self._refuse("", "use Trajectory.delete")

    async def list(self) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._keys, ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._keys, prefix):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        for name in await asyncio.to_thread(self._children, self._full(prefix.rstrip("/"))):
            yield name

    # -- listing (trajectory-level keys) ------------------------------------------

    def _steps(self) -> builtins.list[str]:
        if self.step is not None:
            return [str(self.step)] if self._doc(str(self.step)) is not None else []
        from ..format._layout import STEPS_DIR

        keys = self.reader.io.find(STEPS_DIR)
        return sorted(
            {
                k.split("/")[1]
                for k in keys
                if k.count("/") == 2 and k.endswith("/zarr.json") and _canonical(k.split("/")[1])
            },
            key=int,
        )

    def _children(self, prefix: str) -> builtins.list[str]:
        if prefix == "":
            return ["zarr.json", *self._steps()]
        step, _, node = prefix.partition("/")
        d = self._doc(step)
        if d is None:
            return []
        tensors = self.reader.tables(d.step)
        if node in tensors:
            return ["c", "zarr.json"]
        found = self._find_chunk(d, node, partial=True)
        if found is not None:  # a chunk prefix <tensor>/c[/<i>...]: the next chunk index
            t, coord = found
            grid = chunk_grid(t.shape, logical_chunks(t))
            return [str(i) for i in range(grid[len(coord)])] if len(coord) < len(grid) else []
        head = node + "/" if node else ""
        names = {n[len(head) :].split("/")[0] for n in tensors if n.startswith(head)}
        return ["zarr.json", *sorted(names)] if names or not node else []

    def _keys(self, prefix: str) -> builtins.list[str]:
        """Keys (relative to this store) starting with ``prefix``."""
        full = self._full(prefix) if prefix else self._prefix
        cut = len(self._prefix)
        return [k[cut:] for k in self._all_keys(full) if k.startswith(self._prefix)]

    def _all_keys(self, prefix: str) -> builtins.list[str]:
        keys = [] if self._prefix else ["zarr.json"]
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
