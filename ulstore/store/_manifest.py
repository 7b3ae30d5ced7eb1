"""The step manifest: one immutable JSON object per step, written last.

A manifest is a valid Zarr v3 group document (``steps/<step>/zarr.json``)
whose ``attributes["ulstore"]`` holds everything needed to read the step:

.. code-block:: text

    {"format": 1, "step": 1001, "parent": 1000, "anchor_distance": 1,
     "metadata": {...user...},
     "tensors": {"<name>": {"shape": [...], "dtype": "bfloat16", "chunks": [...],
                            "codec": "ulpack" | "zstd",
                            "entries": [[blob, ref, content], ...]}}}

``entries`` lists the chunks in C order of the chunk grid: ``blob`` is the
blake2b-256 address of the chunk's blob, ``ref`` the step whose co-located
chunk the blob was coded against (null for intra), ``content`` the
blake2b-128 of the decoded chunk.  ``attributes["ulstore_checksum"]`` is the
blake2b-128 of the canonical JSON of the whole document without that field,
and the object must be byte-for-byte the canonical JSON: a flipped byte
breaks the JSON, the canonical form or the checksum, so a damaged manifest is
always an error, never a wrong chunk table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..core.dtypes import numpy_dtype
from ..core.sealed import canonical_json, digest128
from ..errors import CorruptManifestError
from ._layout import chunk_grid

__all__ = ["FORMAT", "MAX_CHUNK_BYTES", "Entry", "TensorManifest", "Manifest"]

FORMAT = 1
#: Largest chunk a manifest may declare (and ``chunk_bytes`` may ask for): a bound
#: on what one chunk read allocates, whatever a crafted manifest says.
MAX_CHUNK_BYTES = 1 << 32


def _checksum(body: bytes) -> str:
    return digest128(body)


def _count(n, least: int) -> int:
    """A shape (``least`` 0) or chunk (``least`` 1) extent read from a manifest."""
    if isinstance(n, bool) or not isinstance(n, int) or n < least or n >= 1 << 62:
        raise ValueError(f"extent {n!r} is not an int in [{least}, 2**62)")
    return n


@dataclass(frozen=True)
class Entry:
    """One chunk of one tensor in one step."""

    blob: str  # blake2b-256 hex of the blob bytes: its address
    ref: int | None  # step whose co-located chunk is the reference; None = intra
    content: str  # blake2b-128 hex of the decoded chunk

    def to_json(self) -> list:
        return [self.blob, self.ref, self.content]


@dataclass(frozen=True)
class TensorManifest:
    """Array metadata and chunk table of one tensor in one step."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    codec: str
    entries: tuple[Entry, ...]

    @property
    def grid(self) -> tuple[int, ...]:
        return chunk_grid(self.shape, self.chunks)

    def index(self, coord: tuple[int, ...]) -> int:
        """Position of chunk ``coord`` in :attr:`entries` (C order)."""
        return int(np.ravel_multi_index(coord, self.grid)) if coord else 0

    def entry(self, coord: tuple[int, ...]) -> Entry:
        return self.entries[self.index(coord)]

    def coords(self):
        """Chunk coordinates in C order (the order of :attr:`entries`)."""
        return list(np.ndindex(*self.grid))

    def region(self, coord: tuple[int, ...]) -> tuple[slice, ...]:
        """The slice of the tensor that chunk ``coord`` covers (edge chunks are short)."""
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(coord, self.chunks, self.shape))

    def region_shape(self, coord: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(min((i + 1) * c, n) - i * c for i, c, n in zip(coord, self.chunks, self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype.name,
            "chunks": list(self.chunks),
            "codec": self.codec,
            "entries": [e.to_json() for e in self.entries],
        }


@dataclass(frozen=True)
class Manifest:
    """Everything stored about one step."""

    step: int
    parent: int | None
    anchor_distance: int  # steps since the last full anchor along the parent chain
    tensors: dict[str, TensorManifest]
    metadata: dict = field(default_factory=dict)
    created: str = ""

    def to_bytes(self) -> bytes:
        """The manifest object: a Zarr v3 group ``zarr.json`` (canonical JSON)."""
        body = {
            "format": FORMAT,
            "step": self.step,
            "parent": self.parent,
            "anchor_distance": self.anchor_distance,
            "created": self.created,
            "metadata": self.metadata,
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
        }
        attributes: dict = {"ulstore": body}
        doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
        attributes["ulstore_checksum"] = _checksum(canonical_json(doc))
        return canonical_json(doc)

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, step: int | None = None) -> Manifest:
        """Parse and check a manifest object.

        Raises
        ------
        CorruptManifestError
            The bytes are not a well-formed manifest with a matching checksum.
        """
        try:
            doc = json.loads(data)
            # the stored bytes must be exactly the canonical form, and the checksum
            # covers the whole document: no flipped byte can go unnoticed
            if canonical_json(doc) != bytes(data):
                raise CorruptManifestError("step manifest is not in canonical form", step=step, key=key)
            attrs = doc["attributes"]
            checksum = attrs.pop("ulstore_checksum")
            if checksum != _checksum(canonical_json(doc)):
                raise CorruptManifestError("step manifest fails its checksum", step=step, key=key)
            body = attrs["ulstore"]
            if body["format"] != FORMAT:
                raise CorruptManifestError(f"unknown manifest format {body['format']!r}", step=step, key=key)
            tensors = {}
            for name, t in body["tensors"].items():
                tm = TensorManifest(
                    shape=tuple(_count(n, 0) for n in t["shape"]),
                    dtype=numpy_dtype(t["dtype"]),
                    chunks=tuple(_count(n, 1) for n in t["chunks"]),
                    codec=str(t["codec"]),
                    entries=tuple(Entry(str(b), None if r is None else int(r), str(c)) for b, r, c in t["entries"]),
                )
                if math.prod(tm.chunks) * tm.dtype.itemsize > MAX_CHUNK_BYTES:
                    raise CorruptManifestError(
                        f"chunks {list(tm.chunks)} exceed {MAX_CHUNK_BYTES} bytes", step=step, tensor=name, key=key
                    )
                if len(tm.entries) != math.prod(tm.grid) or len(tm.chunks) != len(tm.shape):
                    raise CorruptManifestError(
                        "chunk table does not match the chunk grid", step=step, tensor=name, key=key
                    )
                tensors[name] = tm
            m = cls(
                step=int(body["step"]),
                parent=None if body["parent"] is None else int(body["parent"]),
                anchor_distance=int(body["anchor_distance"]),
                tensors=tensors,
                metadata=body["metadata"],
                created=str(body.get("created", "")),
            )
        except CorruptManifestError:
            raise
        except Exception as e:  # JSON, missing fields, wrong types: all one thing to the caller
            raise CorruptManifestError(
                f"step manifest is malformed: {type(e).__name__}: {e}", step=step, key=key
            ) from e
        if step is not None and m.step != step:
            raise CorruptManifestError(f"manifest is for step {m.step}", step=step, key=key)
        return m
