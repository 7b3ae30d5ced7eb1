"""Garbage collection: :meth:`gc` drops packs no step names and repacks mostly-dead ones.

Crash safety: new bytes first (a new pack: the live blobs, then the
rewritten table blocks), then each rewritten step document (one PUT each,
logical content unchanged), then removals.  Until the old packs go, old and
new are both readable, so a crash at any point loses nothing; running gc
again finishes it.  A grace period (``older_than``) keeps packs that a
commit in flight has written but not yet named.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
import weakref

from ...errors import InvalidInputError
from .._base import TrajectoryBase
from .._pending import PENDING_DIR
from ..format._layout import PACK_SUFFIX, PACKS_DIR, is_pack_id, pack_key, step_key
from ..format._packs import Location, PackStream
from ..format._stepdoc import StepDoc
from ._relocate import rechained, relocated_doc

__all__ = ["GarbageCollector"]


#: Where gc notes when it retired a repacked pack (deleted once the grace period has passed).
RETIRED_DIR = "gc/retired"


class GarbageCollector:
    """The gc of a trajectory."""

    def __init__(self, trajectory: TrajectoryBase):
        # a proxy, not a reference: the trajectory owns this object, and a trajectory dropped
        # must free its caches and kept step at once (no cycle left for the garbage collector)
        self._t = weakref.proxy(trajectory)

    def gc(self, *, older_than: float = 0.0, repack_below: float = 0.5) -> dict:
        """Drop packs no step names and repack mostly-dead ones; never loses a live blob.

        Parameters
        ----------
        older_than : float
            Grace period in seconds.  A commit writes its packs before its step
            document, so only packs (and local ``.tmp/`` files, and markers of
            work in flight under ``pending/``) at least this old are removed, and
            a pack emptied by repacking is only removed by a later ``gc`` once it
            has been unused for this long.  While other processes may commit, use
            a grace period longer than a commit takes.
        repack_below : float
            Repack a pack whose live bytes are less than this fraction of it:
            its live blobs are copied to a new pack, the step documents that
            name it are rewritten, then it is dropped.  0 disables repacking.

        Returns
        -------
        dict
            ``packs`` (removed), ``bytes`` (freed), ``repacked`` (packs whose
            live blobs were moved), ``steps_rewritten``, and ``deferred``: the
            key of a delete or another gc in flight, which made this gc remove
            and rewrite nothing (run it again later), else None.

        Notes
        -----
        Safe against a concurrent ``delete`` and another ``gc``: gc announces
        itself under ``pending/``; a delete that sees it refuses, and a gc that
        sees a delete or another gc defers.  Every step document gc rewrites is a
        compare-and-swap against the version it read, so a document another
        process changed or removed meanwhile is left as it is, and the packs it
        names are kept.  Steps deleted during the scan are skipped.
        """
        self._t._check_writable()
        if not isinstance(older_than, int | float) or older_than < 0:
            raise InvalidInputError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        self._check_not_symlinked(PACKS_DIR)
        with self._t._pending.collecting() as (marker, deleting):
            if deleting is not None:
                return {"packs": 0, "bytes": 0, "repacked": 0, "steps_rewritten": 0, "deferred": deleting}
            out = self._collect(older_than, repack_below)
            self._drop_stale_markers(older_than, keep=marker)
        return {**out, "deferred": None}

    def _collect(self, older_than: float, repack_below: float) -> dict:
        io, reader = self._t._io, self._t._reader
        now = time.time()
        listing = self._packs_listed(now)  # listed FIRST: a pack created after this is never considered
        retired = self._retired(now)
        reader.forget()
        docs, live = self._scan()
        listed = {pid for d in docs.values() for pid in d.named_packs()}  # (chains: copies of ancestors' lists)
        removed = _unnamed(listing, listed, retired, older_than)
        freed = sum(listing[p][0] for p in removed)
        repack = _mostly_dead(listing, listed, live, repack_below)
        rewritten, kept = self._repack(repack, docs, live) if repack else (0, set())
        emptied = [pid for pid in repack if pid not in kept]
        if emptied and not older_than:
            removed += emptied
            freed += sum(listing[p][0] for p in emptied)
        else:
            for pid in emptied:
                io.put(f"{RETIRED_DIR}/{pid}", b"")
        io.delete_many([pack_key(p) for p in removed])
        io.delete_many([f"{RETIRED_DIR}/{p}" for p in retired if p in removed or p in listed])
        io.sweep_tmp(older_than)
        reader.forget()
        return {"packs": len(removed), "bytes": freed, "repacked": len(emptied), "steps_rewritten": rewritten}

    def _packs_listed(self, now: float) -> dict[str, tuple[int, float | None]]:
        """pack id -> (size, age) of every pack object listed now (symbolic links left out)."""
        listing = {}
        for key, info in self._t._io.find(PACKS_DIR, detail=True).items():
            name = key.rsplit("/", 1)[-1]
            if key == f"{PACKS_DIR}/{name}" and name.endswith(PACK_SUFFIX) and is_pack_id(name[: -len(PACK_SUFFIX)]):
                if info.get("islink"):
                    continue
                listing[name[: -len(PACK_SUFFIX)]] = (int(info.get("size") or 0), _age(info, now))
        return listing

    def _scan(self) -> tuple[dict[int, StepDoc], dict[str, set]]:
        """Every step's document and the byte ranges it names, per pack; steps deleted meanwhile are skipped."""
        docs: dict[int, StepDoc] = {}
        live: dict[str, set] = {}
        for s in self._t.steps:
            got = self._t._reader.stored_tables(s)
            if got is None:
                continue
            d = got[1]
            locations = self._locations(s, d)
            docs[s] = d
            for pid, off, n in locations:
                live.setdefault(pid, set()).add((off, n))
        return docs, live

    def _drop_stale_markers(self, older_than: float, keep: str) -> None:
        """Markers of commits/deletes/gcs killed mid-way (see ``_pending.py``): past the grace period only."""
        now = time.time()
        pending = self._t._io.find(PENDING_DIR, detail=True)
        self._t._io.delete_many(
            [
                k
                for k, info in pending.items()
                if k != keep and (not older_than or (_age(info, now) or 0.0) >= older_than)
            ]
        )

    def _retired(self, now: float) -> dict[str, float | None]:
        out = {}
        for key, info in self._t._io.find(RETIRED_DIR, detail=True).items():
            pid = key.rsplit("/", 1)[-1]
            if is_pack_id(pid):
                out[pid] = _age(info, now)
        return out

    def _check_not_symlinked(self, key: str) -> None:
        if self._t._io.local and os.path.islink(self._t._io.path(key)):
            raise InvalidInputError(f"{self._t._io.path(key)!r} is a symlink; gc never deletes outside the root")

    def _locations(self, s: int, d: StepDoc) -> list[Location]:
        """Every byte range step ``s`` names: blobs, snapshots, files, table blocks."""
        out: list[Location] = [(d.packs[t.pack], t.offset, t.length) for t in d.tables]
        out += [(d.packs[f.pack], f.offset, f.length) for f in d.files.values()]
        for t in self._t._reader.tables(s).values():
            for p in t.pieces:
                out += [(d.packs[int(a)], int(b), int(c)) for a, b, c in zip(p.pack, p.off, p.length)]
                if p.snap is not None:
                    out += [(d.packs[int(a)], int(b), int(c)) for a, b, c in p.snap if a >= 0]
        return out

    def _repack(self, packs: list[str], docs: dict[int, StepDoc], live: dict[str, set]) -> tuple[int, set[str]]:
        """Copy the live blobs of ``packs`` to a new pack and rewrite every step document naming them.

        Returns the number of documents rewritten and the packs still named by a
        document that changed since it was read (its compare-and-swap failed):
        those are kept.
        """
        reader = self._t._reader
        gone = set(packs)
        tables_of = {s: reader.tables(s) for s, d in docs.items() if gone & set(d.packs)}
        blocks = {(docs[s].packs[t.pack], t.offset, t.length) for s in tables_of for t in docs[s].tables}
        stream = PackStream(self._t._io, self._t.pack_bytes)
        moved: dict[Location, Location] = {}
        try:
            for pid in packs:
                ranges = sorted((pid, off, n) for off, n in live.get(pid, ()) if (pid, off, n) not in blocks)
                for k in range(0, len(ranges), 256):
                    group = ranges[k : k + 256]
                    for loc, data in zip(group, reader.fetch(group)):
                        moved[loc] = stream.append(data)
            new_docs = [
                relocated_doc(
                    docs[s], tables_of[s], stream, lambda pid, off, n: moved.get((pid, off, n), (pid, off, n))
                )
                for s in sorted(tables_of)
            ]
            stream.close()
            new_docs = rechained(docs, new_docs)  # descendants name the moved table blocks in their chains
        except BaseException:
            stream.abort()
            raise
        done, kept = 0, set()
        for nd in new_docs:
            old = docs[nd.step]
            if self._t._io.replace_if(step_key(nd.step), nd.to_bytes(), old.to_bytes()):
                done += 1
            else:  # rewritten (a delete re-parented it) or removed meanwhile: what it names now stays
                kept |= gone & old.named_packs()
                now = reader.stored_doc(nd.step)
                kept |= gone & (now.named_packs() if now is not None else set())
        reader.forget()
        return done, kept


def _unnamed(listing: dict, listed: set, retired: dict, older_than: float) -> list[str]:
    """The packs no step names that are past the grace period (retired by a repack: since then)."""
    out = []
    for pid, (_, age) in listing.items():
        if pid in listed:
            continue
        grace = retired.get(pid, age)
        if older_than and (grace is None or grace < older_than):
            continue
        out.append(pid)
    return out


def _mostly_dead(listing: dict, listed: set, live: dict, repack_below: float) -> list[str]:
    """The named packs whose live bytes are under ``repack_below`` of their size."""
    if repack_below <= 0:
        return []
    return [
        pid
        for pid, (size, _) in listing.items()
        if pid in listed and size and sum(n for _, n in live.get(pid, ())) < repack_below * size
    ]


def _age(info: dict, now: float) -> float | None:
    for k in ("mtime", "LastModified", "created", "last_modified"):
        v = info.get(k)
        if v is None:
            continue
        if isinstance(v, _dt.datetime):
            return now - v.timestamp()
        try:
            return now - float(v)
        except (TypeError, ValueError):
            continue
    return None
