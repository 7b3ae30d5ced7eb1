"""One rANS-coded stream of tokens and raw tails: the building block of every coded payload.

A *section* codes ``n`` unsigned words ``z`` (residuals, or gaps between changed
elements) as tokens under static per-context tables, plus their raw low bits:

    scale bits | table size | table | 4 lane states | word count | words | tail bits | tail

The dense RANS mode is one section over every element; the SPARSE mode is two
(gaps, then the changed elements' residuals).  See ``docs/format.md``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from ..errors import CorruptBlobError
from . import _format as F
from ._dtypes import FloatFormat
from ._rans_tables import ENC_ENTRY, POOL_BELOW, SCALE_BITS, STATE_LOW, sum_rows, table_rows
from ._scratch import scratch

__all__ = ["encode_section", "decode_section", "read_fields", "check_v1_intra_size", "Fields", "STATUS", "TABLE_STATUS"]

# Status codes the kernels return, and what they mean for the user.
STATUS = {
    -1: "the rANS word stream ends early",
    -2: "the raw-tail bitstream does not match the decoded lengths",
    -3: "the rANS lanes do not end in their initial state",
    -5: "the rANS word stream has words left over",
    -6: "a changed position lies past the end of the tensor",
    -7: "a changed element has a zero residual",
    -8: "out of memory",
    -9: "the kernel was called with inconsistent arguments",
    -10: "the changed positions are not an Elias-Fano coding of ascending positions",
}

_LANE_STATES = struct.Struct(f"<{F.LANES}I")

TABLE_STATUS = {
    -1: "it is truncated",
    -2: "a value is out of range",
    -3: "it names a token beyond the alphabet",
    -4: "a row has no tokens",
    -5: "it has trailing bytes",
}


def encode_section(k, fmt: FloatFormat, z, sym, counts, emask: int) -> list:
    """Code words ``z`` with symbols ``sym`` (``context << token_bits | token``).

    ``counts`` is the symbols' histogram.  Returns the section as a list of
    bytes-like parts; some are views of this thread's scratch buffers, valid
    until its next call.
    """
    n = z.size
    zeros = int(counts[:: 1 << fmt.token_bits].sum())  # token 0 of every context
    scale_bits = SCALE_BITS
    rows = np.empty(emask + 1, dtype=np.int64)
    q = np.empty((emask + 2, fmt.alphabet), dtype=np.int64)
    q = q[: k.table_model(counts, fmt.token_bits, fmt.alphabet, POOL_BELOW, scale_bits, rows, q)]
    freqs = np.empty(q.shape, dtype=np.uint32)
    k.normalize_rows(q, scale_bits, freqs)
    table = scratch("encoder table", (emask + 1) * ENC_ENTRY.itemsize << fmt.token_bits, np.uint8)
    k.encoder_table(rows, freqs, scale_bits, fmt.token_bits, table)
    words = scratch("words", n + 1, np.uint16)  # one spare slot: see kernels.enc_put
    states = np.empty(F.LANES, dtype=np.uint32)
    n_words = k.rans_encode(sym, table, words, states, zeros * 16 > 15 * n)
    tail = scratch("tail", n * (fmt.width - 3) // 8 + 16, np.uint8)
    tail_bits = k.pack_tails(sym, z, fmt.token_bits, tail)
    head = bytearray((scale_bits,))
    table_bytes = np.zeros(len(q) * (2 + 5 * fmt.alphabet), dtype=np.uint8)
    n_bytes = (k.pack_table(np.ascontiguousarray(q, dtype=np.int64), table_bytes) + 7) // 8
    F.write_varint(head, n_bytes)
    head += table_bytes[:n_bytes].tobytes()
    head += states.astype("<u4").tobytes()
    F.write_varint(head, n_words)
    middle = bytearray()
    F.write_varint(middle, tail_bits)
    # the kernels work in the machine's byte order, which ulstore requires to be little-endian
    return [head, words[n + 1 - n_words :].view(np.uint8), middle, tail[: (tail_bits + 7) // 8]]


class Fields(NamedTuple):
    """A section's parts, as read (and range-checked) from a blob."""

    table: np.ndarray  # uint8 table bit string
    states: np.ndarray  # uint32[4] final lane states
    words: np.ndarray  # uint8 view of the 16-bit rANS words
    tail: np.ndarray  # uint8 raw tail bytes
    tail_bits: int


