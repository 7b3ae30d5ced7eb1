"""Reading steps: lazy zarr groups, whole tensors, step info and ancestry.

The chunk decoding itself happens in ``_reader.py`` (ChunkReader), below the
zarr ``Store`` of ``_logical.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._base import MAIN, TrajectoryBase

__all__ = ["ReadMixin", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What :meth:`Trajectory.log` reports about one step."""

    step: int
    parent: int | None
    anchor_distance: int
    created: str
    metadata: dict = field(default_factory=dict)


class ReadMixin(TrajectoryBase):
    """The read half of :class:`~ulstore.store.Trajectory`."""

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
        step: int | None = self._resolve(start)
        out = []
        seen = set()
        while step is not None and step not in seen:
            seen.add(step)
            m = self._reader.manifest(step)
            out.append(StepInfo(m.step, m.parent, m.anchor_distance, m.created, dict(m.metadata)))
            step = m.parent
        return out
