"""Retention: :meth:`delete` a step (re-encoding what depended on it) and :meth:`gc` unreferenced blobs."""

from __future__ import annotations

import datetime as _dt
import time

from ..errors import RefMovedError
from ._base import TrajectoryBase
from ._chunkcodec import encode_chunk
from ._layout import BLOBS_DIR, blob_key, step_key
from ._manifest import Entry, Manifest, TensorManifest
from ._pending import PENDING_DIR
from ._pool import run_bounded

__all__ = ["RetentionMixin"]


class RetentionMixin(TrajectoryBase):
    """delete and gc of :class:`~ulstore.store.Trajectory`."""

    # -- retention ----------------------------------------------------------------

    def delete(self, step) -> None:
        """Delete ``step``; every other step stays readable, exactly.

        Chunks of other steps coded against ``step`` are re-encoded against
        ``step``'s own reference (its parent's chunk, or intra), and steps whose
        parent was ``step`` are re-parented to ``step``'s parent; each such
        manifest is rewritten with a single PUT.  Refs pointing at ``step`` move
        to its parent (or are removed if it had none).  Blobs are not removed:
        run :meth:`gc`.

        Safe against concurrent commits: if a commit on ``step`` or on a step
        that depends on it is in flight, or another delete is, it refuses
        (ConflictError) before changing anything; a commit that would refer to
        a step being deleted refuses likewise (see ``_pending.py``).

        Raises
        ------
        ConflictError
            A commit depending on ``step``, or another delete, is in flight: retry later.
        """
        self._check_writable()
        step = self._resolve(step)
        dead = self._reader.manifest(step)
        with self._pending.deleting(step, lambda: self._dependants(step), lambda: self.steps):
            self._delete(step, dead)

    def _dependants(self, step: int) -> set[int]:
        """Steps whose parent is ``step`` or whose entries are coded against it."""
        out = set()
        for s in self.steps:
            m = self._reader.manifest(s)
            if m.parent == step or any(e.ref == step for t in m.tensors.values() for e in t.entries):
                out.add(s)
        return out

    def _delete(self, step: int, dead: Manifest) -> None:
        io, reader = self._io, self._reader
        for s in self.steps:
            if s == step:
                continue
            m = reader.manifest(s)
            stale = [
                (name, i, coord)
                for name, t in m.tensors.items()
                for i, coord in enumerate(t.coords())
                if t.entries[i].ref == step
            ]
            if not stale and m.parent != step:
                continue
            new_entries = {name: list(t.entries) for name, t in m.tensors.items()}

            def recode(job, m=m):
                name, i, coord = job
                t = m.tensors[name]
                old = t.entries[i]
                own = dead.tensors[name].entries[i]
                if own.content == old.content:  # same chunk as the deleted step's: share its entry
                    return name, i, own
                value = reader.chunk(m.step, name, coord)
                ref = reader.chunk(own.ref, name, coord) if own.ref is not None else None
                blob, digest = encode_chunk(value, ref, t.codec)
                io.put(blob_key(digest), blob)
                return name, i, Entry(digest, own.ref, old.content)

            run_bounded(recode, stale, self._threads, new_entries)
            rewritten = Manifest(
                step=m.step,
                parent=dead.parent if m.parent == step else m.parent,
                anchor_distance=m.anchor_distance,
                tensors={
                    name: TensorManifest(t.shape, t.dtype, t.chunks, t.codec, tuple(new_entries[name]))
                    for name, t in m.tensors.items()
                },
                metadata=m.metadata,
                created=m.created,
            )
            io.put(step_key(s), rewritten.to_bytes())  # contents unchanged: one atomic PUT
            reader.forget([s])
        for name, target in self.refs.items():
            if target == step:
                try:
                    self._move_ref(name, dead.parent, step)
                except RefMovedError:  # moved away from step meanwhile: nothing to do
                    pass
        io.delete(step_key(step))
        reader.forget([step])

    def gc(self, *, older_than: float = 0.0) -> dict:
        """Remove blobs that no manifest references.

        Parameters
        ----------
        older_than : float
            Only remove blobs at least this many seconds old.  A commit writes
            its blobs before its manifest, so a gc running concurrently with a
            writer must use a grace period longer than a commit takes.

        Returns
        -------
        dict
            ``{"blobs": removed count, "bytes": removed bytes}``.
        """
        self._check_writable()
        live: set[str] = set()
        for s in self.steps:
            m = self._reader.manifest(s)
            for t in m.tensors.values():
                live.update(e.blob for e in t.entries)
        now = time.time()
        dead = []
        freed = 0
        for key, info in self._io.find(BLOBS_DIR, detail=True).items():
            if key.rsplit("/", 1)[-1] in live:
                continue
            age = _age(info, now)
            if older_than and age is not None and age < older_than:
                continue
            dead.append(key)
            freed += int(info.get("size") or 0)
        self._io.delete_many(dead)
        self._io.sweep_tmp()
        # markers of commits/deletes killed mid-way (see _pending.py): past the grace period only
        pending = self._io.find(PENDING_DIR, detail=True)
        self._io.delete_many(
            [k for k, info in pending.items() if not older_than or (_age(info, now) or 0.0) >= older_than]
        )
        return {"blobs": len(dead), "bytes": freed}


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
