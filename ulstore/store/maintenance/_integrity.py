"""Integrity and sizes: :meth:`verify` re-reads and checks everything; :meth:`inventory` and :meth:`stats` add up bytes."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from ...errors import CorruptBlobError, CorruptManifestError, IntegrityError, NotFoundError, StepNotFoundError
from .._base import TrajectoryBase
from ..format._chunk_tables import TensorTable, content_checksum
from ..format._chunkcodec import content_digest, decode_chunk
from ..format._layout import PACK_SUFFIX, PACKS_DIR, is_pack_id, pack_key, step_key
from ..format._read_cost import PER_READ, own_cost
from ..format._stepdoc import StepDoc, chain_after
from ..read._chunk_reader import ChunkReader
from ..read._decode_plan import _Plan, batched
from ..read._lru import _LRU

__all__ = ["Integrity", "VerifyReport", "Inventory", "StepView", "TensorView", "EntryView", "blob_name"]


@dataclass
class VerifyReport:
    """Result of :meth:`Trajectory.verify`.

    ``errors`` lists one dict per bad object: ``key`` (the damaged pack,
    step document or ref), ``step``, ``tensor``, ``error`` (class name) and
    ``message``.  ``warnings`` lists, in the same form (``error`` names the
    kind: ``StaleChain``, ``StaleReadCost``), step documents whose derived
    fields disagree with what they derive from: a ``chain`` that is not the
    parent's directory and chain (reads never trust it for values: each chunk
    is checked against its step's own content hash, so a stale one can only
    cost speed, or fail a read whose old blocks are gone), or ``anchoring``
    figures that are not those the walk recomputes (they only steer where
    anchors go; figures written by another version of the cost model differ
    too).  Warnings do not make ``ok`` false.
    """

    steps: int = 0
    chunks: int = 0
    blobs: int = 0
    errors: list = field(default_factory=list)
    warnings: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def blob_name(pack: str, offset: int, length: int) -> str:
    """A blob's name in an :class:`Inventory`: ``<pack id>@<offset>+<length>``."""
    return f"{pack}@{offset}+{length}"


@dataclass(frozen=True)
class EntryView:
    """One chunk entry of an inventory: ``blob`` names its blob, ``blobs`` its blob and snapshot."""

    blob: str
    blobs: tuple[str, ...]


@dataclass(frozen=True)
class TensorView:
    shape: tuple[int, ...]
    dtype: np.dtype
    entries: tuple[EntryView, ...]


@dataclass(frozen=True)
class StepView:
    step: int
    parent: int | None
    tensors: dict[str, TensorView]
    files: tuple[str, ...] = ()  # blob names of the step's files


@dataclass(frozen=True)
class Inventory:
    """What a trajectory stores, read without decoding anything (:meth:`Trajectory.inventory`).

    ``manifests``: step -> :class:`StepView` (``tensors``: name -> ``shape``,
    ``dtype``, ``entries`` whose ``blob`` names a blob), in step order;
    ``manifest_bytes``: step -> bytes of its step document and table blocks;
    ``blob_bytes``: blob name -> size of every blob some step names;
    ``pack_bytes``: pack id -> size of every pack; ``unreferenced_bytes``:
    pack bytes no step names (removed by ``gc``).
    """

    manifests: dict[int, StepView]
    manifest_bytes: dict[int, int]
    blob_bytes: dict[str, int]
    pack_bytes: dict[str, int] = field(default_factory=dict)
    unreferenced_bytes: int = 0
    table_bytes: dict[int, int] = field(default_factory=dict)


