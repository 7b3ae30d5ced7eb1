"""Pure-NumPy ULPack kernels: the executable specification, and the ``numpy`` backend.

Every kernel has a compiled twin in ``codec_ext/`` (``_kernels.pyx`` and the files it
includes) with the same signature and byte-identical results; tests hold the two to that.
The element-wise stages are vectorised; the rANS loops are inherently serial and run in
plain Python (slow, but short and obviously right).  This package is the namespace the
backend switch hands out (``kernels().<name>``); the twins live in modules by job:

    _hashes.py              hash64, hash_sum64, hash_fill (checksums)
    _residual_sections.py   version 1: residuals, rANS, raw tails, tables
    _sparse_payloads.py     SPARSE payloads: split, gaps, word-sum update, decode
    _apply_job.py           a version's SPARSE deltas applied in place (twin of _apply.pxi)
    _one_stream_rans.py     version 3 (one-stream sections): intra symbols, the one-stream rANS
    _one_stream_tables.py   version 3 tables: pack, read, slots, scale choice

Conventions shared with the compiled kernels
--------------------------------------------
* ``x``, ``r``: target and reference as unsigned w-bit words (intra: ``r`` all zero,
  i.e. +0.0).
* residual ``z = zigzag(key(x) - key(r))``; token ``t``: ``nb = max(bitlen(z) - 3, 0)``,
  ``t = (z >> nb) + 4 nb``; ``tail = z & (2**nb - 1)`` is stored raw.  ``t`` determines
  (b, q1, q2) and vice versa.
* context of element i: ``(r_i >> mant_bits) & emask`` (emask 0 drops conditioning);
  symbol ``sym = context << token_bits | t``.
* rANS: 4 lanes, element i on lane ``i % 4``; states in [2**15, 2**31); 16-bit words.
"""

from __future__ import annotations

from ._apply_job import SparseApply, sparse_apply
from ._hashes import hash64, hash_fill, hash_sum64
from ._one_stream_rans import intra_symbols, rans_decode3, rans_encode3
from ._one_stream_tables import decode3, pack_table3, quantize_rows3, read_table3, slot_table3
from ._residual_sections import (
    context_histogram,
    encoder_table,
    histogram,
    normalize_rows,
    pack_table,
    pack_tails,
    rans_decode,
    rans_encode,
    read_table,
    reconstruct,
    residuals,
    slot_table,
    table_model,
    unpack_tails,
)
from ._sparse_payloads import (
    ef_encode,
    ef_positions,
    gap_gather,
    scatter,
    sparse_decode,
    sparse_decode_ef,
    sparse_split,
    sum_update,
)

__all__ = [
    "BACKEND",
    "hash64",
    "hash_sum64",
    "residuals",
    "histogram",
    "context_histogram",
    "pack_tails",
    "rans_encode",
    "rans_decode",
    "slot_table",
    "unpack_tails",
    "reconstruct",
    "pack_table",
    "read_table",
    "normalize_rows",
    "encoder_table",
    "table_model",
    "sparse_split",
    "gap_gather",
    "sum_update",
    "scatter",
    "sparse_decode",
    "ef_encode",
    "ef_positions",
    "sparse_decode_ef",
    "sparse_apply",
    "SparseApply",
    # format version 3
    "intra_symbols",
    "rans_encode3",
    "rans_decode3",
    "decode3",
    "pack_table3",
    "read_table3",
    "slot_table3",
    "hash_fill",
    "quantize_rows3",
]

BACKEND = "numpy"
