"""The DCP ``StorageReader``: any step read as a DCP checkpoint, at any world size and sharding.

``read_metadata`` describes each tensor of the step as ONE chunk covering the whole tensor,
whatever pieces the step stores it in; DCP's resharding then asks for exactly the box each
local shard needs (one ReadItem per local shard and tensor), and ``read_data`` assembles that
box from the overlapping pieces (``Trajectory.read_box``).  Non-tensor leaves come from the
step's ``dcp/objects/...`` files, as the ``torch.save`` bytes DCP wrote.
"""

from __future__ import annotations

import io
import math
import uuid

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..codec import TORCH_VIA_INT
from ..core.torch import dtype_table, to_tensor
from ..errors import ConflictError, InvalidInputError, TensorNotFoundError
from ..store import Trajectory
from ._checkpoint_step import METADATA_FILE, TrajectoryEndpoint, decode_metadata, step_of

__all__ = ["Reader"]

#: a rank's boxes are read in groups of about this many bytes (one read_boxes call, one group's destinations resolved at a time)
GROUP_BYTES = 256 << 20


class Reader(TrajectoryEndpoint, StorageReader):
    """A DCP storage reader for one step of a ulstore trajectory.

    Parameters
    ----------
    url : str, os.PathLike or Trajectory
    step : int or str, optional
        The step to load (``dcp.load(..., checkpoint_id=N)`` sets it too); a ref name, or
        None for the head of ``branch`` (default ``"main"``).
    **open_options
        Passed to :func:`ulstore.open` (``storage_options``, ``threads``, ...).
    """

    _mode = "r"

    def __init__(self, url, step=None, *, branch: str | None = None, **open_options):
        super().__init__()
        self._traj = url if isinstance(url, Trajectory) else None
        self.url = None if self._traj is not None else url
        self.open_options = open_options
        self.step = step if step is None or isinstance(step, str) and not step.isdigit() else step_of(step)
        self.branch = branch
        self.load_id = uuid.uuid4().hex
        self._step: int | None = None  # the step this load reads (resolved in read_metadata)
        self._objects: dict[str, str] = {}

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self):
        return self.step

    def read_metadata(self, *args, **kwargs) -> Metadata:
        traj = self.trajectory
        step = self.step if self.step is not None else self.branch or "main"
        self._step = step = traj.resolve(step)
        torch_dtypes = dtype_table(torch)
        md: dict = {}
        for name, (shape, dtype) in traj.tensors(step).items():
            if dtype not in torch_dtypes:
                raise InvalidInputError(f"dtype {dtype} has no torch equivalent", step=step, tensor=name)
            size = torch.Size(shape)
            md[name] = TensorStorageMetadata(
                TensorProperties(dtype=torch_dtypes[dtype]),
                size,
                [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)],
            )
        planner_data, self._objects = None, {}
        if METADATA_FILE in traj.files(step):
            planner_data, self._objects = decode_metadata(traj.read_file(step, METADATA_FILE), step=step)
        for fqn in self._objects:
            md[fqn] = BytesStorageMetadata()
        meta = StorageMeta(checkpoint_id=str(step), load_id=self.load_id)
        return Metadata(md, planner_data=planner_data, storage_data={"step": step}, storage_meta=meta)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        data = metadata.storage_data
        if not isinstance(data, dict) or data.get("step") != self._step:
            raise InvalidInputError("metadata given to the ulstore Reader did not come from its read_metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan.storage_data = self._step
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = sorted({p.storage_data for p in plans})
        if len(steps) > 1:
            raise ConflictError(
                f"ranks resolved {self.branch or 'main'!r} to different steps {steps} (a save moved it during "
                "the load); pass step=N"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        traj, step = self.trajectory, self._step
        tensors = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(traj.read_file(step, self._objects[fqn])))
                continue
            base = item.storage_index.offset or ()
            offset = tuple(a + b for a, b in zip(base, item.storage_offsets)) if base else tuple(item.storage_offsets)
            tensors.append((item, offset))
        specs = traj.tensors(step)
        for group in _groups(tensors, specs):
            self._read_group(group, planner, specs)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_group(self, group: list, planner: LoadPlanner, specs: dict) -> None:
        """Read one group's boxes with one ``read_boxes`` call, straight into the destination tensors where
        their memory can take the stored values as they are (CPU, same dtype), else into arrays copied in."""
        traj, step = self.trajectory, self._step
        boxes, outs, dests = [], [], []
        for item, offset in group:
            fqn = item.storage_index.fqn
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.size()) != tuple(item.lengths):
                raise InvalidInputError(
                    f"box {list(offset)}+{list(item.lengths)} is read into a destination of {list(dest.size())}",
                    step=step,
                    tensor=fqn,
                )
            if fqn not in specs:
                raise TensorNotFoundError("the load plan names a tensor the step does not have", step=step, tensor=fqn)
            dtype = specs[fqn][1]
            view = _numpy_view(dest, dtype)
            boxes.append((fqn, offset, tuple(item.lengths)))
            outs.append(view if view is not None else np.empty(tuple(item.lengths), dtype))
            dests.append((item, dest, view is None))
        traj.read_boxes(step, boxes, out=outs)
        for (item, dest, copy), value in zip(dests, outs):
            if copy:
                dest.copy_(to_tensor(value))
            planner.commit_tensor(item, dest)


def _numpy_view(tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray | None:
    """A writable numpy array sharing ``tensor``'s memory (strides and all) with the stored ``dtype``, or None
    when its values must be converted or moved (another dtype, another device, conjugate or negative bits)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_conj() or tensor.is_neg():
        return None
    if dtype_table(torch).get(dtype) != tensor.dtype:
        return None
    via = TORCH_VIA_INT.get(str(tensor.dtype))
    view = tensor.view(getattr(torch, via[0])).numpy().view(via[1]) if via is not None else tensor.numpy()
    return view if view.dtype == dtype and view.flags.writeable else None


def _groups(tensors: list, specs: dict):
    """The rank's boxes in groups of about GROUP_BYTES (so that a planner whose ``resolve_tensor`` allocates
    holds one group's destinations at a time)."""
    group: list = []
    size = 0
    for item, offset in tensors:
        group.append((item, offset))
        spec = specs.get(item.storage_index.fqn)
        size += math.prod(item.lengths) * (spec[1].itemsize if spec is not None else 1)
        if size >= GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group