class Integrity:
    """verify, inventory and stats of a trajectory."""

    def __init__(self, trajectory: TrajectoryBase):
        # a proxy, not a reference: the trajectory owns this object, and a trajectory dropped
        # must free its caches and kept step at once (no cycle left for the garbage collector)
        self._t = weakref.proxy(trajectory)

    # -- integrity ----------------------------------------------------------------

    def verify(self, step=None, *, raise_on_error: bool = True) -> VerifyReport:
        """Re-read and check every blob, snapshot, table, file, step document and ref reachable from ``step`` (default: all).

        Every blob is fetched again (no cache: an entry is decoded once per
        verify, never skipped because some other chunk has the same content),
        decoded against its reference and checked against its content hash;
        snapshots are decoded too.  Each step's content checksum is recomputed
        and its ``parent_content`` compared with the parent's (the hash chain).

        Raises
        ------
        IntegrityError
            (the class of the first problem, e.g. CorruptBlobError) if
            ``raise_on_error`` and anything is damaged; its ``key`` names the
            first bad object and its message lists all of them.
        """
        fresh = ChunkReader(self._t._io, 0, self._t._threads)
        memo = _LRU(max(self._t._reader.cache_bytes, 64 << 20))
        report = VerifyReport()
        steps = [self._t._resolve(step)] if step is not None else self._t.steps
        bad: dict[str, IntegrityError] = {}
        blobs: set = set()

        def note(e: IntegrityError, s, tensor=None):
            key = e.key or f"step {s}"
            if key not in bad:
                bad[key] = e
                report.errors.append(
                    {
                        "key": e.key,
                        "step": e.step if e.step is not None else s,
                        "tensor": e.tensor or tensor,
                        "error": type(e).__name__,
                        "message": str(e),
                    }
                )

        if step is None:
            self._verify_refs(note)
        parents: dict[int, int | None] = {}  # the parent links read: a loop of them is damage too
        for s in steps:
            for _ in range(3):
                errors: list[IntegrityError] = []
                try:
                    counts = self._verify_one(fresh, memo, s, blobs, errors)
                except StepNotFoundError:
                    counts = None  # deleted since it was listed: nothing to check
                    break
                if not errors:
                    break
                # damage, or another process rewrote (delete, gc) or removed the step meanwhile: read it anew
                now = _since(fresh, s)
                if now == "gone":
                    counts, errors = None, []
                    break
                if now == "same":
                    break
                fresh.forget_docs()
            for e in errors:
                note(e, s)
            if counts is not None:
                report.steps += counts[0]
                report.chunks += counts[1]
            held = fresh.cached_doc(s)
            if held is not None:
                parents[s] = held.parent
        if step is not None:  # the ancestry of the step asked, back to its anchor (what reading it relies on)
            _ancestry(fresh, steps[0], parents)
        for loop in _parent_loops(parents):
            s = loop[-1]
            note(
                CorruptManifestError(
                    f"parent links loop: {' -> '.join(map(str, loop))} -> {loop[0]} (crafted step documents: "
                    "a parent walk would never reach a root)",
                    step=s,
                    key=step_key(s),
                ),
                s,
            )
        report.blobs = len(blobs)
        report.warnings.extend(_warnings(fresh, [s for s in steps if step_key(s) not in bad]))
        if bad and raise_on_error:
            first = next(iter(bad.values()))
            listing = "; ".join(f"{d['key']}: {d['error']}" for d in report.errors)
            raise type(first)(
                f"verify found {len(bad)} damaged object(s): {listing}",
                step=first.step,
                tensor=first.tensor,
                key=first.key,
            )
        return report

    def _verify_one(self, fresh: ChunkReader, memo, s: int, blobs: set, errors: list) -> tuple[int, int] | None:
        """Check step ``s`` (problems appended to ``errors``); (steps, chunks) checked."""
        try:
            d = fresh.doc(s)
            tables = fresh.tables(s)
            self._verify_step(fresh, d, tables)
        except IntegrityError as e:
            errors.append(e)
            return None
        chunks = 0
        for name in d.files:
            try:
                fresh.file(s, name)
            except IntegrityError as e:
                errors.append(e)
        for batch in _batches(s, tables):
            chunks += len(batch)
            errors.extend(_verify_chunks(fresh, memo, batch, blobs))
        return 1, chunks

    def _verify_step(self, fresh: ChunkReader, d: StepDoc, tables: dict[str, TensorTable]) -> None:
        key = step_key(d.step)
        files = {k: f.hash for k, f in d.files.items()}
        if content_checksum(tables.values(), files, d.metadata) != d.content:
            raise CorruptManifestError("step content does not match its content checksum", step=d.step, key=key)
        if d.parent is not None:
            try:
                pd = fresh.doc(d.parent)
            except StepNotFoundError as e:
                raise CorruptManifestError(f"parent step {d.parent} is missing", step=d.step, key=key) from e
            if pd.content != d.parent_content:
                raise CorruptManifestError(
                    f"hash chain broken: parent_content is not step {d.parent}'s content", step=d.step, key=key
                )
        elif d.parent_content is not None:
            raise CorruptManifestError("a root step names a parent content", step=d.step, key=key)

    def _verify_refs(self, note) -> None:
        """Every ref entry sealed and chained; every ref's head step present."""
        for name, errors in self._t._refs.problems().items():
            for e in errors:
                note(e, None)
            try:
                head = self._t._refs.read(name)
            except IntegrityError:
                continue  # reported above
            if head.step is not None and not self._t._io.exists(step_key(head.step)):
                note(
                    CorruptManifestError(f"ref {name!r} points at step {head.step}, which is missing", key=head.key),
                    head.step,
                )

    def inventory(self) -> Inventory:
        """Every step's tables (parsed and checked, as for reading) and every pack's size; nothing decoded.

        Raises
        ------
        CorruptManifestError
            A step document or table block is damaged.  (A step deleted while the
            inventory is taken is left out; one rewritten meanwhile is read anew.)
        """
        reader = ChunkReader(self._t._io, 0, self._t._threads)
        manifests, manifest_bytes, blob_bytes, table_bytes = {}, {}, {}, {}
        used: dict[str, list] = {}
        for s in self._t.steps:
            got = reader.stored_tables(s)
            if got is None:
                continue  # deleted while the inventory was taken
            raw, d, tables = got
            table_bytes[s] = sum(b.length for b in d.tables)
            manifest_bytes[s] = len(raw) + table_bytes[s]
            for b in d.tables:
                used.setdefault(d.packs[b.pack], []).append((b.offset, b.length))
            views = {}
            for name, t in tables.items():
                entries = []
                for p in t.pieces:
                    for i in range(p.n):
                        loc = (d.packs[int(p.pack[i])], int(p.off[i]), int(p.length[i]))
                        names = [blob_name(*loc)]
                        blob_bytes[names[0]] = loc[2]
                        used.setdefault(loc[0], []).append(loc[1:])
                        snap = p.snapshot(i)
                        if snap is not None:
                            sloc = (d.packs[snap[0]], snap[1], snap[2])
                            names.append(blob_name(*sloc))
                            blob_bytes[names[-1]] = sloc[2]
                            used.setdefault(sloc[0], []).append(sloc[1:])
                        entries.append(EntryView(names[0], tuple(names)))
                views[name] = TensorView(t.shape, t.dtype, tuple(entries))
            file_names = []
            for f in d.files.values():
                loc = (d.packs[f.pack], f.offset, f.length)
                file_names.append(blob_name(*loc))
                blob_bytes[file_names[-1]] = f.length
                used.setdefault(loc[0], []).append(loc[1:])
            manifests[s] = StepView(s, d.parent, views, tuple(file_names))
        packs = self._pack_sizes()
        live = sum(_covered(ranges) for pid, ranges in used.items() if pid in packs)
        unreferenced = max(0, sum(packs.values()) - live)
        return Inventory(manifests, manifest_bytes, blob_bytes, packs, unreferenced, table_bytes)

    def _pack_sizes(self) -> dict[str, int]:
        out = {}
        for key, info in self._t._io.find(PACKS_DIR, detail=True).items():
            name = key.rsplit("/", 1)[-1]
            if name.endswith(PACK_SUFFIX) and is_pack_id(name[: -len(PACK_SUFFIX)]):
                out[name[: -len(PACK_SUFFIX)]] = int(info.get("size") or 0)
        return out

    def stats(self) -> dict:
        """Sizes: stored bytes (packs and step documents) vs the raw bytes of every step.

        Returns
        -------
        dict
            ``steps``, ``chunks`` (entries over all steps), ``blobs`` (distinct
            blobs named), ``packs``, ``blob_bytes`` (pack bytes that are not
            table blocks), ``manifest_bytes`` (step documents + table blocks),
            ``stored_bytes`` (packs + step documents), ``unreferenced_bytes``,
            ``raw_bytes`` (sum of every step's tensors), ``ratio`` (raw /
            stored), ``manifest_bytes_per_chunk``.
        """
        inv = self.inventory()
        manifest_bytes = sum(inv.manifest_bytes.values())
        raw = sum(t.dtype.itemsize * int(np.prod(t.shape)) for m in inv.manifests.values() for t in m.tensors.values())
        chunks = sum(len(t.entries) for m in inv.manifests.values() for t in m.tensors.values())
        pack_bytes = sum(inv.pack_bytes.values())
        stored = pack_bytes + manifest_bytes - sum(inv.table_bytes.values())
        return {
            "steps": len(inv.manifests),
            "chunks": chunks,
            "blobs": len(inv.blob_bytes),
            "packs": len(inv.pack_bytes),
            "blob_bytes": stored - manifest_bytes,
            "manifest_bytes": manifest_bytes,
            "stored_bytes": stored,
            "unreferenced_bytes": inv.unreferenced_bytes,
            "raw_bytes": raw,
            "ratio": raw / stored if stored else float("nan"),
            "manifest_bytes_per_chunk": manifest_bytes / chunks if chunks else float("nan"),
        }


