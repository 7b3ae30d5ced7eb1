"""Packs: blobs and table blocks concatenated into bounded, immutable objects.

Writing (:class:`PackStream`): blobs are appended in the order the caller
gives them (plan order, so a pack's layout is deterministic and a step's
chunks sit together), streamed to ``packs/<id>.pack`` with bounded memory;
a pack that reaches ``pack_bytes`` is closed and the next blob starts a new
one.  Pack ids are random: a retried or racing commit never writes, and a
``gc`` never deletes, a pack another commit needs.

Reading (:func:`fetch`): byte ranges of the same pack that lie close together
are merged into one request (:func:`coalesce`), requests run concurrently,
and each caller gets a view of exactly its bytes.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import defaultdict
from typing import TYPE_CHECKING

from ...core.objects import ObjectStore, ObjectWriter
from ...errors import CorruptBlobError, PackMissingError
from ._layout import new_pack_id, pack_key

if TYPE_CHECKING:
    from ._stepdoc import StepDoc

__all__ = ["PackStream", "coalesce", "fetch", "own_blob_range", "DEFAULT_PACK_BYTES", "Location"]

#: Default bound of a pack: large enough that a step is a few objects, small enough to repack.
DEFAULT_PACK_BYTES = 256 << 20
#: Merge ranges of one pack whose gap is at most this many bytes into one request.
MAX_GAP = 1 << 20
#: Never merge requests beyond this many bytes.
MAX_SPAN = 64 << 20

#: (pack id, offset, length)
Location = tuple[str, int, int]


class PackStream:
    """Append blobs to packs of at most ``pack_bytes`` (one blob larger than that gets a pack of its own).

    Not thread-safe: one thread appends, in the order the pack should have.
    """

    def __init__(self, io: ObjectStore, pack_bytes: int = DEFAULT_PACK_BYTES):
        self.io = io
        self.pack_bytes = int(pack_bytes)
        self.ids: list[str] = []  # every pack opened, in order
        self.closed: list[str] = []  # the ones that exist now
        self._writer: ObjectWriter | None = None
        self._id: str | None = None

    def append(self, data) -> Location:
        """Append one blob; returns where it went."""
        n = memoryview(data).nbytes
        w = self._writer
        if w is not None and w.tell() and w.tell() + n > self.pack_bytes:
            self._close_current()
        if self._writer is None:
            self._id = new_pack_id()
            self.ids.append(self._id)
            self._writer = self.io.open_writer(pack_key(self._id), block_size=min(self.pack_bytes, 64 << 20))
        assert self._id is not None
        return self._id, self._writer.write(data), n

    @property
    def current(self) -> str | None:
        """The id of the open pack, if any."""
        return self._id

    def _close_current(self) -> None:
        w, pid = self._writer, self._id
        self._writer = self._id = None
        if w is not None and pid is not None:
            w.close()
            self.closed.append(pid)

    def close(self) -> list[str]:
        """Close the open pack; returns the ids of every pack written."""
        self._close_current()
        return list(self.closed)

    def abort(self) -> None:
        """Discard the open pack (closed ones stay: orphans for ``gc``)."""
        w = self._writer
        self._writer = self._id = None
        if w is not None:
            w.abort()


def coalesce(ranges, max_gap: int = MAX_GAP, max_span: int = MAX_SPAN) -> list[tuple[int, int, list[int]]]:
    """Merge ``(start, end)`` ranges into requests ``(start, end, [indices of the ranges inside])``."""
    out: list[tuple[int, int, list[int]]] = []
    idx: list[int] = []
    s = e = 0
    for i in sorted(range(len(ranges)), key=ranges.__getitem__):
        a, b = ranges[i]
        if idx and a - e <= max_gap and (b if b > e else e) - s <= max_span:  # (no max(): once per blob)
            idx.append(i)
            if b > e:
                e = b
        else:
            if idx:
                out.append((s, e, idx))
            s, e, idx = a, b, [i]
    if idx:
        out.append((s, e, idx))
    return out


def fetch(
    io: ObjectStore,
    locations: list[Location],
    *,
    pool: cf.Executor | None = None,
    max_gap: int = MAX_GAP,
    max_span: int = MAX_SPAN,
) -> list[memoryview]:
    """The bytes at each location (views into a few large reads), in order.

    Raises
    ------
    CorruptBlobError
        A pack is missing or shorter than a location needs (``key`` names the pack).
    """
    by_pack: dict[str, list[int]] = defaultdict(list)
    for i, (pid, _, _) in enumerate(locations):
        by_pack[pid].append(i)
    jobs = []
    for pid, idx in by_pack.items():
        ranges = [(locations[i][1], locations[i][1] + locations[i][2]) for i in idx]
        groups = coalesce(ranges, max_gap, max_span)
        jobs.append((pid, [(s, e, [idx[k] for k in members]) for s, e, members in groups]))
    out: list = [None] * len(locations)

    def run(job):
        pid, groups = job
        key = pack_key(pid)
        got = io.get_ranges(key, [(s, e) for s, e, _ in groups])
        if got is None:
            raise PackMissingError("pack is missing", key=key)
        for (s, e, members), data in zip(groups, got):
            if len(data) != e - s:
                raise CorruptBlobError(f"pack is shorter than its entries say (byte {s + len(data)} < {e})", key=key)
            view = memoryview(data)
            for i in members:
                _, off, n = locations[i]
                out[i] = view[off - s : off - s + n]

    if pool is None or len(jobs) <= 1:
        for job in jobs:
            run(job)
    else:
        for f in [pool.submit(run, job) for job in jobs]:
            f.result()
    return out


#: The most bytes a reader reads ahead (:meth:`~ulstore.store._reader.ChunkReader.blocks`, ``own_blobs``): a
#: larger step's blobs are fetched as usual.
MAX_AHEAD = 64 << 20


def own_blob_range(d: StepDoc) -> Location | None:
    """The bytes step ``d``'s commit wrote before its table blocks, if they are all blobs of its changes: ``(pack,
    0, first block's offset)``; else None.

    A commit streams its blobs (plan order), then its files, then its table
    blocks into packs of its own, so the pack holding the blocks starts with
    the step's last blobs.  Every blob is of a changed chunk unless the step
    carries snapshots (then no chunk is a delta without one: anchor distance
    0) or files in that pack.  Snapshots for some chunks only (pieces
    committed apart with and without them) would be read ahead too: bytes
    read in vain, never a wrong value.
    """
    if d.anchor_distance == 0 or not d.tables:
        return None
    pack = d.tables[0].pack
    if any(t.pack != pack for t in d.tables) or any(f.pack == pack for f in d.files.values()):
        return None
    start = min(t.offset for t in d.tables)
    return (d.packs[pack], 0, start) if 0 < start <= MAX_AHEAD else None
