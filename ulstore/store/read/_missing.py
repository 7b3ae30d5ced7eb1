"""A tensor a reader names that the step does not have: said with the closest names it has.

The reader's own lookups (``ChunkReader.tensor``) stay cheap and terse: zarr probes
keys that do not exist all the time.  The public read methods and step groups turn
a miss into a message naming the step's closest tensor names (the step's tables are
read only then).
"""

from __future__ import annotations

import contextlib
from typing import cast

import zarr

from ...core.formatting import did_you_mean, plural
from ...errors import TensorNotFoundError
from ._logical import LogicalStore

__all__ = ["tensor_not_found", "explained", "StepGroup"]


def tensor_not_found(names, step: int, name: str) -> TensorNotFoundError:
    """The error for tensor ``name`` missing from ``step``, whose tensors are ``names``."""
    names = list(names)
    err = TensorNotFoundError(
        f"no tensor {name!r} in step {step}{did_you_mean(name, names)} "
        f"({plural(len(names), 'tensor')}: `traj.tensors({step})` lists them)"
    )
    err.step, err.tensor = step, name  # (said in the text already)
    vars(err)["_explained"] = True  # (explained() leaves it as it is)
    return err


@contextlib.contextmanager
def explained(reader, step: int):
    """Within: a TensorNotFoundError about ``step`` is raised again with the step's closest names."""
    try:
        yield
    except TensorNotFoundError as e:
        if e.tensor is None or e.step not in (None, step) or getattr(e, "_explained", False):
            raise
        raise tensor_not_found(reader.tables(step), step, e.tensor) from None


class StepGroup(zarr.Group):
    """A step's read-only :class:`zarr.Group` (what ``traj[step]`` returns): a member it does not have is a
    :class:`~ulstore.errors.TensorNotFoundError` (a ``KeyError``) naming the closest tensors it has."""

    def __getitem__(self, path: str):
        try:
            node = super().__getitem__(path)
        except (KeyError, FileNotFoundError) as e:
            if isinstance(e, TensorNotFoundError) or not isinstance(path, str):
                raise
            raise self._missing(path) from None
        return StepGroup(node._async_group) if isinstance(node, zarr.Group) else node

    def _missing(self, path: str) -> TensorNotFoundError:
        reader = cast(LogicalStore, self.store).reader
        step_part, _, prefix = self.path.strip("/").partition("/")
        name = f"{prefix}/{path}" if prefix else path
        step = int(step_part)
        return tensor_not_found(reader.tables(step), step, name)
