"""The trainer side: :class:`Publisher` writes every version as a ULPack delta, anchors, then the pointer.

One ``publish(version, state)``:

1. copies to host the tensors that may have changed (all of them, unless a
   :class:`~ulstore.sync.ChangeDetector` or ``unchanged=`` proves some did not);
2. compares each chunk's bits with the last published version and codes the
   chunks that differ as ULPack deltas against it (in parallel threads);
3. writes the packs, the layout if new, and ``versions/<v>.json``;
4. every ``anchor_every`` versions, also codes the *whole* state intra and
   writes its packs and ``anchors/<v>.json`` (every parameter, changed or not);
5. writes ``latest.json`` -- last, so a reader never sees a version whose
   objects are not all in place.  Only then does the publisher's reference
   (what the next delta is coded against) advance.

A publish that fails or is killed at any point leaves ``latest.json`` on the
previous version; retrying the same version, or publishing a later one, is safe.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..core.sealed import canonical_json
from ..errors import CorruptManifestError, InvalidInputError
from ._bucket import open_bucket as _open_bucket
from ._documents import Latest, Layout, Manifest
from ._layout import (
    ANCHORS_DIR,
    FORMAT,
    LATEST,
    SYNC_META,
    VERSIONS_DIR,
    anchor_key,
    check_version,
    is_sync_meta,
    layout_key,
    now,
    parse_version_key,
    version_key,
)
from ._publish_steps import PublishSteps
from ._reader import BucketReader
from ._workers import WorkerOwner, Workers

__all__ = ["Publisher", "PublishInfo", "DEFAULT_ANCHOR_EVERY", "DEFAULT_CHUNK_ELEMS", "DEFAULT_PACK_BYTES"]

log = logging.getLogger("ulstore.sync")

#: A full anchor every this many versions (the TRL branch uses 10 or 20).
DEFAULT_ANCHOR_EVERY = 10
#: Elements per chunk: the unit of change detection, parallel coding and in-place writes (2 MiB of bf16).
DEFAULT_CHUNK_ELEMS = 1 << 20
#: Largest pack object; anchors of big models span several (S3 caps one PUT at 5 GB).
DEFAULT_PACK_BYTES = 256 << 20


@dataclass(frozen=True)
class PublishInfo:
    """What one :meth:`Publisher.publish` wrote.

    Attributes
    ----------
    version : int
    kind : {"delta", "reset"}
        ``reset``: no delta could be coded (first version, or a restarted
        publisher that could not load the last version); followers load the anchor.
    anchor : bool
        An anchor (full state) was written too.
    changed_chunks, total_chunks : int
        Chunks coded in the delta / chunks in the state.
    skipped_tensors : int
        Tensors neither copied nor compared because they were known unchanged.
    delta_bytes, anchor_bytes : int
        Pack bytes written for the delta and for the anchor.
    seconds : float
        Wall time of the call.
    """

    version: int
    kind: str
    anchor: bool
    changed_chunks: int
    total_chunks: int
    skipped_tensors: int
    delta_bytes: int
    anchor_bytes: int
    seconds: float


class Publisher(PublishSteps, WorkerOwner):
    """Publish a trainer's weights to a bucket after every optimizer step.

    Parameters
    ----------
    url : str or os.PathLike
        fsspec URL of the store (``s3://bucket/run-7``, a local directory, ``memory://x``).
    anchor_every : int, default 10
        Write a full anchor every ``anchor_every`` versions (0: only the first).
        A replica that joins late loads the newest anchor and replays at most
        ``anchor_every - 1`` deltas.
    storage_options : dict, optional
        fsspec options (credentials, ``client_kwargs={"endpoint_url": ...}``).
    chunk_elems : int, default 2**20
        Elements per chunk.
    pack_bytes : int, default 256 MiB
        Largest pack object.
    threads : int, optional
        Threads that compare, code and upload (default: CPU count, at least 2).
    detector : ChangeDetector, optional
        Optimizer hooks that prove tensors unchanged; they are then neither
        copied to host nor compared (checked again at every anchor).
    resume : bool, default True
        If the store already holds versions, code the first new one as a delta
        against the latest (loaded from the store) instead of a reset anchor
        that every follower would have to download.
    sparse : bool, default True
        Code each delta chunk by the positions of its changed elements when at
        most 1/8 change (ULPack's SPARSE mode): followers then apply it in time
        proportional to the changes.  False: dense deltas, about a quarter
        smaller on RL steps, that followers decode element by element.

    Raises
    ------
    BucketAccessError
        The bucket is missing, unreachable, or not writable.
    InvalidInputError
        ``url`` holds something that is not a sync store, or bad settings.

    Examples
    --------
    >>> import numpy as np, ml_dtypes
    >>> from ulstore.sync import Publisher, Follower
    >>> w = {"w": np.linspace(-1, 1, 1000).astype(ml_dtypes.bfloat16)}
    >>> pub = Publisher("memory://doc-sync", anchor_every=4)
    >>> pub.publish(0, w).kind
    'reset'
    >>> w["w"][:10] = 0.5
    >>> info = pub.publish(1, w)
    >>> info.kind, info.changed_chunks
    ('delta', 1)
    >>> replica = {"w": np.zeros(1000, ml_dtypes.bfloat16)}
    >>> f = Follower("memory://doc-sync", state=replica)
    >>> f.bootstrap()
    1
    >>> bool((replica["w"].view(np.uint16) == w["w"].view(np.uint16)).all())
    True
    """

    def __init__(
        self,
        url,
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        storage_options: dict | None = None,
        *,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        threads: int | None = None,
        detector=None,
        resume: bool = True,
        sparse: bool = True,
    ):
        self.anchor_every = _check_int("anchor_every", anchor_every, 0)
        self.chunk_elems = _check_int("chunk_elems", chunk_elems, 1)
        if self.chunk_elems >= 1 << 32:
            raise InvalidInputError("chunk_elems must be below 2**32 (a ULPack blob's limit)")
        self.pack_bytes = _check_int("pack_bytes", pack_bytes, 1)
        self.detector = detector
        self.resume = bool(resume)
        self.sparse = bool(sparse)
        self._bucket = _open_bucket(url, storage_options)
        self.url = self._bucket.url
        self._bucket.probe()
        self._init_store()
        self._workers = Workers(threads, "ulstore-publish")
        self._reader = BucketReader(self._bucket, self._workers)
        try:
            self._latest = self._reader.latest()
        except CorruptManifestError as e:  # a damaged pointer: start a fresh chain rather than refuse to publish
            log.warning("latest.json of %s is damaged (%s); the next version will be a reset anchor", self.url, e)
            self._latest = None
        self._layout: Layout | None = None
        self._ref: dict[str, np.ndarray] = {}  # flat host bits of the last published version
        self._loaded = False
        self._since_anchor = 0
        self._layouts_written: set[str] = set()
        #: Counters: ``versions``, ``anchors``, ``bytes`` written, ``detector_misses``.
        self.stats = {"versions": 0, "anchors": 0, "bytes": 0, "detector_misses": 0}

    def _init_store(self) -> None:
        """Create ``sync.json`` or check it: the write probe, and a guard against foreign data."""
        raw = self._bucket.get(SYNC_META)
        if raw is None:
            if self._bucket.get("zarr.json") is not None:
                raise InvalidInputError(
                    f"{self.url!r} holds a ulstore trajectory, not a sync store; use another prefix"
                )
            self._bucket.put(SYNC_META, canonical_json({"format": FORMAT, "created": now()}))
            return
        if not is_sync_meta(raw):
            raise InvalidInputError(f"{self.url!r} holds a {SYNC_META} that is not a {FORMAT} store", key=SYNC_META)

    def __repr__(self) -> str:
        return f"<Publisher {self.url!r} latest={self.latest}>"

    @property
    def latest(self) -> int | None:
        """The newest version readers can see (None before the first publish)."""
        return None if self._latest is None else self._latest.version

    # -- publishing -------------------------------------------------------------------

    def publish(self, version, state: Mapping, *, metadata: dict | None = None, unchanged=None) -> PublishInfo:
        """Publish ``state`` as ``version``.

        Parameters
        ----------
        version : int
            Greater than every published version (gaps are fine, e.g. the optimizer step).
        state : Mapping of str to array
            numpy arrays or torch tensors (CPU or CUDA).  Not modified; do not
            modify it during the call.  Floating-point tensors are ULPack-coded;
            integer and bool tensors are sent raw when they change.
        metadata : dict, optional
            JSON-serializable; followers see it as ``Follower.metadata``
            (e.g. ``{"model_version": step}``).
        unchanged : iterable of str, optional
            Names known bit-identical to the last published version: neither
            copied nor compared.  Ignored at anchors, which compare everything.

        Returns
        -------
        PublishInfo

        Raises
        ------
        InvalidInputError
            ``version`` is not greater than the latest, or the state is unusable.
        BucketAccessError
            A write failed; ``latest.json`` still names the previous version.
        """
        t0 = time.perf_counter()
        version = check_version(version)
        if self._latest is not None and version <= self._latest.version:
            raise InvalidInputError(
                f"version {version} is not greater than the latest published version "
                f"{self._latest.version}; versions must increase"
            )
        if not isinstance(state, Mapping) or not state:
            raise InvalidInputError("state must be a non-empty mapping of tensor name to array")
        metadata = _check_metadata(metadata)
        self._load_reference()
        known = set(unchanged or ())
        if self.detector is not None:
            known |= self.detector.unchanged()
        has_ref = self._layout is not None
        is_anchor = not has_ref or (self.anchor_every > 0 and self._since_anchor + 1 >= self.anchor_every)

        hosts, layout, skipped = self._snapshot(state, known if has_ref and not is_anchor else set())
        delta = self._code_delta(layout, hosts) if has_ref else []
        if is_anchor and has_ref:
            self._count_detector_misses(layout, delta, known)
        parent = self._latest
        kind = "delta" if has_ref else "reset"
        anchor_at = version if is_anchor else parent.anchor

        # 1. the delta's packs, the layout, the version manifest
        self._put_layout(layout)
        packs, entries, delta_bytes = self._put_packs(delta) if kind == "delta" else ([], [], 0)
        vm, vraw = Manifest(
            kind=kind,
            version=version,
            parent=parent.version if parent else None,
            parent_checksum=parent.checksum if parent else None,
            anchor=anchor_at,
            layout=layout.digest,
            packs=tuple(packs),
            entries=tuple(entries),
            created=now(),
            metadata=metadata,
        ).sealed()
        self._bucket.put(version_key(version), vraw)
        # 2. the anchor: every chunk of the state, intra-coded
        anchor_bytes = 0
        if is_anchor:
            apacks, aentries, anchor_bytes = self._put_packs(self._code_anchor(layout, hosts))
            am, araw = Manifest(
                kind="anchor",
                version=version,
                parent=None,
                parent_checksum=None,
                anchor=version,
                layout=layout.digest,
                packs=tuple(apacks),
                entries=tuple(aentries),
                created=vm.created,
                metadata=metadata,
                version_checksum=vm.checksum,
            ).sealed()
            self._bucket.put(anchor_key(version), araw)
            anchor_checksum = am.checksum
        else:
            anchor_checksum = parent.anchor_checksum
        # 3. the commit point
        latest = Latest(version, vm.checksum, anchor_at, anchor_checksum, now())
        self._bucket.put(LATEST, latest.to_bytes())

        # only now does the reference advance: a failure above left it on the previous version
        self._advance(layout, hosts, delta if has_ref else None)
        self._latest = latest
        self._since_anchor = 0 if is_anchor else self._since_anchor + 1
        if self.detector is not None:
            self.detector.reset()
        self.stats["versions"] += 1
        self.stats["anchors"] += int(is_anchor)
        self.stats["bytes"] += delta_bytes + anchor_bytes + len(vraw)
        total_chunks = sum(t.n_chunks(layout.chunk_elems) for t in layout.tensors)
        return PublishInfo(
            version,
            kind,
            is_anchor,
            len(delta),
            total_chunks,
            skipped,
            delta_bytes,
            anchor_bytes,
            time.perf_counter() - t0,
        )

    # -- retention --------------------------------------------------------------------

    def prune(self, keep_anchors: int = 2) -> dict:
        """Delete everything older than the ``keep_anchors``-th newest anchor.

        Kept: that anchor and every newer one, every version from it to the
        latest, and the packs and layouts they name.  A follower that was
        replaying a deleted version finds it missing and re-bootstraps from a
        kept anchor (reported as ``missing``); one that is current is unaffected.
        Call it from the publishing process between publishes (it must not
        race a publish, whose packs are not yet named by a manifest).

        Returns
        -------
        dict
            ``{"objects": deleted count, "cutoff": oldest version kept}``.
        """
        if isinstance(keep_anchors, bool) or not isinstance(keep_anchors, int) or keep_anchors < 1:
            raise InvalidInputError(f"keep_anchors must be an int >= 1, got {keep_anchors!r}")
        latest = self._reader.latest()
        if latest is None:
            return {"objects": 0, "cutoff": None}
        anchors = [a for a in self._reader.anchors() if a <= latest.version]
        if len(anchors) <= keep_anchors:
            return {"objects": 0, "cutoff": anchors[0] if anchors else None}
        cutoff = anchors[-keep_anchors]
        kept = self._reader.chain(latest, cutoff)
        kept += [self._reader.anchor(a) for a in anchors if a >= cutoff]
        live_packs = {key for m in kept for key, _ in m.packs}
        live_layouts = {layout_key(m.layout) for m in kept}
        dead = [k for k in self._bucket.list(VERSIONS_DIR) if (parse_version_key(k, VERSIONS_DIR) or 0) < cutoff]
        dead += [k for k in self._bucket.list(ANCHORS_DIR) if (parse_version_key(k, ANCHORS_DIR) or 0) < cutoff]
        dead += [k for k in self._bucket.list("packs") if k not in live_packs]
        dead += [k for k in self._bucket.list("layouts") if k not in live_layouts]
        # manifests first: a reader then meets a missing manifest (clean) rather than a missing pack
        self._bucket.delete_many(sorted(dead, key=lambda k: k.startswith(("packs/", "layouts/"))))
        return {"objects": len(dead), "cutoff": cutoff}


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidInputError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        return json.loads(canonical_json(dict(metadata)))
    except (TypeError, ValueError) as e:
        raise InvalidInputError(
            f"metadata must be JSON-serializable (finite numbers, str, lists, dicts): {e}"
        ) from None
