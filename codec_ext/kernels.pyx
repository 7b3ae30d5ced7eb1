# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled ULPack kernels: tight nogil loops over typed memoryviews.

READ ME FIRST
-------------
* Same signatures and byte-identical results as ``ulstore/_reference.py``, the
  executable specification; the Python layer (``ulstore/codec.py``) validates
  input, allocates every buffer and builds the tables.  Nothing here allocates.
* rANS with 32-bit states kept in [L, 2**31), L = 2**15, 16-bit renormalisation.
  The upper bound is 2**31, not 2**32: the reciprocal division below is exact only
  for x < 2**31.  With S <= 15 one renormalisation step always suffices.
* Encoding runs in REVERSE element order and its words grow backwards from the
  end of ``words_out``; decoding runs forwards.  Four lanes, element i on lane
  i % 4; interleaved lanes need no signalling because both sides visit elements
  in mirrored order.
* Untrusted input: the decoder never reads outside ``words`` or ``tail`` and
  reports inconsistencies as negative status codes instead of guessing.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

BACKEND = "cython"

ctypedef fused word_t:
    uint8_t
    uint16_t
    uint32_t
    uint64_t

cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil

cdef enum:
    LANES = 4
    STATE_LOW = 1 << 15

# -- residuals -------------------------------------------------------------------
# All arithmetic in uint64 and masked to w bits: C would promote 8/16-bit words to
# (signed) int.


cdef inline uint64_t key(uint64_t u, uint64_t h, uint64_t wmask) noexcept nogil:
    # order-preserving: negative floats are complemented, positive ones get the top bit
    return (~u & wmask) if (u & h) else (u | h)


cdef inline uint64_t unkey(uint64_t k, uint64_t h, uint64_t wmask) noexcept nogil:
    return (k & ~h) if (k & h) else (~k & wmask)


cdef inline int bitlen(uint64_t z) noexcept nogil:
    return 0 if z == 0 else 64 - __builtin_clzll(z)


cdef inline uint64_t load64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)  # one unaligned load on x86/arm64 (little-endian assumed)
    return v


# -- checksum --------------------------------------------------------------------


