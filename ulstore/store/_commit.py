"""Committing a step: piece writers encode, the finalizer writes tables, the step document, the ref.

One code path: :meth:`CommitMixin.commit` = one :class:`PieceWriter` over the
whole state + :meth:`CommitMixin.finalize`.  Distributed writers (a DCP rank
each) run :meth:`CommitMixin.piece_writer` and hand their picklable records
to one process that calls :meth:`CommitMixin.finalize`.

Where a chunk is *encoded*: ``_writer.PieceWriter._job`` ->
``_chunkcodec.encode_chunk`` -> :func:`ulstore.codec.encode`.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import json
import math
from collections.abc import Mapping

import numpy as np

from ..core.dtypes import numpy_dtype
from ..core.sealed import canonical_json
from ..core.torch import as_numpy
from ..errors import ConflictError, DtypeError, InvalidInputError, NotFoundError, StepExistsError
from ._base import MAIN, TrajectoryBase
from ._chunkcodec import ULPACK, codec_for, content_digest, digest, zstd_compress
from ._kept import release_free_memory
from ._layout import check_file_names, check_ref_name, check_step, check_tensor_names, step_key
from ._packs import PackStream
from ._refs import RefState
from ._stepdoc import FileRef, StepDoc, TableRef
from ._tables import Piece, TensorTable, content_checksum, encode_block, pieces_problem
from ._writer import PieceRecord, PieceWriter

__all__ = ["CommitMixin", "HEAD", "TABLE_BLOCK_BYTES"]

#: Raw bytes of tensor tables gathered into one block (a lazy slice fetches one block).
TABLE_BLOCK_BYTES = 256 << 10


class _Head:
    def __repr__(self) -> str:
        return "HEAD"

    def __reduce__(self) -> str:
        return "HEAD"  # unpickles as the one HEAD (``parent is HEAD`` holds in another process)


#: ``parent=HEAD`` (the default of :meth:`Trajectory.commit`): the head of the branch.
HEAD = _Head()


def _as_array(name: str, value) -> np.ndarray:
    """Accept numpy arrays/scalars, torch tensors and other ``__array__`` objects; never lists."""
    try:
        arr = as_numpy(value, array_like=True)
    except InvalidInputError as e:  # a torch tensor with no plain data (meta, sparse)
        raise type(e)(e.message, tensor=name) from None
    if arr is None:
        raise InvalidInputError(
            f"tensor values must be arrays (numpy, torch, ...), got {type(value).__name__}; "
            "wrap Python numbers and lists with np.asarray and an explicit dtype",
            tensor=name,
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
    except RecursionError:
        raise InvalidInputError("metadata is nested too deeply to store as JSON") from None
    except (TypeError, ValueError) as e:
        raise InvalidInputError(
            f"metadata must be JSON-serializable (finite numbers, str, lists, dicts): {e}"
        ) from None


def _check_files(files) -> dict[str, bytes]:
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise InvalidInputError(f"files must map file names to bytes, got {type(files).__name__}")
    check_file_names(files)
    out = {}
    for name, data in files.items():
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInputError(f"file {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


class CommitMixin(TrajectoryBase):
    """The commit half of :class:`~ulstore.store.Trajectory`."""

    # -- the high-level commit -------------------------------------------------------

    def commit(
        self,
        step,
        state: Mapping,
        *,
        parent=HEAD,
        branch: str | None = None,
        metadata=None,
        anchor: bool | None = None,
        executor: cf.Executor | None = None,
        files: Mapping[str, bytes] | None = None,
        snapshot: bool = False,
        sparse: bool = False,
    ) -> int:
        """Store ``state`` as a new, immutable ``step``.

        Parameters
        ----------
        step : int
            The new step's number; must not exist.
        state : Mapping of str to array
            Tensor name -> numpy array / torch tensor (memory-mapped arrays are
            read one chunk window at a time).  Names may contain ``/`` (nested
            groups), dots and any unicode, not ``\\``.  Do not modify the
            arrays during the call.
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
        files : Mapping of str to bytes, optional
            Small non-tensor files kept with the step (``config.json``,
            tokenizer files): content-hashed, Zstd-compressed, deduplicated.
            Read them back with :meth:`files` and :meth:`read_file`.
        snapshot : bool
            Also store an intra-coded copy (snapshot) of every delta-coded
            chunk: readers start from it instead of walking the chain.
        sparse : bool
            Code delta chunks in which at most 1/8 of the elements changed by
            position (ULPack SPARSE): a few more bytes than dense deltas, but a
            holder of the parent applies them with :func:`ulstore.decode_changes`
            in time proportional to the changes (see :meth:`changes`).

        Returns
        -------
        int
            ``step``.

        Raises
        ------
        StepExistsError
            ``step`` exists, or another writer created it during this commit.
            (Retrying a commit that was interrupted after its commit point,
            with the same state, completes it instead: the branch moves.)
        StepNotFoundError
            ``parent`` does not exist, or was deleted during the commit.
        NotFoundError
            ``parent`` is HEAD, the branch does not exist and the trajectory has
            steps: pass ``parent=None`` for a new root, or a step.
        InvalidInputError, DtypeError
            A value is not an array, a name, file or metadata is invalid, or
            ``anchor=False`` and a tensor cannot be delta-coded.
        RefMovedError
            The branch moved while committing (another writer won): re-read the
            head and retry; the message says whether the step was created.
        ConflictError
            ``branch`` was given and points at a step other than ``parent``; a
            step this commit refers to is being deleted; or an earlier commit on
            the same head created its step but never moved the branch.
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
        files_ = _check_files(files)
        ref = self._refs.read(check_ref_name(branch if branch is not None else MAIN))
        if self._io.exists(step_key(step)):
            doc = self._existing(step, parent, ref)
            return self._complete(step, doc, ref, self._state_content(doc, step, arrays, files_, metadata))
        parent, move = self._prepare(step, parent, ref, branch is not None)
        is_anchor = self._is_anchor(parent, anchor)
        if anchor is False:
            self._check_strict(step, parent, arrays)
        return self._commit(
            step,
            arrays,
            parent=parent,
            is_anchor=is_anchor,
            strict=anchor is False,
            branch=ref if move else None,
            metadata=metadata,
            files=files_,
            snapshot=snapshot,
            executor=executor or self._executor,
            sparse=sparse,
        )

    def _prepare(self, step: int, parent, ref: RefState, branch_given: bool) -> tuple[int | None, bool]:
        """Resolve ``parent`` against the branch as read (``ref``); whether the branch moves to ``step``."""
        head = ref.step
        if parent is HEAD:
            if head is None and self.steps:
                raise NotFoundError(
                    f"branch {ref.name!r} does not exist, so it has no head to commit on; pass parent=<step> "
                    "(CLI: --parent) to start it from a step, or parent=None (CLI: --root) for a new root",
                    step=step,
                    key=ref.key,
                )
            parent = head
        elif parent is not None:
            parent = self._resolve(parent)
        if branch_given and head is not None and head != parent:
            raise ConflictError(
                f"branch {ref.name!r} is at step {head}, not at parent {parent}; "
                "pass parent=None/HEAD or another branch name",
                step=step,
                key=ref.key,
            )
        return parent, head is None or head == parent

    # -- an existing step: the retry of an interrupted commit (D12) ---------------------

    def _existing(self, step: int, parent, ref: RefState) -> StepDoc:
        """``step`` exists: its document if this commit may retry one interrupted after its commit point.

        That is: ``step``'s parent is the head of the branch (as read) and the
        parent this commit asks for.  Otherwise ``StepExistsError``.
        """
        doc = self._reader.doc(step)
        wanted = ref.step if parent is HEAD else (None if parent is None else self._resolve(parent))
        if ref.step == step or doc.parent != wanted or doc.parent != ref.step:
            raise StepExistsError("step already exists; steps are immutable", step=step, key=step_key(step))
        return doc

    def _complete(self, step: int, doc: StepDoc, ref: RefState, content: str | None) -> int:
        """Finish the interrupted commit of ``step`` if ``content`` is what it stored: move the branch (D12).

        ``content`` is the logical content checksum (format 2: tensor names,
        dtypes, shapes, pieces, every chunk's BLAKE3, files, metadata) of what
        the retry would commit; any other content is refused.
        """
        if content != doc.content:
            raise StepExistsError(
                f"step already exists with different contents (parent {doc.parent}, not on branch "
                f"{ref.name!r}); steps are immutable: delete({step}) first, or use a new step number",
                step=step,
                key=step_key(step),
            )
        self._refs.move(ref, step)
        if doc.parent is not None:
            self._pending.clear(step, doc.parent)
        return step

    def _state_content(self, doc: StepDoc, step: int, arrays: dict, files: dict, metadata: dict) -> str | None:
        """The content checksum ``arrays``, ``files`` and ``metadata`` would have on ``step``'s piece grids.

        Hashes every chunk (BLAKE3), decodes nothing; None if the tensors' names,
        dtypes or shapes already differ.
        """
        stored = self._reader.tables(step)
        if set(stored) != set(arrays):
            return None
        tables = []
        for name, t in stored.items():
            arr = arrays[name]
            if arr.dtype != t.dtype or tuple(arr.shape) != t.shape:
                return None
            pieces = []
            for p in t.pieces:
                box = arr[(..., *(slice(o, o + n) for o, n in zip(p.offset, p.shape)))]
                content = np.zeros((p.n, 16), np.uint8)
                for i, coord in enumerate(p.coords()):
                    region = np.ascontiguousarray(box[p.region(coord)]).reshape(p.region_shape(coord))
                    content[i] = np.frombuffer(content_digest(region), np.uint8)
                pieces.append(Piece(p.offset, p.shape, p.chunks, content, p.ref, p.pack, p.off, p.length))
            tables.append(TensorTable(name, t.dtype, t.shape, t.codec, tuple(pieces)))
        return content_checksum(tables, {n: digest(d).hex() for n, d in files.items()}, metadata)

    def _is_anchor(self, parent: int | None, anchor: bool | None) -> bool:
        if anchor is False and parent is None:
            raise InvalidInputError("anchor=False needs a parent to delta-code against")
        if anchor is True or parent is None:
            return True
        if anchor is False:
            return False
        return self.anchor_every > 0 and self._reader.doc(parent).anchor_distance + 1 >= self.anchor_every

    def _check_strict(self, step: int, parent, arrays: dict) -> None:
        """``anchor=False``: refuse, before writing anything, tensors that would need intra blobs."""
        for name, arr in arrays.items():
            if codec_for(arr.dtype) != ULPACK:
                continue
            try:
                pt = self._reader.tensor(parent, name)
            except KeyError:
                pt = None
            if pt is None or pt.dtype != arr.dtype or pt.shape != tuple(arr.shape):
                why = (
                    "is new"
                    if pt is None
                    else f"changed from {pt.dtype}{list(pt.shape)} to {arr.dtype}{list(arr.shape)}"
                )
                raise InvalidInputError(
                    f"tensor {why}, which needs an intra-coded chunk, but anchor=False forbids it; "
                    "commit with anchor=None or anchor=True",
                    step=step,
                    tensor=name,
                )

    def _commit(
        self,
        step: int,
        arrays: dict,
        *,
        parent: int | None,
        is_anchor: bool,
        strict: bool = False,
        branch: RefState | None,
        metadata: dict,
        files: dict,
        snapshot: bool = False,
        executor=None,
        chunks: dict | None = None,
        created: str | None = None,
        sparse: bool = False,
    ) -> int:
        """One piece writer over ``arrays``, then the finalizer (holding the kept step meanwhile).

        The kept step is used only if no other writer or reader of this object
        holds it now (never wait: an unclosed piece writer must not hang a commit).
        """
        lock = self._kept.lock
        owned = self._kept.enabled and lock.acquire(blocking=False)
        kept = self._kept if owned else None
        held = kept.nbytes if kept is not None else 0
        try:
            w = self._new_writer(step, parent, is_anchor, strict, snapshot, kept, executor, sparse)
            try:
                for name, arr in arrays.items():
                    w.write(name, arr, chunks=(chunks or {}).get(name))
                records = w.flush()
                self._finalize(
                    step,
                    records,
                    parent,
                    w.stream,
                    branch=branch,
                    metadata=metadata,
                    files=files,
                    anchor=is_anchor,
                    created=created,
                )
            except BaseException:
                w.abort()
                raise
            finally:
                w._shutdown()
            if kept is not None:
                kept.retain({n: {r.layout for r in records if r.name == n} for n in arrays})
                kept.step, kept.origin = step, "commit"
                if kept.nbytes > held:  # new kept arrays: return the freed space around them
                    release_free_memory()
        finally:
            if owned:
                lock.release()
        return step

    def _new_writer(self, step, parent, is_anchor, strict, snapshot, kept, executor, sparse=False) -> PieceWriter:
        return PieceWriter(
            step=step,
            parent=parent,
            parent_content=self._reader.doc(parent).content if parent is not None else None,
            anchor=is_anchor,
            strict=strict,
            snapshot=snapshot,
            reader=self._reader,
            stream=PackStream(self._io, self.pack_bytes),
            kept=kept,
            chunk_bytes=self.chunk_bytes,
            threads=self._threads if executor is not None else self._encode_threads,
            executor=executor,
            sparse=sparse,
        )

    # -- the low-level API ------------------------------------------------------------

    def piece_writer(
        self,
        step,
        *,
        parent=HEAD,
        branch: str | None = None,
        anchor: bool | None = None,
        snapshot: bool = False,
        executor: cf.Executor | None = None,
        sparse: bool = False,
    ) -> PieceWriter:
        """A writer for pieces of tensors of ``step`` (one per process or rank); see ``docs/concepts.md``.

        ``parent``, ``branch``, ``anchor``, ``snapshot`` and ``sparse`` mean what they mean
        for :meth:`commit`; every writer of one step must be given the same.
        Use ``writer.write(name, array, offset=..., shape=...)`` per piece, then
        ``records = writer.close()``, and give every writer's records to one
        :meth:`finalize`.  This writer codes against the kept parent if no
        other writer of this trajectory object holds it.  If ``step`` exists
        because its finalize was interrupted after the commit point (its parent
        is still the branch head), a writer is made anyway: :meth:`finalize`
        of the same content then completes that commit.
        """
        self._check_writable()
        step = check_step(step)
        ref = self._refs.read(check_ref_name(branch if branch is not None else MAIN))
        if self._io.exists(step_key(step)):
            parent = self._existing(step, parent, ref).parent  # finalize completes it if the content is the same
        else:
            parent, _ = self._prepare(step, parent, ref, branch is not None)
        is_anchor = self._is_anchor(parent, anchor)
        kept = self._kept if self._kept.enabled and self._kept.lock.acquire(blocking=False) else None
        w = self._new_writer(
            step, parent, is_anchor, anchor is False, snapshot, kept, executor or self._executor, sparse
        )
        w.ref = ref
        if kept is not None:
            shutdown = w._shutdown

            def release() -> None:
                shutdown()
                if kept.lock.locked():
                    kept.lock.release()

            w._shutdown = release  # type: ignore[method-assign]
        return w

    def finalize(
        self,
        step,
        records,
        *,
        branch: str | None = None,
        metadata=None,
        files: Mapping[str, bytes] | None = None,
        writer: PieceWriter | None = None,
    ) -> int:
        """Make ``step`` visible: write its tables (and files), then its step document, then move the ref.

        Parameters
        ----------
        step : int
        records : iterable of PieceRecord
            From every piece writer of ``step`` (together they must tile each tensor exactly).
        branch, metadata, files
            As for :meth:`commit`.
        writer : PieceWriter, optional
            A still-open writer of this process: its records are added and the
            tables go into its pack (one pack for the whole commit).

        The branch moves by compare-and-swap from where it was when ``writer``
        was made (without ``writer``: when finalize starts).  If ``step``
        exists because an earlier finalize of the same records was interrupted
        after its commit point, this one completes it (moves the branch).

        Raises
        ------
        InvalidInputError
            Records disagree (step, parent, anchor, dtype, shape) or pieces do not tile a tensor.
        StepExistsError, ConflictError, RefMovedError
            As for :meth:`commit`.
        """
        self._check_writable()
        step = check_step(step)
        records = list(records)
        stream = None
        if writer is not None:
            records += writer.flush()
            stream = writer.stream
        if not records and writer is None:
            raise InvalidInputError("finalize needs the records of at least one piece writer (or the writer)")
        first = records[0] if records else writer
        parent, anchor = first.parent, first.anchor  # type: ignore[union-attr]
        name = check_ref_name(branch if branch is not None else MAIN)
        ref = writer.ref if writer is not None else None
        if ref is None or ref.name != name:
            ref = self._refs.read(name)
        metadata = _check_metadata(metadata)
        files_ = _check_files(files)
        try:
            if self._io.exists(step_key(step)):
                doc = self._existing(step, parent, ref)
                pdoc = self._reader.doc(parent) if parent is not None else None
                tables, _ = self._tables(step, records, parent, pdoc, anchor)
                content = content_checksum(tables, {n: digest(d).hex() for n, d in files_.items()}, metadata)
                if writer is not None:
                    writer.abort()  # its blobs are already in the step
                return self._complete(step, doc, ref, content)
            _, move = self._prepare(step, parent, ref, branch is not None)
            self._finalize(
                step,
                records,
                parent,
                stream or PackStream(self._io, self.pack_bytes),
                branch=ref if move else None,
                metadata=metadata,
                files=files_,
                anchor=anchor,
            )
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            if writer is not None:
                writer._shutdown()
        return step

    def _tables(self, step, records, parent, pdoc, anchor) -> tuple[list[TensorTable], list[str]]:
        """The tensor tables of ``records`` (checked, see :meth:`_gather`) and the packs they point into."""
        tensors, packs = self._gather(step, records, parent, pdoc, anchor)
        index = {p: i for i, p in enumerate(packs)}
        tables = [TensorTable(n, t[0], t[1], t[2], tuple(r.piece(index) for r in t[3])) for n, t in tensors.items()]
        return tables, packs

    def _finalize(
        self,
        step,
        records,
        parent,
        stream: PackStream,
        *,
        branch: RefState | None,
        metadata,
        files,
        anchor,
        created=None,
    ):
        """Tables and files into ``stream``, close it, then the commit point and the ref move.

        ``branch``: the branch as read before the commit (None: move no ref);
        it moves by compare-and-swap, through :meth:`Pending.publish` (which
        first refuses a commit on a step being deleted, or on a head whose
        previous commit was interrupted; see ``_pending.py``).
        """
        pdoc = self._reader.doc(parent) if parent is not None else None
        tables, packs = self._tables(step, records, parent, pdoc, anchor)
        index = {p: i for i, p in enumerate(packs)}

        def number(pid: str) -> int:
            if pid not in index:
                index[pid] = len(packs)
                packs.append(pid)
            return index[pid]

        file_refs = {}
        for name in sorted(files):
            data = files[name]
            h = digest(data).hex()
            old = pdoc.files.get(name) if pdoc is not None else None
            if old is None and pdoc is not None:
                old = next((f for f in pdoc.files.values() if f.hash == h), None)
            if old is not None and old.hash == h and pdoc is not None:
                file_refs[name] = FileRef(number(pdoc.packs[old.pack]), old.offset, old.length, old.size, h)
                continue
            same = next((f for f in file_refs.values() if f.hash == h), None)
            if same is not None:
                file_refs[name] = same
                continue
            pid, off, n = stream.append(zstd_compress(data))
            file_refs[name] = FileRef(number(pid), off, n, len(data), h)
        table_refs = []
        for block in _blocks(tables):
            raw = encode_block(block)
            pid, off, n = stream.append(raw)
            table_refs.append(TableRef(block[0].name, block[-1].name, number(pid), off, n, digest(raw).hex()))
        stream.close()
        has_delta = any(
            bool(((p.ref >= 0) & ((p.snap[:, 0] < 0) if p.snap is not None else True)).any())
            for t in tables
            for p in t.pieces
        )
        doc = StepDoc(
            step=step,
            parent=parent,
            content=content_checksum(tables, {k: f.hash for k, f in file_refs.items()}, metadata),
            parent_content=pdoc.content if pdoc is not None else None,
            anchor_distance=pdoc.anchor_distance + 1 if has_delta and pdoc is not None else 0,
            packs=tuple(packs),
            tables=tuple(table_refs),
            files=file_refs,
            metadata=metadata,
            created=created or _now(),
        )
        key = step_key(step)

        def create() -> None:  # the commit point: conditional create, so of two writers exactly one wins
            try:
                self._io.create(key, doc.to_bytes())
            except FileExistsError:
                raise StepExistsError("another writer committed this step first", step=step, key=key) from None
            self._reader.remember(doc, tables)

        refers = {int(r) for t in tables for p in t.pieces for r in np.unique(p.ref) if r >= 0}
        self._pending.publish(step, parent, refers, create, refs=self._refs, branch=branch, steps=lambda: self.steps)

    def _gather(self, step, records: list[PieceRecord], parent, pdoc, anchor) -> tuple[dict, list[str]]:
        """Check the records of one step agree and tile their tensors; group them by tensor; list their packs."""
        tensors: dict[str, tuple] = {}
        for r in records:
            if not isinstance(r, PieceRecord):
                raise InvalidInputError(f"finalize takes PieceRecords, got {type(r).__name__}")
            if (r.step, r.parent, r.anchor) != (step, parent, anchor) or r.parent_content != (
                pdoc.content if pdoc is not None else None
            ):
                raise InvalidInputError(
                    f"a record was written for step {r.step} on parent {r.parent} (anchor={r.anchor}), "
                    f"not step {step} on {parent} (anchor={anchor})",
                    step=step,
                    tensor=r.name,
                )
            dtype = numpy_dtype(r.dtype)
            t = tensors.setdefault(r.name, (dtype, tuple(r.shape), r.codec, []))
            if (t[0], t[1], t[2]) != (dtype, tuple(r.shape), r.codec):
                raise InvalidInputError("pieces of one tensor disagree on dtype or shape", step=step, tensor=r.name)
            t[3].append(r)
        check_tensor_names(tensors)
        packs: list[str] = []
        seen: set[str] = set()
        out = {}
        for name in sorted(tensors):
            dtype, shape, codec, rs = tensors[name]
            rs.sort(key=lambda r: r.offset)
            why = pieces_problem(shape, [r.layout for r in rs])
            if why is not None:
                raise InvalidInputError(f"pieces do not tile the tensor: {why}", step=step, tensor=name)
            for r in rs:
                n = math.prod(-(-s // c) for s, c in zip(r.piece_shape, r.chunks))
                if not (len(r.content) == len(r.ref) == len(r.pack) == len(r.off) == len(r.length) == n):
                    raise InvalidInputError("a record's columns do not match its chunk grid", step=step, tensor=name)
                for pid in r.packs:
                    if pid not in seen:
                        seen.add(pid)
                        packs.append(pid)
            out[name] = (dtype, shape, codec, rs)
        return out, packs


def _blocks(tables: list[TensorTable]) -> list[list[TensorTable]]:
    """Consecutive tensors (sorted by name) grouped into blocks of about ``TABLE_BLOCK_BYTES`` raw."""
    out: list[list[TensorTable]] = []
    size = 0
    for t in tables:
        n = 64 + len(t.name) + sum(24 * len(t.shape) + 45 * p.n for p in t.pieces)
        if not out or size + n > TABLE_BLOCK_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out
