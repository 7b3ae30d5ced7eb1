"""The trajectory store: checkpoints as immutable, delta-coded, content-addressed Zarr steps.

:func:`open` returns a :class:`Trajectory`.  Layers, one way only::

    trajectory.py   Trajectory, open: commit / read / delete / gc / verify
    _logical.py     read-only zarr Store presenting steps as plain arrays
    _reader.py      manifests + reference walking + decoded-chunk LRU
    _manifest.py    the per-step manifest (JSON, checksummed)
    _chunkcodec.py  one chunk <-> one blob (ULPack or Zstd), hashes
    _blobs.py       keyed objects over fsspec, conditional create
    _layout.py      keys, names, chunk shapes
    _zarr_dtypes.py bfloat16 / fp8 as zarr data types

The store imports :mod:`ulstore.codec`; the codec never imports the store.
"""
from .trajectory import HEAD, StepInfo, Trajectory, VerifyReport, open

__all__ = ["open", "Trajectory", "StepInfo", "VerifyReport", "HEAD"]
