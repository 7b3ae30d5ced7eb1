# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled ULPack kernels: tight nogil loops over typed memoryviews.

READ ME FIRST
-------------
* Same signatures and byte-identical results as ``ulstore/_reference.py``, the
  executable specification; the Python layer (``ulstore/codec.py``) validates
  input, allocates every buffer and builds the tables.  Nothing here allocates.
* Encoding: ``residuals`` -> ``histogram`` -> (tables, in Python) -> ``pack_tails``
  and ``rans_encode``.  Decoding: ``rans_decode`` -> ``unpack_tails`` ->
  ``reconstruct``.  Passes are split so that the element-wise ones vectorise and
  the serial ones (rANS states, the tail bit cursor) stay short.
* A symbol ``sym = context << token_bits | token`` joins the reference exponent and
  the token, so one table lookup serves both.
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

ctypedef fused sym_t:
    uint16_t
    uint32_t

cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil

cdef enum:
    LANES = 4
    STATE_LOW = 1 << 15

# -- residuals -------------------------------------------------------------------
# All arithmetic in uint64 and masked to w bits: C would promote 8/16-bit words to
# (signed) int.  No branches on data: float signs and residual sizes are random in
# dense regimes, and a mispredicted branch costs more than the whole element.


cdef inline uint64_t key(uint64_t u, uint64_t h, uint64_t wmask, int width) noexcept nogil:
    # order-preserving: negative floats are complemented (u ^ all-ones), others get the top bit
    return u ^ (((0 - (u >> (width - 1))) & wmask) | h)


cdef inline uint64_t unkey(uint64_t k, uint64_t h, uint64_t wmask, int width) noexcept nogil:
    # k >= h: clear the top bit; else complement
    return k ^ ((((k >> (width - 1)) - 1) & wmask) | h)


cdef inline int bitlen(uint64_t z) noexcept nogil:
    return 64 - __builtin_clzll(z | 1)  # 1 for z == 0: same token and tail as 0 bits


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


# -- encode pass 1: residuals and symbols (element-wise) -------------------------


cdef inline int token_of(uint64_t z) noexcept nogil:
    """t = (z >> nb) + 4 nb, nb = max(bitlen(z) - 3, 0): bit length and the 2 bits below the leading one."""
    cdef int nb = bitlen(z) - 3
    nb &= ~(nb >> 31)  # max(nb, 0) without a (mispredicted) branch
    return <int>(z >> nb) + 4 * nb


def residuals(word_t[::1] x, word_t[::1] r, int mant_bits, uint32_t emask, int token_bits,
              word_t[::1] z_out, sym_t[::1] sym_out):
    """z = zigzag(key(x) - key(r)) and sym = (r's exponent & emask) << token_bits | token(z)."""
    cdef Py_ssize_t n = x.shape[0], i
    cdef int width = sizeof(word_t) * 8
    cdef uint64_t wmask = (<uint64_t>-1) >> (64 - width)
    cdef uint64_t h = (<uint64_t>1) << (width - 1)
    cdef uint64_t d
    cdef uint32_t hs = h, ws = wmask, u, v, zs, t, bits, small
    cdef float f
    cdef const word_t* px = &x[0] if n else NULL
    cdef const word_t* pr = &r[0] if n else NULL
    cdef word_t* pz = &z_out[0] if n else NULL
    cdef sym_t* ps = &sym_out[0] if n else NULL
    with nogil:
        if word_t is uint8_t or word_t is uint16_t:
            # 32-bit lane arithmetic and the token read off float(z)'s exponent and top two
            # mantissa bits (exact for z < 2**24): no clz, so this loop vectorises.
            for i in range(n):
                u = px[i]
                v = pr[i]
                zs = ((u ^ (((0 - (u >> (width - 1))) & ws) | hs)) - (v ^ (((0 - (v >> (width - 1))) & ws) | hs))) & ws
                zs = ((zs << 1) ^ (0 - (zs >> (width - 1)))) & ws
                f = <float>zs
                memcpy(&bits, &f, 4)
                small = 0 - <uint32_t>(zs < 4)  # tokens 0..3 are z itself
                t = (zs & small) | (((bits >> 21) - 512) & ~small)
                pz[i] = <word_t>zs
                ps[i] = <sym_t>((((v >> mant_bits) & emask) << token_bits) | t)
        else:
            for i in range(n):
                d = (key(px[i], h, wmask, width) - key(pr[i], h, wmask, width)) & wmask
                d = ((d << 1) ^ (0 - (d >> (width - 1)))) & wmask
                pz[i] = <word_t>d
                ps[i] = <sym_t>((<uint64_t>((pr[i] >> mant_bits) & emask) << token_bits) | token_of(d))


