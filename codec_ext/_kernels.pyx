# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled ULPack kernels: tight nogil loops over typed memoryviews.

READ ME FIRST
-------------
* Same signatures and byte-identical results as ``ulstore/codec/reference/``, the
  executable specification; the Python layer (``_api.py``, ``_section.py``) validates
  input, allocates every buffer and builds the tables.  The one exception is
  ``sparse_decode``, which chains whole stages in one GIL release and mallocs
  (and frees) its temporaries.
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
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

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
    int __builtin_ctzll(unsigned long long) nogil
    int __builtin_popcountll(unsigned long long) nogil
    void __builtin_prefetch(const void*) nogil

cdef enum:
    PREFETCH = 32  # gathers ahead of use (positions of changed elements)

include "_constants.pxi"  # LANES, STATE_LOW, STATE_BITS, SCALE_BITS, SCALE, EncEntry: shared with the twin

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


cdef extern from "_mixsum.h" nogil:
    # splitmix64's finaliser, a bijection with full avalanche.  The checksum is a sum over words, so a
    # weaker per-word mix lets flips cancel in pairs (two flipped top bits add 2**64); with full
    # avalanche they do not.  In C beside the in-place apply's block form of it (one definition).
    uint64_t mix "ulp_mix"(uint64_t z)


cdef struct Hasher:
    # a hash64 in progress: words before byte ``done`` are in ``acc``
    uint64_t acc
    uint64_t salt
    Py_ssize_t done


cdef inline void hash_words(Hasher* hs, const uint8_t* p, Py_ssize_t upto) noexcept nogil:
    """Add every whole 8-byte word below byte ``upto``."""
    cdef int64_t nw
    if ULP3_HAVE_AVX2:  # whole groups of 8 words in AVX2 registers (the same sum)
        nw = ((upto - hs.done) >> 3) & ~(<int64_t>7)
        if nw > 0:
            ulp_hash_sum_words(p + hs.done, nw, hs.salt, &hs.acc)
            hs.salt += <uint64_t>nw * <uint64_t>0x9E3779B97F4A7C15ULL
            hs.done += nw * 8
    while hs.done + 8 <= upto:
        hs.salt += <uint64_t>0x9E3779B97F4A7C15ULL
        hs.acc += mix(load64(p + hs.done) + hs.salt)
        hs.done += 8