def _warnings(fresh: ChunkReader, steps: list[int]) -> list[dict]:
    """:func:`_derived_fields` of ``steps`` (read and undamaged)."""
    out = []
    for s in steps:
        try:
            out.extend(_derived_fields(fresh, s))
        except (IntegrityError, StepNotFoundError):
            continue  # gone meanwhile, or its parent is damaged or gone: reported with the parent
    return out


def _warning(kind: str, s: int, message: str) -> dict:
    return {"key": step_key(s), "step": s, "tensor": None, "error": kind, "message": message}


def _derived_fields(fresh: ChunkReader, s: int) -> list[dict]:
    """Warnings about step ``s``'s ``chain`` and ``anchoring``, compared with what they are derived from: its
    parent's document, and its tables priced by the read-cost model (``_read_cost.py``)."""
    d = fresh.doc(s)
    pd = fresh.doc(d.parent) if d.parent is not None else None
    out = []
    if d.chain and pd is not None and d.anchor_distance > 0 and d.chain != chain_after(pd):
        out.append(
            _warning(
                "StaleChain",
                s,
                f"the step document's chain (ancestor table directories, {len(d.chain)} steps) is not step "
                f"{d.parent}'s directory and chain: reads check every chunk against the step's own content hashes, "
                "so values stay exact, but a read may fetch stale table blocks (and fail once gc removed them)",
            )
        )
    a = d.anchoring
    if a is None:
        return out
    anchor = a.why is not None or pd is None
    if not anchor and (pd is None or pd.anchoring is None):
        want = None
    elif anchor:
        own = own_cost(fresh.tables(s), d.packs, None, (), fresh.fetch) + PER_READ
        want = (own, own, own)
    else:
        assert pd is not None and pd.anchoring is not None
        own = own_cost(fresh.tables(s), d.packs, fresh.tables(pd.step), pd.packs, fresh.fetch)
        want = (pd.anchoring.cost + own, pd.anchoring.anchor_cost, own)
    got = (a.cost, a.anchor_cost, a.step_cost)
    if got != want:
        out.append(
            _warning(
                "StaleReadCost",
                s,
                f"stored read-cost figures (cost, anchor cost, own) {got} are not those its tables and parent give "
                f"{want if want is not None else '(none: the parent has no figures)'}: they steer where the next "
                "anchors go, not what a read returns (figures of another version of the cost model differ too)",
            )
        )
    return out