def histogram(sym_t[::1] sym, uint32_t[:, ::1] hist_out):
    """Add symbol counts; with 4 rows, element i counts in row i % 4 (no store-to-load chains)."""
    cdef Py_ssize_t n = sym.shape[0], i = 0
    cdef uint32_t* h0 = &hist_out[0, 0]
    cdef uint32_t* h1
    cdef uint32_t* h2
    cdef uint32_t* h3
    cdef const sym_t* ps = &sym[0] if n else NULL
    with nogil:
        if hist_out.shape[0] == 4:
            h1 = &hist_out[1, 0]
            h2 = &hist_out[2, 0]
            h3 = &hist_out[3, 0]
            while i + 4 <= n:
                h0[ps[i]] += 1
                h1[ps[i + 1]] += 1
                h2[ps[i + 2]] += 1
                h3[ps[i + 3]] += 1
                i += 4
            while i < n:
                hist_out[i & 3, ps[i]] += 1
                i += 1
        else:
            for i in range(n):
                h0[ps[i]] += 1


def context_histogram(word_t[::1] r, int mant_bits, uint32_t emask, uint32_t[:, ::1] hist_out):
    """Count reference elements per context ``(r >> mant_bits) & emask``; element i in row i % 4."""
    cdef Py_ssize_t n = r.shape[0], i = 0
    cdef const word_t* pr = &r[0] if n else NULL
    cdef uint32_t* h0 = &hist_out[0, 0]
    cdef uint32_t* h1 = &hist_out[1, 0]
    cdef uint32_t* h2 = &hist_out[2, 0]
    cdef uint32_t* h3 = &hist_out[3, 0]
    with nogil:
        while i + 4 <= n:
            h0[(pr[i] >> mant_bits) & emask] += 1
            h1[(pr[i + 1] >> mant_bits) & emask] += 1
            h2[(pr[i + 2] >> mant_bits) & emask] += 1
            h3[(pr[i + 3] >> mant_bits) & emask] += 1
            i += 4
        while i < n:
            h0[(pr[i] >> mant_bits) & emask] += 1
            i += 1


# -- encode pass 2: raw tails -----------------------------------------------------


cdef inline void put_bits(uint8_t* out, int64_t* outpos, uint64_t* buf, int* fill, uint64_t bits, int nb) noexcept nogil:
    """Append ``nb`` <= 32 bits LSB-first; flushes whole bytes with one unconditional store."""
    buf[0] |= bits << fill[0]
    fill[0] += nb
    memcpy(out + outpos[0], buf, 8)  # the caller's buffer has 8 bytes of slack
    outpos[0] += fill[0] >> 3
    buf[0] >>= fill[0] & ~7
    fill[0] &= 7


cdef inline int tail_len(int t) noexcept nogil:
    cdef int nb = (t >> 2) - 1
    return nb & ~(nb >> 31)


