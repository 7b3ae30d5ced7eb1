"""The DCP ``StorageWriter``: each rank's shards become pieces of one step; the coordinator finalizes.

Read me first
-------------
- DCP calls, per save: ``reset(checkpoint_id)`` (only when ``dcp.save`` is given a
  ``checkpoint_id``), then on every rank ``set_up_storage_writer`` and ``prepare_local_plan``,
  on the coordinator ``prepare_global_plan``, on every rank ``write_data``, and on the
  coordinator ``finish`` -- only if every rank's ``write_data`` returned.
- The coordinator decides the parent once (``prepare_global_plan``) and sends it to every rank
  in its plan, so all ranks code against the same step even if the branch moves meanwhile.
- ``write_data`` runs one store piece writer: every SHARD/TENSOR item is a piece (a box of the
  tensor at its global offset); non-tensor items (BYTE_IO, ``torch.save`` bytes) travel to the
  coordinator in the results and become step files.  Results carry the piece records.
- ``finish`` is the store's finalize: table blocks, files, then the step document by
  conditional create (the commit point), then the ref.  Nothing before it is visible.
- A reused ``Writer`` keeps its trajectory open, and the trajectory keeps the pieces this rank
  wrote last: the next save codes against them in memory.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import io
import math
import uuid

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..core.torch import from_tensor
from ..errors import InvalidInputError, StepExistsError
from ..store import HEAD, PieceRecord, Trajectory, tensor_name_problem
from ._checkpoint_step import METADATA_FILE, TrajectoryEndpoint, encode_metadata, object_file, step_of

__all__ = ["Writer"]


@dataclasses.dataclass(frozen=True)
class _Save:
    """The coordinator's decision for one save, sent to every rank in its plan."""

    step: int
    parent: int | None


@dataclasses.dataclass(frozen=True)
class _Object:
    """A non-tensor leaf: its ``torch.save`` bytes, on their way to the coordinator."""

    data: bytes