cdef uint64_t hash_sum(Hasher* hs, const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """The word sum of the ``n`` bytes at ``p``, the last word zero-padded (hash64 before its final mix)."""
    cdef uint64_t last = 0
    hash_words(hs, p, n)
    if n - hs.done:
        memcpy(&last, p + hs.done, n - hs.done)
        hs.salt += <uint64_t>0x9E3779B97F4A7C15ULL
        hs.acc += mix(last + hs.salt)
        hs.done = n
    return hs.acc


cdef uint64_t hash_final(Hasher* hs, const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """Finish a hash64 of the ``n`` bytes at ``p``."""
    return mix(hash_sum(hs, p, n) + <uint64_t>n * <uint64_t>0x9E3779B97F4A7C15ULL)


def hash64(data):
    """64-bit checksum of a byte buffer (see ``reference.hash64`` for the definition)."""
    cdef uint64_t n = memoryview(data).cast("B").nbytes
    return mix(<uint64_t>hash_sum64(data) + n * <uint64_t>0x9E3779B97F4A7C15ULL)


def hash_sum64(data):
    """The word sum ``hash64`` finishes: ``hash64 = mix(hash_sum64 + nbytes * golden)``."""
    cdef const uint8_t[::1] b = memoryview(data).cast("B")
    cdef Py_ssize_t n = b.shape[0]
    cdef Hasher hs = Hasher(0, 0, 0)
    cdef uint64_t acc
    with nogil:
        acc = hash_sum(&hs, &b[0] if n else NULL, n)
    return acc


cdef extern from "_crc32.h" nogil:
    void ulp_crc_init()
    uint32_t ulp_crc32(uint32_t crc, const uint8_t* p, size_t n)

ulp_crc_init()  # the byte table and the CPU check, once, before any thread can call crc32


def crc32(data, uint32_t crc=0):
    """``zlib.crc32(data, crc)``: the blob CRC-32, folded with PCLMULQDQ where the CPU has it (_crc32.h)."""
    cdef const uint8_t[::1] b = memoryview(data).cast("B")
    cdef size_t n = b.shape[0]
    if n == 0:
        return crc
    with nogil:
        crc = ulp_crc32(crc, &b[0], n)
    return crc


# -- encode pass 1: residuals and symbols (element-wise) -------------------------


cdef inline int token_of(uint64_t z) noexcept nogil:
    """t = (z >> nb) + 4 nb, nb = max(bitlen(z) - 3, 0): bit length and the 2 bits below the leading one."""
    cdef int nb = bitlen(z) - 3
    nb &= ~(nb >> 31)  # max(nb, 0) without a (mispredicted) branch
    return <int>(z >> nb) + 4 * nb


cdef enum:
    BLOCK = 4096  # elements per block of the element-wise passes that also hash their input


cdef inline void residual_block(const word_t* px, const word_t* pr, word_t* pz, sym_t* ps, Py_ssize_t lo,
                                Py_ssize_t hi, int mant_bits, uint32_t emask, int token_bits) noexcept nogil:
    cdef Py_ssize_t i
    cdef int width = sizeof(word_t) * 8
    cdef uint64_t wmask = (<uint64_t>-1) >> (64 - width)
    cdef uint64_t h = (<uint64_t>1) << (width - 1)
    cdef uint64_t d
    cdef uint32_t hs = h, ws = wmask, u, v, zs, t, bits, small
    cdef float f
    if word_t is uint8_t or word_t is uint16_t:
        # 32-bit lane arithmetic and the token read off float(z)'s exponent and top two
        # mantissa bits (exact for z < 2**24): no clz, so this loop vectorises.
        for i in range(lo, hi):
            u = px[i]
            v = pr[i]
            zs = ((u ^ (((0 - (u >> (width - 1))) & ws) | hs)) - (v ^ (((0 - (v >> (width - 1))) & ws) | hs))) & ws
            zs = ((zs << 1) ^ (0 - (zs >> (width - 1)))) & ws
            f = <float><int32_t>zs  # zs < 2**16: the signed conversion is exact and vectorises
            memcpy(&bits, &f, 4)
            small = 0 - <uint32_t>(zs < 4)  # tokens 0..3 are z itself
            t = (zs & small) | (((bits >> 21) - 512) & ~small)
            pz[i] = <word_t>zs
            ps[i] = <sym_t>((((v >> mant_bits) & emask) << token_bits) | t)
    else:
        for i in range(lo, hi):
            d = (key(px[i], h, wmask, width) - key(pr[i], h, wmask, width)) & wmask
            d = ((d << 1) ^ (0 - (d >> (width - 1)))) & wmask
            pz[i] = <word_t>d
            ps[i] = <sym_t>((<uint64_t>((pr[i] >> mant_bits) & emask) << token_bits) | token_of(d))


def residuals(const word_t[::1] x, const word_t[::1] r, int mant_bits, uint32_t emask, int token_bits,
              word_t[::1] z_out, sym_t[::1] sym_out):
    """z = zigzag(key(x) - key(r)) and sym = (r's exponent & emask) << token_bits | token(z).

    Returns ``(hash64(x), hash64(r))``: each block is hashed while it is in cache.
    """
    cdef Py_ssize_t n = x.shape[0], lo = 0, hi, nbytes = x.shape[0] * sizeof(word_t)
    cdef const word_t* px = &x[0] if n else NULL
    cdef const word_t* pr = &r[0] if n else NULL
    cdef word_t* pz = &z_out[0] if n else NULL
    cdef sym_t* ps = &sym_out[0] if n else NULL
    cdef Hasher hx = Hasher(0, 0, 0), hr = Hasher(0, 0, 0)
    cdef uint64_t hash_x, hash_r
    with nogil:
        while lo < n:
            hi = min(n, lo + BLOCK)
            residual_block(px, pr, pz, ps, lo, hi, mant_bits, emask, token_bits)
            # both hashes in one pass: a word the delta left unchanged is mixed once (_one_stream.pxi)
            hash_pair_words(&hr, &hx, <const uint8_t*>pr, <const uint8_t*>px, hi * <Py_ssize_t>sizeof(word_t))
            lo = hi
        hash_x = hash_final(&hx, <const uint8_t*>px, nbytes)
        hash_r = hash_final(&hr, <const uint8_t*>pr, nbytes)
    return hash_x, hash_r


def histogram(const sym_t[::1] sym, uint32_t[:, ::1] hist_out):
    """Symbol counts, returned in row 0 of ``hist_out`` (whose contents on entry do not matter).

    With 4 rows, element i counts in row i % 4 and the rows are folded into row 0 at
    the end: interleaved copies keep the increments off one store-to-load chain.
    """
    cdef Py_ssize_t n = sym.shape[0], i = 0, size = hist_out.shape[1], rows = hist_out.shape[0]
    cdef uint32_t* h0 = &hist_out[0, 0]
    cdef uint32_t* h1
    cdef uint32_t* h2
    cdef uint32_t* h3
    cdef const sym_t* ps = &sym[0] if n else NULL
    with nogil:
        memset(h0, 0, rows * size * sizeof(uint32_t))
        if rows == 4:
            h1 = h0 + size
            h2 = h1 + size
            h3 = h2 + size
            while i + 4 <= n:
                h0[ps[i]] += 1
                h1[ps[i + 1]] += 1
                h2[ps[i + 2]] += 1
                h3[ps[i + 3]] += 1
                i += 4
            while i < n:
                h0[ps[i]] += 1
                i += 1
            for i in range(size):
                h0[i] += h1[i] + h2[i] + h3[i]
        else:
            for i in range(n):
                h0[ps[i]] += 1


def context_histogram(const word_t[::1] r, int mant_bits, uint32_t emask, uint32_t[:, ::1] hist_out):
    """Count reference elements per context ``(r >> mant_bits) & emask``; element i in row i % 8.

    ``hist_out`` has 8 rows: a context is usually shared by long runs of elements, and
    8 interleaved copies keep the increments off one store-to-load chain.  Returns
    ``hash64`` of ``r``'s bytes, computed in the same pass over memory.
    """
    cdef Py_ssize_t n = r.shape[0], i = 0, j
    cdef const word_t* pr = &r[0] if n else NULL
    cdef uint32_t* h = &hist_out[0, 0]
    cdef Py_ssize_t stride = hist_out.shape[1]
    cdef const uint8_t* pb = <const uint8_t*>pr
    cdef Hasher hs = Hasher(0, 0, 0)
    cdef uint64_t acc
    if hist_out.shape[0] != 8:
        raise ValueError("context_histogram needs 8 histogram rows")
    with nogil:
        while i + 8 <= n:
            for j in range(8):
                h[j * stride + ((pr[i + j] >> mant_bits) & emask)] += 1
            i += 8
            if (i & 4095) == 0:  # hash what was just counted while it is in cache
                hash_words(&hs, pb, i * <Py_ssize_t>sizeof(word_t))
        while i < n:
            h[(pr[i] >> mant_bits) & emask] += 1
            i += 1
        acc = hash_final(&hs, pb, n * <Py_ssize_t>sizeof(word_t))
    return acc


# -- encode pass 2: raw tails -----------------------------------------------------


cdef inline void put_bits(uint8_t* out, int64_t* outpos, uint64_t* buf, int* fill, uint64_t bits, int nb) noexcept nogil:
    """Append ``nb`` bits LSB-first (``fill + nb <= 64``: callers keep ``nb <= 56``).

    Flushes whole bytes with one unconditional 8-byte store; the caller's buffer
    has 8 bytes of slack.
    """
    buf[0] |= bits << fill[0]
    fill[0] += nb
    memcpy(out + outpos[0], buf, 8)
    outpos[0] += fill[0] >> 3
    buf[0] >>= fill[0] & ~7
    fill[0] &= 7


cdef inline int tail_len(int t) noexcept nogil:
    cdef int nb = (t >> 2) - 1
    return nb & ~(nb >> 31)


cdef inline void put_one(uint8_t* out, int64_t* outpos, uint64_t* buf, int* fill, uint64_t z, int t,
                         int64_t* total) noexcept nogil:
    cdef int nb = tail_len(t)
    cdef uint64_t tail = z & (((<uint64_t>1) << nb) - 1)
    total[0] += nb
    if nb > 32:  # only float64 residuals are this long: split so the buffer never overflows
        put_bits(out, outpos, buf, fill, tail & <uint64_t>0xFFFFFFFFULL, 32)
        tail >>= 32
        nb -= 32
    put_bits(out, outpos, buf, fill, tail, nb)


def pack_tails(const sym_t[::1] sym, const word_t[::1] z, int token_bits, uint8_t[::1] tail_out):
    """Write every residual's raw low bits, LSB-first, into ``tail_out``; returns the bit count."""
    cdef Py_ssize_t n = z.shape[0], i = 0, j
    cdef uint32_t amask = (1 << token_bits) - 1
    cdef uint64_t bitbuf = 0, any_bits, bits
    cdef int fill = 0, k, sh, t
    cdef int64_t outpos = 0, total = 0
    cdef uint8_t nbits[64]  # per 8/16-bit token: tail length and mask
    cdef uint32_t mask[64]
    for t in range(64):
        nbits[t] = tail_len(t)
        mask[t] = (1u << nbits[t]) - 1
    cdef uint8_t* out = &tail_out[0]
    cdef const word_t* pz = &z[0] if n else NULL
    cdef const sym_t* ps = &sym[0] if n else NULL
    with nogil:
        while i + 8 <= n:
            # runs of unchanged elements (the sparse regime) have no tail bits at all
            any_bits = pz[i] | pz[i + 1] | pz[i + 2] | pz[i + 3] | pz[i + 4] | pz[i + 5] | pz[i + 6] | pz[i + 7]
            if any_bits:
                if word_t is uint8_t or word_t is uint16_t:
                    # tails are <= 13 bits: gather 4 into one append (<= 52 bits)
                    for j in range(i, i + 8, 4):
                        bits = 0
                        sh = 0
                        for k in range(4):
                            t = ps[j + k] & amask
                            bits |= (<uint64_t>(pz[j + k] & mask[t])) << sh
                            sh += nbits[t]
                        total += sh
                        put_bits(out, &outpos, &bitbuf, &fill, bits, sh)
                else:
                    for j in range(i, i + 8):
                        put_one(out, &outpos, &bitbuf, &fill, pz[j], ps[j] & amask, &total)
            i += 8
        while i < n:
            put_one(out, &outpos, &bitbuf, &fill, pz[i], ps[i] & amask, &total)
            i += 1
        if fill:
            memcpy(out + outpos, &bitbuf, 8)
    return total


# -- encode pass 3: rANS ------------------------------------------------------------


cdef inline uint64_t enc_put(uint64_t s, const EncEntry* e, uint16_t* words, Py_ssize_t* pos, bint rare) noexcept nogil:
    """Push one symbol: renormalise, then x = (x // f << S) + x % f + start = x + start + (x // f) (M - f).

    ``rare``: renormalisation is rare (sparse deltas) and a branch predicts well;
    otherwise the select is written as masks so that it cannot become a branch.
    """
    cdef uint64_t emit, mask
    if rare:
        if s >= e.xmax:
            pos[0] -= 1
            words[pos[0]] = <uint16_t>s
            s >>= 16
    else:
        emit = s >= e.xmax
        mask = 0 - emit
        words[pos[0] - 1] = <uint16_t>s  # harmless when not emitting: the slot is still free
        pos[0] -= emit
        s = (s & ~mask) | ((s >> 16) & mask)
    return s + e.start + ((s * e.rcp) >> e.shift) * (SCALE - (e.xmax >> (31 - SCALE_BITS)))


def rans_encode(const sym_t[::1] sym, const uint8_t[::1] table, uint16_t[::1] words_out, uint32_t[::1] states_out,
                bint mostly_zero=False):
    """Encode symbols in reverse; words fill ``words_out`` from its end; returns their count.

    ``table`` holds one EncEntry per symbol value; ``words_out`` needs one slot more
    than the element count (see ``enc_put``).  ``mostly_zero`` is a speed hint only
    (most tokens are 0); the output does not depend on it.
    """
    cdef Py_ssize_t n = sym.shape[0], i
    cdef Py_ssize_t cap = words_out.shape[0], pos = words_out.shape[0]
    cdef uint64_t x0 = STATE_LOW, x1 = STATE_LOW, x2 = STATE_LOW, x3 = STATE_LOW
    cdef const EncEntry* tab = <const EncEntry*>&table[0]
    cdef uint16_t* words = &words_out[0]
    cdef const sym_t* ps = &sym[0] if n else NULL
    with nogil:
        # the elements past the last whole group of 4 come first (they are decoded last)
        i = n - 1
        while i >= (n & ~3):
            if (i & 3) == 2:
                x2 = enc_put(x2, &tab[ps[i]], words, &pos, False)
            elif (i & 3) == 1:
                x1 = enc_put(x1, &tab[ps[i]], words, &pos, False)
            else:
                x0 = enc_put(x0, &tab[ps[i]], words, &pos, False)
            i -= 1
        if mostly_zero:  # one loop per renormalisation regime (see enc_put)
            while i >= 3:
                x3 = enc_put(x3, &tab[ps[i]], words, &pos, True)
                x2 = enc_put(x2, &tab[ps[i - 1]], words, &pos, True)
                x1 = enc_put(x1, &tab[ps[i - 2]], words, &pos, True)
                x0 = enc_put(x0, &tab[ps[i - 3]], words, &pos, True)
                i -= 4
        else:
            while i >= 3:
                x3 = enc_put(x3, &tab[ps[i]], words, &pos, False)
                x2 = enc_put(x2, &tab[ps[i - 1]], words, &pos, False)
                x1 = enc_put(x1, &tab[ps[i - 2]], words, &pos, False)
                x0 = enc_put(x0, &tab[ps[i - 3]], words, &pos, False)
                i -= 4
    states_out[0] = <uint32_t>x0
    states_out[1] = <uint32_t>x1
    states_out[2] = <uint32_t>x2
    states_out[3] = <uint32_t>x3
    return cap - pos


# -- decode pass 1: rANS ------------------------------------------------------------


cdef inline uint64_t dec_step(uint64_t s, const uint32_t* slots, int32_t row, uint8_t* token) noexcept nogil:
    """Pop one token: x' = f * (x >> S) + (slot - start), all three read from one slot entry."""
    cdef uint32_t e = slots[row + (s & (SCALE - 1))]
    token[0] = <uint8_t>(e >> 24)
    return (((e >> 12) & 0xFFF) + 1) * (s >> SCALE_BITS) + (e & 0xFFF)


cdef inline uint64_t dec_step_b(uint64_t s, const uint8_t* sym, const uint32_t* fs, int32_t row, int fsh,
                                uint8_t* token) noexcept nogil:
    """``dec_step`` on a byte per slot: the slot's token, then its ``f | start << 16`` (a row's ``fs`` entries
    start at ``row >> fsh``): a table a quarter the size, mostly in L1 where four-byte slots were in L2."""
    cdef uint32_t slot = <uint32_t>(s & (SCALE - 1))
    cdef uint8_t t = sym[row + slot]
    cdef uint32_t e = fs[(row >> fsh) + t]
    token[0] = t
    return (e & 0xFFFF) * (s >> SCALE_BITS) + slot - (e >> 16)



cdef inline uint64_t dec_renorm(uint64_t s, const uint8_t* words, int64_t* pos, bint rare) noexcept nogil:
    """Shift in the next 16-bit word if the state fell below L (the caller guarantees a
    readable word at ``pos``).

    ``rare``: renormalisation is rare (sparse deltas), so a branch predicts well and
    is cheapest.  Otherwise a mispredicted branch per element would dominate, so
    the select is written as masks, which compilers cannot turn back into a branch.
    """
    cdef uint16_t w16
    cdef uint64_t need, mask
    if rare:
        if s < STATE_LOW:
            memcpy(&w16, words + 2 * pos[0], 2)
            pos[0] += 1
            return (s << 16) | w16
        return s
    need = s < STATE_LOW
    mask = 0 - need
    memcpy(&w16, words + 2 * pos[0], 2)
    pos[0] += need
    return (s << (need << 4)) | (w16 & mask)  # shifted by 16 and the word in, or as it was


cdef inline Py_ssize_t decode_groups(const word_t* pr, Py_ssize_t n, int mant_bits, uint32_t emask,
                                     const int32_t* rows, const uint32_t* sl, const uint8_t* pw, int64_t n_words,
                                     uint64_t* x, int64_t* pos, uint8_t* pt, bint rare, bint one_row) noexcept nogil:
    """The fast path of ``rans_decode_core``: whole groups of 4 while 4 more words can be read unchecked.

    Returns how many tokens it decoded (``x`` and ``pos`` advanced).  ``rare``:
    see ``dec_renorm``.  ``one_row``: one context (``emask`` 0, as for SPARSE
    gaps), so no row is looked up per element.  Both are compile-time constants
    at every call, so each call is its own loop.
    """
    cdef Py_ssize_t i = 0
    cdef int64_t at = pos[0]  # a local: stores through pt could alias pos[0], not it
    cdef uint64_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3]
    cdef int32_t r0, r1, r2, r3
    r0 = r1 = r2 = r3 = rows[0]
    while i + 4 <= n and at + 4 <= n_words:
        # each lane's row looked up just before its step: looked up together at the top, the four rows
        # and four states outnumbered the registers and the states lived on the stack
        if not one_row:
            r0 = rows[(pr[i] >> mant_bits) & emask]
        x0 = dec_renorm(dec_step(x0, sl, r0, pt + i), pw, &at, rare)
        if not one_row:
            r1 = rows[(pr[i + 1] >> mant_bits) & emask]
        x1 = dec_renorm(dec_step(x1, sl, r1, pt + i + 1), pw, &at, rare)
        if not one_row:
            r2 = rows[(pr[i + 2] >> mant_bits) & emask]
        x2 = dec_renorm(dec_step(x2, sl, r2, pt + i + 2), pw, &at, rare)
        if not one_row:
            r3 = rows[(pr[i + 3] >> mant_bits) & emask]
        x3 = dec_renorm(dec_step(x3, sl, r3, pt + i + 3), pw, &at, rare)
        i += 4
    x[0], x[1], x[2], x[3] = x0, x1, x2, x3
    pos[0] = at
    return i


cdef inline Py_ssize_t decode_groups_b(const word_t* pr, Py_ssize_t n, int mant_bits, uint32_t emask,
                                       const int32_t* rows, const uint8_t* sym, const uint32_t* fs, int fsh,
                                       const uint8_t* pw, int64_t n_words, uint64_t* x, int64_t* pos,
                                       uint8_t* pt) noexcept nogil:
    """``decode_groups`` on byte-per-slot tables (``dec_step_b``), renormalisation as masks (a word per few
    tokens: residual tokens).  The four lanes step first, then shift in their words at once: lane k's word
    is the next after those lanes 0..k-1 took (the order one lane after another reads them), its position a
    prefix sum of which lanes need one, so no lane waits for the one before it to have read its word.  With
    the tables in L1 that wait had become the chain: 4-5% off the whole in-place job, in-process A/B."""
    cdef Py_ssize_t i = 0
    cdef int64_t at = pos[0], p1, p2, p3
    cdef uint64_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3], n0, n1, n2, n3
    cdef uint16_t w0, w1, w2, w3
    cdef int32_t r0, r1, r2, r3
    while i + 4 <= n and at + 4 <= n_words:
        r0 = rows[(pr[i] >> mant_bits) & emask]
        r1 = rows[(pr[i + 1] >> mant_bits) & emask]
        r2 = rows[(pr[i + 2] >> mant_bits) & emask]
        r3 = rows[(pr[i + 3] >> mant_bits) & emask]
        x0 = dec_step_b(x0, sym, fs, r0, fsh, pt + i)
        x1 = dec_step_b(x1, sym, fs, r1, fsh, pt + i + 1)
        x2 = dec_step_b(x2, sym, fs, r2, fsh, pt + i + 2)
        x3 = dec_step_b(x3, sym, fs, r3, fsh, pt + i + 3)
        n0, n1, n2, n3 = x0 < STATE_LOW, x1 < STATE_LOW, x2 < STATE_LOW, x3 < STATE_LOW
        p1 = at + <int64_t>n0
        p2 = p1 + <int64_t>n1
        p3 = p2 + <int64_t>n2
        memcpy(&w0, pw + 2 * at, 2)  # (at + 4 <= n_words: each of the four is a word of the stream)
        memcpy(&w1, pw + 2 * p1, 2)
        memcpy(&w2, pw + 2 * p2, 2)
        memcpy(&w3, pw + 2 * p3, 2)
        x0 = (x0 << (n0 << 4)) | (w0 & (0 - n0))
        x1 = (x1 << (n1 << 4)) | (w1 & (0 - n1))
        x2 = (x2 << (n2 << 4)) | (w2 & (0 - n2))
        x3 = (x3 << (n3 << 4)) | (w3 & (0 - n3))
        at = p3 + <int64_t>n3
        i += 4
    x[0], x[1], x[2], x[3] = x0, x1, x2, x3
    pos[0] = at
    return i


