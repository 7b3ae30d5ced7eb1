"""Types of the compiled kernels (built from ``codec_ext/_kernels.pyx``): the functions codec's Python calls.

Each has a NumPy twin of the same name in :mod:`ulstore.codec.reference`, whose docstrings
state what it computes.  Array arguments are typed memoryviews in Cython: 1-d (``[::1]``) or
2-d (``[:, ::1]``) C-contiguous buffers of the word type the name suggests; ``*_out``
arguments are written, the rest only read.  Status codes: 0 is success, negatives name the
corruption (see the callers' status tables).  Where a kernel takes words of several widths
(Cython fused types), ``x``, ``r``, ``z``, ``values`` are uint8/16/32/64 and ``sym`` uint16/32.
"""

from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ._apply_plan import ApplyPlan

_Array = NDArray[Any]  # a C-contiguous buffer of the kernel's word type
_Bytes = bytes | bytearray | memoryview | NDArray[Any]  # any bytes-like object

BACKEND: Final[str]
#: numbers the kernels share with the Python side (tests compare them with _format, _rans_tables)
CONSTANTS: Final[dict[str, Any]]
#: the version-3 ones (RAW_CHUNK, MAX_LANES; compared with _one_stream)
CONSTANTS3: Final[dict[str, int]]
#: whether this build runs the AVX2 loops of _one_stream_loops.h (the x86-64-v3 build on x86-64)
HAVE_AVX2: Final[bool]

# -- checksums -----------------------------------------------------------------------------------
def hash64(data: _Bytes) -> int: ...
def hash_sum64(data: _Bytes) -> int: ...
def hash_fill(value: int, count: int, itemsize: int) -> int: ...
def crc32(data: _Bytes, crc: int = 0) -> int: ...

# -- version 1: residual sections ------------------------------------------------------------------
def residuals(
    x: _Array, r: _Array, mant_bits: int, emask: int, token_bits: int, z_out: _Array, sym_out: _Array
) -> tuple[int, int]: ...
def histogram(sym: _Array, hist_out: _Array) -> None: ...
def context_histogram(r: _Array, mant_bits: int, emask: int, hist_out: _Array) -> int: ...
def pack_tails(sym: _Array, z: _Array, token_bits: int, tail_out: _Array) -> int: ...
def rans_encode(
    sym: _Array, table: _Array, words_out: _Array, states_out: _Array, mostly_zero: bool = False
) -> int: ...
def rans_decode(
    r: _Array,
    mant_bits: int,
    emask: int,
    ctx_rows: _Array,
    slots: _Array,
    words: _Array,
    states: _Array,
    tokens_out: _Array,
) -> int: ...
def slot_table(freqs: _Array, out: _Array) -> None: ...
def unpack_tails(tokens: _Array, tail: _Array, tail_bits: int, z_out: _Array) -> int: ...
def reconstruct(r: _Array, values: _Array) -> int: ...
def pack_table(q: _Array, out: _Array) -> int: ...
def read_table(data: _Array, n_rows: _Array, scale_bits: int, q_out: _Array) -> int: ...
def normalize_rows(q: _Array, scale_bits: int, freqs_out: _Array) -> None: ...
def encoder_table(rows: _Array, freqs: _Array, scale_bits: int, token_bits: int, out: _Array) -> None: ...
def table_model(
    counts: _Array, token_bits: int, alphabet: int, pool_below: int, scale_bits: int, rows_out: _Array, q_out: _Array
) -> int: ...

