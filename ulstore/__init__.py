"""ulstore: a lossless, content-addressed store for checkpoint trajectories, built on ULPack.

``encode``/``decode`` code one tensor against a reference; :mod:`ulstore.codec`
holds the codec and the numcodecs ``ulpack`` codec.
"""
from ._backend import available_backends, backend, set_backend
from ._format import header_bound
from .codec import ULPack, decode, decode_many, encode, encode_many, inspect_blob, model_entropy_bits
from .errors import *  # noqa: F401,F403  (the error tree is public API)
from .errors import __all__ as _errors_all

__version__ = "0.1.0"

__all__ = [
    "encode",
    "decode",
    "encode_many",
    "decode_many",
    "inspect_blob",
    "model_entropy_bits",
    "header_bound",
    "ULPack",
    "backend",
    "set_backend",
    "available_backends",
    *_errors_all,
]
from .store import Trajectory, open  # noqa: E402
__all__ += ["open", "Trajectory"]
