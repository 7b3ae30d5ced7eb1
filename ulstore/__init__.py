"""ulstore: a lossless, content-addressed store for checkpoint trajectories, built on ULPack.

- :func:`open` a trajectory (a Zarr v3 hierarchy on any fsspec filesystem), commit
  steps, read any step lazily: :mod:`ulstore.store`.
- :func:`encode` / :func:`decode` one tensor against a reference, and the numcodecs
  codec ``ulpack``: :mod:`ulstore.codec`.
- Checkpoint files in and out: :mod:`ulstore.io` (files: :mod:`ulstore.io.checkpoints`).
- Weight sync for asynchronous RL: :mod:`ulstore.sync`.
- Sharded saves through ``torch.distributed.checkpoint``: :mod:`ulstore.dcp`.

Every subpackage (:mod:`ulstore.store`, :mod:`ulstore.codec`, :mod:`ulstore.io`,
:mod:`ulstore.sync`, :mod:`ulstore.dcp`, :mod:`ulstore.cli`, :mod:`ulstore.toytrain`) and every public
name (``ulstore.open``, ``ulstore.encode``...) is an attribute of ``ulstore`` that loads on first use
(PEP 562): ``import ulstore`` imports only the error tree, so ``ulstore --help`` starts at once, and
``ulstore.dcp.Writer`` works without ``import ulstore.dcp``.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

from .errors import *  # noqa: F401,F403  (the error tree is public API)
from .errors import __all__ as _errors_all

if TYPE_CHECKING:
    from .codec import (
        Changes,
        ULPack,
        available_backends,
        backend,
        content_sum,
        decode,
        decode_changes,
        decode_many,
        encode,
        encode_many,
        header_bound,
        inspect_blob,
        model_entropy_bits,
        set_backend,
    )
    from .store import Trajectory, open, upgrade

__version__ = "0.1.0"

__all__ = [
    "open",
    "upgrade",
    "Trajectory",
    "encode",
    "decode",
    "encode_many",
    "decode_many",
    "decode_changes",
    "content_sum",
    "Changes",
    "inspect_blob",
    "model_entropy_bits",
    "header_bound",
    "ULPack",
    "backend",
    "set_backend",
    "available_backends",
    *_errors_all,
]

_SUBMODULES = ("io", "sync", "dcp", "toytrain", "cli", "store", "codec", "core")
#: the public names and the subpackage each comes from, imported on first use: ``ulstore --help`` and
#: ``import ulstore.errors`` then cost no codec import (ml_dtypes alone is ~0.3 s of a cold start)
_LAZY = {
    name: "store" if name in ("open", "upgrade", "Trajectory") else "codec"
    for name in __all__
    if name not in _errors_all
}


def __getattr__(name):
    # the heavier submodules load on first use: ``import ulstore`` stays light (no torch)
    if name in _SUBMODULES:
        return _importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        value = getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module 'ulstore' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES) | set(_LAZY))