def _since(reader: ChunkReader, s: int) -> str:
    """Whether step ``s``'s document is ``"gone"``, the ``"same"`` as ``reader`` read, or ``"changed"`` since."""
    try:
        stored = reader.stored_doc(s)
    except CorruptManifestError:
        return "same"  # damaged: reported as read
    if stored is None:
        return "gone"
    return "same" if reader.cached_doc(s) == stored else "changed"


def _ancestry(fresh: ChunkReader, step: int, parents: dict[int, int | None]) -> None:
    """Add the parent links from ``step`` back to its nearest anchor (or root) to ``parents``; stops at a step
    already in it (a loop), or one that cannot be read (reported by whoever reads it)."""
    s: int | None = step
    first = True  # (the step itself is in parents already, from verify's own read of it)
    while s is not None and (first or s not in parents):
        first = False
        try:
            d = fresh.doc(s)
        except (IntegrityError, NotFoundError):
            return
        parents[s] = d.parent
        if d.anchor_distance == 0:
            return
        s = d.parent


def _parent_loops(parents: dict[int, int | None]) -> list[list[int]]:
    """Every loop of the links ``parents`` (step -> parent), once each, as its steps in walk order."""
    done: set[int] = set()
    loops = []
    for start in parents:
        path: list[int] = []
        on_path: set[int] = set()
        s: int | None = start
        while s is not None and s in parents and s not in done and s not in on_path:
            path.append(s)
            on_path.add(s)
            s = parents[s]
        if s is not None and s in on_path:
            loops.append(path[path.index(s) :])
        done.update(path)
    return loops