def read_fields(rd: F.Reader, n: int, fmt: FloatFormat) -> Fields:
    """Read the fields of a section of ``n`` words of ``fmt``'s width (nothing is decoded)."""
    scale_bits = rd.u8("scale bits")
    if scale_bits != SCALE_BITS:
        raise CorruptBlobError(f"ULPack blob declares a {scale_bits}-bit scale; the format uses {SCALE_BITS}")
    table = np.frombuffer(rd.take(rd.varint("table size", limit=1 << 24), "table"), dtype=np.uint8)
    raw_states = rd.take(4 * F.LANES, "lane states")
    if not all(STATE_LOW <= x < 1 << 31 for x in _LANE_STATES.unpack(raw_states)):  # plain ints: 4 values
        raise CorruptBlobError("ULPack blob has an rANS lane state out of range")
    n_words = rd.varint("word count", limit=n)
    words = np.frombuffer(rd.take(2 * n_words, "rANS words"), dtype=np.uint8)
    tail_bits = rd.varint("tail bit count", limit=n * (fmt.width - 3))
    raw_tail = rd.take((tail_bits + 7) // 8, "raw tail")
    if tail_bits % 8 and raw_tail[-1] >> (tail_bits % 8):
        raise CorruptBlobError("ULPack blob has non-zero padding bits after its raw tail")
    states = np.frombuffer(raw_states, dtype="<u4").copy()  # aligned: the kernels read them as uint32_t
    return Fields(table, states, words, np.frombuffer(raw_tail, dtype=np.uint8), tail_bits)


def status_error(status: int) -> CorruptBlobError:
    """The error for a kernel's non-zero status (table statuses arrive as status - 100)."""
    if status <= -100:
        what = TABLE_STATUS.get(status + 100, f"status {status + 100}")
        return CorruptBlobError(f"ULPack blob table is corrupt: {what}")
    return CorruptBlobError(f"ULPack blob is corrupt: {STATUS.get(status, f'status {status}')}")


def decode_section(k, fmt: FloatFormat, rd: F.Reader, r, emask: int, n_c, out=None) -> np.ndarray:
    """Read a section of ``len(r)`` words whose contexts come from reference words ``r``.

    ``n_c`` counts the elements of each context (it fixes the table rows, which
    the blob never names).  Returns the coded words ``z``: a new array, or
    ``out`` (``len(r)`` contiguous words of ``fmt.word``) filled in place.
    """
    n = len(r)
    f = read_fields(rd, n, fmt)
    rows = table_rows(n_c)
    row_n = sum_rows(n_c, n_c)
    q = np.zeros((len(row_n), fmt.alphabet), dtype=np.int64)
    status = k.read_table(f.table, row_n, SCALE_BITS, q)
    if status:
        raise status_error(status - 100)
    freqs = np.empty(q.shape, dtype=np.uint32)
    k.normalize_rows(q, SCALE_BITS, freqs)
    # first slot entry of each context's row; contexts absent from the reference are never read
    ctx_rows = (np.maximum(rows, 0) << SCALE_BITS).astype(np.int32)
    slots = scratch("slots", len(freqs) << SCALE_BITS, np.uint32)
    k.slot_table(freqs, slots)
    tokens = scratch("tokens", n, np.uint8)
    status = k.rans_decode(r, fmt.mant_bits, emask, ctx_rows, slots, f.words, f.states, tokens)
    z = np.empty(n, dtype=fmt.word) if out is None else out
    if not status:
        status = k.unpack_tails(tokens, f.tail, f.tail_bits, z)
    if status:
        raise status_error(status)
    return z


def check_v1_intra_size(k, fmt: FloatFormat, header: F.Header, rd: F.Reader, verify) -> None:
    """Refuse a version-1 intra RANS blob whose declared size its payload cannot code,
    before anything of that size is allocated (see ``_one_stream.decode_section3``); ``verify(hash64)``
    checks a constant tensor's values from their hash alone."""
    n = header.size
    peek = F.Reader(rd.buf, rd.pos, rd.end)
    fields = read_fields(peek, n, fmt)
    q = np.zeros((1, fmt.alphabet), dtype=np.int64)
    if k.read_table(fields.table, np.array([n], dtype=np.int64), SCALE_BITS, q):
        return  # the decoder reports the damage, and allocates nothing of size n first
    present = np.flatnonzero(q[0])
    n_words = len(fields.words) // 2
    if len(present) == 1:  # one token: every element has the same residual
        t = int(present[0])
        nb = max((t >> 2) - 1, 0)
        if nb:
            if n * nb != fields.tail_bits:
                raise CorruptBlobError(
                    f"ULPack blob declares {n} elements but its raw tail holds {fields.tail_bits // nb}"
                )
        else:  # a constant tensor: check its values from their hash alone
            w = fmt.width
            key = ((1 << (w - 1)) + ((t >> 1) ^ -(t & 1))) & ((1 << w) - 1)
            verify(k.hash_fill(key & ~(1 << (w - 1)) if key >> (w - 1) else ~key & ((1 << w) - 1), n, w // 8))
    elif n > 46000 * (F.LANES + n_words):
        raise CorruptBlobError(f"ULPack blob declares {n} elements, more than its payload can code")