def pack_tails(sym_t[::1] sym, word_t[::1] z, int token_bits, uint8_t[::1] tail_out):
    """Write every residual's raw low bits, LSB-first, into ``tail_out``; returns the bit count."""
    cdef Py_ssize_t n = z.shape[0], i = 0, j
    cdef uint32_t amask = (1 << token_bits) - 1
    cdef uint64_t bitbuf = 0, tail, any_bits
    cdef int nb, fill = 0
    cdef int64_t outpos = 0, total = 0
    cdef uint8_t* out = &tail_out[0]
    cdef const word_t* pz = &z[0] if n else NULL
    cdef const sym_t* ps = &sym[0] if n else NULL
    with nogil:
        while i < n:
            if i + 8 <= n:
                # runs of unchanged elements (the sparse regime) have no tail bits at all
                any_bits = pz[i] | pz[i + 1] | pz[i + 2] | pz[i + 3] | pz[i + 4] | pz[i + 5] | pz[i + 6] | pz[i + 7]
                if any_bits == 0:
                    i += 8
                    continue
                j = i + 8
            else:
                j = n
            while i < j:
                nb = tail_len(ps[i] & amask)
                tail = pz[i] & (((<uint64_t>1) << nb) - 1)
                total += nb
                if word_t is uint64_t:
                    if nb > 32:  # keep every append <= 32 bits so the buffer never overflows
                        put_bits(out, &outpos, &bitbuf, &fill, tail & <uint64_t>0xFFFFFFFFULL, 32)
                        tail >>= 32
                        nb -= 32
                put_bits(out, &outpos, &bitbuf, &fill, tail, nb)
                i += 1
        if fill:
            memcpy(out + outpos, &bitbuf, 8)
    return total


# -- encode pass 3: rANS ------------------------------------------------------------


cdef packed struct EncEntry:
    # one per symbol; must match ``_tables.ENC_ENTRY``
    uint64_t rcp     # ceil(2**shift / f): x // f == (x * rcp) >> shift for x < 2**31
    uint32_t xmax    # f << (31 - S): emit 16 bits first when x >= xmax
    uint16_t start   # cumulative frequency below the symbol
    uint16_t shift


cdef inline void enc_put(uint64_t* x, const EncEntry* e, uint32_t total, int scale_bits,
                         uint16_t* words, Py_ssize_t* pos) noexcept nogil:
    """Push one symbol: renormalise, then x = (x // f << S) + x % f + start = x + start + (x // f) (M - f)."""
    cdef uint64_t s = x[0]
    cdef int emit = s >= e.xmax
    words[pos[0] - 1] = <uint16_t>s  # harmless when not emitting: the slot is still free
    pos[0] -= emit
    s >>= 16 * emit
    x[0] = s + e.start + ((s * e.rcp) >> e.shift) * (total - (e.xmax >> (31 - scale_bits)))


def rans_encode(sym_t[::1] sym, const uint8_t[::1] table, int scale_bits,
                uint16_t[::1] words_out, uint32_t[::1] states_out):
    """Encode symbols in reverse; words fill ``words_out`` from its end; returns their count.

    ``table`` holds one EncEntry per symbol value; ``words_out`` needs one slot more
    than the element count (see ``enc_put``).
    """
    cdef Py_ssize_t n = sym.shape[0], i
    cdef Py_ssize_t cap = words_out.shape[0], pos = words_out.shape[0]
    cdef uint64_t x0 = STATE_LOW, x1 = STATE_LOW, x2 = STATE_LOW, x3 = STATE_LOW
    cdef uint32_t total = 1 << scale_bits
    cdef const EncEntry* tab = <const EncEntry*>&table[0]
    cdef uint16_t* words = &words_out[0]
    cdef const sym_t* ps = &sym[0] if n else NULL
    with nogil:
        # the elements past the last whole group of 4 come first (they are decoded last)
        i = n - 1
        while i >= (n & ~3):
            if (i & 3) == 2:
                enc_put(&x2, &tab[ps[i]], total, scale_bits, words, &pos)
            elif (i & 3) == 1:
                enc_put(&x1, &tab[ps[i]], total, scale_bits, words, &pos)
            else:
                enc_put(&x0, &tab[ps[i]], total, scale_bits, words, &pos)
            i -= 1
        while i >= 3:
            enc_put(&x3, &tab[ps[i]], total, scale_bits, words, &pos)
            enc_put(&x2, &tab[ps[i - 1]], total, scale_bits, words, &pos)
            enc_put(&x1, &tab[ps[i - 2]], total, scale_bits, words, &pos)
            enc_put(&x0, &tab[ps[i - 3]], total, scale_bits, words, &pos)
            i -= 4
    states_out[0] = <uint32_t>x0
    states_out[1] = <uint32_t>x1
    states_out[2] = <uint32_t>x2
    states_out[3] = <uint32_t>x3
    return cap - pos


