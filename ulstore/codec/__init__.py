"""ULPack: lossless delta coding of one floating-point tensor against a reference.

The codec layer: pure functions of their arguments, no I/O, no knowledge of
stores.  It imports only :mod:`ulstore.errors` and its own modules.

Public API (re-exported by :mod:`ulstore`): :func:`encode`, :func:`decode`,
:func:`decode_changes` / :class:`Changes`, :func:`content_sum`,
:func:`encode_many` / :func:`decode_many`, :func:`inspect_blob`,
:func:`model_entropy_bits`, :func:`header_bound`, the backend switch
(:func:`backend`, :func:`set_backend`, :func:`available_backends`) and the
numcodecs codec :class:`ULPack` (entry point ``ulstore.codec:ULPack``).

Three parts: this package's modules (the Python API: validation, formats, tables), the
NumPy reference in :mod:`ulstore.codec.reference`, and the compiled kernels, built from
the top-level ``codec_ext/`` into ``ulstore.codec._kernels*``.  Both kernel backends
give the same bytes; :mod:`._backend` picks one.

Modules, top to bottom (each imports only those below it)::

    _sparse_apply.py       apply_sparse: a version's SPARSE blobs applied in place, all or nothing
    _decode_blobs.py       decode_blobs: many blobs decoded into the caller's buffers (the kernel entered there)
    _apply_plan.py         ApplyPlan: what one apply job is given (blobs, arrays, the format's numbers)
    _analysis.py           inspect_blob (header fields, bytes per part), model_entropy_bits
    _changed_elements.py   decode_changes / Changes: a delta as the elements it changes
    _api.py                encode / decode of one tensor (blob <-> array)
    _batch.py              encode_many / decode_many on a thread pool
    _numcodecs.py          ULPack, the numcodecs codec
    _sparse.py             SPARSE payloads: positions + residuals of the changed elements
    _elias_fano.py         version-4 SPARSE positions: the Elias-Fano coding (and its NumPy decoder)
    _one_stream.py         version-3 RANS and INTRA payloads: one-stream sections (tokens and raw
                           bits through one rANS state), band rows, table choices
    _section.py            version-1 sections: table, lane states, words, raw tails
    _format.py             the blob bytes: header, CRC, bounds-checked reader (versions 1 to 4)
    _rans_tables.py        rANS frequency tables (integer arithmetic, shared by both backends)
    _dtypes.py             the six float formats and exact bit views (numpy, ml_dtypes, torch)
    _backend.py            which kernels run: compiled (_kernels*.so) or the NumPy reference
    reference/             the NumPy twin of every kernel (the executable specification, and
                           the ``numpy`` backend's namespace); its docstring lists its modules
    _checksum.py           finishing and folding the word-sum checksum
    _scratch.py            per-thread reusable buffers

The compiled kernels (``codec_ext/``)::

    _kernels.pyx               nogil loops over typed memoryviews, built twice: ``_kernels`` (any
                               CPU) and ``_kernels_x86_64_v3`` (from _kernels_x86_64_v3.pyx); includes
    _one_stream.pxi            version-3 (one-stream) kernels
    _one_stream_loops.h        their C loops (AVX2 in the x86-64-v3 build, portable C in both)
    _apply.pxi                 the in-place SPARSE apply job
    _constants.pxi             numbers shared with the Python side (_format, _rans_tables)
    _crc32.h, _mixsum.h        the blob CRC-32 (PCLMULQDQ where the CPU has it), the word-sum mix
"""

from ._analysis import inspect_blob, model_entropy_bits
from ._api import HEADER_BOUND, decode, decode_into, encode
from ._backend import available_backends, backend, set_backend
from ._batch import decode_many, encode_many
from ._changed_elements import Changes, content_sum, decode_changes
from ._decode_blobs import decode_blobs
from ._dtypes import TORCH_VIA_INT, format_of, tensor_to_numpy
from ._format import header_bound
from ._numcodecs import ULPack
from ._sparse import SPARSE_ALWAYS_UP_TO, SPARSE_MAX_FRACTION
from ._sparse_apply import Applied, ApplyPlan, apply_sparse, is_sparse_blob, reserve_buffers, target_meta, undo

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
    "decode_blobs",
    "is_sparse_blob",
    "apply_sparse",
    "ApplyPlan",
    "Applied",
    "target_meta",
    "reserve_buffers",
    "undo",
    # when a delta is coded SPARSE (the store prices a delta it has not encoded yet by them)
    "SPARSE_MAX_FRACTION",
    "SPARSE_ALWAYS_UP_TO",
]