cdef int rans_decode_core(const word_t* pr, Py_ssize_t n, int mant_bits, uint32_t emask, const int32_t* rows,
                          const uint32_t* sl, const uint8_t* pw, int64_t n_words, const uint32_t* states,
                          uint8_t* pt, const uint8_t* sym=NULL, int fsh=0) noexcept nogil:
    """The body of :func:`rans_decode` on raw pointers (``n_words`` 16-bit words at ``pw``)."""
    cdef Py_ssize_t i = 0
    cdef int64_t pos = 0
    cdef uint64_t x[LANES]
    cdef int lane
    cdef uint16_t w16, zero16 = 0
    if n_words == 0:
        pw = <const uint8_t*>&zero16
    x[0], x[1], x[2], x[3] = states[0], states[1], states[2], states[3]
    # one loop per renormalisation regime (see dec_renorm) and per number of contexts
    if sym != NULL:  # byte-per-slot tables, ``sl`` their f|start rows (residual tokens of SPARSE deltas)
        i = decode_groups_b(pr, n, mant_bits, emask, rows, sym, sl, fsh, pw, n_words, x, &pos, pt)
    elif n_words * 16 < n:
        if emask == 0:
            i = decode_groups(pr, n, mant_bits, emask, rows, sl, pw, n_words, x, &pos, pt, True, True)
        else:
            i = decode_groups(pr, n, mant_bits, emask, rows, sl, pw, n_words, x, &pos, pt, True, False)
    elif emask == 0:
        i = decode_groups(pr, n, mant_bits, emask, rows, sl, pw, n_words, x, &pos, pt, False, True)
    else:
        i = decode_groups(pr, n, mant_bits, emask, rows, sl, pw, n_words, x, &pos, pt, False, False)
    # the rest one element at a time, every word read checked
    while i < n:
        lane = i & 3
        if sym != NULL:
            x[lane] = dec_step_b(x[lane], sym, sl, rows[(pr[i] >> mant_bits) & emask], fsh, pt + i)
        else:
            x[lane] = dec_step(x[lane], sl, rows[(pr[i] >> mant_bits) & emask], pt + i)
        if x[lane] < STATE_LOW:
            if pos >= n_words:
                return -1
            memcpy(&w16, pw + 2 * pos, 2)
            x[lane] = (x[lane] << 16) | w16
            pos += 1
        i += 1
    if pos != n_words:
        return -5
    for lane in range(LANES):
        if x[lane] != STATE_LOW:
            return -3
    return 0


