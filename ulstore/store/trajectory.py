"""The :class:`Trajectory`: commit checkpoints as steps, read any step back, exactly.

Read me first
-------------
- A step is immutable and appears atomically: its blobs are written first,
  its manifest (``steps/<step>/zarr.json``) last, by conditional create.  A
  crashed commit leaves only unreferenced blobs, which :meth:`Trajectory.gc`
  removes; a retry of the same step rewrites the same blobs (their names are
  their hashes) and succeeds.
- A chunk is coded against the co-located chunk of the *parent* step when the
  tensor kept its shape and dtype; a chunk whose content did not change reuses
  the parent's manifest entry verbatim (no new blob).  Every ``anchor_every``
  steps along the chain, a step is a full anchor: all chunks intra-coded (or
  reused from an intra entry), so no read walks back further.
- Refs (``main``, ``rl-run-2``) are small mutable JSON objects, last writer
  wins.  Steps themselves are never overwritten, except by :meth:`delete`,
  which rewrites the manifests of steps that referenced the deleted one (one
  PUT each, contents unchanged).

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
import datetime as _dt
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import (
    ConflictError,
    CorruptManifestError,
    DtypeError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    ReadOnlyError,
    StepExistsError,
    StepNotFoundError,
)
from ..core.objects import ObjectStore
from ..core.sealed import canonical_json
from ..core.torch import from_tensor, is_tensor
from ._chunkcodec import ULPACK, codec_for, content_digest, encode_chunk
from ._layout import (
    BLOBS_DIR,
    REFS_DIR,
    ROOT_META,
    STEPS_DIR,
    STEPS_META,
    blob_key,
    check_ref_name,
    check_step,
    check_tensor_names,
    choose_chunks,
    ref_key,
    step_key,
)
from ._logical import LogicalStore
from ._manifest import FORMAT, Entry, Manifest, TensorManifest
from ._reader import DEFAULT_CACHE_BYTES, ChunkReader
from ._zarr_dtypes import register as _register_zarr_dtypes

__all__ = ["open", "Trajectory", "StepInfo", "VerifyReport", "HEAD", "DEFAULT_ANCHOR_EVERY", "DEFAULT_CHUNK_BYTES"]

#: Default distance between full anchors along a chain (bounds a read to 16 blobs per chunk).
DEFAULT_ANCHOR_EVERY = 16
#: Default chunk size: big enough that S3 request latency is amortised, small enough for lazy slices.
DEFAULT_CHUNK_BYTES = 4 << 20
#: Default main branch.
MAIN = "main"

_MODES = ("r", "r+", "a", "w", "w-", "x")


class _Head:
    def __repr__(self) -> str:
        return "HEAD"


#: ``parent=HEAD`` (the default of :meth:`Trajectory.commit`): the head of the branch.
HEAD = _Head()


@dataclass(frozen=True)
class StepInfo:
    """What :meth:`Trajectory.log` reports about one step."""

    step: int
    parent: int | None
    anchor_distance: int
    created: str
    metadata: dict = field(default_factory=dict)


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


def open(
    url,
    mode: str = "a",
    *,
    storage_options: dict | None = None,
    anchor_every: int | None = None,
    chunk_bytes: int | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    executor: cf.Executor | None = None,
    threads: int | None = None,
) -> "Trajectory":
    """Open (or create) the trajectory at ``url``.

    Parameters
    ----------
    url : str or os.PathLike
        Any fsspec URL (``s3://bucket/run-7``, ``memory://x``, ``gs://...``) or a
        local path.
    mode : {"r", "r+", "a", "w", "w-"}, default "a"
        ``"r"`` read only, must exist; ``"r+"`` read/write, must exist; ``"a"``
        read/write, created if missing; ``"w"`` create, **deleting** anything
        at ``url``; ``"w-"`` (or ``"x"``) create, fail if it exists.
    storage_options : dict, optional
        Passed to the fsspec filesystem (credentials, endpoint, ...).
    anchor_every : int, optional
        A full intra-coded step every ``anchor_every`` steps along a chain (0:
        only the root).  Stored at creation; passing it to an existing
        trajectory changes it for this session's commits only.
    chunk_bytes : int, optional
        Target chunk size for new tensors (a tensor keeps its chunk grid along
        its chain).  Stored at creation like ``anchor_every``.
    cache_bytes : int
        Budget of the decoded-chunk cache.
    executor : concurrent.futures.Executor, optional
        Where commits encode chunks (e.g. ``distributed.Client.get_executor()``);
        default: a thread pool.
    threads : int, optional
        Threads for I/O and (without ``executor``) encoding; default: CPU count.

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
        Bad ``mode`` or settings, or ``url`` holds a Zarr hierarchy that is not a trajectory.

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
    url = os.fspath(url)
    io = ObjectStore.from_url(url, storage_options)
    if mode == "w":
        io.remove_tree()
    raw = io.get(ROOT_META)
    if raw is None:
        if mode in ("r", "r+"):
            raise NotFoundError(f"no trajectory at {url!r} (open with mode='a' or 'w' to create one)", key=ROOT_META)
        settings = _new_settings(anchor_every, chunk_bytes)
        try:
            io.create(ROOT_META, canonical_json(_group({"ulstore": settings})))
        except FileExistsError:  # another process created it just now: use theirs
            raw = io.get(ROOT_META)
        else:
            io.put(STEPS_META, canonical_json(_group({})))
    if raw is not None:
        if mode in ("w-", "x"):
            raise ConflictError(f"a trajectory already exists at {url!r}", key=ROOT_META)
        settings = _parse_settings(raw)
    if anchor_every is not None:
        settings["anchor_every"] = _check_positive("anchor_every", anchor_every, zero=True)
    if chunk_bytes is not None:
        settings["chunk_bytes"] = _check_positive("chunk_bytes", chunk_bytes)
    return Trajectory(
        io, url=url, read_only=mode == "r", anchor_every=settings["anchor_every"],
        chunk_bytes=settings["chunk_bytes"], cache_bytes=cache_bytes, executor=executor, threads=threads,
    )


def _group(attributes: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def _check_positive(name, value, zero=False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise InvalidInputError(f"{name} must be an int >= {0 if zero else 1}, got {value!r}")
    return value


def _new_settings(anchor_every, chunk_bytes) -> dict:
    return {
        "format": FORMAT,
        "anchor_every": DEFAULT_ANCHOR_EVERY if anchor_every is None else _check_positive("anchor_every", anchor_every, True),
        "chunk_bytes": DEFAULT_CHUNK_BYTES if chunk_bytes is None else _check_positive("chunk_bytes", chunk_bytes),
        "blob_hash": "blake2b-256",
        "content_hash": "blake2b-128",
    }


def _parse_settings(raw: bytes) -> dict:
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptManifestError(f"root zarr.json is not JSON: {e}", key=ROOT_META) from e
    settings = doc.get("attributes", {}).get("ulstore") if isinstance(doc, dict) else None
    if not isinstance(settings, dict):
        raise InvalidInputError("this Zarr hierarchy is not a ulstore trajectory", key=ROOT_META)
    if settings.get("format") != FORMAT:
        raise CorruptManifestError(f"unsupported trajectory format {settings.get('format')!r}", key=ROOT_META)
    return dict(settings)


def _as_array(name: str, value) -> np.ndarray:
    """Accept numpy arrays/scalars, torch tensors and other ``__array__`` objects; never lists."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, np.generic):
        arr = np.asarray(value)
    elif is_tensor(value):
        arr = from_tensor(value)
    elif hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape"):
        arr = np.asarray(value)
    else:
        raise InvalidInputError(
            f"tensor values must be arrays (numpy, torch, ...), got {type(value).__name__}; "
            "wrap Python numbers and lists with np.asarray and an explicit dtype", tensor=name,
        )
    try:
        codec_for(arr.dtype)
    except DtypeError as e:
        raise DtypeError(e.message, tensor=name) from None
    return arr


def _check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    metadata = dict(metadata)
    if "ulstore" in metadata:
        raise InvalidInputError("the metadata key 'ulstore' is reserved")
    try:
        return json.loads(canonical_json(metadata))
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"metadata must be JSON-serializable (finite numbers, str, lists, dicts): {e}") from None


class Trajectory:
    """A trajectory of checkpoints: immutable steps, branches, lazy exact reads.

    Create one with :func:`ulstore.open`.  Thread-safe for reads; commits from
    several threads or processes are safe (each step is created at most once)
    but a branch moves to whichever commit wrote its ref last.
    """

    def __init__(self, io: ObjectStore, *, url: str, read_only: bool, anchor_every: int, chunk_bytes: int,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, executor=None, threads=None):
        _register_zarr_dtypes()
        self._io = io
        self.url = url
        self.read_only = read_only
        self.anchor_every = anchor_every
        self.chunk_bytes = chunk_bytes
        self._executor = executor
        self._threads = threads or max(4, os.cpu_count() or 1)
        self._reader = ChunkReader(io, cache_bytes)
        self._store = LogicalStore(self._reader)

    def __repr__(self) -> str:
        return f"<Trajectory {self.url!r} ({'read-only' if self.read_only else 'read/write'})>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Drop caches (the trajectory holds no other resources)."""
        self._reader.clear_cache()
        self._reader.forget()

    # -- names --------------------------------------------------------------------

    @property
    def steps(self) -> list[int]:
        """All committed steps, sorted (one LIST of ``steps/``)."""
        keys = self._io.find(STEPS_DIR)
        out = []
        for k in keys:
            parts = k.split("/")
            if len(parts) == 3 and parts[2] == "zarr.json" and parts[1].isdigit():
                out.append(int(parts[1]))
        return sorted(out)

    def __contains__(self, step) -> bool:
        try:
            self._resolve(step)
            return True
        except NotFoundError:
            return False

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def refs(self) -> dict[str, int]:
        """Branches and tags: name -> step."""
        out = {}
        for k in self._io.find(REFS_DIR):
            name = k[len(REFS_DIR) + 1 :]
            if name.endswith(".json") and "/" not in name:
                step = self._get_ref(name[: -len(".json")])
                if step is not None:
                    out[name[: -len(".json")]] = step
        return out

    def head(self, branch: str = MAIN) -> int | None:
        """The step ``branch`` points to (None if the branch does not exist)."""
        return self._get_ref(check_ref_name(branch))

    def _get_ref(self, name: str) -> int | None:
        key = ref_key(name)
        raw = self._io.get(key)
        if raw is None:
            return None
        try:
            return check_step(json.loads(raw)["step"])
        except Exception as e:
            raise CorruptManifestError(f"ref is damaged: {e}", key=key) from e

    def set_ref(self, name: str, step) -> None:
        """Point branch or tag ``name`` at ``step`` (creating or moving it)."""
        self._check_writable()
        step = self._resolve(step)
        self._io.put(ref_key(check_ref_name(name)), canonical_json({"step": step}))

    def delete_ref(self, name: str) -> None:
        """Remove branch or tag ``name`` (its steps stay)."""
        self._check_writable()
        self._io.delete(ref_key(check_ref_name(name)))

    def _resolve(self, step_or_ref) -> int:
        """A step number, or a ref name resolved to its step; the step must exist."""
        if isinstance(step_or_ref, str):
            step = self._get_ref(check_ref_name(step_or_ref))
            if step is None:
                raise StepNotFoundError(f"no step or ref named {step_or_ref!r}", key=ref_key(step_or_ref))
        else:
            step = check_step(step_or_ref)
        self._reader.manifest(step)  # raises StepNotFoundError
        return step

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{self.url!r} was opened with mode='r'; open with mode='a' to write")

    # -- reading ------------------------------------------------------------------

    def __getitem__(self, step_or_ref):
        """The step as a read-only, lazy :class:`zarr.Group`.

        Indexing an array fetches and decodes only the chunks it touches (and
        their reference chains).  bfloat16/fp8 arrays have their real dtype.
        """
        import zarr

        step = self._resolve(step_or_ref)
        return zarr.open_group(store=self._store, path=str(step), mode="r", zarr_format=3, use_consolidated=False)

    def read(self, step_or_ref, names=None) -> dict[str, np.ndarray]:
        """Decode whole tensors of a step (all by default) into fresh, writable arrays.

        Parameters
        ----------
        step_or_ref : int or str
        names : iterable of str, optional

        Returns
        -------
        dict of str to numpy.ndarray
            Bit-exact, original dtypes (``ml_dtypes.bfloat16`` for bf16).
        """
        return self._reader.read(self._resolve(step_or_ref), names, threads=self._threads)

    def info(self, step_or_ref) -> StepInfo:
        """Parent, anchor distance, creation time and metadata of one step."""
        m = self._reader.manifest(self._resolve(step_or_ref))
        return StepInfo(m.step, m.parent, m.anchor_distance, m.created, dict(m.metadata))

    def tensors(self, step_or_ref) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Tensor names of a step with their shape and dtype, without decoding anything."""
        m = self._reader.manifest(self._resolve(step_or_ref))
        return {k: (t.shape, t.dtype) for k, t in m.tensors.items()}

    def log(self, start=MAIN) -> list[StepInfo]:
        """The ancestry of a step or branch head, newest first, back to its root."""
        step = self._resolve(start)
        out = []
        seen = set()
        while step is not None and step not in seen:
            seen.add(step)
            m = self._reader.manifest(step)
            out.append(StepInfo(m.step, m.parent, m.anchor_distance, m.created, dict(m.metadata)))
            step = m.parent
        return out

    # -- writing ------------------------------------------------------------------

    def commit(self, step, state: Mapping, *, parent=HEAD, branch: str | None = None, metadata=None,
               anchor: bool | None = None, executor: cf.Executor | None = None) -> int:
        """Store ``state`` as a new, immutable ``step``.

        Parameters
        ----------
        step : int
            The new step's number; must not exist.
        state : Mapping of str to array
            Tensor name -> numpy array / torch tensor.  Names may contain ``/``
            (nested groups), dots and any unicode.  Do not modify the arrays
            during the call.
        parent : int, str or None, default HEAD
            The step this one derives from: by default the head of ``branch``;
            any existing step (or ref name) to branch off it; None for a new root.
        branch : str, optional
            Ref to advance to ``step`` (default ``"main"``).  A branch is only
            moved if it points at ``parent`` or does not exist yet; with the
            default branch and another ``parent``, the step is committed
            without moving any ref.
        metadata : dict, optional
            JSON-serializable; becomes the step group's attributes.
        anchor : bool, optional
            None: follow ``anchor_every``.  True: make this step a full anchor
            (every chunk intra-coded).  False: forbid intra coding: every float
            tensor must be delta-coded against the parent, so a new tensor or a
            shape or dtype change raises InvalidInputError instead of silently
            starting a new chain.
        executor : concurrent.futures.Executor, optional
            Overrides the trajectory's executor for this commit.

        Returns
        -------
        int
            ``step``.

        Raises
        ------
        StepExistsError
            ``step`` exists, or another writer created it during this commit.
        StepNotFoundError
            ``parent`` does not exist.
        InvalidInputError, DtypeError
            A value is not an array, a name or metadata is invalid, or ``anchor=False``
            and a tensor cannot be delta-coded.
        ConflictError
            ``branch`` was given and points at a step other than ``parent``.
        ReadOnlyError
            The trajectory was opened with mode="r".
        """
        self._check_writable()
        step = check_step(step)
        if not isinstance(state, Mapping):
            raise InvalidInputError(f"state must be a mapping of tensor name to array, got {type(state).__name__}")
        check_tensor_names(state.keys())
        arrays = {name: _as_array(name, v) for name, v in state.items()}
        metadata = _check_metadata(metadata)
        if self._io.exists(step_key(step)):
            raise StepExistsError("step already exists; steps are immutable", step=step, key=step_key(step))

        branch_given = branch is not None
        branch = check_ref_name(branch if branch_given else MAIN)
        head = self._get_ref(branch)
        if parent is HEAD:
            parent = head
        elif parent is not None:
            parent = self._resolve(parent)
        pm = self._reader.manifest(parent) if parent is not None else None
        if branch_given and head is not None and head != parent:
            raise ConflictError(
                f"branch {branch!r} is at step {head}, not at parent {parent}; "
                "pass parent=None/HEAD or another branch name", step=step, key=ref_key(branch),
            )
        move_branch = head is None or head == parent

        if anchor is False and pm is None:
            raise InvalidInputError("anchor=False needs a parent to delta-code against", step=step)
        if anchor is True or pm is None:
            is_anchor = True
        elif anchor is False:
            is_anchor = False
        else:
            is_anchor = self.anchor_every > 0 and pm.anchor_distance + 1 >= self.anchor_every
        plan = self._plan(step, arrays, pm, is_anchor, anchor is False)
        tensors = self._encode(plan, pm, is_anchor, executor or self._executor)
        manifest = Manifest(
            step=step,
            parent=parent,
            anchor_distance=0 if is_anchor else pm.anchor_distance + 1,
            tensors=tensors,
            metadata=metadata,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        )
        try:
            # the commit point: conditional create, so of two writers exactly one wins
            self._io.create(step_key(step), manifest.to_bytes())
        except FileExistsError:
            raise StepExistsError("another writer committed this step first", step=step, key=step_key(step)) from None
        if move_branch:
            self._io.put(ref_key(branch), canonical_json({"step": step}))
        return step

    def _plan(self, step, arrays, pm: Manifest | None, is_anchor: bool, strict: bool) -> dict:
        """Per tensor: (array, codec, chunks, parent tensor or None if it cannot be a reference)."""
        plan = {}
        for name, arr in arrays.items():
            codec = codec_for(arr.dtype)
            pt = pm.tensors.get(name) if pm is not None else None
            same = pt is not None and pt.shape == arr.shape and pt.dtype == arr.dtype
            if strict and not same and codec == ULPACK:
                why = "is new" if pt is None else f"changed from {pt.dtype}{list(pt.shape)} to {arr.dtype}{list(arr.shape)}"
                raise InvalidInputError(
                    f"tensor {why}, which needs an intra-coded chunk, but anchor=False forbids it; "
                    "commit with anchor=None or anchor=True", step=step, tensor=name,
                )
            chunks = pt.chunks if same else choose_chunks(arr.shape, arr.dtype.itemsize, self.chunk_bytes)
            plan[name] = (arr, codec, chunks, pt if same else None)
        return plan

    def _encode(self, plan: dict, pm: Manifest | None, is_anchor: bool, executor) -> dict[str, TensorManifest]:
        """Encode and write every changed chunk; returns the new tensor manifests."""
        entries: dict[str, list] = {}
        jobs = []
        for name, (arr, codec, chunks, pt) in plan.items():
            tm = TensorManifest(arr.shape, arr.dtype, chunks, codec, ())
            entries[name] = [None] * math.prod(tm.grid)
            jobs += [(name, i, coord) for i, coord in enumerate(tm.coords())]
        parent = pm.step if pm is not None else None
        reader, io = self._reader, self._io

        def run(job):
            name, i, coord = job
            arr, codec, chunks, pt = plan[name]
            tm = TensorManifest(arr.shape, arr.dtype, chunks, codec, ())
            # ascontiguousarray makes 0-d arrays 1-d: restore the chunk's own shape
            region = np.ascontiguousarray(arr[tm.region(coord)]).reshape(tm.region_shape(coord))
            content = content_digest(region)
            pe = pt.entry(coord) if pt is not None else None
            # unchanged: reuse the parent's entry, no new blob (an anchor only reuses intra entries)
            if pe is not None and pe.content == content and (not is_anchor or pe.ref is None):
                return name, i, pe
            ref_step = parent if pe is not None and codec == ULPACK and not is_anchor else None
            ref = reader.chunk(parent, name, coord) if ref_step is not None else None
            if executor is None:
                blob, digest = encode_chunk(region, ref, codec)
            else:
                blob, digest = executor.submit(encode_chunk, region, ref, codec).result()
            io.put(blob_key(digest), blob)
            # keep a copy: the next commit codes against it without a decode
            reader.remember((content, arr.dtype.str, region.shape), np.array(region, copy=True))
            return name, i, Entry(digest, ref_step, content)

        _run_bounded(run, jobs, self._threads, entries)
        return {
            name: TensorManifest(arr.shape, arr.dtype, chunks, codec, tuple(entries[name]))
            for name, (arr, codec, chunks, _) in plan.items()
        }

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
                    {"key": e.key, "step": e.step if e.step is not None else s, "tensor": e.tensor or tensor,
                     "error": type(e).__name__, "message": str(e)}
                )

        if step is None:
            for name in list(self._io.find(REFS_DIR)):
                try:
                    self._get_ref(name[len(REFS_DIR) + 1 : -len(".json")])
                except IntegrityError as e:
                    note(e, None)
        seen_blobs = set()
        for s in steps:
            try:
                m = fresh.manifest(s)
            except IntegrityError as e:
                note(e, s)
                continue
            report.steps += 1
            for name, t in m.tensors.items():
                for coord in t.coords():
                    report.chunks += 1
                    seen_blobs.add(t.entry(coord).blob)
                    try:
                        fresh.chunk(s, name, coord)
                    except IntegrityError as e:
                        note(e, s, name)
                    except NotFoundError as e:  # a reference step is gone
                        note(CorruptManifestError(f"reference is missing: {e}", step=s, tensor=name, key=step_key(s)), s)
        report.blobs = len(seen_blobs)
        if bad and raise_on_error:
            first = next(iter(bad.values()))
            listing = "; ".join(f"{d['key']}: {d['error']}" for d in report.errors)
            raise type(first)(f"verify found {len(bad)} damaged object(s): {listing}", step=first.step,
                              tensor=first.tensor, key=first.key)
        return report

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
        steps = self.steps
        manifest_bytes = raw = chunks = 0
        for s in steps:
            data = self._io.get(step_key(s)) or b""
            manifest_bytes += len(data)
            m = self._reader.manifest(s)
            raw += sum(t.nbytes for t in m.tensors.values())
            chunks += sum(len(t.entries) for t in m.tensors.values())
        blobs = self._io.find(BLOBS_DIR, detail=True)
        blob_bytes = sum(int(info.get("size") or 0) for info in blobs.values())
        stored = blob_bytes + manifest_bytes
        return {
            "steps": len(steps),
            "chunks": chunks,
            "blobs": len(blobs),
            "blob_bytes": blob_bytes,
            "manifest_bytes": manifest_bytes,
            "stored_bytes": stored,
            "raw_bytes": raw,
            "ratio": raw / stored if stored else float("nan"),
            "manifest_bytes_per_chunk": manifest_bytes / chunks if chunks else float("nan"),
        }

    # -- retention ----------------------------------------------------------------

    def delete(self, step) -> None:
        """Delete ``step``; every other step stays readable, exactly.

        Chunks of other steps coded against ``step`` are re-encoded against
        ``step``'s own reference (its parent's chunk, or intra), and steps whose
        parent was ``step`` are re-parented to ``step``'s parent; each such
        manifest is rewritten with a single PUT.  Refs pointing at ``step`` move
        to its parent (or are removed if it had none).  Blobs are not removed:
        run :meth:`gc`.

        Not safe while another process commits a child of ``step``.
        """
        self._check_writable()
        step = self._resolve(step)
        dead = self._reader.manifest(step)
        io, reader = self._io, self._reader
        for s in self.steps:
            if s == step:
                continue
            m = reader.manifest(s)
            stale = [(name, i, coord) for name, t in m.tensors.items()
                     for i, coord in enumerate(t.coords()) if t.entries[i].ref == step]
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

            _run_bounded(recode, stale, self._threads, new_entries)
            rewritten = Manifest(
                step=m.step,
                parent=dead.parent if m.parent == step else m.parent,
                anchor_distance=m.anchor_distance,
                tensors={name: TensorManifest(t.shape, t.dtype, t.chunks, t.codec, tuple(new_entries[name]))
                         for name, t in m.tensors.items()},
                metadata=m.metadata,
                created=m.created,
            )
            io.put(step_key(s), rewritten.to_bytes())  # contents unchanged: one atomic PUT
            reader.forget([s])
        for name, target in self.refs.items():
            if target == step:
                if dead.parent is None:
                    io.delete(ref_key(name))
                else:
                    io.put(ref_key(name), canonical_json({"step": dead.parent}))
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
        live = set()
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


def _run_bounded(fn, jobs: list, threads: int, entries: dict) -> None:
    """Run ``fn`` over ``jobs`` on ``threads`` threads, at most ``2 * threads`` in flight.

    Bounding the window bounds memory: each job holds one chunk (and its
    reference) until its blob is written.  ``fn`` returns ``(name, i, entry)``.
    """
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            name, i, e = fn(job)
            entries[name][i] = e
        return
    with cf.ThreadPoolExecutor(threads) as pool:
        pending = set()
        it = iter(jobs)
        try:
            for job in it:
                pending.add(pool.submit(fn, job))
                if len(pending) >= 2 * threads:
                    done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    for f in done:
                        name, i, e = f.result()
                        entries[name][i] = e
            for f in cf.as_completed(pending):
                name, i, e = f.result()
                entries[name][i] = e
        except BaseException:
            for f in pending:
                f.cancel()
            raise
