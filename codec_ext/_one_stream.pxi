# Format-version-3 kernels, included by _kernels.pyx (twins: _one_stream_rans.py, _one_stream_tables.py).
#
# READ ME FIRST
# * One section = one rANS stream on 4 or 32 lanes (element i on lane i % lanes)
#   carrying, per element, its token and then its raw low bits in chunks of at most
#   RAW_CHUNK = 15 bits (no separate bit stream, so lanes never wait for each other).
# * Order: groups of G = min(lanes, 8) elements; per group every token, then every
#   raw chunk 0, chunk 1, ...  Encoding runs the exact reverse, words growing
#   backwards from the end of ``words_out``.
# * The encoder table has one entry per symbol value (delta: ``context << token_bits |
#   token``, every context of a band row sharing the row's entries; intra: the
#   exponent and top mantissa bits).  Decoder slot entries of intra rows hold a
#   symbol's rank and ``lut`` maps it back.
# * The decoder writes values (not residuals) and hashes them and the reference in
#   blocks while they are in cache.  16-bit words on 32 lanes run the AVX2 loop of
#   _one_stream_loops.h in the x86-64-v3 build, INTRA 16-bit words on 4 lanes its scalar
#   ulp3_dec4_intra16 (both builds); the scalar loop below finishes what they leave
#   and does everything else in the portable build.
# * Untrusted input: every word read is checked against ``n_words`` (the vector loop
#   runs only while 64 more words exist); rows and tokens come from validated
#   tables, so no table read is out of bounds.

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

import numpy as np

cdef extern from "_one_stream_loops.h" nogil:
    int ULP3_HAVE_AVX2
    void ulp_hash_sum_words(const uint8_t *p, int64_t nw, uint64_t salt, uint64_t *acc)
    void ulp_hash_sum_pair(const uint8_t *pa, const uint8_t *pb, int64_t nw, uint64_t salt, uint64_t *acc_a,
                           uint64_t *acc_b)
    int64_t ulp3_encode_p1(const void *v, int word_bytes, const uint16_t *sym, int64_t hi, int mode, int tb,
                           int s, int width, const void *table, int lanes, uint64_t *x, uint16_t *words,
                           int64_t pos, int rare)
    struct ulp3_venc:
        uint32_t rcp
        uint32_t info
    void ulp3_venc_table(const void *tab, int64_t n, ulp3_venc *out)
    void ulp3_intra_table(const uint32_t *slots, const uint32_t *lut, uint64_t *e64)
    int64_t ulp3_dec4_delta8(const uint8_t *r, uint8_t *out, int64_t i, int64_t end, int mant, uint32_t emask,
                             const int32_t *ctx_base, const uint64_t *f0, const uint32_t *slots,
                             const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states,
                              uint32_t *changed, int64_t *n_changed, int zero_groups)
    int64_t ulp3_dec4_delta16(const uint16_t *r, uint16_t *out, int64_t i, int64_t end, int mant, uint32_t emask,
                              const int32_t *ctx_base, const uint64_t *f0, const uint32_t *slots,
                              const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states,
                              uint32_t *changed, int64_t *n_changed, int zero_groups)
    void ulp3_intra4_table(const uint32_t *slots, const uint32_t *lut, int s, void *t4)
    int64_t ulp3_dec4_intra16(uint16_t *out, int64_t i, int64_t end, int s, const void *t4,
                              const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states)
    int64_t ulp3_gen8_encode(const uint8_t *v, const uint16_t *sym, int64_t hi, int lanes, int mode, int tb, int s,
                             int width, const void *table, uint64_t *x, uint16_t *words, int64_t pos, int rare)
    int64_t ulp3_gen8_decode(const uint8_t *r, uint8_t *out, int64_t i, int64_t end, int lanes, int mode, int mant,
                             uint32_t emask, const int32_t *ctx_base, const uint32_t *slots, const uint32_t *lut, int s,
                             const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states)
    int64_t ulp3_gen16_encode(const uint16_t *v, const uint16_t *sym, int64_t hi, int lanes, int mode, int tb, int s,
                             int width, const void *table, uint64_t *x, uint16_t *words, int64_t pos, int rare)
    int64_t ulp3_gen16_decode(const uint16_t *r, uint16_t *out, int64_t i, int64_t end, int lanes, int mode, int mant,
                             uint32_t emask, const int32_t *ctx_base, const uint32_t *slots, const uint32_t *lut, int s,
                             const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states)
    int64_t ulp3_gen32_encode(const uint32_t *v, const uint16_t *sym, int64_t hi, int lanes, int mode, int tb, int s,
                             int width, const void *table, uint64_t *x, uint16_t *words, int64_t pos, int rare)
    int64_t ulp3_gen32_decode(const uint32_t *r, uint32_t *out, int64_t i, int64_t end, int lanes, int mode, int mant,
                             uint32_t emask, const int32_t *ctx_base, const uint32_t *slots, const uint32_t *lut, int s,
                             const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states)
    int64_t ulp3_gen64_encode(const uint64_t *v, const uint32_t *sym, int64_t hi, int lanes, int mode, int tb, int s,
                             int width, const void *table, uint64_t *x, uint16_t *words, int64_t pos, int rare)
    int64_t ulp3_gen64_decode(const uint64_t *r, uint64_t *out, int64_t i, int64_t end, int lanes, int mode, int mant,
                             uint32_t emask, const int32_t *ctx_base, const uint32_t *slots, const uint32_t *lut, int s,
                             const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states)
    int64_t ulp3_gen64i_encode(const uint64_t *v, const uint16_t *sym, int64_t hi, int lanes, int mode, int tb, int s,
                             int width, const void *table, uint64_t *x, uint16_t *words, int64_t pos, int rare)
    int64_t ulp3_gen64i_decode(const uint64_t *r, uint64_t *out, int64_t i, int64_t end, int lanes, int mode, int mant,
                             uint32_t emask, const int32_t *ctx_base, const uint32_t *slots, const uint32_t *lut, int s,
                             const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states)
    int64_t ulp3_avx2_encode16(const uint16_t *v, const uint16_t *sym, int64_t hi, int mode, int tb, int s,
                               int width, const ulp3_venc *vt, uint64_t *x, uint16_t *words, int64_t pos)
    int64_t ulp3_avx2_encode32(const uint32_t *v, const uint16_t *sym, int64_t hi, int mode, int tb, int s,
                               const ulp3_venc *vt, uint64_t *x, uint16_t *words, int64_t pos)
    int64_t ulp3_avx2_decode16(const uint16_t *r, uint16_t *out, int64_t i, int64_t end, int mode,
                               int mant_bits, int emask, int lo, int count, int s,
                               const uint32_t *slots, const uint64_t *e64, const uint8_t *words,
                               int64_t n_words, int64_t *pos_io, uint32_t *states)
    int64_t ulp3_avx2_decode32(const uint32_t *r, uint32_t *out, int64_t i, int64_t end, int mode,
                               int mant_bits, int emask, int lo, int count, int s,
                               const uint32_t *slots, const uint64_t *e64, const uint8_t *words,
                               int64_t n_words, int64_t *pos_io, uint32_t *states)