def _covered(ranges: list) -> int:
    """Bytes covered by ``(offset, length)`` ranges (overlaps counted once)."""
    total, end = 0, -1
    for off, n in sorted(ranges):
        if off + n <= end:
            continue
        total += off + n - max(off, end)
        end = off + n
    return total


def _batches(step: int, tables: dict[str, TensorTable]):
    """The chunks of a step as ``(node, piece, i)`` in batches of about ``BATCH_BYTES`` raw bytes."""
    return batched(
        (((step, name, j, c), p, i), int(np.prod(p.region_shape(c))) * t.dtype.itemsize)
        for name, t in tables.items()
        for j, p in enumerate(t.pieces)
        for i, c in enumerate(p.coords())
    )


def _verify_chunks(fresh: ChunkReader, memo: _LRU, batch: list, blobs: set) -> list[IntegrityError]:
    """Decode every chunk of ``batch`` along its delta chain (not its snapshot), and every snapshot on its own."""
    errors: list[IntegrityError] = []
    try:
        plan = _Plan(fresh, memo=memo, prefer_snapshot=False)
        for node, _, _ in batch:
            plan.add(node)
        plan.run()
    except (IntegrityError, NotFoundError):
        if len(batch) == 1:
            raise
        for item in batch:  # find which chunks are bad, one at a time
            try:
                errors += _verify_chunks(fresh, memo, [item], blobs)
            except IntegrityError as e:
                errors.append(e)
            except NotFoundError as e:
                step, tensor = item[0][0], item[0][1]
                errors.append(
                    CorruptManifestError(f"reference is missing: {e}", step=step, tensor=tensor, key=step_key(step))
                )
        return errors
    packs = fresh.doc(batch[0][0][0]).packs
    snaps = []
    for node, p, i in batch:
        blobs.add((packs[int(p.pack[i])], int(p.off[i])))
        s = p.snapshot(i)
        if s is not None:
            snaps.append((node, p, i, (packs[s[0]], s[1], s[2])))
            blobs.add((packs[s[0]], s[1]))
    if snaps:
        datas = fresh.fetch([loc for *_, loc in snaps])
        for (node, p, i, loc), data in zip(snaps, datas):
            t = fresh.tensor(node[0], node[1])
            key = pack_key(loc[0])
            try:
                value = decode_chunk(data, None, t.codec, t.dtype, p.region_shape(node[3]), key=key)
                if content_digest(value) != p.content[i].tobytes():
                    raise CorruptBlobError(f"snapshot at byte {loc[1]} fails its content hash", key=key)
            except IntegrityError as e:
                e.step = e.step if e.step is not None else node[0]  # (the blob's own checks name its pack only)
                e.tensor = e.tensor or node[1]
                errors.append(e)
    return errors
