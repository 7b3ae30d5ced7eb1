"""The :class:`Trajectory`: commit checkpoints as steps, read any step back, exactly.

Read me first
-------------
- A step is immutable and appears atomically: its blobs and table blocks are
  written first, into packs (``packs/<id>.pack``), its step document
  (``steps/<step>/zarr.json``) last, by conditional create.  A crashed commit
  leaves only unreferenced packs, which :meth:`Trajectory.gc` removes; a retry
  writes new packs (random names) and succeeds.
- A chunk is coded against the co-located chunk of the *parent* step when the
  tensor kept its shape and dtype; a chunk whose content did not change reuses
  the parent's entry verbatim (no new blob).  A step is a full anchor (all
  chunks intra-coded, or reused from an intra entry, so no read walks back
  further) when reading it as a delta would cost more than ``anchor_cost``
  (default 2) times reading an anchor, in a model of bytes fetched and decode
  work kept in each step document: dense runs get frequent anchors, sparse
  ones rare ones.  ``anchor_every=N`` instead makes every N-th step along a
  chain an anchor (trajectories created before the cost policy keep theirs).
- A writer keeps the step it committed last (the kept parent) and codes the
  next commit against it without decoding anything (``keep_parent``).
- Refs (``main``, ``rl-run-2``) are append-only logs of sealed entries, moved
  by compare-and-swap: of two writers that read the same head, one moves it and
  the other gets ``RefMovedError`` (``_refs.py``).  Steps themselves are never
  overwritten, except by :meth:`delete` and :meth:`gc` (repacking), which
  rewrite step documents with unchanged contents, each by compare-and-swap on
  the bytes they read (:meth:`ObjectStore.replace_if`): never a lost update.

Examples
--------
>>> import numpy as np, ulstore
>>> traj = ulstore.open("memory://doctest-traj", mode="w")
>>> w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
>>> traj.commit(0, {"layer.weight": w, "step": np.int64(0)}, metadata={"loss": 2.3})
0
>>> traj.commit(1, {"layer.weight": w + np.float32(1e-3), "step": np.int64(1)})
1
>>> traj.steps, traj.head()
([0, 1], 1)
>>> g = traj[1]
>>> float(g["layer.weight"][0, 0]) == float(w[0, 0] + np.float32(1e-3))
True
>>> bool((traj.read(0)["layer.weight"] == w).all()), traj[0].attrs["loss"]
(True, 2.3)
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import json
import os

from ..core.backends import access_failure, cached_url, is_cache
from ..core.formatting import redact_url
from ..core.objects import MAX_DOCUMENT_BYTES, TMP_DIR, ObjectStore
from ..core.sealed import canonical_json
from ..errors import (
    ConflictError,
    CorruptManifestError,
    FormatError,
    InvalidInputError,
    NotFoundError,
    ReadOnlyError,
    StorageAccessError,
    UlstoreError,
)
from ._base import TrajectoryBase
from .commit._commit import Committer
from .commit._commit_input import HEAD
from .format._chunk_tables import MAX_CHUNK_BYTES
from .format._chunkcodec import HASH_NAME
from .format._layout import ROOT_META, STEPS_META
from .format._packs import DEFAULT_PACK_BYTES
from .format._read_cost import DEFAULT_ANCHOR_COST, DEFAULT_ANCHOR_EVERY
from .format._stepdoc import FORMAT, MAX_ANCHOR_K
from .maintenance._delete import Deleter
from .maintenance._gc import GarbageCollector
from .maintenance._integrity import Integrity, VerifyReport
from .read._chunk_reader import DEFAULT_CACHE_BYTES
from .read._step_reader import Reader, StepInfo

__all__ = [
    "open",
    "Trajectory",
    "StepInfo",
    "VerifyReport",
    "HEAD",
    "DEFAULT_ANCHOR_COST",
    "DEFAULT_ANCHOR_EVERY",
    "DEFAULT_CHUNK_BYTES",
]

# DEFAULT_ANCHOR_COST: the cost policy's k, the default of new trajectories; DEFAULT_ANCHOR_EVERY: the fixed
# count of trajectories made before it, and what an older ulstore uses on a new one (_read_cost.py)
#: Default chunk size: big enough that S3 request latency is amortised, small enough for lazy slices.
DEFAULT_CHUNK_BYTES = 4 << 20

_MODES = ("r", "r+", "a", "w", "w-", "x")


def open(
    url,
    mode: str = "a",
    *,
    fs=None,
    storage_options: dict | None = None,
    anchor_every: int | None = None,
    chunk_bytes: int | None = None,
    pack_bytes: int | None = None,
    anchor_cost: float | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    keep_parent: bool | int = True,
    executor: cf.Executor | None = None,
    threads: int | None = None,
    durable: bool = True,
) -> Trajectory:
    """Open (or create) the trajectory at ``url``.

    Parameters
    ----------
    url : str, os.PathLike, fsspec.FSMap or ObjectStore
        Any fsspec URL (``s3://bucket/run-7``, ``memory://x``, ``gs://...``,
        ``filecache::s3://...``) or a local path; with ``fs``, a path on that
        filesystem; a mapper (``fs.get_mapper(path)``), whose filesystem and
        root are used; or an :class:`ulstore.core.objects.ObjectStore` already
        opened (e.g. with an ``access_error``; ``storage_options`` are then
        ignored).  ``traj.url`` is ``url`` as given (a relative path stays
        relative), with any ``user:password@`` shown as ``***@``, as in every
        message.
    fs : fsspec.AbstractFileSystem, optional
        An already configured filesystem (as zarr's ``FsspecStore(fs, path=...)``):
        ``url`` is then a path on it.  Not with ``storage_options``.
    mode : {"r", "r+", "a", "w", "w-"}, default "a"
        ``"r"`` read only, must exist; ``"r+"`` read/write, must exist; ``"a"``
        read/write, created if missing; ``"w"`` create, **deleting** the
        trajectory at ``url`` (anything else there, a directory of checkpoint
        files say, is refused, not deleted); ``"w-"`` (or ``"x"``) create,
        fail if it exists.
    storage_options : dict, optional
        Passed to the fsspec filesystem (credentials, endpoint, ...).
    anchor_every : int, optional
        A full intra-coded step every ``anchor_every`` steps along a chain (0:
        only the root) instead of the cost policy.  Stored at creation;
        passing it to an existing trajectory changes it for this session's
        commits only.
    anchor_cost : float, optional
        The cost policy (the default of new trajectories, with k = 2): a
        step is an anchor when reading it as a delta would cost more than
        ``anchor_cost`` times reading its chain's anchor (bytes fetched plus
        decode work, modelled; ``ulstore log`` shows why a step is an
        anchor).  Stored at creation; given to an existing trajectory, it
        holds for this session's commits.  Not with ``anchor_every``.
    chunk_bytes : int, optional
        Target chunk size for new tensors (a tensor keeps its chunk grid along
        its chain).  Stored at creation like ``anchor_every``.
    pack_bytes : int, optional
        Bound of a pack object (default 256 MiB): a commit writes its blobs
        into ``ceil(new bytes / pack_bytes)`` packs.  Stored at creation.
    cache_bytes : int
        Budget of the decoded-chunk cache of lazy slices.
    keep_parent : bool or int, default True
        Keep the step committed (or read) last fully materialised, so the next
        commit codes against it without decoding and consecutive reads decode
        one blob per chunk: costs one step of memory.  False: decode the parent
        chunk by chunk instead (memory: a few chunks).  An int: keep steps up
        to that many bytes.
    executor : concurrent.futures.Executor, optional
        Where commits encode chunks (e.g. ``distributed.Client.get_executor()``);
        default: a thread pool.
    threads : int, optional
        Threads of reads (default: at least 4, for I/O) and of encoding
        (default: the CPU count; each encoding thread holds a few chunks of
        scratch memory).
    durable : bool, default True
        Local disk: fsync every pack, step document and ref (and the
        directories they enter) before a commit returns, so a power cut cannot
        lose an acknowledged step.  False trades that for speed (see
        docs/concepts.md).  Object stores are durable when a PUT returns,
        whatever this says.

    Returns
    -------
    Trajectory

    Raises
    ------
    NotFoundError
        ``mode`` is "r" or "r+" and there is no trajectory at ``url``.
    ConflictError
        ``mode`` is "w-" and a trajectory exists.
    InvalidInputError
        Bad ``mode`` or settings, or ``url`` holds a Zarr hierarchy that is not a trajectory, or
        ``url`` holds anything but a trajectory (files, a directory of them) and ``mode`` is "w" (which
        would delete it) or creates a trajectory there ("a", "w-"): an empty or missing location is fine.
    ReadOnlyError
        ``url`` reads through a cache (``simplecache::``, ``filecache::``, ``blockcache::``) and
        ``mode`` is "r+", "w" or "w-", or "a" with nothing there to open: caches are read-only (open
        the underlying URL to write).  With mode "a" an existing trajectory opens read-only.
    StorageAccessError
        The storage cannot be used: no credentials (for S3: set AWS credentials, pass
        ``storage_options={"key": ..., "secret": ...}``, or ``anon=True`` for a public bucket),
        access denied, or the endpoint unreachable.  The message says which, and how to fix it.

    Examples
    --------
    >>> import tempfile, numpy as np, ulstore
    >>> path = tempfile.mkdtemp()
    >>> traj = ulstore.open(path, anchor_every=8, chunk_bytes=1 << 16)
    >>> traj.commit(10, {"w": np.ones((4, 4), np.float16)})
    10
    >>> ulstore.open(path, mode="r").read(10)["w"].sum()
    np.float16(16.0)
    """
    if mode not in _MODES:
        raise InvalidInputError(f"mode must be one of {_MODES}, got {mode!r}")
    cache_bytes = _check_positive("cache_bytes", cache_bytes, zero=True)
    if threads is not None:
        threads = _check_positive("threads", threads)
    url, io = _object_store(url, fs, storage_options, durable)
    cached = _cache_refusal(io, url) if is_cache(io.fs) else None  # caches are read-only
    if cached is not None and mode in ("r+", "w", "w-", "x"):
        raise ReadOnlyError(f"cannot open {url!r} with mode={mode!r}: {cached}")
    if anchor_every is not None and anchor_cost is not None:
        raise InvalidInputError("pass anchor_every (a fixed count) or anchor_cost (the cost policy), not both")
    anchor_cost = _check_anchor_cost(anchor_cost)
    settings = _stored_settings(
        io, url, mode, cached, lambda: _new_settings(anchor_every, chunk_bytes, pack_bytes, anchor_cost)
    )
    # given settings hold for this session's commits
    if anchor_every is not None:
        settings["anchor_every"] = _check_positive("anchor_every", anchor_every, zero=True)
        settings.pop("anchor_cost", None)
    if anchor_cost is not None:
        settings["anchor_cost"] = anchor_cost
    if chunk_bytes is not None:
        settings["chunk_bytes"] = _check_positive("chunk_bytes", chunk_bytes)
    if pack_bytes is not None:
        settings["pack_bytes"] = _check_positive("pack_bytes", pack_bytes)
    if not isinstance(keep_parent, bool):
        _check_positive("keep_parent", keep_parent, zero=True)
    traj = Trajectory(
        io,
        url=url,
        read_only=mode == "r" or cached is not None,
        anchor_every=settings["anchor_every"],
        anchor_cost=settings.get("anchor_cost"),
        chunk_bytes=settings["chunk_bytes"],
        pack_bytes=settings["pack_bytes"],
        cache_bytes=cache_bytes,
        keep_parent=keep_parent,
        executor=executor,
        threads=threads,
    )
    if cached is not None and mode != "r":  # mode "a" through a cache: reads work, writes say why they cannot
        traj._why_read_only = f"{url!r} was opened through a caching URL: {cached}"
    return traj


def _stored_settings(io: ObjectStore, url: str, mode: str, cached: str | None, new) -> dict:
    """The settings stored at the trajectory's root; with none there, ``new()`` written there first (a new
    trajectory), unless ``mode`` or a cache (``cached``: why it is read-only) forbids it."""
    with _access_errors(url):  # no credentials, access denied, unreachable: a StorageAccessError saying so
        if mode == "w":
            _check_replaceable(io, url)
            io.remove_tree()
        raw = io.get(ROOT_META, limit=MAX_DOCUMENT_BYTES)
        if raw is None:
            if mode in ("r", "r+"):
                _check_bucket(io, url)
                what = _what_else(io)
                hint = (
                    f": it {what}; checkpoint files are imported into a trajectory of their own with "
                    "ulstore.io.import_checkpoint(traj, path) (CLI: ulstore add)"
                    if what is not None
                    else " (open with mode='a' or 'w' to create one)"
                )
                raise NotFoundError(f"no trajectory at {url!r}{hint}", key=ROOT_META)
            if cached is not None:
                _check_bucket(io, url)
                raise ReadOnlyError(f"no trajectory at {url!r}, and none can be created there: {cached}")
            raw = _check_creatable(io, url, mode)
        if raw is None:
            settings = new()
            try:
                io.create(ROOT_META, canonical_json(_group({"ulstore": settings})))
            except FileExistsError:  # another process created it just now: use theirs
                raw = io.get(ROOT_META, limit=MAX_DOCUMENT_BYTES)
            except OSError:  # s3fs: FileNotFoundError "The specified bucket does not exist"
                _check_bucket(io, url)
                raise
            else:
                io.put(STEPS_META, canonical_json(_group({})))
    if raw is None:
        return settings
    if mode in ("w-", "x"):
        raise ConflictError(
            f"a trajectory already exists at {url!r}; to add steps to it, use mode='a' "
            f"(CLI: `ulstore add {url} CHECKPOINT...`)",
            key=ROOT_META,
        )
    return _parse_settings(raw, url)


def _check_replaceable(io: ObjectStore, url: str) -> None:
    """Refuse mode "w" where it would delete something that is not a trajectory.

    ``mode="w"`` starts over by deleting everything at ``url``: that is what a user asks for on a
    trajectory (or on nothing), not on a directory of checkpoint files or a file given by mistake
    (``ulstore.open("checkpoints", mode="w")``).  Anything else there is refused, named, and left alone.
    """
    raw = io.get(ROOT_META, limit=MAX_DOCUMENT_BYTES)
    if raw is not None:
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            doc = None
        attributes = doc.get("attributes") if isinstance(doc, dict) else None
        if isinstance(attributes, dict) and isinstance(attributes.get("ulstore"), dict):
            return  # a trajectory (of any format): replacing it is what mode "w" is for
        what = f"{url!r} holds a Zarr hierarchy (zarr.json) that is not a ulstore trajectory"
    else:
        there = _what_else(io)
        if there is None:
            return
        what = f"{url!r} {there}, not a trajectory"
    raise InvalidInputError(
        f"refusing to open {url!r} with mode='w', which deletes what is there first: {what}; give the trajectory "
        "a path of its own (a new directory), or delete what is there yourself first"
    )


def _check_creatable(io: ObjectStore, url: str, mode: str) -> bytes | None:
    """Refuse to create a trajectory among what is at ``url`` when it is not one (mode "a", "w-"; a sync
    Publisher's bucket; a DCP checkpoint): a trajectory written into a directory of checkpoint files mixes its
    objects with them and is hard to tell apart or remove.  An empty or missing location is fine.

    Returns the root document if a trajectory appeared meanwhile (another process, a DCP rank, created it
    between our read and our listing: use it), else None (create one).
    """
    there = _what_else(io)
    if there is None:
        return None
    raw = io.get(ROOT_META, limit=MAX_DOCUMENT_BYTES)
    if raw is not None:
        return raw
    raise InvalidInputError(
        f"refusing to create a trajectory at {url!r} (mode={mode!r}): it {there}, not a trajectory; give the "
        "trajectory a path of its own (a new directory); checkpoint files are imported into one with "
        "ulstore.io.import_checkpoint(traj, path) (CLI: ulstore add)"
    )


def _what_else(io: ObjectStore) -> str | None:
    """What is at the root of ``io``, where no trajectory is ("is a file", "holds 3 entries (...)"), or None."""
    if io.fs.isfile(io.root):
        return "is a file"
    found = [k for k in io.list("") if k != TMP_DIR]
    if not found:
        return None
    shown = ", ".join(repr(k) for k in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return f"holds {len(found)} entr{'y' if len(found) == 1 else 'ies'} ({shown})"


def _cache_refusal(io: ObjectStore, url: str) -> str:
    """Why a trajectory cannot be written through the caching wrapper of ``io``, and how to write it."""
    behind = cached_url(io.fs, io.root)
    where = f"open the underlying URL {redact_url(behind)!r} to write" if behind else "open the URL behind it to write"
    return (
        "caches are read-only (simplecache::, filecache::, blockcache::): a write would land in the local "
        f"cache, not in the trajectory; {where}, and read through the cache with mode='r'"
    )


def _object_store(url, fs, storage_options, durable: bool = True) -> tuple[str, ObjectStore]:
    """(url as shown: credentials redacted, object client) for a URL, a path on ``fs``, or an fsspec mapper."""
    from fsspec.mapping import FSMap

    if isinstance(url, ObjectStore):
        return url.url, url
    if isinstance(url, FSMap):
        if fs is not None and fs is not url.fs:
            raise InvalidInputError("pass either a mapper or fs=, not both")
        fs, url = url.fs, url.root
    if fs is None:
        io = ObjectStore.from_url(os.fspath(url), storage_options, durable=durable)
        return io.url, io
    if storage_options:
        raise InvalidInputError("storage_options go to the filesystem: configure fs= with them instead")
    if not hasattr(fs, "_strip_protocol") or not hasattr(fs, "cat_file"):
        raise InvalidInputError(f"fs must be an fsspec filesystem, got {type(fs).__name__}")
    url = os.fspath(url)
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    io = ObjectStore(fs, fs._strip_protocol(url), url=url, protocol=protocol, durable=durable)
    return io.url, io


@contextlib.contextmanager
def _access_errors(url: str):
    """Within: a backend failure that means the storage cannot be used becomes a StorageAccessError."""
    try:
        yield
    except UlstoreError:
        raise
    except Exception as e:
        text = access_failure(e, url)
        if text is None:
            raise
        raise StorageAccessError(text) from e


def _check_bucket(io: ObjectStore, url: str) -> None:
    """Raise NotFoundError naming the bucket if ``url`` lies in a bucket that does not exist."""
    bucket = io.missing_bucket()
    if bucket is not None:
        raise NotFoundError(
            f"bucket {bucket!r} does not exist (for {url!r}): ulstore creates no buckets; create it first, "
            "or check the bucket name, endpoint and region (storage_options)"
        )


def _group(attributes: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def _check_positive(name, value, zero=False, error=InvalidInputError, key=None) -> int:
    top = MAX_CHUNK_BYTES if name == "chunk_bytes" else None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < (0 if zero else 1)
        or (top is not None and value > top)
    ):
        limit = f" and <= {top}" if top is not None else ""
        raise error(f"{name} must be an int >= {0 if zero else 1}{limit}, got {value!r}", key=key)
    return value


def _check_anchor_cost(k, error=InvalidInputError, key=None) -> float | None:
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= MAX_ANCHOR_K:
        raise error(f"anchor_cost must be a number > 0 and <= {MAX_ANCHOR_K:g}, got {k!r}", key=key)
    return float(k)


def _new_settings(anchor_every, chunk_bytes, pack_bytes=None, anchor_cost=None) -> dict:
    """The settings a new trajectory stores.  Without ``anchor_every``, the cost policy: ``anchor_cost`` (k)
    beside ``anchor_every`` 16, the fixed count an older ulstore (which knows no ``anchor_cost``) follows."""
    cost = (
        {} if anchor_every is not None else {"anchor_cost": DEFAULT_ANCHOR_COST if anchor_cost is None else anchor_cost}
    )
    return cost | {
        "format": FORMAT,
        "anchor_every": DEFAULT_ANCHOR_EVERY
        if anchor_every is None
        else _check_positive("anchor_every", anchor_every, True),
        "chunk_bytes": DEFAULT_CHUNK_BYTES if chunk_bytes is None else _check_positive("chunk_bytes", chunk_bytes),
        "pack_bytes": DEFAULT_PACK_BYTES if pack_bytes is None else _check_positive("pack_bytes", pack_bytes),
        "hash": HASH_NAME,
    }


def _parse_settings(raw: bytes, url: str = "") -> dict:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptManifestError(f"root zarr.json is not JSON: {e}", key=ROOT_META) from e
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    settings = attributes.get("ulstore") if isinstance(attributes, dict) else None
    if not isinstance(settings, dict):
        raise InvalidInputError("this Zarr hierarchy is not a ulstore trajectory", key=ROOT_META)
    if settings.get("format") == 1:
        raise FormatError(
            f"{url or 'this trajectory'} is in ulstore's old format 1 (one object per chunk); convert it "
            f"with `ulstore upgrade {url or 'SRC'} DEST` (or ulstore.upgrade(src, dest)), then open DEST",
            key=ROOT_META,
        )
    if settings.get("format") != FORMAT:
        raise CorruptManifestError(f"unsupported trajectory format {settings.get('format')!r}", key=ROOT_META)
    out = dict(settings)
    for name, zero in (("anchor_every", True), ("chunk_bytes", False), ("pack_bytes", False)):
        _check_positive(name, out.get(name), zero, error=CorruptManifestError, key=ROOT_META)
    if "anchor_cost" in out:  # absent: a trajectory made before the cost policy keeps its fixed count
        _check_anchor_cost(out["anchor_cost"], error=CorruptManifestError, key=ROOT_META)
    return out


def _delegate(job: str, method):
    """A method of :class:`Trajectory` that is ``method`` of its job object ``job``: same signature, same docs."""
    name = method.__name__

    @functools.wraps(method)
    def delegated(self, *args, **kwargs):
        return getattr(getattr(self, job), name)(*args, **kwargs)

    return delegated


class Trajectory(TrajectoryBase):
    """A trajectory of checkpoints: immutable steps, branches, lazy exact reads.

    Create one with :func:`ulstore.open`.  Thread-safe for reads; commits from
    several threads or processes are safe: each step is created at most once,
    and a branch moves by compare-and-swap (a loser gets ``RefMovedError``).

    A trajectory is also a read-only, Sequence-like view of its step numbers:
    ``len(traj)``, ``list(traj)`` and ``for step in traj`` give the steps in
    increasing order (as :attr:`steps`), ``reversed(traj)`` newest first, and
    ``1200 in traj`` / ``"main" in traj`` test a step or a ref.  Indexing
    returns a step's lazy :class:`zarr.Group`:

    - ``traj[1200]``, a non-negative int, is step NUMBER 1200 (never the
      1200th step);
    - ``traj["main"]`` is the step a branch or tag points to;
    - ``traj[-1]``, a negative int, counts from the last step by number:
      ``traj[-1] == traj[traj.steps[-1]]`` (the largest step number, which is
      not necessarily the last one committed or a branch head).

    Examples
    --------
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doctest-sequence", mode="w")
    >>> for s in (0, 10, 20):
    ...     _ = traj.commit(s, {"w": np.full(2, s, np.float32)})
    >>> list(traj), len(traj), 10 in traj
    ([0, 10, 20], 3, True)
    >>> float(traj[10]["w"][0]), float(traj[-1]["w"][0]), float(traj[-3]["w"][0])
    (10.0, 20.0, 0.0)
    """

    # The trajectory owns its jobs, each an object with its own state that works on the trajectory's
    # objects, steps and refs (``_base.py``); its public methods are theirs, delegated below in the
    # order docs/api.md lists them (names and refs, read, commit, integrity, delete, gc).

    def __init__(self, io: ObjectStore, **settings):
        super().__init__(io, **settings)
        self._reads = Reader(self)
        self._committer = Committer(self)
        self._integrity = Integrity(self)
        self._deleter = Deleter(self)
        self._gc = GarbageCollector(self)

    __getitem__ = _delegate("_reads", Reader.__getitem__)
    zarr_store = _delegate("_reads", Reader.zarr_store)
    read = _delegate("_reads", Reader.read)
    read_box = _delegate("_reads", Reader.read_box)
    read_boxes = _delegate("_reads", Reader.read_boxes)
    pieces = _delegate("_reads", Reader.pieces)
    files = _delegate("_reads", Reader.files)
    read_file = _delegate("_reads", Reader.read_file)
    changes = _delegate("_reads", Reader.changes)
    change_columns = _delegate("_reads", Reader.change_columns)
    feed_layout = _delegate("_reads", Reader.feed_layout)
    fetch_blobs = _delegate("_reads", Reader.fetch_blobs)
    info = _delegate("_reads", Reader.info)
    step_document = _delegate("_reads", Reader.step_document)
    accept_step_document = _delegate("_reads", Reader.accept_step_document)
    tensors = _delegate("_reads", Reader.tensors)
    diff = _delegate("_reads", Reader.diff)
    log = _delegate("_reads", Reader.log)

    commit = _delegate("_committer", Committer.commit)
    piece_writer = _delegate("_committer", Committer.piece_writer)
    finalize = _delegate("_committer", Committer.finalize)

    verify = _delegate("_integrity", Integrity.verify)
    inventory = _delegate("_integrity", Integrity.inventory)
    stats = _delegate("_integrity", Integrity.stats)

    delete = _delegate("_deleter", Deleter.delete)
    discard = _delegate("_deleter", Deleter.discard)

    gc = _delegate("_gc", GarbageCollector.gc)