cdef enum:
    RAW_CHUNK = 15
    MAX_LANES = 32
    BLOCK3 = 4096  # elements decoded between two hash updates (a multiple of 32)
    BLOCK3_GROUPS = 1024  # BLOCK3 / 4: groups of 4 lanes in a block
    # a 4-lane delta tries its zero-group loop when some row gives token 0 this many slots of 4096 (a group of
    # four zeros then comes at least a third of the time; an RL step's rows give it ~4000, a dense delta's few)
    ZERO_GROUPS_FROM = 3072

#: True when this build runs the AVX2 loops of _one_stream_loops.h (16- and 32-bit words on 32 lanes).
HAVE_AVX2 = bool(ULP3_HAVE_AVX2)
#: The version-3 constants, for the tests that compare them with the twin's (_one_stream_rans, _one_stream).
CONSTANTS3 = {"RAW_CHUNK": RAW_CHUNK, "MAX_LANES": MAX_LANES}


def hash_fill(uint64_t value, uint64_t count, int itemsize):
    """``hash64`` of ``count`` copies of the ``itemsize``-byte little-endian ``value`` (constant memory)."""
    cdef uint64_t word = 0, acc = 0, salt = 0, last, nbytes = count * itemsize, full, j
    cdef int k, per = 8 // itemsize, rest
    for k in range(per):
        word |= value << (8 * itemsize * k)
    full = nbytes // 8
    with nogil:
        for j in range(full):
            salt += <uint64_t>0x9E3779B97F4A7C15ULL
            acc += mix(word + salt)
        rest = <int>(nbytes - 8 * full)
        if rest:
            last = word & (((<uint64_t>1) << (8 * rest)) - 1)
            salt += <uint64_t>0x9E3779B97F4A7C15ULL
            acc += mix(last + salt)
    return mix(acc + nbytes * <uint64_t>0x9E3779B97F4A7C15ULL)


def intra_symbols(const word_t[::1] x, int sym_shift, uint64_t sym_mask, sym_t[::1] sym_out):
    """``sym = (x >> sym_shift) & sym_mask``; returns ``hash64(x)`` (hashed block by block)."""
    cdef Py_ssize_t n = x.shape[0], i, lo = 0, hi
    cdef const word_t* px = &x[0] if n else NULL
    cdef sym_t* ps = &sym_out[0] if n else NULL
    cdef Hasher hs = Hasher(0, 0, 0)
    cdef uint64_t digest
    with nogil:
        while lo < n:
            hi = min(n, lo + BLOCK3)
            for i in range(lo, hi):
                ps[i] = <sym_t>((px[i] >> sym_shift) & sym_mask)
            hash_words(&hs, <const uint8_t*>px, hi * <Py_ssize_t>sizeof(word_t))
            lo = hi
        digest = hash_final(&hs, <const uint8_t*>px, n * <Py_ssize_t>sizeof(word_t))
    return digest


# -- encoding ------------------------------------------------------------------------


cdef inline uint64_t enc_raw(uint64_t x, uint64_t bits, int c, uint16_t* words, Py_ssize_t* pos) noexcept nogil:
    """Push ``c`` (0..15) raw bits: renormalise (emit 16 bits) if ``x << c`` would reach 2**31."""
    cdef uint64_t emit = x >= ((<uint64_t>1) << (31 - c))
    cdef uint64_t mask = 0 - emit
    words[pos[0] - 1] = <uint16_t>x  # harmless when not emitting: the slot is still free
    pos[0] -= emit
    x = (x & ~mask) | ((x >> 16) & mask)
    return (x << c) | bits


cdef inline uint64_t enc3_raw_of(int mode, uint64_t value, sym_t sy, int tb, int s, int width, int* nb) noexcept nogil:
    """An element's raw value and its bit count (mode 0: value is the residual; 1: the value)."""
    if mode == 0:
        nb[0] = tail_len(<int>(sy & ((1u << tb) - 1)))
        return value & (((<uint64_t>1) << nb[0]) - 1)
    nb[0] = s + 1
    return ((value >> (width - 1)) << s) | (value & (((<uint64_t>1) << s) - 1))


