"""Integrity and sizes: :meth:`verify` re-reads and checks everything; :meth:`inventory` and :meth:`stats` add up bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CorruptManifestError, IntegrityError, NotFoundError, StepNotFoundError
from ._base import TrajectoryBase
from ._layout import BLOBS_DIR, step_key
from ._manifest import Manifest
from ._reader import ChunkReader

__all__ = ["IntegrityMixin", "VerifyReport", "Inventory"]


@dataclass
class VerifyReport:
    """Result of :meth:`Trajectory.verify`.

    ``errors`` lists one dict per bad object: ``key`` (the damaged blob,
    manifest or ref), ``step``, ``tensor``, ``error`` (class name) and
    ``message``.
    """

    steps: int = 0
    chunks: int = 0
    blobs: int = 0
    errors: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class Inventory:
    """What a trajectory stores, read without decoding anything (:meth:`Trajectory.inventory`).

    ``manifests``: step -> its checked manifest (``tensors``: name ->
    ``shape``, ``dtype``, ``entries`` whose ``blob`` is a blob address), in
    step order; ``manifest_bytes``: step -> stored size of its manifest;
    ``blob_bytes``: address -> size of every blob, referenced or not.
    """

    manifests: dict[int, Manifest]
    manifest_bytes: dict[int, int]
    blob_bytes: dict[str, int]


class IntegrityMixin(TrajectoryBase):
    """verify and stats of :class:`~ulstore.store.Trajectory`."""

    # -- integrity ----------------------------------------------------------------

    def verify(self, step=None, *, raise_on_error: bool = True) -> VerifyReport:
        """Re-read and check every blob, manifest and ref reachable from ``step`` (default: all).

        Every blob is fetched again (nothing from the cache), checked against
        its address, decoded against its reference and checked against its
        content hash.

        Returns
        -------
        VerifyReport

        Raises
        ------
        IntegrityError
            (the class of the first problem, e.g. CorruptBlobError) if
            ``raise_on_error`` and anything is damaged; its ``key`` names the
            first bad object and its message lists all of them.
        """
        fresh = ChunkReader(self._io, self._reader.cache_bytes)
        report = VerifyReport()
        steps = [self._resolve(step)] if step is not None else self.steps
        bad: dict[str, IntegrityError] = {}

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
        seen_blobs = set()
        for s in steps:
            try:
                m = fresh.manifest(s)
            except IntegrityError as e:
                note(e, s)
                continue
            report.steps += 1
            if m.parent is not None and not self._io.exists(step_key(m.parent)):
                note(CorruptManifestError(f"parent step {m.parent} is missing", step=s, key=step_key(s)), s)
            for name, t in m.tensors.items():
                for coord in t.coords():
                    report.chunks += 1
                    seen_blobs.add(t.entry(coord).blob)
                    try:
                        fresh.chunk(s, name, coord)
                    except IntegrityError as e:
                        note(e, s, name)
                    except NotFoundError as e:  # a reference step is gone
                        note(
                            CorruptManifestError(f"reference is missing: {e}", step=s, tensor=name, key=step_key(s)), s
                        )
        report.blobs = len(seen_blobs)
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

    def _verify_refs(self, note) -> None:
        """Every ref entry sealed and chained; every ref's head step present."""
        for name, errors in self._refs.problems().items():
            for e in errors:
                note(e, None)
            try:
                head = self._refs.read(name)
            except IntegrityError:
                continue  # reported above
            if head.step is not None and not self._io.exists(step_key(head.step)):
                note(
                    CorruptManifestError(f"ref {name!r} points at step {head.step}, which is missing", key=head.key),
                    head.step,
                )

    def inventory(self) -> Inventory:
        """Every step's manifest (parsed and checked, as for reading) and every blob's size; nothing decoded.

        Raises
        ------
        CorruptManifestError
            A manifest is damaged.
        StepNotFoundError
            A step was deleted while the inventory was taken.
        """
        manifests, manifest_bytes = {}, {}
        for s in self.steps:
            key = step_key(s)
            raw = self._io.get(key)
            if raw is None:
                raise StepNotFoundError("step manifest vanished while reading", step=s, key=key)
            manifests[s] = Manifest.from_bytes(raw, key=key, step=s)
            manifest_bytes[s] = len(raw)
        blobs = self._io.find(BLOBS_DIR, detail=True)
        blob_bytes = {k.rsplit("/", 1)[-1]: int(info.get("size") or 0) for k, info in blobs.items()}
        return Inventory(manifests, manifest_bytes, blob_bytes)

    def stats(self) -> dict:
        """Sizes: stored blob and manifest bytes vs the raw bytes of every step.

        Returns
        -------
        dict
            ``steps``, ``chunks`` (entries over all steps), ``blobs``,
            ``blob_bytes``, ``manifest_bytes``, ``stored_bytes`` (blobs +
            manifests), ``raw_bytes`` (sum of every step's tensors), ``ratio``
            (raw / stored), ``manifest_bytes_per_chunk``.
        """
        inv = self.inventory()
        manifest_bytes = sum(inv.manifest_bytes.values())
        raw = sum(t.nbytes for m in inv.manifests.values() for t in m.tensors.values())
        chunks = sum(len(t.entries) for m in inv.manifests.values() for t in m.tensors.values())
        blob_bytes = sum(inv.blob_bytes.values())
        stored = blob_bytes + manifest_bytes
        return {
            "steps": len(inv.manifests),
            "chunks": chunks,
            "blobs": len(inv.blob_bytes),
            "blob_bytes": blob_bytes,
            "manifest_bytes": manifest_bytes,
            "stored_bytes": stored,
            "raw_bytes": raw,
            "ratio": raw / stored if stored else float("nan"),
            "manifest_bytes_per_chunk": manifest_bytes / chunks if chunks else float("nan"),
        }
