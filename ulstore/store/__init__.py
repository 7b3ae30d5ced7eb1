"""The trajectory store: checkpoints as immutable, delta-coded, content-addressed Zarr steps.

:func:`open` returns a :class:`Trajectory`.  Layers, one way only::

    trajectory.py   open, settings; Trajectory = the job mixins below
    _read.py        reading: lazy zarr groups, whole tensors, info, log
    _commit.py      commit: plan chunks, encode changed ones, blobs, then the manifest
    _integrity.py   verify, stats
    _retention.py   delete (re-encoding dependants), gc
    _base.py        state, steps and refs every job stands on
    _pool.py        the bounded thread pool chunks are encoded on
    _logical.py     read-only zarr Store presenting steps as plain arrays
    _reader.py      manifests + reference walking + decoded-chunk LRU: where a chunk is decoded
    _manifest.py    the per-step manifest (JSON, checksummed)
    _chunkcodec.py  one chunk <-> one blob (ULPack or Zstd), hashes
    _layout.py      keys, names, chunk shapes
    _zarr_dtypes.py bfloat16 / fp8 as zarr data types

Objects go through :class:`ulstore.core.objects.ObjectStore`.  The store
imports :mod:`ulstore.codec` and :mod:`ulstore.core`, never io, sync or the CLI.
"""

from ._integrity import Inventory
from .trajectory import HEAD, StepInfo, Trajectory, VerifyReport, open

__all__ = ["open", "Trajectory", "StepInfo", "VerifyReport", "Inventory", "HEAD"]