# -- decode pass 1: rANS ------------------------------------------------------------


cdef struct DecTables:
    const uint8_t* words
    int64_t n_words
    const int32_t* ctx_map
    const uint8_t* slot2sym
    const uint32_t* fs
    int scale_bits
    int alphabet
    int mant_bits
    uint64_t emask


cdef inline int dec_get(uint64_t* x, const DecTables* d, uint64_t v, int64_t* pos, bint checked,
                        uint8_t* token) noexcept nogil:
    """Pop one token from lane state ``x``; ``v`` is the element's reference word.  0 or a status."""
    cdef int32_t c = d.ctx_map[(v >> d.mant_bits) & d.emask]
    cdef uint64_t s = x[0]
    cdef uint32_t slot, e
    cdef uint16_t w16
    cdef int t, need
    if c < 0:
        return -4
    slot = s & ((1 << d.scale_bits) - 1)
    t = d.slot2sym[(<int64_t>c << d.scale_bits) + slot]
    e = d.fs[<int64_t>c * d.alphabet + t]
    s = (e >> 16) * (s >> d.scale_bits) + slot - (e & 0xFFFF)
    need = s < STATE_LOW
    if checked:  # near the end of the stream: read only what exists
        if need:
            if pos[0] >= d.n_words:
                return -1
            memcpy(&w16, d.words + 2 * pos[0], 2)
            s = (s << 16) | w16
            pos[0] += 1
        x[0] = s
    else:  # branchless: the caller guarantees 4 readable words ahead
        memcpy(&w16, d.words + 2 * pos[0], 2)
        x[0] = (s << (16 * need)) | (w16 & (0 - <uint64_t>need))
        pos[0] += need
    token[0] = <uint8_t>t
    return 0


def rans_decode(word_t[::1] r, int mant_bits, uint32_t emask, const int32_t[::1] ctx_map,
                const uint8_t[::1] slot2sym, const uint32_t[::1] fs, int scale_bits, int alphabet,
                const uint8_t[::1] words, const uint32_t[::1] states, uint8_t[::1] tokens_out):
    """Decode one token per element into ``tokens_out``; returns 0 or a negative status."""
    cdef Py_ssize_t n = tokens_out.shape[0], i = 0, j
    cdef int64_t pos = 0
    cdef uint64_t x[LANES]
    cdef uint64_t x0, x1, x2, x3
    cdef int status = 0
    cdef uint16_t zero16 = 0
    cdef DecTables d
    cdef const word_t* pr = &r[0] if n else NULL
    cdef uint8_t* pt = &tokens_out[0] if n else NULL
    d.words = &words[0] if words.shape[0] else <const uint8_t*>&zero16
    d.n_words = words.shape[0] // 2
    d.ctx_map = &ctx_map[0]
    d.slot2sym = &slot2sym[0]
    d.fs = &fs[0]
    d.scale_bits = scale_bits
    d.alphabet = alphabet
    d.mant_bits = mant_bits
    d.emask = emask
    x0, x1, x2, x3 = states[0], states[1], states[2], states[3]
    with nogil:
        # fast path: whole groups of 4 while 4 more words can be read unchecked
        while i + 4 <= n and pos + 4 <= d.n_words:
            status = (dec_get(&x0, &d, pr[i], &pos, False, pt + i)
                      | dec_get(&x1, &d, pr[i + 1], &pos, False, pt + i + 1)
                      | dec_get(&x2, &d, pr[i + 2], &pos, False, pt + i + 2)
                      | dec_get(&x3, &d, pr[i + 3], &pos, False, pt + i + 3))
            if status:
                break
            i += 4
        # the rest one element at a time, every word read checked
        x[0], x[1], x[2], x[3] = x0, x1, x2, x3
        while status == 0 and i < n:
            status = dec_get(&x[i & 3], &d, pr[i], &pos, True, pt + i)
            i += 1
        if status == 0:
            if pos != d.n_words:
                status = -5
            else:
                for j in range(LANES):
                    if x[j] != STATE_LOW:
                        status = -3
    return status


