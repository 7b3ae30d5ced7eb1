"""ulstore: a lossless, content-addressed store for checkpoint trajectories, built on ULPack.

- :func:`open` a trajectory (a Zarr v3 hierarchy on any fsspec filesystem), commit
  steps, read any step lazily: :mod:`ulstore.store`.
- :func:`encode` / :func:`decode` one tensor against a reference, and the numcodecs
  codec ``ulpack``: :mod:`ulstore.codec`.
- Checkpoint files in and out: :mod:`ulstore.io` (files: :mod:`ulstore.io.checkpoints`).
- Weight sync for asynchronous RL: :mod:`ulstore.sync`.
- Sharded saves through ``torch.distributed.checkpoint``: :mod:`ulstore.dcp`.

The subpackages :mod:`ulstore.io`, :mod:`ulstore.sync`, :mod:`ulstore.dcp`,
:mod:`ulstore.cli` and :mod:`ulstore.toytrain` are attributes of ``ulstore``
that load on first use (PEP 562): ``import ulstore`` imports neither them nor
torch, and ``ulstore.dcp.Writer`` works without ``import ulstore.dcp``.
"""

import importlib as _importlib

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
from .errors import *  # noqa: F401,F403  (the error tree is public API)
from .errors import __all__ as _errors_all
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

_SUBMODULES = ("io", "sync", "dcp", "toytrain", "cli")


def __getattr__(name):
    # the heavier submodules load on first use: ``import ulstore`` stays light (no torch)
    if name in _SUBMODULES:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ulstore' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
