"""ULPack: lossless delta coding of one floating-point tensor against a reference.

The codec layer: pure functions of their arguments, no I/O, no knowledge of
stores.  It imports only :mod:`ulstore.errors` and its own modules.

Public API (re-exported by :mod:`ulstore`): :func:`encode`, :func:`decode`,
:func:`decode_changes` / :class:`Changes`, :func:`content_sum`,
:func:`encode_many` / :func:`decode_many`, :func:`inspect_blob`,
:func:`model_entropy_bits`, :func:`header_bound`, the backend switch
(:func:`backend`, :func:`set_backend`, :func:`available_backends`) and the
numcodecs codec :class:`ULPack` (entry point ``ulstore.codec:ULPack``).

Modules, top to bottom (each imports only those below it)::

    _inplace.py     apply_sparse: a version's SPARSE blobs applied in place, all or nothing
    _analysis.py    inspect_blob, model_entropy_bits
    _changes.py     decode_changes / Changes: a delta as the elements it changes
    _api.py         encode / decode of one tensor (blob <-> array)
    _batch.py       encode_many / decode_many on a thread pool
    _numcodecs.py   ULPack, the numcodecs codec
    _sparse.py      SPARSE payloads: positions + residuals of the changed elements
    _elias_fano.py  version-4 SPARSE positions: the Elias-Fano coding (and its NumPy decoder)
    _section3.py    version-3 RANS and INTRA payloads: one stream, band rows, table choices
    _section.py     version-1 sections: table, lane states, words, raw tails
    _format.py      the blob bytes: header, CRC, bounds-checked reader (versions 1 to 4)
    _tables.py      rANS frequency tables (integer arithmetic, shared by both backends)
    _dtypes.py      the six float formats and exact bit views (numpy, ml_dtypes, torch)
    _backend.py     which kernels run: compiled (_kernels*.so) or the NumPy twin
    _kernels.pyx    compiled nogil loops (built twice: _kernels, _kernels_v3); includes
                    _kernels3.pxi (version 3), _apply.pxi (in-place SPARSE apply),
                    _simd3.h (C loops, AVX2 in _kernels_v3)
                    and _crc32.h (the blob CRC-32, PCLMULQDQ when the CPU has it)
    _reference.py   the NumPy twin of every kernel (the executable specification, and
                    the ``numpy`` backend's namespace), gathered from the modules below
    _reference_sparse.py   its SPARSE twins: split, gaps, word-sum update, decode (versions 2 and 4)
    _reference_apply.py    its twin of the in-place SPARSE apply
    _reference3_tables.py  its version-3 table twins: pack, read, slots, scale choice
    _reference3.py  its version-3 twins: intra symbols, the one-stream rANS
    _reference1.py  its version-1 twins: residuals, rANS, raw tails, tables
    _reference_hash.py     its checksum twins: hash64, hash_sum64, hash_fill
    _checksum.py    finishing and folding the word-sum checksum
    _scratch.py     per-thread reusable buffers
"""
from ._analysis import inspect_blob, model_entropy_bits
from ._api import HEADER_BOUND, decode, decode_into, encode
from ._backend import available_backends, backend, set_backend
from ._batch import decode_many, encode_many
from ._changes import Changes, content_sum, decode_changes
from ._dtypes import TORCH_VIA_INT, format_of, tensor_to_numpy
from ._format import header_bound
from ._inplace import Applied, apply_sparse, is_sparse_blob, reserve_buffers, target_meta, undo
from ._numcodecs import ULPack

__all__ = [
    "ULPack",
    "encode",
    "decode",
    "encode_many",
    "decode_many",
    "decode_changes",
    "Changes",
    "content_sum",
    "inspect_blob",
    "model_entropy_bits",
    "header_bound",
    "HEADER_BOUND",
    "backend",
    "set_backend",
    "available_backends",
    # the door for the layers above (store, sync): exact bit views, decoding into a buffer, in-place apply
    "format_of",
    "tensor_to_numpy",
    "TORCH_VIA_INT",
    "decode_into",
    "is_sparse_blob",
    "apply_sparse",
    "Applied",
    "target_meta",
    "reserve_buffers",
    "undo",
]