cdef Py_ssize_t enc3_groups(const word_t* v, const sym_t* sym, Py_ssize_t lo, Py_ssize_t hi, int mode, int tb,
                            int s, int width, const EncEntry* tab, int lanes, int phases,
                            uint64_t* x, uint16_t* words, Py_ssize_t pos, bint mostly_zero) noexcept nogil:
    """Encode the groups of [lo, hi) (lo at a group boundary, hi at one or the end), last first; any
    number of raw phases.  Returns the new word position."""
    cdef Py_ssize_t g, end, i, j, base, group = min(lanes, 8)
    cdef uint64_t raws[8]
    cdef int nbs[8]
    cdef int p, c
    g = ((hi - 1 - lo) // group) * group + lo
    while g >= lo:
        end = min(hi, g + group)
        base = g % lanes
        for i in range(g, end):
            raws[i - g] = enc3_raw_of(mode, v[i], sym[i], tb, s, width, &nbs[i - g])
        for p in range(phases - 1, -1, -1):
            for j in range(end - g - 1, -1, -1):
                c = min(max(nbs[j] - RAW_CHUNK * p, 0), RAW_CHUNK)
                x[base + j] = enc_raw(x[base + j], (raws[j] >> (RAW_CHUNK * p)) & ((1u << c) - 1), c, words, &pos)
        for j in range(end - g - 1, -1, -1):
            x[base + j] = enc_put(x[base + j], &tab[sym[g + j]], words, &pos, mostly_zero)
        g -= group
    return pos


def rans_encode3(const word_t[::1] v, const sym_t[::1] sym, int mode, int p_a, int p_b,
                 const uint8_t[::1] table, int lanes, int phases, uint16_t[::1] words_out,
                 uint32_t[::1] states_out, bint mostly_zero=False):
    """Encode every element (token, then raw chunks) in the reverse of decoding order.

    See ``_one_stream_rans.rans_encode3``.  ``table`` holds one EncEntry per symbol value.
    ``words_out`` needs ``len(v) * (1 + phases) + 8`` slots; returns the number of
    words (at its end).  ``mostly_zero`` is a speed hint (renormalisation is rare);
    the output does not depend on it.
    """
    cdef Py_ssize_t n = v.shape[0], cap = words_out.shape[0], pos = words_out.shape[0]
    cdef Py_ssize_t group = min(lanes, 8), whole
    cdef int j, tb = p_a, s = p_a, width = p_b
    cdef uint64_t x[MAX_LANES]
    cdef const EncEntry* tab = <const EncEntry*>&table[0]
    cdef uint16_t* words = &words_out[0]
    cdef const word_t* pv = &v[0] if n else NULL
    cdef const sym_t* ps = &sym[0] if n else NULL
    cdef ulp3_venc* vt = NULL
    cdef Py_ssize_t simd_end = 0
    if (mode not in (0, 1) or lanes not in (4, 32) or phases < 1 or phases > 5 or cap < n * (1 + phases) + 8
            or states_out.shape[0] != lanes or sym.shape[0] != n):
        raise ValueError("rans_encode3: inconsistent arguments")
    if ULP3_HAVE_AVX2 and sym_t is uint16_t and lanes == 32 and n >= 64 and (
            (word_t is uint16_t and phases == 1) or (word_t is uint32_t and phases == 2)):
        vt = <ulp3_venc*>malloc((table.shape[0] // sizeof(EncEntry)) * sizeof(ulp3_venc))
        if vt == NULL:
            raise MemoryError()
    with nogil:
        for j in range(lanes):
            x[j] = STATE_LOW
        whole = (n // group) * group
        # the last, partial group is encoded first
        pos = enc3_groups(pv, ps, whole, n, mode, tb, s, width, tab, lanes, phases, x, words, pos, mostly_zero)
        if vt != NULL:  # the vector loop takes whole blocks of 32 from the top
            simd_end = whole - whole % 32
            pos = enc3_groups(pv, ps, simd_end, whole, mode, tb, s, width, tab, lanes, phases, x, words, pos,
                              mostly_zero)
            ulp3_venc_table(tab, table.shape[0] // sizeof(EncEntry), vt)
            if word_t is uint16_t:
                pos = ulp3_avx2_encode16(<const uint16_t*>pv, <const uint16_t*>ps, simd_end, mode, tb, s, width, vt,
                                         x, words, pos)
            else:
                pos = ulp3_avx2_encode32(<const uint32_t*>pv, <const uint16_t*>ps, simd_end, mode, tb, s, vt, x,
                                         words, pos)
            whole = 0
        if phases == 1 and sizeof(word_t) <= 2 and sizeof(sym_t) == 2:
            pos = ulp3_encode_p1(pv, sizeof(word_t), <const uint16_t*>ps, whole, mode, tb, s, width, tab,
                                 lanes, x, words, pos, mostly_zero)
        elif word_t is uint32_t and sym_t is uint16_t and phases == 2:
            pos = ulp3_gen32_encode(pv, ps, whole, lanes, mode, tb, s, width, tab, x, words, pos, mostly_zero)
        elif word_t is uint64_t and sym_t is uint32_t and phases == 5:
            pos = ulp3_gen64_encode(pv, ps, whole, lanes, mode, tb, s, width, tab, x, words, pos, mostly_zero)
        elif word_t is uint64_t and sym_t is uint16_t and phases == 4:
            pos = ulp3_gen64i_encode(pv, ps, whole, lanes, mode, tb, s, width, tab, x, words, pos, mostly_zero)
        else:
            pos = enc3_groups(pv, ps, 0, whole, mode, tb, s, width, tab, lanes, phases, x, words, pos, mostly_zero)
        for j in range(lanes):
            states_out[j] = <uint32_t>x[j]
    free(vt)
    return cap - pos


# -- decoding ------------------------------------------------------------------------


cdef inline void hash_pair_words(Hasher* hr, Hasher* ho, const uint8_t* pr, const uint8_t* po,
                                 Py_ssize_t upto) noexcept nogil:
    """``hash_words`` of the reference and of the values over the same words at once: a word
    the delta left unchanged (most of them, in sparse deltas) is mixed once for both."""
    cdef uint64_t a, b, m
    cdef int64_t nw
    if ULP3_HAVE_AVX2:  # whole groups of 8 words in AVX2 registers (the same sums)
        nw = ((upto - hr.done) >> 3) & ~(<int64_t>7)
        if nw > 0:
            ulp_hash_sum_pair(pr + hr.done, po + hr.done, nw, hr.salt, &hr.acc, &ho.acc)
            hr.salt += <uint64_t>nw * <uint64_t>0x9E3779B97F4A7C15ULL
            hr.done += nw * 8
    while hr.done + 8 <= upto:
        hr.salt += <uint64_t>0x9E3779B97F4A7C15ULL
        a = load64(pr + hr.done)
        b = load64(po + hr.done)
        m = mix(a + hr.salt)
        hr.acc += m
        ho.acc += m if a == b else mix(b + hr.salt)
        hr.done += 8
    ho.salt = hr.salt
    ho.done = hr.done


cdef inline void hash_word_fix(Hasher* ho, const uint8_t* pr, const uint8_t* po, int64_t w) noexcept nogil:
    """Correct ``ho`` (which counted reference word ``w`` for the values) where value word ``w`` differs."""
    cdef uint64_t a = load64(pr + 8 * w), b = load64(po + 8 * w)
    cdef uint64_t salt = <uint64_t>(w + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
    if a != b:
        ho.acc += mix(b + salt) - mix(a + salt)


cdef inline void hash_patched_words(Hasher* hr, Hasher* ho, const uint8_t* pr, const uint8_t* po, Py_ssize_t upto,
                                    const uint32_t* changed, int64_t n_changed, Py_ssize_t rest) noexcept nogil:
    """``hash_pair_words`` of a 4-lane delta of 16-bit words whose values equal the reference except in the
    groups ``changed`` (group g of 4 elements is word g / 4) and from element ``rest`` on: the reference is
    hashed once, and the values' sum is the reference's corrected at those words only (a sparse delta's
    values cost no second pass)."""
    cdef uint64_t before = hr.acc
    cdef int64_t w0 = hr.done >> 3, w1, w, k
    hash_words(hr, pr, upto)
    w1 = hr.done >> 3
    ho.acc += hr.acc - before
    for k in range(n_changed):
        w = changed[k] >> 2
        if w0 <= w < w1:
            hash_word_fix(ho, pr, po, w)
    for w in range(max(w0, <int64_t>(rest >> 2)), w1):
        hash_word_fix(ho, pr, po, w)
    ho.salt = hr.salt
    ho.done = hr.done


cdef struct Dec3:
    # one section being decoded (see rans_decode3)
    const uint32_t* slots
    const uint32_t* lut
    const int32_t* ctx_base   # per context: its band row << 12 (delta)
    const uint8_t* words
    int64_t n_words
    int64_t pos
    int mode, lanes, phases, mant_bits, s, width
    uint32_t emask
    uint32_t x[MAX_LANES]


cdef inline int dec3_refill(Dec3* d, uint64_t* x) noexcept nogil:
    cdef uint16_t w16
    if x[0] < STATE_LOW:
        if d.pos >= d.n_words:
            return -1
        memcpy(&w16, d.words + 2 * d.pos, 2)
        d.pos += 1
        x[0] = (x[0] << 16) | w16
    return 0


cdef inline word_t dec3_value(Dec3* d, word_t ref, int t, uint64_t raw) noexcept nogil:
    """The value of an element from its token (rank) and raw bits."""
    cdef int nb, width = sizeof(word_t) * 8
    cdef uint64_t z, wmask = (<uint64_t>-1) >> (64 - width), h = (<uint64_t>1) << (width - 1)
    if d.mode != 1:  # delta (mode 0) or against +0.0 (mode 2, ref = 0)
        nb = tail_len(t)
        z = ((<uint64_t>(t - 4 * nb)) << nb) | raw
        return <word_t>unkey((key(ref, h, wmask, width) + ((z >> 1) ^ (0 - (z & 1)))) & wmask, h, wmask, width)
    return <word_t>(((raw >> d.s) << (width - 1)) | ((<uint64_t>d.lut[t]) << d.s) | (raw & (((<uint64_t>1) << d.s) - 1)))


cdef int dec3_groups(Dec3* d, const word_t* r, word_t* out, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    """Decode the elements [lo, hi) (lo at a group boundary), scalar, every word read checked."""
    cdef Py_ssize_t i, j, base, group = min(d.lanes, 8), end
    cdef uint64_t x, e, raw
    cdef int tokens[8]
    cdef uint64_t raws[8]
    cdef int p, c, nb, t
    cdef int32_t rowbase = 0
    cdef word_t ref
    while lo < hi:
        end = min(hi, lo + group)
        base = lo % d.lanes
        for i in range(lo, end):
            if d.mode == 0:
                rowbase = d.ctx_base[(r[i] >> d.mant_bits) & d.emask]
            x = d.x[base + i - lo]
            e = d.slots[rowbase + (x & (SCALE - 1))]
            x = (((e >> 12) & 0xFFF) + 1) * (x >> SCALE_BITS) + (e & 0xFFF)
            if dec3_refill(d, &x):
                return -1
            d.x[base + i - lo] = <uint32_t>x
            tokens[i - lo] = <int>(e >> 24)
            raws[i - lo] = 0
        for p in range(d.phases):
            for i in range(lo, end):
                j = i - lo
                nb = tail_len(tokens[j]) if d.mode != 1 else d.s + 1
                c = min(max(nb - RAW_CHUNK * p, 0), RAW_CHUNK)
                x = d.x[base + j]
                raws[j] |= (x & ((1u << c) - 1)) << (RAW_CHUNK * p)
                x >>= c
                if dec3_refill(d, &x):
                    return -1
                d.x[base + j] = <uint32_t>x
        for i in range(lo, end):
            ref = r[i] if d.mode == 0 else 0  # typed: word_t picks dec3_value's specialisation
            out[i] = dec3_value(d, ref, tokens[i - lo], raws[i - lo])
        lo = end
    return 0


def rans_decode3(const word_t[::1] r, int mode, int p_a, int p_b, int p_c, int mant_bits, uint32_t emask,
                 const uint32_t[::1] slots, const uint32_t[::1] lut, int lanes, int phases,
                 const uint8_t[::1] words, const uint32_t[::1] states, word_t[::1] out, uint64_t[::1] hashes_out):
    """Decode every element into ``out`` (values); returns 0 or a negative status.

    See ``_one_stream_rans.rans_decode3``.  Delta: ``r`` is the reference, ``p_b, p_c``
    the band; intra: ``r`` is not read, ``p_a = s``.  Writes ``hashes_out =
    [hash64(out), hash64(r) or 0]``.  Statuses: -1 the words end early, -3 a lane
    does not end at 2**15, -5 words are left over, -9 inconsistent arguments.
    """
    cdef Py_ssize_t n = out.shape[0]
    cdef int status
    cdef uint64_t hashes[2]
    cdef Py_ssize_t rows = (p_c + 1) if mode == 0 else 1
    if (lanes not in (4, 32) or states.shape[0] != lanes or phases < 1 or phases > 5 or p_c < 0 or mode < 0 or mode > 2
            or slots.shape[0] < rows * SCALE or (mode == 0 and r.shape[0] != n) or (mode == 1 and lut.shape[0] < 256)
            or (mode == 1 and (p_a < 0 or p_a + 1 > 15 * phases))):
        return -9
    with nogil:
        status = decode3_core(&r[0] if (mode == 0 and n) else <const word_t*>NULL, &out[0] if n else NULL, n, mode,
                              p_a, p_b, p_c, mant_bits, emask, &slots[0], &lut[0] if lut.shape[0] else NULL, lanes,
                              phases, &words[0] if words.shape[0] else NULL, words.shape[0] // 2, &states[0], hashes)
    if status == 0:
        hashes_out[0] = hashes[0]
        hashes_out[1] = hashes[1]
    return status


cdef int decode3_core(const word_t* pr, word_t* po, Py_ssize_t n, int mode, int p_a, int p_b, int p_c, int mant_bits,
                      uint32_t emask, const uint32_t* slots, const uint32_t* lut, int lanes, int phases,
                      const uint8_t* words, int64_t n_words, const uint32_t* states,
                      uint64_t* hashes_out) noexcept nogil:
    """:func:`rans_decode3` on checked arguments (``pr`` NULL unless a delta): 0 or a status, ``hashes_out``
    written on success."""
    cdef Py_ssize_t lo = 0, hi, c, n_ctx = emask + 1
    cdef int status = 0, j
    cdef Dec3 d
    cdef Hasher ho = Hasher(0, 0, 0), hr = Hasher(0, 0, 0)
    cdef int32_t* ctx_base = NULL
    cdef uint64_t* f0 = NULL
    cdef uint64_t* e64 = NULL  # the INTRA slot table of the AVX2 loops (ulp3_intra_table) or the 4-lane loop (ulp3_intra4_table)
    cdef uint32_t changed[BLOCK3_GROUPS]  # a 4-lane delta block's groups not copied from the reference
    cdef int64_t n_changed = 0
    cdef Py_ssize_t fast_end = 0  # where the 4-lane loop stopped in the block
    cdef uint32_t f, row
    cdef int zero_groups = 0  # whether the 4-lane delta loop tries groups of four zero tokens (token 0 common)
    d.slots = slots
    d.lut = lut
    d.words = words
    d.n_words = n_words
    d.pos = 0
    d.mode, d.lanes, d.phases, d.mant_bits, d.s, d.width = mode, lanes, phases, mant_bits, p_a, p_b
    d.emask = emask
    for j in range(lanes):
        d.x[j] = states[j]
    if mode == 0:
        ctx_base = <int32_t*>malloc(n_ctx * sizeof(int32_t))
        f0 = <uint64_t*>malloc(n_ctx * sizeof(uint64_t))
        if ctx_base == NULL or f0 == NULL:
            status = -8
        else:
            for c in range(n_ctx):
                row = <uint32_t>(c - p_b + 1) if <uint64_t>(c - p_b) < <uint64_t>p_c else 0
                ctx_base[c] = <int32_t>(row << SCALE_BITS)
                # token 0 starts its row iff the row's first slot decodes token 0
                f = slots[row << SCALE_BITS]
                f0[c] = (((f >> 12) & 0xFFF) + 1) if (f >> 24) == 0 else 0
                zero_groups |= f0[c] >= ZERO_GROUPS_FROM
        d.ctx_base = ctx_base
    elif mode == 1 and ((ULP3_HAVE_AVX2 and lanes == 32 and (
            (word_t is uint16_t and phases == 1) or (word_t is uint32_t and phases == 2)))
            or (lanes == 4 and word_t is uint16_t and phases == 1)):
        e64 = <uint64_t*>malloc(SCALE * sizeof(uint64_t))
        if e64 == NULL:
            status = -8
        elif lanes == 4:
            ulp3_intra4_table(d.slots, d.lut, p_a, e64)
        else:
            ulp3_intra_table(d.slots, d.lut, e64)
    while status == 0 and lo < n:
        hi = min(n, lo + BLOCK3)
        if word_t is uint16_t:
            if lanes == 32 and phases == 1 and mode != 2:
                lo = ulp3_avx2_decode16(pr, po, lo, hi, mode, mant_bits, emask, p_b, p_c, p_a, d.slots,
                                        e64, d.words, d.n_words, &d.pos, d.x)
        elif word_t is uint32_t:
            if lanes == 32 and phases == 2:
                lo = ulp3_avx2_decode32(pr, po, lo, hi, mode, mant_bits, emask, p_b, p_c, p_a, d.slots,
                                        e64, d.words, d.n_words, &d.pos, d.x)
        if word_t is uint16_t:
            if lanes == 4 and mode == 1 and phases == 1:
                lo = ulp3_dec4_intra16(po, lo, hi, p_a, e64, d.words, d.n_words, &d.pos, d.x)
        n_changed = 0
        fast_end = lo
        if lanes == 4 and mode == 0:
            if word_t is uint16_t:
                lo = ulp3_dec4_delta16(pr, po, lo, hi, mant_bits, emask, ctx_base, f0, d.slots, d.words,
                                       d.n_words, &d.pos, d.x, changed, &n_changed, zero_groups)
            elif word_t is uint8_t:
                lo = ulp3_dec4_delta8(pr, po, lo, hi, mant_bits, emask, ctx_base, f0, d.slots, d.words,
                                      d.n_words, &d.pos, d.x, changed, &n_changed, zero_groups)
            fast_end = lo
        # then the unrolled scalar C loop for every layout, while words are plentiful
        if word_t is uint8_t and phases == 1:
            lo = ulp3_gen8_decode(pr, po, lo, hi, lanes, mode, mant_bits, emask, ctx_base, d.slots, d.lut, p_a,
                                  d.words, d.n_words, &d.pos, d.x)
        elif word_t is uint16_t and phases == 1:
            lo = ulp3_gen16_decode(pr, po, lo, hi, lanes, mode, mant_bits, emask, ctx_base, d.slots, d.lut, p_a,
                                   d.words, d.n_words, &d.pos, d.x)
        elif word_t is uint32_t and phases == 2:
            lo = ulp3_gen32_decode(pr, po, lo, hi, lanes, mode, mant_bits, emask, ctx_base, d.slots, d.lut, p_a,
                                   d.words, d.n_words, &d.pos, d.x)
        elif word_t is uint64_t and phases == 5:
            lo = ulp3_gen64_decode(pr, po, lo, hi, lanes, mode, mant_bits, emask, ctx_base, d.slots, d.lut, p_a,
                                   d.words, d.n_words, &d.pos, d.x)
        elif word_t is uint64_t and phases == 4:
            lo = ulp3_gen64i_decode(pr, po, lo, hi, lanes, mode, mant_bits, emask, ctx_base, d.slots, d.lut, p_a,
                                    d.words, d.n_words, &d.pos, d.x)
        if lo < hi:  # the end of the word stream: every read checked
            status = dec3_groups(&d, pr, po, lo, hi)
        if word_t is uint16_t and mode == 0 and lanes == 4 and hi - fast_end <= 256:
            hash_patched_words(&hr, &ho, <const uint8_t*>pr, <const uint8_t*>po, hi * <Py_ssize_t>sizeof(word_t),
                               changed, n_changed, fast_end)
        elif mode == 0:
            hash_pair_words(&hr, &ho, <const uint8_t*>pr, <const uint8_t*>po, hi * <Py_ssize_t>sizeof(word_t))
        else:
            hash_words(&ho, <const uint8_t*>po, hi * <Py_ssize_t>sizeof(word_t))
        lo = hi
    free(ctx_base)
    free(f0)
    free(e64)
    if status == 0:
        if d.pos != d.n_words:
            status = -5
        else:
            for j in range(lanes):
                if d.x[j] != STATE_LOW:
                    status = -3
    if status == 0:
        hashes_out[0] = hash_final(&ho, <const uint8_t*>po, n * <Py_ssize_t>sizeof(word_t))
        hashes_out[1] = hash_final(&hr, <const uint8_t*>pr, n * <Py_ssize_t>sizeof(word_t)) if mode == 0 else 0
    return status


# -- tables ------------------------------------------------------------------------


def pack_table3(int has_band, int band_count, int band_lo, const uint32_t[:, ::1] freqs,
                const int64_t[::1] scales, const int64_t[::1] orders, uint8_t[::1] out):
    """Write a version-3 table into zeroed ``out``; returns its length in bits (see the twin).

    ``out`` needs ``4 + rows * (4 + 4 * alphabet)`` bytes.
    """
    cdef Py_ssize_t rows = freqs.shape[0], alphabet = freqs.shape[1], i, t, k, prev, first
    cdef int64_t pos = 0
    cdef uint8_t* o = &out[0]
    cdef uint64_t v
    cdef int g
    if scales.shape[0] < rows or orders.shape[0] < rows:
        raise ValueError("pack_table3: one scale and one order per row")
    with nogil:
        if has_band:
            put_gamma(o, &pos, band_count + 1)
            if band_count:
                put_gamma(o, &pos, band_lo + 1)
        for i in range(rows):
            k = 0
            for t in range(alphabet):
                k += freqs[i, t] != 0
            put_gamma(o, &pos, k + 1)
            if k >= 2:
                put_gamma(o, &pos, SCALE_BITS + 1 - scales[i])
                put_gamma(o, &pos, orders[i] + 1)
            prev = -1
            first = -1
            for t in range(alphabet):
                if freqs[i, t]:
                    put_gamma(o, &pos, t - prev)
                    prev = t
                    if first < 0:
                        first = t
            if first >= 0:
                g = <int>orders[i]
                for t in range(first + 1, alphabet):
                    if freqs[i, t]:
                        v = freqs[i, t] - 1  # Exp-Golomb of order g
                        put_gamma(o, &pos, (v >> g) + 1)
                        put_msb(o, &pos, v, g)
    return pos


def read_table3(const uint8_t[::1] data, int has_band, int n_ctx, int alphabet, int max_tokens,
                int64_t[::1] band_out, uint32_t[:, ::1] freqs_out):
    """Parse a version-3 table into ``freqs_out`` (at scale 2**12; the rows of the band are overwritten); returns
    its length in bytes or a status: -1 truncated, -2 a value out of range, -3 a token beyond the alphabet or
    more than ``max_tokens`` in a row, -4 nothing left for a row's first token, -5 non-zero
    padding, -9 ``freqs_out`` too small."""
    cdef int64_t used
    if alphabet > freqs_out.shape[1] or band_out.shape[0] < 2:
        return -9
    with nogil:
        used = table3_core(&data[0] if data.shape[0] else NULL, data.shape[0], has_band, n_ctx, alphabet, max_tokens,
                           freqs_out.shape[0], freqs_out.shape[1], &freqs_out[0, 0], &band_out[0])
    return used


cdef int64_t table3_core(const uint8_t* dp, int64_t nbytes, int has_band, int n_ctx, int alphabet, int max_tokens,
                         Py_ssize_t rows_cap, Py_ssize_t stride, uint32_t* freqs, int64_t* band_out) noexcept nogil:
    """:func:`read_table3` into ``freqs`` (``rows_cap`` rows ``stride`` apart, each row of the band zeroed
    before it is read): its length in bytes, or a status; ``band_out`` gets (count, lo)."""
    cdef int64_t end = 8 * nbytes, pos = 0, count = 0, lo = 0, k, t, value, rest, j, i, scale, order, b
    cdef int status = 0
    cdef int64_t first
    if has_band:
        status = get_gamma(dp, end, &pos, n_ctx + 1, &value)
        if not status:
            count = value - 1
            if count:
                status = get_gamma(dp, end, &pos, n_ctx - count + 1, &value)
                lo = value - 1
    if not status and count + 1 > rows_cap:
        status = -9
    i = 0
    while not status and i <= count:
        memset(freqs + i * stride, 0, alphabet * sizeof(uint32_t))
        status = get_gamma(dp, end, &pos, alphabet + 1, &k)
        if status:
            break
        k -= 1
        if k > max_tokens:
            status = -3
            break
        scale = SCALE_BITS
        order = 0
        if k >= 2:
            status = get_gamma(dp, end, &pos, SCALE_BITS + 1, &value)
            if status:
                break
            scale = SCALE_BITS + 1 - value
            status = get_gamma(dp, end, &pos, scale + 1, &value)
            if status:
                break
            order = value - 1
        t = -1
        first = -1
        rest = (<int64_t>1) << scale
        for j in range(k):
            status = get_gamma(dp, end, &pos, alphabet, &value)
            if status:
                break
            t += value
            if t >= alphabet:
                status = -3
                break
            freqs[i * stride + t] = 1  # occurs; frequency below
            if first < 0:
                first = t
        if status:
            break
        if first >= 0:
            for t in range(first + 1, alphabet):
                if freqs[i * stride + t]:
                    status = get_gamma(dp, end, &pos, ((((<int64_t>1) << scale) - 2) >> order) + 1, &value)
                    if status:
                        break
                    if pos + order > end:
                        status = -1
                        break
                    value -= 1
                    for b in range(order):
                        value = (value << 1) | ((dp[pos >> 3] >> (7 - (pos & 7))) & 1)
                        pos += 1
                    value += 1
                    if value > ((<int64_t>1) << scale) - 1:
                        status = -2
                        break
                    freqs[i * stride + t] = <uint32_t>(value << (SCALE_BITS - scale))
                    rest -= value
        if status:
            break
        if k:
            if rest < 1:
                status = -4
                break
            freqs[i * stride + first] = <uint32_t>(rest << (SCALE_BITS - scale))
        i += 1
    if not status and pos % 8 and (dp[pos >> 3] & (0xFF >> (pos & 7))):
        status = -5
    band_out[0] = count
    band_out[1] = lo
    return status if status else (pos + 7) // 8


def slot_table3(const uint32_t[:, ::1] freqs, int rank_mode, uint32_t[::1] slots_out, uint32_t[::1] lut_out):
    """One entry per (row, slot): ``token << 24 | (f - 1) << 12 | (slot - start)`` (see the twin)."""
    if slots_out.shape[0] < freqs.shape[0] * SCALE or (rank_mode and lut_out.shape[0] < 256):
        raise ValueError("slot_table3: output too small")
    with nogil:
        slot3_core(&freqs[0, 0], freqs.shape[0], freqs.shape[1], freqs.shape[1], rank_mode, &slots_out[0],
                   &lut_out[0] if lut_out.shape[0] else NULL)


cdef void slot3_core(const uint32_t* freqs, Py_ssize_t rows, Py_ssize_t alphabet, Py_ssize_t stride, int rank_mode,
                     uint32_t* o, uint32_t* lut_out) noexcept nogil:
    """:func:`slot_table3` on rows ``stride`` apart (``lut_out``: 256 entries, written with ``rank_mode``)."""
    cdef Py_ssize_t i, t, rank
    cdef uint32_t f, j, code
    for i in range(rows):
        rank = 0
        for t in range(alphabet):
            f = freqs[i * stride + t]
            if f == 0:
                continue
            code = <uint32_t>(rank if rank_mode else t)
            if rank_mode:
                lut_out[rank] = <uint32_t>t
            for j in range(f):
                o[0] = (code << 24) | ((f - 1) << 12) | j
                o += 1
            rank += 1
        if rank == 0:
            for j in range(SCALE):
                o[0] = ((SCALE - 1) << 12) | j
                o += 1


# -- a whole payload in one call ------------------------------------------------------


cdef enum:
    SEC3_PARAMS = -20    # invalid section parameters
    SEC3_STATES = -21    # lane states truncated or out of range
    SEC3_ODD = -22       # an odd number of bytes of rANS words
    SEC3_EMPTY = -23     # a table without any token
    SEC3_CAPACITY = -24  # more elements declared than the payload can hold
    SEC3_CONSTANT = 1    # a constant tensor against +0.0 (no capacity bound): the caller's slower path decodes it
    STEPS_PER_WORD = 46000  # (_one_stream._STEPS_PER_WORD)


cdef struct Sec3:
    # a parsed version-3 section and the rans_decode3 arguments it implies
    int lanes, mode, p_a, p_b, p_c, phases
    Py_ssize_t rows, alphabet
    const uint8_t* words
    int64_t n_words
    uint32_t states[MAX_LANES]


cdef int sec3_parse(const uint8_t* p, int64_t size, bint intra, bint has_ref, int width, int mant_bits, int exp_bits,
                    int token_bits, int alphabet, uint32_t emask, int64_t n, uint32_t** freqs_out,
                    Sec3* s) noexcept nogil:
    """The checks and arguments of ``_one_stream.section3_args`` on the payload ``p[:size]``: 0 or a status
    (a table status minus 100); ``freqs_out[0]``: the rows' frequencies (malloc'ed, the caller frees)."""
    cdef int params, kk, max_tokens, n_ctx, lane, c
    cdef bint has_band
    cdef int64_t used, pos, band[2], capacity
    cdef Py_ssize_t rows_cap, i, t0
    cdef uint32_t x
    cdef uint32_t* freqs
    cdef bint any_token = False
    if size < 1:
        return -101  # (the table status of a truncated table: the params byte is missing)
    params = p[0]
    kk = (params >> 2) & 3
    if params >> 4 or (params & 3) >= 2 or (kk and not intra) or kk > min(3, mant_bits):
        return SEC3_PARAMS
    s.lanes = 4 if (params & 3) == 0 else 32
    if intra:
        s.alphabet, has_band, n_ctx, max_tokens = (<Py_ssize_t>1) << (exp_bits + kk), False, 1, 256
    else:
        s.alphabet, has_band, n_ctx, max_tokens = alphabet, emask > 0, emask + 1, alphabet
    rows_cap = n_ctx + 1 if has_band else 1
    freqs = <uint32_t*>malloc(rows_cap * s.alphabet * sizeof(uint32_t))
    freqs_out[0] = freqs
    if freqs == NULL:
        return -8
    used = table3_core(p + 1, size - 1, has_band, n_ctx, <int>s.alphabet, max_tokens, rows_cap, s.alphabet, freqs,
                       band)
    if used < 0:
        return <int>used - 100
    s.rows = band[0] + 1
    pos = 1 + used
    if size - pos < 4 * s.lanes:
        return SEC3_STATES
    for lane in range(s.lanes):
        memcpy(&x, p + pos + 4 * lane, 4)
        if x < STATE_LOW or x >= (<uint32_t>1) << 31:
            return SEC3_STATES
        s.states[lane] = x
    pos += 4 * s.lanes
    if (size - pos) % 2:
        return SEC3_ODD
    s.words, s.n_words = p + pos, (size - pos) // 2
    for i in range(s.rows * s.alphabet):
        any_token |= freqs[i] != 0
    if not any_token:
        return SEC3_EMPTY
    capacity = 31 * s.lanes + 16 * s.n_words
    if intra:
        if n * (mant_bits - kk + 1) > capacity:
            return SEC3_CAPACITY
        s.mode, s.p_a, s.p_b, s.p_c = 1, mant_bits - kk, width, 0
        s.phases = (mant_bits - kk + 1 + RAW_CHUNK - 1) // RAW_CHUNK
    else:
        if not has_ref:  # against +0.0, one row
            t0 = 0
            while freqs[t0] == 0:
                t0 += 1
            if freqs[t0] == SCALE and t0 < 8:
                return SEC3_CONSTANT
            if n > STEPS_PER_WORD * (s.lanes + s.n_words):
                return SEC3_CAPACITY
        s.mode, s.p_a, s.p_b, s.p_c = (0 if has_ref else 2), token_bits, <int>band[1], <int>band[0]
        s.phases = (width - 3 + RAW_CHUNK - 1) // RAW_CHUNK
    return 0


_WORD_TYPES = {wb: np.dtype(f"<u{wb}") for wb in (1, 2, 4, 8)}


def decode3(blob, Py_ssize_t start, Py_ssize_t end, out, ref, bint intra, int width, int mant_bits, int exp_bits,
            int token_bits, int alphabet, uint32_t emask, int64_t n):
    """A version-3 RANS or INTRA payload ``blob[start:end]`` decoded in one call: ``_one_stream.section3_args``'
    checks, the tables and :func:`rans_decode3`, the GIL released throughout.

    ``out``: the words to write (``n`` of ``width`` bits), or None for a new array, made only once the
    payload is known to hold ``n`` elements; ``ref``: the reference words of a delta, or None.  Returns
    ``(status, out, hash64(values), hash64(ref) or 0)``; status 0, or any other value when the payload is
    damaged, inconsistent or a constant tensor against +0.0 (then ``out`` is None or partly written, and
    the caller's step-by-step path says what is wrong, or decodes the constant).
    """
    cdef Py_buffer bb, ob, rb
    cdef Sec3 s
    cdef uint32_t* freqs = NULL
    cdef uint32_t* slots = NULL
    cdef uint32_t lut[256]
    cdef uint64_t hashes[2]
    cdef int status, wb = width // 8
    cdef const uint8_t* pr
    cdef bint got_o = False, got_r = False
    if width not in (8, 16, 32, 64) or not 0 <= mant_bits < width or not 0 < exp_bits < width or alphabet > 256:
        raise ValueError("decode3: not a float format")
    hashes[0] = hashes[1] = 0
    s.rows = 0
    PyObject_GetBuffer(blob, &bb, PyBUF_SIMPLE)
    try:
        if not 0 <= start <= end <= bb.len:
            raise ValueError("decode3: the payload lies outside the blob")
        with nogil:
            status = sec3_parse(<const uint8_t*>bb.buf + start, end - start, intra, ref is not None, width, mant_bits,
                                exp_bits, token_bits, alphabet, emask, n, &freqs, &s)
            if not status:
                slots = <uint32_t*>malloc(s.rows * SCALE * sizeof(uint32_t))
                if slots == NULL:
                    status = -8
                else:
                    memset(lut, 0, sizeof(lut))
                    slot3_core(freqs, s.rows, s.alphabet, s.alphabet, intra, slots, lut)
            free(freqs)
        if status:
            return status, None, 0, 0
        if out is None:
            out = np.empty(n, dtype=_WORD_TYPES[wb])
        PyObject_GetBuffer(out, &ob, PyBUF_WRITABLE)
        got_o = True
        if ref is not None:
            PyObject_GetBuffer(ref, &rb, PyBUF_SIMPLE)
            got_r = True
        if ob.len != n * wb or (got_r and rb.len != n * wb):
            raise ValueError("decode3: out and ref must hold n words")
        pr = <const uint8_t*>rb.buf if got_r and n else NULL
        with nogil:
            if wb == 1:
                status = decode3_core(<const uint8_t*>pr, <uint8_t*>ob.buf, n, s.mode, s.p_a, s.p_b, s.p_c,
                                      mant_bits, emask, slots, lut, s.lanes, s.phases, s.words, s.n_words, s.states,
                                      hashes)
            elif wb == 2:
                status = decode3_core(<const uint16_t*>pr, <uint16_t*>ob.buf, n, s.mode, s.p_a, s.p_b, s.p_c,
                                      mant_bits, emask, slots, lut, s.lanes, s.phases, s.words, s.n_words, s.states,
                                      hashes)
            elif wb == 4:
                status = decode3_core(<const uint32_t*>pr, <uint32_t*>ob.buf, n, s.mode, s.p_a, s.p_b, s.p_c,
                                      mant_bits, emask, slots, lut, s.lanes, s.phases, s.words, s.n_words, s.states,
                                      hashes)
            else:
                status = decode3_core(<const uint64_t*>pr, <uint64_t*>ob.buf, n, s.mode, s.p_a, s.p_b, s.p_c,
                                      mant_bits, emask, slots, lut, s.lanes, s.phases, s.words, s.n_words, s.states,
                                      hashes)
        return status, out, hashes[0], hashes[1]
    finally:
        free(slots)
        if got_o:
            PyBuffer_Release(&ob)
        if got_r:
            PyBuffer_Release(&rb)
        PyBuffer_Release(&bb)


# -- choosing table scales (twin: _one_stream_tables.quantize_rows3) ------------------------------


cdef inline int64_t gamma_len(uint64_t v) noexcept nogil:
    return 2 * bitlen(v) - 1


cdef int64_t row_table_len(const int64_t* f, Py_ssize_t alphabet, int scale, int64_t* order) noexcept nogil:
    """Bits ``pack_table3`` spends on one row at ``scale``, with its cheapest Exp-Golomb order."""
    cdef int64_t k = 0, bits, eg[SCALE_BITS + 1], best
    cdef Py_ssize_t t, prev = -1
    cdef int g
    cdef bint first = True
    cdef uint64_t v
    for g in range(SCALE_BITS + 1):
        eg[g] = 0
    bits = 0
    for t in range(alphabet):
        if f[t] == 0:
            continue
        k += 1
        bits += gamma_len(<uint64_t>(t - prev))
        prev = t
        if not first:
            v = <uint64_t>(f[t] - 1)
            for g in range(scale + 1):
                eg[g] += gamma_len((v >> g) + 1) + g
        first = False
    bits += gamma_len(<uint64_t>(k + 1))
    order[0] = 0
    if k >= 2:
        bits += gamma_len(<uint64_t>(SCALE_BITS + 1 - scale))
        best = eg[0] + gamma_len(1)
        for g in range(1, scale + 1):
            if eg[g] + gamma_len(<uint64_t>(g + 1)) < best:
                best = eg[g] + gamma_len(<uint64_t>(g + 1))
                order[0] = g
        bits += best
    return bits


def quantize_rows3(const int64_t[:, ::1] counts, const int64_t[::1] cost_table, uint32_t[:, ::1] freqs_out,
                   uint32_t[:, ::1] f12_out, int64_t[::1] scales_out, int64_t[::1] orders_out):
    """Per row: frequencies at the scale that minimises table plus data bits (see the twin);
    returns the total estimated cost in Q16 bits."""
    cdef Py_ssize_t rows = counts.shape[0], alphabet = counts.shape[1], i, t
    cdef int64_t n, k, lowest, middle, cost, best_cost, order, best_order, total = 0
    cdef int d, scale, best_scale
    cdef int64_t* f = NULL
    cdef int64_t* fb = NULL
    if cost_table.shape[0] < SCALE + 1 or freqs_out.shape[0] < rows or f12_out.shape[0] < rows:
        raise ValueError("quantize_rows3: inconsistent arguments")
    f = <int64_t*>malloc(max(alphabet, 1) * sizeof(int64_t))
    fb = <int64_t*>malloc(max(alphabet, 1) * sizeof(int64_t))
    if f == NULL or fb == NULL:
        free(f)
        free(fb)
        raise MemoryError()
    with nogil:
        for i in range(rows):
            n = 0
            k = 0
            for t in range(alphabet):
                n += counts[i, t]
                k += counts[i, t] > 0
            lowest = bitlen(<uint64_t>(k - 1)) if k >= 2 else 0
            middle = min(max(bitlen(<uint64_t>max(n, 1)) - 1, lowest), SCALE_BITS)
            best_cost = -1
            best_scale = 0
            best_order = 0
            for d in range(1, -2, -1):
                scale = <int>min(max(middle + d, lowest), SCALE_BITS)
                if n > 0:
                    normalize_row(&counts[i, 0], alphabet, n, scale, f)
                else:
                    for t in range(alphabet):
                        f[t] = 0
                cost = row_table_len(f, alphabet, scale, &order) << 16
                for t in range(alphabet):
                    if f[t]:
                        cost += counts[i, t] * cost_table[f[t] << (SCALE_BITS - scale)]
                if best_cost < 0 or cost < best_cost:
                    best_cost, best_scale, best_order = cost, scale, order
                    memcpy(fb, f, alphabet * sizeof(int64_t))
            for t in range(alphabet):
                freqs_out[i, t] = <uint32_t>fb[t]
                f12_out[i, t] = <uint32_t>(fb[t] << (SCALE_BITS - best_scale))
            scales_out[i] = best_scale
            orders_out[i] = best_order
            total += best_cost
    free(f)
    free(fb)
    return total