# -- SPARSE payloads (versions 2 and 4) ------------------------------------------------------------
def sparse_split(z: _Array, sym: _Array, gaps_out: _Array, gsym_out: _Array, z_out: _Array, sym_out: _Array) -> int: ...
def gap_gather(gaps: _Array, r: _Array, pos_out: _Array, r_out: _Array) -> int: ...
def sum_update(r: _Array, pos: _Array, values: _Array) -> int: ...
def scatter(dst: _Array, pos: _Array, values: _Array) -> int: ...
def sparse_decode(
    r: _Array,
    mant_bits: int,
    emask: int,
    pool_below: int,
    g_table: _Array,
    g_states: _Array,
    g_words: _Array,
    g_tail: _Array,
    g_tail_bits: int,
    g_alphabet: int,
    t_table: _Array,
    t_states: _Array,
    t_words: _Array,
    t_tail: _Array,
    t_tail_bits: int,
    t_alphabet: int,
    pos_out: _Array,
    values_out: _Array,
    sum_out: _Array,
) -> int: ...
def ef_encode(pos: _Array, n: int, out: _Array) -> int: ...
def ef_positions(lo: _Array, hi: _Array, n: int, pos_out: _Array) -> int: ...
def sparse_decode_ef(
    r: _Array,
    mant_bits: int,
    emask: int,
    pool_below: int,
    lo: _Array,
    hi: _Array,
    t_table: _Array,
    t_states: _Array,
    t_words: _Array,
    t_tail: _Array,
    t_tail_bits: int,
    t_alphabet: int,
    pos_out: _Array,
    values_out: _Array,
    sum_out: _Array,
) -> int: ...

# -- version 3: one-stream sections -----------------------------------------------------------------
def intra_symbols(x: _Array, sym_shift: int, sym_mask: int, sym_out: _Array) -> int: ...
def rans_encode3(
    v: _Array,
    sym: _Array,
    mode: int,
    p_a: int,
    p_b: int,
    table: _Array,
    lanes: int,
    phases: int,
    words_out: _Array,
    states_out: _Array,
    mostly_zero: bool = False,
) -> int: ...
def rans_decode3(
    r: _Array,
    mode: int,
    p_a: int,
    p_b: int,
    p_c: int,
    mant_bits: int,
    emask: int,
    slots: _Array,
    lut: _Array,
    lanes: int,
    phases: int,
    words: _Array,
    states: _Array,
    out: _Array,
    hashes_out: _Array,
) -> int: ...
def decode3(
    blob: _Bytes,
    start: int,
    end: int,
    out: _Array | None,
    ref: _Array | None,
    intra: bool,
    width: int,
    mant_bits: int,
    exp_bits: int,
    token_bits: int,
    alphabet: int,
    emask: int,
    n: int,
) -> tuple[int, _Array | None, int, int]: ...
def pack_table3(
    has_band: int, band_count: int, band_lo: int, freqs: _Array, scales: _Array, orders: _Array, out: _Array
) -> int: ...
def read_table3(
    data: _Array, has_band: int, n_ctx: int, alphabet: int, max_tokens: int, band_out: _Array, freqs_out: _Array
) -> int: ...
def slot_table3(freqs: _Array, rank_mode: int, slots_out: _Array, lut_out: _Array) -> None: ...
def quantize_rows3(
    counts: _Array, cost_table: _Array, freqs_out: _Array, f12_out: _Array, scales_out: _Array, orders_out: _Array
) -> int: ...

# -- SPARSE blobs applied in place (_apply.pxi) -------------------------------------------------------
#: (status, failed blob, positions, new words, old words, starts, target word sums)
_Result = tuple[int, int, NDArray[np.int64], _Array, _Array, list[int], list[int]]

class SparseApply:
    def __init__(
        self,
        plan: ApplyPlan,
        write: bool,
        buffers: tuple[_Array, _Array, _Array] | None = None,
        order: Any = None,
        crc: bool = False,
    ) -> None: ...
    def work(self) -> None: ...
    def join(self, seconds: float = 2e-4) -> bool: ...
    def finish(self) -> _Result: ...

def sparse_apply(plan: ApplyPlan, write: bool, buffers: tuple[_Array, _Array, _Array] | None = None) -> _Result: ...
def mixsum_simd(enable: bool | None = None) -> bool: ...
def mix_diff_sum(a: _Array, b: _Array) -> int: ...