cdef inline uint64_t mix(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return z ^ (z >> 31)


def hash64(data):
    """64-bit checksum of a byte buffer (see ``_reference.hash64`` for the definition)."""
    cdef const uint8_t[::1] b = memoryview(data).cast("B")
    cdef Py_ssize_t n = b.shape[0], j, m = n // 8
    cdef uint64_t acc = 0, salt = 0, last = 0
    cdef const uint8_t* p = &b[0] if n else NULL
    with nogil:
        for j in range(m):
            salt += <uint64_t>0x9E3779B97F4A7C15ULL
            acc += mix(load64(p + 8 * j) + salt)
        if n % 8:
            memcpy(&last, p + 8 * m, n % 8)
            salt += <uint64_t>0x9E3779B97F4A7C15ULL
            acc += mix(last + salt)
        acc = mix(acc + <uint64_t>n * <uint64_t>0xD6E8FEB86659FD93ULL)
    return acc


# -- pass 1: tokens, histogram, raw tails ----------------------------------------


def analyze(word_t[::1] x, word_t[::1] r, bint has_ref, int mant_bits, uint64_t emask,
            uint8_t[::1] tokens_out, uint64_t[:, ::1] hist_out, uint8_t[::1] tail_out):
    """Tokens, per-context token histogram and LSB-first tail bits; returns the tail bit count."""
    cdef Py_ssize_t n = x.shape[0], i
    cdef int width = sizeof(word_t) * 8
    cdef int alphabet = hist_out.shape[1]
    cdef uint64_t wmask = (<uint64_t>-1) >> (64 - width)
    cdef uint64_t h = (<uint64_t>1) << (width - 1)
    cdef uint64_t kr = h, d, z, v, tail, bitbuf = 0, ctx = 0
    cdef int b, nb, t, fill = 0
    cdef int64_t total = 0, outpos = 0
    cdef uint64_t* hist = &hist_out[0, 0]
    cdef uint8_t* out = &tail_out[0]
    with nogil:
        for i in range(n):
            if has_ref:
                v = r[i]
                kr = key(v, h, wmask)
                ctx = (v >> mant_bits) & emask
            d = (key(x[i], h, wmask) - kr) & wmask
            z = ((d << 1) ^ (0 - (d >> (width - 1)))) & wmask  # zigzag
            b = bitlen(z)
            nb = b - 3 if b > 3 else 0
            t = <int>(z >> nb) + 4 * nb
            tokens_out[i] = <uint8_t>t
            hist[ctx * alphabet + t] += 1
            if nb:
                tail = z & (((<uint64_t>1) << nb) - 1)
                total += nb
                bitbuf |= tail << fill
                if fill + nb >= 64:
                    memcpy(out + outpos, &bitbuf, 8)
                    outpos += 8
                    # fill >= 3 here because nb <= 61, so the shift is defined
                    bitbuf = tail >> (64 - fill) if fill else 0
                    fill = fill + nb - 64
                else:
                    fill += nb
        if fill:
            memcpy(out + outpos, &bitbuf, (fill + 7) // 8)
    return total


# -- pass 2: rANS encode ---------------------------------------------------------


def rans_encode(const uint8_t[::1] tokens, word_t[::1] r, bint has_ref, int mant_bits, uint64_t emask,
                const int32_t[::1] ctx_map, const uint64_t[::1] rcp, const uint32_t[::1] shift,
                const uint32_t[::1] start, const uint32_t[::1] cmpl, const uint64_t[::1] xmax,
                int alphabet, uint16_t[::1] words_out, uint32_t[::1] states_out):
    """Encode ``tokens`` in reverse; words fill ``words_out`` from its end; returns their count."""
    cdef Py_ssize_t n = tokens.shape[0], i
    cdef Py_ssize_t cap = words_out.shape[0], pos = words_out.shape[0]
    cdef uint64_t x[LANES]
    cdef uint64_t q
    cdef int64_t e, base = ctx_map[0] * alphabet
    cdef int lane
    for lane in range(LANES):
        x[lane] = STATE_LOW
    with nogil:
        i = n - 1
        while i >= 0:
            lane = i & 3
            if has_ref:
                base = <int64_t>ctx_map[(r[i] >> mant_bits) & emask] * alphabet
            e = base + tokens[i]
            if x[lane] >= xmax[e]:
                pos -= 1
                words_out[pos] = <uint16_t>(x[lane] & 0xFFFF)
                x[lane] >>= 16
            q = (x[lane] * rcp[e]) >> shift[e]
            x[lane] = x[lane] + start[e] + q * cmpl[e]
            i -= 1
    for lane in range(LANES):
        states_out[lane] = <uint32_t>x[lane]
    return cap - pos


# -- decode ----------------------------------------------------------------------


cdef inline uint64_t window(const uint8_t* tail, int64_t tail_len, int64_t bitpos) noexcept nogil:
    """At least 57 bits starting at ``bitpos``, LSB-first; bytes past the end read as 0."""
    cdef int64_t byte = bitpos >> 3, k
    cdef uint64_t w = 0
    if byte + 8 <= tail_len:
        w = load64(tail + byte)
    else:
        for k in range(8):
            if byte + k < tail_len:
                w |= (<uint64_t>tail[byte + k]) << (8 * k)
    return w >> (bitpos & 7)


cdef inline uint64_t read_bits(const uint8_t* tail, int64_t tail_len, int64_t* bitpos, int nb) noexcept nogil:
    """Next ``nb`` (1..61) tail bits; overruns are caught by the caller's final count check."""
    cdef uint64_t w = window(tail, tail_len, bitpos[0])
    if nb > 56:  # only float64 tails are this long: fetch the top bits separately
        w = (w & <uint64_t>0xFFFFFFFFULL) | (window(tail, tail_len, bitpos[0] + 32) << 32)
    bitpos[0] += nb
    return w & (((<uint64_t>1) << nb) - 1)


def decode(const uint8_t[::1] words, const uint32_t[::1] states, const uint8_t[::1] tail, int64_t tail_bits,
           word_t[::1] r, bint has_ref, int mant_bits, uint64_t emask, const int32_t[::1] ctx_map,
           const uint8_t[::1] slot2sym, const uint32_t[::1] fs, int scale_bits, int alphabet, word_t[::1] out):
    """Decode tokens, tails and values into ``out``; returns 0 or a negative status."""
    cdef Py_ssize_t n = out.shape[0], i
    cdef int width = sizeof(word_t) * 8
    cdef uint64_t wmask = (<uint64_t>-1) >> (64 - width)
    cdef uint64_t h = (<uint64_t>1) << (width - 1)
    cdef int64_t n_words = words.shape[0] // 2, pos = 0
    cdef int64_t tail_len = tail.shape[0], bitpos = 0
    cdef uint32_t mask = (1 << scale_bits) - 1
    cdef uint64_t x[LANES]
    cdef uint64_t kr = h, v, z, delta
    cdef uint32_t slot, e
    cdef int32_t c = ctx_map[0]
    cdef int t, nb, lane, status = 0
    cdef uint16_t w16
    cdef const uint8_t* wp = &words[0] if n_words else NULL
    cdef const uint8_t* tp = &tail[0] if tail_len else NULL
    for lane in range(LANES):
        x[lane] = states[lane]
    with nogil:
        for i in range(n):
            lane = i & 3
            if has_ref:
                v = r[i]
                kr = key(v, h, wmask)
                c = ctx_map[(v >> mant_bits) & emask]
                if c < 0:
                    status = -4
                    break
            slot = x[lane] & mask
            t = slot2sym[(<int64_t>c << scale_bits) + slot]
            e = fs[<int64_t>c * alphabet + t]
            x[lane] = (e >> 16) * (x[lane] >> scale_bits) + slot - (e & 0xFFFF)
            if x[lane] < STATE_LOW:
                if pos >= n_words:
                    status = -1
                    break
                memcpy(&w16, wp + 2 * pos, 2)
                x[lane] = (x[lane] << 16) | w16
                pos += 1
            nb = (t >> 2) - 1 if t >= 8 else 0
            z = <uint64_t>(t - 4 * nb) << nb
            if nb:
                z |= read_bits(tp, tail_len, &bitpos, nb)
            delta = (z >> 1) ^ (0 - (z & 1))  # unzigzag
            out[i] = <word_t>unkey((kr + delta) & wmask, h, wmask)
        if status == 0:
            if pos != n_words:
                status = -5
            elif bitpos != tail_bits:
                status = -2
            else:
                for lane in range(LANES):
                    if x[lane] != STATE_LOW:
                        status = -3
    return status