def rans_decode(const word_t[::1] r, int mant_bits, uint32_t emask, const int32_t[::1] ctx_rows,
                const uint32_t[::1] slots, const uint8_t[::1] words, const uint32_t[::1] states,
                uint8_t[::1] tokens_out):
    """Decode one token per element into ``tokens_out``; returns 0 or a negative status.

    ``ctx_rows[(r >> mant_bits) & emask]`` is the context's first entry in ``slots``
    (``token << 24 | (f - 1) << 12 | (slot - start)`` per slot, scale 2**12).
    """
    cdef Py_ssize_t n = tokens_out.shape[0]
    cdef int64_t n_words = words.shape[0] // 2
    cdef int status
    cdef const word_t* pr = &r[0] if n else NULL
    cdef uint8_t* pt = &tokens_out[0] if n else NULL
    cdef const uint8_t* pw = &words[0] if n_words else NULL
    with nogil:
        status = rans_decode_core(pr, n, mant_bits, emask, &ctx_rows[0], &slots[0], pw, n_words, &states[0], pt)
    return status


cdef void slot_core(const uint32_t* freqs, Py_ssize_t rows, Py_ssize_t alphabet, uint32_t* o) noexcept nogil:
    cdef Py_ssize_t i, t, j
    cdef uint32_t f, base
    for i in range(rows):
        for t in range(alphabet):
            f = freqs[i * alphabet + t]
            base = (<uint32_t>t << 24) | ((f - 1) << 12)
            for j in range(f):  # indexed, not o += 1 per entry: the loop vectorises (j < f <= 2**12: no carry)
                o[j] = base + <uint32_t>j
            o += f


cdef void sym_core(const uint32_t* freqs, Py_ssize_t rows, Py_ssize_t alphabet, Py_ssize_t stride, uint8_t* sym,
                   uint32_t* fs) noexcept nogil:
    """Byte-per-slot tables: ``sym[row << S + slot]`` the slot's token, ``fs[row * stride + t]`` ``f | start << 16``."""
    cdef Py_ssize_t i, t
    cdef uint32_t f, start
    for i in range(rows):
        start = 0
        for t in range(alphabet):
            f = freqs[i * alphabet + t]
            fs[i * stride + t] = f | (start << 16)
            memset(sym + (i << SCALE_BITS) + start, <int>t, f)
            start += f


def slot_table(const uint32_t[:, ::1] freqs, uint32_t[::1] out):
    """Fill one entry per (row, slot): ``token << 24 | (f - 1) << 12 | (slot - start)``."""
    if freqs.shape[0] == 0:
        return
    with nogil:
        slot_core(&freqs[0, 0], freqs.shape[0], freqs.shape[1], &out[0])


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


cdef inline uint64_t get_one(const uint8_t* tp, int64_t tlen, int64_t* bitpos, int t) noexcept nogil:
    """One residual from its token and the next tail bits."""
    cdef int nb = tail_len(t)
    cdef uint64_t w = window(tp, tlen, bitpos[0])
    if nb > 56:  # only float64 residuals are this long: fetch the top bits separately
        w = (w & <uint64_t>0xFFFFFFFFULL) | (window(tp, tlen, bitpos[0] + 32) << 32)
    bitpos[0] += nb
    return ((<uint64_t>(t - 4 * nb)) << nb) | (w & (((<uint64_t>1) << nb) - 1))


cdef int unpack_core(const uint8_t* pt, Py_ssize_t n, const uint8_t* tp, int64_t tlen, int64_t tail_bits,
                     word_t* pz) noexcept nogil:
    """The body of :func:`unpack_tails` on raw pointers."""
    cdef Py_ssize_t i = 0, j
    cdef int64_t bitpos = 0
    cdef uint64_t w
    cdef int t, k, sh
    # per token: tail length, the residual with its tail zeroed, and the tail mask
    cdef uint8_t nbits[256]
    cdef uint64_t base[256]
    cdef uint64_t mask[256]
    for t in range(256):
        nbits[t] = tail_len(t) if t < 4 * 64 - 4 else 0
        base[t] = (<uint64_t>(t - 4 * nbits[t])) << nbits[t]
        mask[t] = ((<uint64_t>1) << nbits[t]) - 1
    while i + 8 <= n:
        if load64(pt + i) == 0:  # 8 unchanged elements: nothing to read
            for j in range(8):
                pz[i + j] = 0
        elif word_t is uint8_t or word_t is uint16_t:
            # 4 tails of <= 13 bits fit one 57-bit window
            for j in range(i, i + 8, 4):
                w = window(tp, tlen, bitpos)
                sh = 0
                for k in range(4):
                    t = pt[j + k]
                    pz[j + k] = <word_t>(base[t] | ((w >> sh) & mask[t]))
                    sh += nbits[t]
                bitpos += sh
        else:
            for j in range(i, i + 8):
                pz[j] = <word_t>get_one(tp, tlen, &bitpos, pt[j])
        i += 8
    while i < n:
        pz[i] = <word_t>get_one(tp, tlen, &bitpos, pt[i])
        i += 1
    return 0 if bitpos == tail_bits else -2


def unpack_tails(const uint8_t[::1] tokens, const uint8_t[::1] tail, int64_t tail_bits, word_t[::1] z_out):
    """Rebuild residuals from tokens and raw tail bits; returns 0, or -2 if the bit count disagrees."""
    cdef Py_ssize_t n = tokens.shape[0]
    cdef int64_t tlen = tail.shape[0]
    cdef int status
    cdef const uint8_t* tp = &tail[0] if tlen else NULL
    cdef const uint8_t* pt = &tokens[0] if n else NULL
    cdef word_t* pz = &z_out[0] if n else NULL
    with nogil:
        status = unpack_core(pt, n, tp, tlen, tail_bits, pz)
    return status


# -- decode pass 3: values (element-wise) -------------------------------------------