class Writer(TrajectoryEndpoint, StorageWriter):
    """A DCP storage writer that saves each ``dcp.save`` as one step of a ulstore trajectory.

    Parameters
    ----------
    url : str, os.PathLike or Trajectory
        The trajectory (created if missing), or an open :class:`~ulstore.store.Trajectory`.
    step : int, optional
        The step the next save creates; ``dcp.save(..., checkpoint_id=N)`` sets it too.
    parent : int, str or None, default HEAD
        What each save codes against: by default the head of ``branch`` when the save starts.
    branch : str, optional
        The ref each save advances (default ``"main"``), as for ``Trajectory.commit``.
    metadata : dict, optional
        JSON step metadata for the next saves (assign ``writer.metadata`` between saves).
    anchor, snapshot, executor
        As for ``Trajectory.commit`` (``executor``: where chunks are encoded, e.g.
        ``distributed.Client.get_executor()``).
    **open_options
        Passed to :func:`ulstore.open` (``storage_options``, ``threads``, ``keep_parent``,
        ``chunk_bytes``, ``pack_bytes``, ``anchor_every``, ...).

    Notes
    -----
    Reuse one ``Writer`` per process for every save: it keeps the pieces this rank wrote last
    in memory, so the next save codes against them without reading anything.

    Examples
    --------
    >>> import torch, torch.distributed.checkpoint as dcp, ulstore, tempfile, warnings
    >>> from ulstore.dcp import Writer, Reader
    >>> url = tempfile.mkdtemp()
    >>> w = Writer(url)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # "torch.distributed is not initialized": one process
    ...     _ = dcp.save({"w": torch.arange(6.0).reshape(2, 3), "epoch": 3}, storage_writer=w, checkpoint_id=0)
    ...     state = {"w": torch.zeros(2, 3), "epoch": 0}
    ...     dcp.load(state, storage_reader=Reader(url, step=0))
    >>> state["epoch"], float(ulstore.open(url)[0]["w"][1, 2])
    (3, 5.0)
    """

    _mode = "a"

    def __init__(
        self,
        url,
        step: int | None = None,
        *,
        parent=HEAD,
        branch: str | None = None,
        metadata: dict | None = None,
        anchor: bool | None = None,
        snapshot: bool = False,
        executor: cf.Executor | None = None,
        **open_options,
    ):
        super().__init__()
        self._traj = url if isinstance(url, Trajectory) else None
        self.url = None if self._traj is not None else url
        self.open_options = open_options
        self.step = None if step is None else step_of(step)
        self.parent, self.branch, self.metadata = parent, branch, metadata
        self.anchor, self.snapshot, self.executor = anchor, snapshot, executor
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex

    # -- pickling (async_save with a process executor ships the writer to another process) ----

    # -- the StorageWriter protocol ---------------------------------------------------------

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> int | None:
        """The step the next save creates."""
        return self.step

    def storage_meta(self) -> StorageMeta | None:
        """The step this save creates (as ``checkpoint_id``) and this writer's save id, for the planner's records."""
        return StorageMeta(checkpoint_id=None if self.step is None else str(self.step), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if not kwargs.get("use_collectives", True):
            raise InvalidInputError(
                "ulstore.dcp needs dcp.save(use_collectives=True): one coordinator makes each step visible"
            )
        if self.step is None:
            raise InvalidInputError("no step to save: pass checkpoint_id=N to dcp.save (or Writer(url, step=N))")
        self.is_coordinator = is_coordinator
        self.trajectory  # noqa: B018 -- open (or fail) on every rank before planning

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                why = tensor_name_problem(item.index.fqn)
                if why is not None:
                    raise InvalidInputError(f"{why}; rename this state dict entry", tensor=item.index.fqn)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        traj, step = self.trajectory, self.step
        assert step is not None
        if step in traj:
            raise StepExistsError("step already exists; steps are immutable", step=step)
        if self.parent is HEAD:
            parent = traj.head(self.branch or "main")
        elif self.parent is None:
            parent = None
        else:
            parent = traj.resolve(self.parent)
        decision = _Save(step, parent)
        return [dataclasses.replace(p, storage_data=decision) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        decision = plan.storage_data
        if not isinstance(decision, _Save):
            raise InvalidInputError("the save plan carries no ulstore decision (was prepare_global_plan skipped?)")
        writer = self.trajectory.piece_writer(
            decision.step,
            parent=decision.parent,
            branch=self.branch,
            anchor=self.anchor,
            snapshot=self.snapshot,
            executor=self.executor,
        )
        results: list[WriteResult] = []
        pieces: list[tuple[WriteItem, tuple[int, ...], int]] = []
        try:
            for item in plan.items:
                data = planner.resolve_data(item) if item.type == WriteItemType.BYTE_IO else None
                if isinstance(data, io.BytesIO):
                    raw = data.getvalue()
                    results.append(WriteResult(item.index, len(raw), _Object(raw)))
                    continue
                td = item.tensor_data
                if td is None:
                    raise InvalidInputError(
                        f"DCP write item of type {item.type.name} holds no tensor", tensor=item.index.fqn
                    )
                offset, box, shape = tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size)
                if math.prod(box) == 0 and math.prod(shape) != 0:
                    results.append(WriteResult(item.index, 0, None))  # an empty shard: nothing of the tensor here
                    continue
                tensor = planner.resolve_data(item)
                if not isinstance(tensor, torch.Tensor):
                    raise InvalidInputError(
                        f"the planner resolved a {type(tensor).__name__}, not a tensor", tensor=item.index.fqn
                    )
                tensor = tensor.detach()
                writer.write(item.index.fqn, from_tensor(tensor), offset=offset, shape=shape)
                pieces.append((item, offset, tensor.numel() * tensor.element_size()))
            records = writer.close()
        except BaseException:
            writer.abort()
            raise
        by_box = {(r.name, tuple(r.offset)): r for r in records}
        for item, offset, nbytes in pieces:
            results.append(WriteResult(item.index, nbytes, by_box[(item.index.fqn, offset)]))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: list[PieceRecord] = []
        files: dict[str, bytes] = {}
        objects: dict[str, str] = {}
        for rank_results in results:
            for r in rank_results:
                if isinstance(r.storage_data, PieceRecord):
                    records.append(r.storage_data)
                elif isinstance(r.storage_data, _Object):
                    name = objects[r.index.fqn] = object_file(r.index.fqn)
                    files[name] = r.storage_data.data
        files[METADATA_FILE] = encode_metadata(metadata.planner_data, objects)
        step_metadata = {**(self.metadata or {}), "dcp": {"world_size": len(results)}}
        assert self.step is not None
        self.trajectory.finalize(self.step, records, branch=self.branch, metadata=step_metadata, files=files)