# -- decode pass 2: raw tails -------------------------------------------------------


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


def unpack_tails(const uint8_t[::1] tokens, const uint8_t[::1] tail, int64_t tail_bits, word_t[::1] z_out):
    """Rebuild residuals from tokens and raw tail bits; returns 0, or -2 if the bit count disagrees."""
    cdef Py_ssize_t n = tokens.shape[0], i = 0, j
    cdef int64_t bitpos = 0, tlen = tail.shape[0]
    cdef const uint8_t* tp = &tail[0] if tlen else NULL
    cdef const uint8_t* pt = &tokens[0] if n else NULL
    cdef word_t* pz = &z_out[0] if n else NULL
    cdef uint64_t w
    cdef int t, nb
    with nogil:
        while i < n:
            if i + 8 <= n:
                if load64(pt + i) == 0:  # 8 unchanged elements: nothing to read
                    for j in range(8):
                        pz[i + j] = 0
                    i += 8
                    continue
                j = i + 8
            else:
                j = n
            while i < j:
                t = pt[i]
                nb = tail_len(t)
                w = window(tp, tlen, bitpos)
                if word_t is uint64_t:
                    if nb > 56:  # only float64 residuals are this long: fetch the top bits separately
                        w = (w & <uint64_t>0xFFFFFFFFULL) | (window(tp, tlen, bitpos + 32) << 32)
                bitpos += nb
                pz[i] = <word_t>(((<uint64_t>(t - 4 * nb)) << nb) | (w & (((<uint64_t>1) << nb) - 1)))
                i += 1
    return 0 if bitpos == tail_bits else -2


# -- decode pass 3: values (element-wise) -------------------------------------------


def reconstruct(word_t[::1] r, word_t[::1] values):
    """In place: residuals in, values out: unkey(key(r) + unzigzag(z)) in w-bit arithmetic."""
    cdef Py_ssize_t n = values.shape[0], i
    cdef int width = sizeof(word_t) * 8
    cdef uint64_t wmask = (<uint64_t>-1) >> (64 - width)
    cdef uint64_t h = (<uint64_t>1) << (width - 1)
    cdef uint32_t hs = h, ws = wmask, v, zs, k
    cdef const word_t* pr = &r[0] if n else NULL
    cdef word_t* pv = &values[0] if n else NULL
    with nogil:
        if word_t is uint8_t or word_t is uint16_t:
            for i in range(n):  # 32-bit lanes: vectorises
                v = pr[i]
                zs = pv[i]
                k = (v ^ (((0 - (v >> (width - 1))) & ws) | hs)) + ((zs >> 1) ^ (0 - (zs & 1)))
                k &= ws
                pv[i] = <word_t>(k ^ ((((k >> (width - 1)) - 1) & ws) | hs))
        else:
            for i in range(n):
                pv[i] = <word_t>unkey((key(pr[i], h, wmask, width) + ((pv[i] >> 1) ^ (0 - (pv[i] & 1)))) & wmask,
                                      h, wmask, width)