cdef inline void reconstruct_block(const word_t* pr, word_t* pv, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    cdef Py_ssize_t i
    cdef int width = sizeof(word_t) * 8
    cdef uint64_t wmask = (<uint64_t>-1) >> (64 - width)
    cdef uint64_t h = (<uint64_t>1) << (width - 1)
    cdef uint32_t hs = h, ws = wmask, v, zs, k
    if word_t is uint8_t or word_t is uint16_t:
        for i in range(lo, hi):  # 32-bit lanes: vectorises
            v = pr[i]
            zs = pv[i]
            k = (v ^ (((0 - (v >> (width - 1))) & ws) | hs)) + ((zs >> 1) ^ (0 - (zs & 1)))
            k &= ws
            pv[i] = <word_t>(k ^ ((((k >> (width - 1)) - 1) & ws) | hs))
    else:
        for i in range(lo, hi):
            pv[i] = <word_t>unkey((key(pr[i], h, wmask, width) + ((pv[i] >> 1) ^ (0 - (pv[i] & 1)))) & wmask,
                                  h, wmask, width)


def reconstruct(const word_t[::1] r, word_t[::1] values):
    """In place: residuals in, values out: unkey(key(r) + unzigzag(z)) in w-bit arithmetic.

    Returns ``hash64`` of the values, each block hashed while it is in cache.
    """
    cdef Py_ssize_t n = values.shape[0], lo = 0, hi
    cdef const word_t* pr = &r[0] if n else NULL
    cdef word_t* pv = &values[0] if n else NULL
    cdef Hasher hv = Hasher(0, 0, 0)
    cdef uint64_t digest
    with nogil:
        while lo < n:
            hi = min(n, lo + BLOCK)
            reconstruct_block(pr, pv, lo, hi)
            hash_words(&hv, <const uint8_t*>pv, hi * <Py_ssize_t>sizeof(word_t))
            lo = hi
        digest = hash_final(&hv, <const uint8_t*>pv, n * <Py_ssize_t>sizeof(word_t))
    return digest


# -- frequency tables (bit-level, MSB-first; see docs/format.md) --------------------


cdef inline void put_msb(uint8_t* out, int64_t* pos, uint64_t value, int nbits) noexcept nogil:
    """Write the low ``nbits`` of ``value``, most significant first, into zeroed ``out``."""
    cdef int k
    for k in range(nbits - 1, -1, -1):
        if (value >> k) & 1:
            out[pos[0] >> 3] |= 0x80 >> (pos[0] & 7)
        pos[0] += 1


cdef inline void put_gamma(uint8_t* out, int64_t* pos, uint64_t value) noexcept nogil:
    cdef int width = bitlen(value)
    pos[0] += width - 1  # the zeros are already there
    put_msb(out, pos, value, width)


def pack_table(const int64_t[:, ::1] q, uint8_t[::1] out):
    """Write the table of quantised counts ``q`` (rows x tokens) into zeroed ``out``; returns bits.

    ``out`` needs ``rows * (2 + 5 * alphabet)`` bytes.
    """
    cdef Py_ssize_t rows = q.shape[0], alphabet = q.shape[1], i, t, prev, k
    cdef int64_t pos = 0
    cdef uint8_t* o = &out[0]
    with nogil:
        for i in range(rows):
            k = 0
            for t in range(1, alphabet):
                k += q[i, t] != 0
            put_msb(o, &pos, q[i, 0] != 0, 1)
            put_gamma(o, &pos, k + 1)
            prev = 0
            for t in range(1, alphabet):
                if q[i, t]:
                    put_gamma(o, &pos, t - prev)
                    prev = t
            for t in range(1, alphabet):
                if q[i, t]:
                    put_gamma(o, &pos, q[i, t])
    return pos


cdef inline int get_gamma(const uint8_t* data, int64_t end, int64_t* pos, int64_t limit, int64_t* value) noexcept nogil:
    """Read one gamma code; 0, or -1 truncated, -2 out of range."""
    cdef int zeros = 0
    cdef int64_t v = 1
    cdef int k
    while True:
        if pos[0] >= end:
            return -1
        if (data[pos[0] >> 3] >> (7 - (pos[0] & 7))) & 1:
            break
        zeros += 1
        pos[0] += 1
        if zeros > 40:
            return -2
    pos[0] += 1
    if pos[0] + zeros > end:
        return -1
    for k in range(zeros):
        v = (v << 1) | ((data[pos[0] >> 3] >> (7 - (pos[0] & 7))) & 1)
        pos[0] += 1
    if v > limit:
        return -2
    value[0] = v
    return 0


cdef int read_table_core(const uint8_t* d, int64_t nbytes, const int64_t* n_rows, Py_ssize_t rows,
                         Py_ssize_t alphabet, int scale_bits, int64_t* q) noexcept nogil:
    """The body of :func:`read_table` on raw pointers (``q``: rows x alphabet, zeroed)."""
    cdef Py_ssize_t i, j
    cdef int64_t end = 8 * nbytes, pos = 0, n, top, k, gap, t, total, value
    cdef int has_zero, status = 0
    cdef int64_t tokens[256]
    for i in range(rows):
        n = n_rows[i]
        top = n >> max(0, bitlen(<uint64_t>n) - scale_bits) if n else 0
        if top == 0:
            top = 1
        if pos >= end:
            return -1
        has_zero = (d[pos >> 3] >> (7 - (pos & 7))) & 1
        pos += 1
        status = get_gamma(d, end, &pos, alphabet, &k)
        if status:
            return status
        k -= 1
        t = 0
        for j in range(k):
            status = get_gamma(d, end, &pos, alphabet, &gap)
            if status:
                return status
            t += gap
            if t >= alphabet:
                return -3
            tokens[j] = t
        total = 0
        for j in range(k):
            status = get_gamma(d, end, &pos, top, &value)
            if status:
                return status
            q[i * alphabet + tokens[j]] = value
            total += value
        if has_zero:
            q[i * alphabet] = max(1, top - total)
        elif k == 0:
            return -4
    if end - pos >= 8:
        return -5
    return 0


def read_table(const uint8_t[::1] data, const int64_t[::1] n_rows, int scale_bits, int64_t[:, ::1] q_out):
    """Parse a table for rows of ``n_rows`` elements into zeroed ``q_out``; returns 0 or a status:
    -1 truncated, -2 value out of range, -3 token beyond the alphabet, -4 row without tokens,
    -5 trailing bytes."""
    cdef int status
    cdef const uint8_t* d = &data[0] if data.shape[0] else NULL
    if q_out.shape[0] == 0:
        return -5 if data.shape[0] else 0
    with nogil:
        status = read_table_core(d, data.shape[0], &n_rows[0], q_out.shape[0], q_out.shape[1], scale_bits,
                                 &q_out[0, 0])
    return status


# -- table construction (twins of ulstore._rans_tables.normalize / encoder_table) ----------


ctypedef fused freq_t:
    uint32_t
    int64_t


cdef inline void normalize_row(const int64_t* c, Py_ssize_t alphabet, int64_t n, int scale, freq_t* f) noexcept nogil:
    """Counts ``c`` (summing to ``n`` > 0) scaled to frequencies ``f`` summing exactly to 2**scale.

    ``floor(c * 2**scale / n)``, raised to 1 for seen symbols; the remainder goes to the
    first most frequent symbol or, when raised rare symbols overshoot, is taken from the
    largest frequencies (first one first), none below 1.  The one loop of both table
    builders: twins ``_rans_tables.normalize`` (every row at ``scale_bits``) and
    ``_one_stream_tables.normalize_scaled`` (a scale per row).
    """
    cdef int64_t total = (<int64_t>1) << scale, used = 0, v, diff, take
    cdef Py_ssize_t t, top = 0, best
    for t in range(alphabet):
        v = (c[t] * total) // n
        if c[t] > 0 and v == 0:
            v = 1
        f[t] = <freq_t>v
        used += v
        if c[t] > c[top]:
            top = t  # first maximum: deterministic tie-break
    diff = total - used
    if diff > 0:
        f[top] += <freq_t>diff
    while diff < 0:  # raised rare symbols: take from the largest, first one first
        best = 0
        for t in range(alphabet):
            if f[t] > f[best]:
                best = t
        take = min(-diff, <int64_t>f[best] - 1)
        f[best] -= <freq_t>take
        diff += take


cdef void normalize_core(const int64_t* q, Py_ssize_t rows, Py_ssize_t alphabet, int scale_bits,
                         uint32_t* f) noexcept nogil:
    cdef Py_ssize_t i, t
    cdef int64_t n
    for i in range(rows):
        n = 0
        for t in range(alphabet):
            n += q[i * alphabet + t]
        normalize_row(q + i * alphabet, alphabet, max(n, 1), scale_bits, f + i * alphabet)


def normalize_rows(const int64_t[:, ::1] q, int scale_bits, uint32_t[:, ::1] freqs_out):
    """Scale each row of counts to sum 2**scale_bits exactly; see ``_rans_tables.normalize``."""
    if q.shape[0] == 0:
        return
    with nogil:
        normalize_core(&q[0, 0], q.shape[0], q.shape[1], scale_bits, &freqs_out[0, 0])


def encoder_table(const int64_t[::1] rows, const uint32_t[:, ::1] freqs, int scale_bits, int token_bits,
                  uint8_t[::1] out):
    """Write one EncEntry per symbol ``context << token_bits | token`` of every context with a row.

    Entries of contexts without a row are left as they are (never read).
    """
    cdef Py_ssize_t n_ctx = rows.shape[0], alphabet = freqs.shape[1], c, t
    cdef EncEntry* tab = <EncEntry*>&out[0]
    cdef EncEntry* e
    cdef uint64_t f, start
    cdef int s
    with nogil:
        for c in range(n_ctx):
            if rows[c] < 0:
                continue
            start = 0
            for t in range(alphabet):
                f = freqs[rows[c], t]
                e = &tab[(c << token_bits) | t]
                s = 0
                while ((<uint64_t>1) << s) < f:  # ceil(log2 f)
                    s += 1
                e.shift = <uint16_t>(31 + s)
                e.rcp = (((<uint64_t>1) << (31 + s)) + f - 1) // f if f else 0
                e.start = <uint16_t>start
                e.xmax = <uint32_t>(f << (31 - scale_bits))
                start += f


def table_model(const uint32_t[::1] counts, int token_bits, int alphabet, int pool_below, int scale_bits,
                int64_t[::1] rows_out, int64_t[:, ::1] q_out):
    """From symbol counts (``context << token_bits | token``) to table rows and quantised counts.

    Twin of ``_rans_tables.table_rows`` + ``sum_rows`` + ``quantized_counts`` in one call.
    ``q_out`` needs one row per context plus one and is zeroed here; returns the
    number of rows used.
    """
    cdef Py_ssize_t n_ctx = rows_out.shape[0], c, t, r, n_rows = 0
    cdef int64_t n, shift, rest, top
    cdef int64_t pooled_n = 0
    cdef bint any_small = False
    cdef const uint32_t* h = &counts[0]
    with nogil:
        memset(&q_out[0, 0], 0, q_out.shape[0] * q_out.shape[1] * sizeof(int64_t))
        for c in range(n_ctx):  # rows of their own, ascending; contexts to pool
            n = 0
            for t in range(alphabet):
                n += h[(c << token_bits) + t]
            if n >= pool_below:
                rows_out[c] = n_rows
                n_rows += 1
            elif n > 0:
                rows_out[c] = -2  # pooled, row number known once all big rows are counted
                any_small = True
            else:
                rows_out[c] = -1
        for c in range(n_ctx):
            if rows_out[c] == -2:
                rows_out[c] = n_rows
            r = rows_out[c]
            if r >= 0:
                for t in range(alphabet):
                    q_out[r, t] += h[(c << token_bits) + t]
        n_rows += any_small
        for r in range(n_rows):  # quantise: docs/format.md, Tables
            n = 0
            for t in range(alphabet):
                n += q_out[r, t]
            shift = max(0, bitlen(<uint64_t>n) - scale_bits)
            rest = 0
            for t in range(1, alphabet):
                if q_out[r, t]:
                    q_out[r, t] = max(1, q_out[r, t] >> shift)
                    rest += q_out[r, t]
            if q_out[r, 0]:
                q_out[r, 0] = max(1, (n >> shift) - rest)
    return n_rows


# -- SPARSE payloads: positions, gathered references, checksum updates, scatter ------------


def sparse_split(const word_t[::1] z, const sym_t[::1] sym, uint32_t[::1] gaps_out, uint16_t[::1] gsym_out,
                 word_t[::1] z_out, sym_t[::1] sym_out):
    """The changed elements of residuals ``z``: gaps between their positions and the gaps' tokens,
    their residuals and symbols.  The outputs must hold exactly the non-zero count: returns it,
    or -1 if they do not."""
    cdef Py_ssize_t n = z.shape[0], i, m = 0, cap = gaps_out.shape[0]
    cdef int64_t last = -1
    cdef uint32_t g
    with nogil:
        for i in range(n):
            if z[i] != 0:
                if m == cap:
                    m = -1
                    break
                g = <uint32_t>(i - last - 1)
                gaps_out[m] = g
                gsym_out[m] = <uint16_t>token_of(g)
                z_out[m] = z[i]
                sym_out[m] = sym[i]
                last = i
                m += 1
    return m if m == cap else -1


cdef int gap_gather_core(const uint32_t* gaps, Py_ssize_t m, const word_t* r, int64_t n, int64_t* pos,
                         word_t* rs) noexcept nogil:
    cdef Py_ssize_t k
    cdef int64_t p = -1
    for k in range(m):
        p += <int64_t>gaps[k] + 1
        if p >= n:  # checked every step: a forged gap stream must not overflow p
            return -6
        pos[k] = p
    gather_core(pos, m, r, rs)
    return 0


cdef void gather_core(const int64_t* pos, Py_ssize_t m, const word_t* r, word_t* rs) noexcept nogil:
    cdef Py_ssize_t k
    # the reads are scattered over the reference: ask for them well before they are needed
    for k in range(min(m, PREFETCH)):
        __builtin_prefetch(&r[pos[k]])
    for k in range(m):
        if k + PREFETCH < m:
            __builtin_prefetch(&r[pos[k + PREFETCH]])
        rs[k] = r[pos[k]]


def gap_gather(const uint32_t[::1] gaps, const word_t[::1] r, int64_t[::1] pos_out, word_t[::1] r_out):
    """Positions ``p_k = p_(k-1) + gaps_k + 1`` (``p_(-1) = -1``) and the reference words there.

    Returns 0, or -6 when a position lies past the end of ``r``.
    """
    cdef int status = 0
    if gaps.shape[0]:
        with nogil:
            status = gap_gather_core(&gaps[0], gaps.shape[0], &r[0], r.shape[0], &pos_out[0], &r_out[0])
    return status


cdef uint64_t sum_update_core(const word_t* r, Py_ssize_t n, const int64_t* pos, Py_ssize_t m,
                              const word_t* values) noexcept nogil:
    cdef Py_ssize_t i = 0, per = 8 // sizeof(word_t), bits = 8 * sizeof(word_t), base
    cdef uint64_t lane = (<uint64_t>-1) >> (64 - 8 * sizeof(word_t))
    cdef int64_t w
    cdef int shift
    cdef uint64_t old, new, salt, acc = 0
    while i < m:
        w = pos[i] // per
        base = w * per
        if base + per <= n:
            old = load64(<const uint8_t*>&r[base])
        else:  # the last word is zero-padded, as in hash64
            old = 0
            memcpy(&old, &r[base], (n - base) * sizeof(word_t))
        new = old
        while i < m and pos[i] < base + per:
            shift = <int>((pos[i] - base) * bits)
            new = (new & ~(lane << shift)) | (<uint64_t>values[i] << shift)
            i += 1
        salt = (<uint64_t>w + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
        acc += mix(new + salt) - mix(old + salt)
    return acc


def sum_update(const word_t[::1] r, const int64_t[::1] pos, const word_t[::1] values):
    """How ``hash_sum64(r)`` changes when ``r[pos] = values`` (pos ascending), mod 2**64.

    Visits only the 8-byte words that hold a changed element.
    """
    cdef Py_ssize_t m = pos.shape[0], k
    cdef uint64_t acc = 0
    cdef bint ok = values.shape[0] == m
    if m and ok:
        with nogil:
            for k in range(m):
                if pos[k] >= r.shape[0] or pos[k] < (pos[k - 1] + 1 if k else 0):
                    ok = False
                    break
            if ok:
                acc = sum_update_core(&r[0], r.shape[0], &pos[0], m, &values[0])
    if not ok:
        raise ValueError("sum_update needs ascending positions inside r, one value each")
    return acc


def scatter(word_t[::1] dst, const int64_t[::1] pos, const word_t[::1] values):
    """``dst[pos] = values``; returns 0, or -1 without writing anything unless the positions
    strictly ascend inside ``dst`` and match ``values`` one to one."""
    cdef Py_ssize_t k, m = pos.shape[0], n = dst.shape[0]
    cdef int64_t last = -1
    cdef int status = 0
    if values.shape[0] != m:
        return -1
    with nogil:
        for k in range(m):
            if pos[k] <= last or pos[k] >= n:
                status = -1
                break
            last = pos[k]
        if not status:
            for k in range(m):
                if k + PREFETCH < m:  # scattered writes: fetch their lines ahead
                    __builtin_prefetch(&dst[pos[k + PREFETCH]])
                dst[pos[k]] = values[k]
    return status


cdef int gap_positions(const uint8_t* tokens, Py_ssize_t m, const uint8_t* tail, int64_t tlen, int64_t tail_bits,
                       int64_t n, int64_t* pos) noexcept nogil:
    """The changed positions of a SPARSE payload from its gap tokens and tail bits, in one pass.

    As ``unpack_core`` into 32-bit gaps, then ``p += gap + 1``, but two tails per
    bit window (gaps' tails are at most 29 bits).  Returns 0, -2 (tail bits not
    all used) or else -6 (a position at or past ``n``): the statuses, and their
    order, of those two steps.
    """
    cdef uint8_t nbits[256]
    cdef uint32_t base[256]
    cdef uint32_t mask[256]
    cdef Py_ssize_t k = 0
    cdef int64_t bitpos = 0, p = -1
    cdef uint64_t w
    cdef int t, nb0, nb1
    for t in range(256):
        nbits[t] = tail_len(t) if t < 4 * 32 - 4 else 0  # the decoder's tokens are below the alphabet, 124
        base[t] = (<uint32_t>(t - 4 * nbits[t])) << nbits[t]
        mask[t] = ((<uint32_t>1) << nbits[t]) - 1
    while k + 2 <= m:
        nb0, nb1 = nbits[tokens[k]], nbits[tokens[k + 1]]
        w = window(tail, tlen, bitpos)
        p += <int64_t>(base[tokens[k]] | (<uint32_t>w & mask[tokens[k]])) + 1
        pos[k] = p
        w = window(tail, tlen, bitpos + nb0) if nb0 + nb1 > 57 else w >> nb0
        p += <int64_t>(base[tokens[k + 1]] | (<uint32_t>w & mask[tokens[k + 1]])) + 1
        pos[k + 1] = p
        p = p if p < n else n  # past the end (-6 below): held there, so that a forged stream cannot wrap it
        bitpos += nb0 + nb1
        k += 2
    if k < m:
        w = window(tail, tlen, bitpos)
        p += <int64_t>(base[tokens[k]] | (<uint32_t>w & mask[tokens[k]])) + 1
        pos[k] = p
        bitpos += nbits[tokens[k]]
    if bitpos != tail_bits:
        return -2
    return -6 if p >= n else 0


cdef int sparse_tokens(const word_t* rs, Py_ssize_t m, int mant_bits, uint32_t emask, int pool_below,
                       const uint8_t* table, int64_t table_len, Py_ssize_t alphabet, const uint32_t* states,
                       const uint8_t* words, int64_t n_words, uint8_t* tokens) noexcept nogil:
    """Decode the residual section's tokens: table rows from the m contexts' counts (pooled below ``pool_below``).

    The rows are a byte per slot and ``f | start << 16`` per token (``sym_core``), not four-byte slots: a
    13-row table of a large chunk is 52 KB instead of 208 KB (L1 rather than L2), and the whole job that
    applies a version in place ran 4-5% faster (13.3M parameters, in-process A/B).
    """
    cdef Py_ssize_t n_ctx = emask + 1, c, k, n_big = 0, n_rows
    cdef int status = -8  # out of memory
    cdef bint small = False
    # four interleaved counts per context, summed after: most changes share a few contexts, and one count
    # incremented change after change waits for its own previous store each time
    cdef int64_t* n_c = <int64_t*>calloc(4 * n_ctx, sizeof(int64_t))
    cdef int32_t* ctx_rows = <int32_t*>calloc(n_ctx, sizeof(int32_t))
    cdef int64_t* row_n = <int64_t*>calloc(n_ctx + 1, sizeof(int64_t))
    cdef int64_t* q = NULL
    cdef uint32_t* freqs = NULL
    cdef uint8_t* sym = NULL
    cdef uint32_t* fs = NULL
    cdef Py_ssize_t stride
    cdef int fsh
    if n_c != NULL and ctx_rows != NULL and row_n != NULL:
        k = m if emask == 0 else 0  # one context (a blob without exponent contexts): its count is m
        n_c[0] = k
        while k + 4 <= m:
            n_c[(rs[k] >> mant_bits) & emask] += 1
            n_c[n_ctx + ((rs[k + 1] >> mant_bits) & emask)] += 1
            n_c[2 * n_ctx + ((rs[k + 2] >> mant_bits) & emask)] += 1
            n_c[3 * n_ctx + ((rs[k + 3] >> mant_bits) & emask)] += 1
            k += 4
        while k < m:
            n_c[(rs[k] >> mant_bits) & emask] += 1
            k += 1
        for c in range(n_ctx):
            n_c[c] += n_c[n_ctx + c] + n_c[2 * n_ctx + c] + n_c[3 * n_ctx + c]
        for c in range(n_ctx):  # own rows in context order, then one pooled row (_rans_tables.table_rows)
            if n_c[c] >= pool_below:
                ctx_rows[c] = <int32_t>(n_big << SCALE_BITS)
                row_n[n_big] = n_c[c]
                n_big += 1
        for c in range(n_ctx):
            if 0 < n_c[c] < pool_below:
                ctx_rows[c] = <int32_t>(n_big << SCALE_BITS)
                row_n[n_big] += n_c[c]
                small = True
        n_rows = n_big + small
        q = <int64_t*>calloc(n_rows * alphabet, sizeof(int64_t))
        freqs = <uint32_t*>malloc(n_rows * alphabet * sizeof(uint32_t))
        # a byte per slot (its token) and per row ``f | start << 16`` per token, rows 64 (or 256) tokens apart
        stride = 64 if alphabet <= 64 else 256
        fsh = SCALE_BITS - (6 if stride == 64 else 8)
        sym = <uint8_t*>malloc(n_rows << SCALE_BITS)
        fs = <uint32_t*>malloc(n_rows * stride * sizeof(uint32_t))
        if q != NULL and freqs != NULL and sym != NULL and fs != NULL:
            status = read_table_core(table, table_len, row_n, n_rows, alphabet, SCALE_BITS, q)
            if status:
                status -= 100
            else:
                normalize_core(q, n_rows, alphabet, SCALE_BITS, freqs)
                sym_core(freqs, n_rows, alphabet, stride, sym, fs)
                status = rans_decode_core(rs, m, mant_bits, emask, ctx_rows, fs, words, n_words, states, tokens,
                                          sym, fsh)
    free(n_c)
    free(ctx_rows)
    free(row_n)
    free(q)
    free(freqs)
    free(sym)
    free(fs)
    return status


cdef int sparse_rest(const word_t[::1] r, int mant_bits, uint32_t emask, int pool_below,
                     const uint8_t[::1] t_table, const uint32_t[::1] t_states, const uint8_t[::1] t_words,
                     const uint8_t[::1] t_tail, int64_t t_tail_bits, int t_alphabet,
                     const int64_t[::1] pos, word_t[::1] values_out, uint64_t[::1] sum_out) noexcept nogil:
    """A SPARSE payload's residual section, its ``m`` positions decoded (both versions): the new words and
    the word-sum change; 0, a stream or table status, -7 (a zero residual) or -8 (out of memory)."""
    cdef Py_ssize_t m = pos.shape[0], n = r.shape[0], k
    cdef int status = -8
    cdef uint8_t zero8 = 0
    cdef uint8_t* tokens = <uint8_t*>malloc(m)
    cdef word_t* rs = <word_t*>malloc(m * sizeof(word_t))
    if tokens != NULL and rs != NULL:
        gather_core(&pos[0], m, &r[0], rs)
        status = sparse_tokens(rs, m, mant_bits, emask, pool_below, &t_table[0] if t_table.shape[0] else &zero8,
                               t_table.shape[0], t_alphabet, &t_states[0],
                               &t_words[0] if t_words.shape[0] else NULL, t_words.shape[0] // 2, tokens)
        if not status:
            status = unpack_core(tokens, m, &t_tail[0] if t_tail.shape[0] else NULL, t_tail.shape[0], t_tail_bits,
                                 &values_out[0])
        if not status:
            for k in range(m):
                if values_out[k] == 0:
                    status = -7
                    break
        if not status:
            reconstruct_block(rs, &values_out[0], 0, m)
            sum_out[0] = sum_update_core(&r[0], n, &pos[0], m, &values_out[0])
    free(tokens)
    free(rs)
    return status


def sparse_decode(const word_t[::1] r, int mant_bits, uint32_t emask, int pool_below,
                  const uint8_t[::1] g_table, const uint32_t[::1] g_states, const uint8_t[::1] g_words,
                  const uint8_t[::1] g_tail, int64_t g_tail_bits, int g_alphabet,
                  const uint8_t[::1] t_table, const uint32_t[::1] t_states, const uint8_t[::1] t_words,
                  const uint8_t[::1] t_tail, int64_t t_tail_bits, int t_alphabet,
                  int64_t[::1] pos_out, word_t[::1] values_out, uint64_t[::1] sum_out):
    """Decode a version-2 SPARSE payload's gap and residual sections in one call (one GIL release).

    Writes the m = len(pos_out) changed positions, their new words, and in
    ``sum_out[0]`` what ``sum_update`` returns for them.  Returns 0,
    a stream status (-1, -2, -3, -5 as the section kernels, -6 a position past the
    end, -7 a zero residual, -8 out of memory, -9 bad arguments), or a table
    status minus 100.
    """
    cdef Py_ssize_t m = pos_out.shape[0], n = r.shape[0]
    cdef int64_t one = m
    cdef int status = -8
    cdef int32_t row0 = 0
    cdef uint8_t zero8 = 0
    cdef const uint8_t* gt = &g_table[0] if g_table.shape[0] else &zero8
    cdef const uint8_t* gw = &g_words[0] if g_words.shape[0] else NULL
    cdef const uint8_t* gtl = &g_tail[0] if g_tail.shape[0] else NULL
    cdef uint8_t* tokens
    cdef int64_t* q
    cdef uint32_t freqs[256]
    cdef uint32_t* slots
    if (m == 0 or m > n or g_alphabet > 256 or t_alphabet > 256 or emask > 0xFFFF or values_out.shape[0] != m
            or sum_out.shape[0] < 1 or g_states.shape[0] != LANES or t_states.shape[0] != LANES):
        return -9
    with nogil:
        tokens = <uint8_t*>malloc(m)
        q = <int64_t*>calloc(g_alphabet, sizeof(int64_t))
        slots = <uint32_t*>malloc(SCALE * sizeof(uint32_t))
        if tokens != NULL and q != NULL and slots != NULL:
            # gaps: one context (the residual words double as a dummy context source: emask 0)
            status = read_table_core(gt, g_table.shape[0], &one, 1, g_alphabet, SCALE_BITS, q)
            if status:
                status -= 100
            else:
                normalize_core(q, 1, g_alphabet, SCALE_BITS, freqs)
                slot_core(freqs, 1, g_alphabet, slots)
                status = rans_decode_core(&r[0], m, 0, 0, &row0, slots, gw, g_words.shape[0] // 2,
                                          &g_states[0], tokens)
            if not status:
                status = gap_positions(tokens, m, gtl, g_tail.shape[0], g_tail_bits, n, &pos_out[0])
        free(tokens)
        free(q)
        free(slots)
        if not status:
            status = sparse_rest(r, mant_bits, emask, pool_below, t_table, t_states, t_words, t_tail, t_tail_bits,
                                 t_alphabet, pos_out, values_out, sum_out)
    return status


cdef inline int ef_low_bits(int64_t n, int64_t m) noexcept nogil:
    return bitlen(<uint64_t>(n // m)) - 1


cdef int ef_core(const uint8_t* lo, int64_t lo_len, const uint8_t* hi, int64_t hi_len, int64_t m, int64_t n,
                 int64_t* pos) noexcept nogil:
    """Elias-Fano positions (``_elias_fano.py``, its twin): 0, -6 or -10, checked in the twin's order.

    Counting the set bits first bounds the decode to exactly ``m`` positions.
    Three passes over ``pos``, each a short loop without a branch on the data:
    the ``L`` low bits of every position (unchecked 8-byte loads while 8 bytes
    remain); then the high part of each, the next set bit of ``high`` (its
    index minus ``k``, shifted up ``L`` bits); then the check that they ascend
    strictly, which vectorises.  One pass doing all three ran twice the
    instructions per position.
    """
    cdef int L = ef_low_bits(n, m), t
    cdef int64_t ones = 0, i, k = 0, bo = 0, fast
    cdef int64_t full = hi_len & ~(<int64_t>7)
    cdef uint64_t w, mask = ((<uint64_t>1) << L) - 1
    cdef bint bad = 0
    for i in range(0, full, 8):
        ones += __builtin_popcountll(load64(hi + i))
    for i in range(full, hi_len):
        ones += __builtin_popcountll(hi[i])
    if ones != m or (m * L) % 8 and lo[lo_len - 1] >> ((m * L) % 8):
        return -10
    if L:
        # the positions whose L bits an unchecked 8-byte load reaches: k * L < 8 * (lo_len - 7)
        fast = min(m, (8 * (lo_len - 7) + L - 1) // L) if lo_len >= 8 else 0
        for k in range(fast):
            pos[k] = <int64_t>((load64(lo + (bo >> 3)) >> (bo & 7)) & mask)
            bo += L
        k = fast
        while k < m:
            pos[k] = <int64_t>(window(lo, lo_len, bo) & mask)
            bo += L
            k += 1
    elif m:
        memset(pos, 0, m * sizeof(int64_t))
    k = 0
    for i in range(0, hi_len, 8):
        w = load64(hi + i) if i < full else window(hi, hi_len, 8 * i)
        while w:
            t = __builtin_ctzll(w)
            w &= w - 1
            pos[k] |= (8 * i + t - k) << L
            k += 1
    for k in range(1, m):
        bad |= pos[k] <= pos[k - 1]
    if bad:
        return -10
    return -6 if m and pos[m - 1] >= n else 0


cdef int ef_decode(const uint8_t[::1] lo, const uint8_t[::1] hi, int64_t n, int64_t m, int64_t* pos) noexcept nogil:
    """:func:`ef_positions` into ``pos``."""
    cdef int L
    if m < 1 or m > n or n >= (<int64_t>1) << 58:  # below (any array): L <= 57 bits fit a window, no shift overflows
        return -9
    L = ef_low_bits(n, m)
    if lo.shape[0] != (m * L + 7) // 8 or hi.shape[0] != (m + ((n - 1) >> L) + 1 + 7) // 8:
        return -9
    return ef_core(&lo[0] if lo.shape[0] else NULL, lo.shape[0], &hi[0], hi.shape[0], m, n, pos)


def ef_encode(const int64_t[::1] pos, int64_t n, uint8_t[::1] out):
    """The Elias-Fano coding of ascending positions ``pos`` below ``n`` (``_elias_fano.encode_positions``'s
    bytes: low part, then high part) into ``out``, exactly ``_elias_fano.sizes`` bytes long; 0, or -9 (bad
    arguments: a length, or a position that is not ascending and below ``n``)."""
    cdef int64_t m = pos.shape[0], k, j = 0, lo_len, hi_len, bit, prev = -1
    cdef int L, nacc = 0
    cdef uint64_t acc = 0, mask
    cdef bint bad = 0
    if m < 1 or m > n or n >= (<int64_t>1) << 58:
        return -9
    L = ef_low_bits(n, m)
    mask = ((<uint64_t>1) << L) - 1
    lo_len, hi_len = (m * L + 7) // 8, (m + ((n - 1) >> L) + 1 + 7) // 8
    if out.shape[0] != lo_len + hi_len:
        return -9
    for k in range(m):  # (a C loop)
        bad |= pos[k] <= prev
        prev = pos[k]
    if bad or prev >= n:
        return -9
    with nogil:
        memset(&out[0], 0, lo_len + hi_len)
        for k in range(m):  # low parts, L bits each, LSB-first (nacc < 8 before each: at most 64 bits held)
            acc |= (<uint64_t>pos[k] & mask) << nacc
            nacc += L
            while nacc >= 8:
                out[j] = <uint8_t>acc
                acc >>= 8
                nacc -= 8
                j += 1
        if nacc:
            out[j] = <uint8_t>acc
        for k in range(m):
            bit = (pos[k] >> L) + k
            out[lo_len + (bit >> 3)] |= <uint8_t>(1 << (bit & 7))
    return 0


def ef_positions(const uint8_t[::1] lo, const uint8_t[::1] hi, int64_t n, int64_t[::1] pos_out):
    """Decode ``len(pos_out)`` Elias-Fano positions below ``n``: 0, -6 (one at or past ``n``), -9 (bad
    arguments: lengths that are not ``_elias_fano.sizes``, ``n`` of 2**58 or more) or -10 (not the coding of
    ascending positions)."""
    cdef int status
    with nogil:
        status = ef_decode(lo, hi, n, pos_out.shape[0], &pos_out[0] if pos_out.shape[0] else NULL)
    return status


def sparse_decode_ef(const word_t[::1] r, int mant_bits, uint32_t emask, int pool_below,
                     const uint8_t[::1] lo, const uint8_t[::1] hi,
                     const uint8_t[::1] t_table, const uint32_t[::1] t_states, const uint8_t[::1] t_words,
                     const uint8_t[::1] t_tail, int64_t t_tail_bits, int t_alphabet,
                     int64_t[::1] pos_out, word_t[::1] values_out, uint64_t[::1] sum_out):
    """:func:`sparse_decode` of a version-4 SPARSE payload: Elias-Fano positions (:func:`ef_positions`'s
    statuses), then the residual section as in version 2."""
    cdef Py_ssize_t m = pos_out.shape[0], n = r.shape[0]
    cdef int status
    if (m == 0 or m > n or t_alphabet > 256 or emask > 0xFFFF or values_out.shape[0] != m or sum_out.shape[0] < 1
            or t_states.shape[0] != LANES):
        return -9
    with nogil:
        status = ef_decode(lo, hi, n, m, &pos_out[0])
        if not status:
            status = sparse_rest(r, mant_bits, emask, pool_below, t_table, t_states, t_words, t_tail, t_tail_bits,
                                 t_alphabet, pos_out, values_out, sum_out)
    return status


include "_one_stream.pxi"  # format version 3: one-stream sections, band rows, intra symbols
include "_apply.pxi"  # SPARSE blobs applied in place, many per call (weight sync)
