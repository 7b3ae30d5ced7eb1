# SPARSE blobs applied in place, a version's worth per job: the weight-sync follower's hot path.
# Included from _kernels.pyx (it uses that file's section, table and checksum cores); twin:
# _apply_job.py.  The job parses every header first; then each worker thread, in one GIL
# release, takes the next blob and: checks its CRC-32 (if asked) and the reference through its word
# sum, decodes the positions (version 4: Elias-Fano; 2: the gap stream), gathers the reference words (saving each
# one's aligned 8-byte word, so the checksum update never reads the array again), decodes the
# residuals, then writes the new words in the same pass that sums the target checksum, putting the
# old words back if it fails.  A blob coded without exponent contexts (flag NO_ECOND: what weight sync
# publishes) decodes its residuals first and then reads, rebuilds and writes each changed word in one
# pass (fused_put), each line touched once.  A blob that fails stops the workers, and finish() undoes
# every blob written from the saved old words.

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.string cimport memcmp

import numpy as np

cdef extern from *:
    """
    /* a prefetch for a line about to be written (prefetchw: fetched in the state a store needs) */
    static inline void ulp_prefetch_write(const void* p) { __builtin_prefetch(p, 1); }
    """
    void ulp_prefetch_write(const void* p) noexcept nogil

cdef enum:
    AHEAD = 64  # random reads and writes prefetched this many changes ahead (more than PREFETCH: the loops are short)
    APPLY_HEADER = -20     # not a SPARSE delta blob (format 2 or 4) of this dtype and shape
    APPLY_REFERENCE = -21  # the reference's word sum does not match the blob's reference hash
    APPLY_FIELDS = -22     # a malformed payload field (truncated, out of range, padding, trailing bytes)
    APPLY_TARGET = -23     # the decoded values fail the target checksum
    APPLY_CRC = -24        # the blob's CRC-32 does not match its bytes (checked when the job is asked to)
    APPLY_PENDING = 1      # a blob no worker has taken (yet)


cdef struct Section:
    const uint8_t* table
    int64_t table_len
    uint32_t states[4]
    const uint8_t* words
    int64_t n_words
    const uint8_t* tail
    int64_t tail_len
    int64_t tail_bits


cdef struct Parsed:
    int64_t m
    uint32_t ref_hash
    uint32_t target_hash
    uint32_t emask
    bint ef  # version 4: Elias-Fano positions (lo, hi) instead of the gap section g
    const uint8_t* lo
    int64_t lo_len
    const uint8_t* hi
    int64_t hi_len
    Section g
    Section t


cdef inline int get_varint(const uint8_t* b, int64_t end, int64_t* pos, uint64_t limit, uint64_t* out) noexcept nogil:
    """LEB128 as _format.Reader.varint: 0, or -1 (truncated, overlong or above ``limit``)."""
    cdef uint64_t value = 0
    cdef int shift = 0
    cdef uint8_t byte
    while True:
        if pos[0] >= end:
            return -1
        byte = b[pos[0]]
        pos[0] += 1
        if shift == 63 and (byte & 0x7F) > 1:  # the value would not fit 64 bits: above any limit
            return -1
        value |= (<uint64_t>(byte & 0x7F)) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift > 63:
            return -1
    if value > limit:
        return -1
    out[0] = value
    return 0


cdef int parse_section(const uint8_t* b, int64_t end, int64_t* pos, int64_t m, int width, Section* s) noexcept nogil:
    """The fields of one section (as _section.read_fields): 0 or APPLY_FIELDS."""
    cdef uint64_t v
    cdef uint32_t x
    cdef int lane
    if pos[0] >= end or b[pos[0]] != SCALE_BITS:
        return APPLY_FIELDS
    pos[0] += 1
    if get_varint(b, end, pos, 1 << 24, &v) or <int64_t>v > end - pos[0]:
        return APPLY_FIELDS
    s.table, s.table_len = b + pos[0], <int64_t>v
    pos[0] += <int64_t>v
    if end - pos[0] < 4 * LANES:
        return APPLY_FIELDS
    for lane in range(LANES):
        memcpy(&x, b + pos[0] + 4 * lane, 4)
        if x < STATE_LOW or x >= (<uint32_t>1) << 31:
            return APPLY_FIELDS
        s.states[lane] = x
    pos[0] += 4 * LANES
    if get_varint(b, end, pos, <uint64_t>m, &v) or <int64_t>(2 * v) > end - pos[0]:
        return APPLY_FIELDS
    s.words, s.n_words = b + pos[0], <int64_t>v
    pos[0] += 2 * <int64_t>v
    if get_varint(b, end, pos, <uint64_t>m * <uint64_t>(width - 3), &v) or <int64_t>((v + 7) // 8) > end - pos[0]:
        return APPLY_FIELDS
    s.tail, s.tail_bits, s.tail_len = b + pos[0], <int64_t>v, <int64_t>((v + 7) // 8)
    pos[0] += s.tail_len
    if s.tail_bits % 8 and s.tail[s.tail_len - 1] >> (s.tail_bits % 8):
        return APPLY_FIELDS
    return 0


cdef int parse_sparse(const uint8_t* b, int64_t size, const uint8_t* meta, int64_t meta_len, int code, int64_t n,
                      uint32_t emask, int width, Parsed* p) noexcept nogil:
    """Header and fields of a whole SPARSE blob of format 2 or 4 (CRC-32 included, checked by the caller).

    ``meta`` is the target checksum's dtype-and-shape bytes (dtype code, LEB128
    dims); the blob's must equal them byte for byte.
    """
    cdef int64_t end = size - 4, pos = 9, k
    cdef uint64_t v
    cdef int ndim = 0, L
    cdef int status
    if end < 9 or meta_len < 1 or (b[0] != 0x55 or b[1] != 0x4C or b[2] != 0x50 or b[3] != 0x4B) or (b[4] != 2 and b[4] != 4) or b[5] != code or b[5] != meta[0] or b[6] != 3:
        return APPLY_HEADER
    if b[7] & ~3 or not b[7] & 1:
        return APPLY_HEADER
    for k in range(1, meta_len):
        ndim += not meta[k] & 0x80
    if b[8] != ndim or end - pos < meta_len - 1 or memcmp(b + pos, meta + 1, meta_len - 1):
        return APPLY_HEADER
    pos += meta_len - 1
    if end - pos < 8:
        return APPLY_FIELDS
    memcpy(&p.ref_hash, b + pos, 4)
    memcpy(&p.target_hash, b + pos + 4, 4)
    pos += 8
    p.emask = 0 if b[7] & 2 else emask
    if get_varint(b, end, &pos, <uint64_t>n, &v) or v == 0:
        return APPLY_FIELDS
    p.m = <int64_t>v
    p.ef = b[4] == 4
    if p.ef:  # Elias-Fano positions: their lengths follow from n and m
        L = ef_low_bits(n, p.m)
        p.lo_len, p.hi_len = (p.m * L + 7) // 8, (p.m + ((n - 1) >> L) + 1 + 7) // 8
        if p.lo_len + p.hi_len > end - pos:
            return APPLY_FIELDS
        p.lo, p.hi = b + pos, b + pos + p.lo_len
        pos += p.lo_len + p.hi_len
        status = 0
    else:
        status = parse_section(b, end, &pos, p.m, 32, &p.g)  # gaps: 32-bit words
    if not status:
        status = parse_section(b, end, &pos, p.m, width, &p.t)
    if not status and pos != end:
        status = APPLY_FIELDS
    return status


cdef extern from "_mixsum.h" nogil:
    uint64_t ulp_mix_diff_sum(const uint64_t* a, const uint64_t* b, Py_ssize_t n)
    int ulp_mixsum_init()
    int ulp_mixsum_get()
    void ulp_mixsum_set(int simd)

cdef enum:
    MIX_BLOCK = 128  # words mixed together; two blocks of them live on the stack of sum_put

ulp_mixsum_init()


def mixsum_simd(enable=None):
    """Whether the in-place apply's checksum pass mixes 8 words at a time (AVX-512); ``enable`` sets it
    (tests run both: they give the same sums).  It cannot be enabled where the CPU or build lacks AVX-512."""
    if enable is not None:
        ulp_mixsum_set(0)
        if enable and ulp_mixsum_init() == 0:
            raise ValueError("this CPU or build has no AVX-512 (avx512f and avx512dq)")
    return bool(ulp_mixsum_get())


def mix_diff_sum(const uint64_t[::1] a, const uint64_t[::1] b):
    """sum(mix(a[i]) - mix(b[i])) mod 2**64 with the path :func:`mixsum_simd` chose (for tests)."""
    if a.shape[0] != b.shape[0]:
        raise ValueError("a and b differ in length")
    return ulp_mix_diff_sum(&a[0] if a.shape[0] else NULL, &b[0] if b.shape[0] else NULL, a.shape[0])


cdef extern from *:
    # a return type that also keeps GCC from inlining the function into the job (sum_put): inlined, the job's
    # other live values pushed its loop's sum and pointers out of registers (loads and stores per change)
    ctypedef void void_noinline "__attribute__((noinline)) void"


cdef inline uint32_t fold32(uint64_t h) noexcept nogil:
    return <uint32_t>(h ^ (h >> 32))


cdef inline uint64_t finish(uint64_t acc, uint64_t nbytes) noexcept nogil:
    return mix(acc + nbytes * <uint64_t>0x9E3779B97F4A7C15ULL)


cdef inline void gather_one(const int64_t* pos, Py_ssize_t k, const word_t* r, int64_t n, word_t* rs,
                            uint64_t* old64) noexcept nogil:
    cdef int64_t base = pos[k] & ~(<int64_t>(8 // sizeof(word_t)) - 1)
    cdef uint64_t w
    if base + <int64_t>(8 // sizeof(word_t)) <= n:
        w = load64(<const uint8_t*>&r[base])
    else:  # the last word is zero-padded, as in hash64
        w = 0
        memcpy(&w, &r[base], (n - base) * sizeof(word_t))
    old64[k] = w
    rs[k] = <word_t>(w >> ((pos[k] - base) * 8 * sizeof(word_t)))


cdef void gather_old(const int64_t* pos, Py_ssize_t m, const word_t* r, int64_t n, word_t* rs,
                     uint64_t* old64) noexcept nogil:
    """The reference word at each position, and the aligned 8-byte word holding it.

    The main loop prefetches unconditionally; the last ``AHEAD`` changes, which
    have nothing left to prefetch, get a loop of their own.
    """
    cdef Py_ssize_t k, ahead = min(m, AHEAD)
    for k in range(ahead):
        __builtin_prefetch(&r[pos[k]])
    for k in range(m - ahead):
        __builtin_prefetch(&r[pos[k + AHEAD]])
        gather_one(pos, k, r, n, rs, old64)
    for k in range(m - ahead, m):
        gather_one(pos, k, r, n, rs, old64)


cdef void_noinline sum_put(const uint64_t* old64, const int64_t* pos, Py_ssize_t m, const word_t* values,
                        word_t* dst, uint64_t* out) noexcept nogil:
    """As sum_update_core, from the saved 8-byte words (no read of the array), into ``out[0]``; with ``dst``,
    also writes the values.

    One pass: each change updates the word being built (started from its saved
    old word when the change opens a word), and a word's difference joins the
    sum when the next change lies in another word (and after the last).  That
    branch is taken for nearly every change of a sparse delta, so it predicts
    well; summing every change's difference under a mask instead (no branch)
    ran twice as many instructions, the checksum's mix being most of them.

    The gather read the lines written here, but a chunk of 20k changes has
    pushed most of them out of L2 by now (1.3 MB of lines, and the decode's
    arrays): each is prefetched for writing ``AHEAD`` changes ahead, which
    took 7% off the whole job at 13M parameters.
    """
    cdef Py_ssize_t k, per = 8 // sizeof(word_t), bits = 8 * sizeof(word_t), nb = 0
    cdef uint64_t lane = (<uint64_t>-1) >> (64 - 8 * sizeof(word_t))
    cdef uint64_t cur, old, salt, acc = 0
    # the salted new and old words of a block of finished words, mixed and summed together (_mixsum.h:
    # 8 words at a time where the CPU has AVX-512)
    cdef uint64_t new_words[MIX_BLOCK]
    cdef uint64_t old_words[MIX_BLOCK]
    cdef int64_t w, prev
    cdef int shift
    out[0] = 0
    if m == 0:
        return
    prev = <int64_t>(<uint64_t>pos[0] // <uint64_t>per)  # a shift: per is a power of two known at compile time
    cur = old = old64[0]
    for k in range(m):
        if dst != NULL and k + AHEAD < m:
            ulp_prefetch_write(&dst[pos[k + AHEAD]])
        w = <int64_t>(<uint64_t>pos[k] // <uint64_t>per)
        if w != prev:
            salt = (<uint64_t>prev + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
            new_words[nb] = cur + salt
            old_words[nb] = old + salt
            nb += 1
            if nb == MIX_BLOCK:
                acc += ulp_mix_diff_sum(new_words, old_words, nb)
                nb = 0
            cur = old = old64[k]
            prev = w
        shift = <int>((pos[k] - w * per) * bits)
        cur = (cur & ~(lane << shift)) | (<uint64_t>values[k] << shift)
        if dst != NULL:
            dst[pos[k]] = values[k]
    salt = (<uint64_t>prev + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
    new_words[nb] = cur + salt
    old_words[nb] = old + salt
    out[0] = acc + ulp_mix_diff_sum(new_words, old_words, nb + 1)


cdef void_noinline fused_put(const int64_t* pos, Py_ssize_t m, word_t* dst, int64_t n, word_t* newv, word_t* old,
                           bint write, uint64_t* out) noexcept nogil:
    """The values of a blob whose residuals do not depend on the reference (flag NO_ECOND) in one pass over
    its positions: each change's line read once, its value rebuilt from the reference word there and its
    residual (``newv`` in, the new word out), the old word saved in ``old``, the checksum summed as
    :func:`sum_put` does and, with ``write``, the new word written.  A blob coded with exponent contexts
    needs every reference word before its residuals decode, and touches each line twice (gather, then
    write); here the lines are prefetched for writing ``AHEAD`` changes ahead and touched once."""
    cdef Py_ssize_t k, per = 8 // sizeof(word_t), bits = 8 * sizeof(word_t), nb = 0
    cdef uint64_t lane = (<uint64_t>-1) >> (64 - 8 * sizeof(word_t))
    cdef uint64_t h = (<uint64_t>1) << (bits - 1)
    cdef uint64_t cur = 0, ow = 0, salt, acc = 0, v, z
    cdef uint64_t new_words[MIX_BLOCK]
    cdef uint64_t old_words[MIX_BLOCK]
    cdef int64_t w, prev = -1, base
    cdef int shift
    out[0] = 0
    if m == 0:
        return
    for k in range(min(m, AHEAD)):
        ulp_prefetch_write(&dst[pos[k]])
    for k in range(m):
        if k + AHEAD < m:
            ulp_prefetch_write(&dst[pos[k + AHEAD]])
        w = <int64_t>(<uint64_t>pos[k] // <uint64_t>per)
        if w != prev:
            if prev >= 0:
                salt = (<uint64_t>prev + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
                new_words[nb] = cur + salt
                old_words[nb] = ow + salt
                nb += 1
                if nb == MIX_BLOCK:
                    acc += ulp_mix_diff_sum(new_words, old_words, nb)
                    nb = 0
            base = w * per
            if base + per <= n:  # (no change of this word is written yet: positions ascend)
                ow = load64(<const uint8_t*>&dst[base])
            else:  # the last word is zero-padded, as in hash64
                ow = 0
                memcpy(&ow, &dst[base], (n - base) * sizeof(word_t))
            cur = ow
            prev = w
        shift = <int>((pos[k] - w * per) * bits)
        v = (ow >> shift) & lane
        old[k] = <word_t>v
        z = newv[k]
        v = unkey((key(v, h, lane, bits) + ((z >> 1) ^ (0 - (z & 1)))) & lane, h, lane, bits)
        newv[k] = <word_t>v
        cur = (cur & ~(lane << shift)) | (v << shift)
        if write:
            dst[pos[k]] = <word_t>v
    salt = (<uint64_t>prev + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
    new_words[nb] = cur + salt
    old_words[nb] = ow + salt
    out[0] = acc + ulp_mix_diff_sum(new_words, old_words, nb + 1)


cdef inline void put_words(word_t* dst, const int64_t* pos, Py_ssize_t m, const word_t* values) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(min(m, AHEAD)):
        __builtin_prefetch(&dst[pos[k]])
    for k in range(m):
        if k + AHEAD < m:
            __builtin_prefetch(&dst[pos[k + AHEAD]])
        dst[pos[k]] = values[k]


cdef int apply_one(const Parsed* p, word_t* dst, int64_t n, uint64_t ref_sum, uint64_t meta_hash, int mant_bits,
                   int pool_below, int g_alphabet, int t_alphabet, bint write, int64_t* pos, word_t* newv,
                   word_t* old, uint8_t* tokens, uint64_t* old64, uint32_t* slots, uint64_t* target) noexcept nogil:
    """Decode and check one parsed blob against ``dst``; 0 or a status.

    ``write``: the new words are written as the checksum is summed (one pass over
    the changes) and put back from ``old`` if it fails: on any status ``dst``
    is as it was.
    """
    cdef int64_t m = p.m, k
    cdef uint64_t nbytes = <uint64_t>n * sizeof(word_t), acc
    cdef bint zero
    cdef int64_t q[256]
    cdef uint32_t freqs[256]
    cdef int32_t row0 = 0
    cdef int status
    if fold32(finish(ref_sum, nbytes)) != p.ref_hash:
        return APPLY_REFERENCE
    if p.ef:
        status = ef_core(p.lo, p.lo_len, p.hi, p.hi_len, m, n, pos)
    else:
        memset(q, 0, sizeof(q))
        status = read_table_core(p.g.table, p.g.table_len, &m, 1, g_alphabet, SCALE_BITS, q)
        if status:
            return status - 100
        normalize_core(q, 1, g_alphabet, SCALE_BITS, freqs)
        slot_core(freqs, 1, g_alphabet, slots)
        status = rans_decode_core(dst, m, 0, 0, &row0, slots, p.g.words, p.g.n_words, p.g.states, tokens)
        if not status:
            status = gap_positions(tokens, m, p.g.tail, p.g.tail_len, p.g.tail_bits, n, pos)
    if not status and p.emask == 0:  # no exponent contexts: residuals first, then one pass over the lines
        status = sparse_tokens(newv, m, mant_bits, 0, pool_below, p.t.table, p.t.table_len, t_alphabet,
                               p.t.states, p.t.words, p.t.n_words, tokens)  # (newv: any m words, masked out)
        if not status:
            status = unpack_core(tokens, m, p.t.tail, p.t.tail_len, p.t.tail_bits, newv)
        if status:
            return status
        zero = 0
        for k in range(m):
            zero |= newv[k] == 0
        if zero:
            return -7
        fused_put(pos, m, dst, n, newv, old, write, &acc)
        acc += ref_sum
        if fold32(finish(acc, nbytes) ^ meta_hash) != p.target_hash:
            if write:
                put_words(dst, pos, m, old)
            return APPLY_TARGET
        target[0] = acc
        return 0
    if not status:
        gather_old(pos, m, dst, n, old, old64)
    if not status:
        status = sparse_tokens(old, m, mant_bits, p.emask, pool_below, p.t.table, p.t.table_len, t_alphabet,
                               p.t.states, p.t.words, p.t.n_words, tokens)
    if not status:
        status = unpack_core(tokens, m, p.t.tail, p.t.tail_len, p.t.tail_bits, newv)
    if not status:
        zero = 0
        for k in range(m):  # no early exit: the loop vectorises (a valid blob has no zero residual)
            zero |= newv[k] == 0
        if zero:
            return -7
        reconstruct_block(old, newv, 0, m)
        sum_put(old64, pos, m, newv, dst if write else NULL, &acc)
        acc += ref_sum
        if fold32(finish(acc, nbytes) ^ meta_hash) != p.target_hash:
            if write:
                put_words(dst, pos, m, old)
            return APPLY_TARGET
        target[0] = acc
    return status


cdef extern from *:
    """
    static inline Py_ssize_t ulp_take(Py_ssize_t* next) { return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); }
    static inline int ulp_get(const int* flag) { return __atomic_load_n(flag, __ATOMIC_RELAXED); }
    static inline void ulp_set(int* flag, int v) { __atomic_store_n(flag, v, __ATOMIC_RELAXED); }
    static inline void ulp_enter(int* running) { __atomic_fetch_add(running, 1, __ATOMIC_RELAXED); }
    /* a worker leaves the job: its last access to the job's memory (release: its writes happen before) */
    static inline void ulp_leave(int* running) { __atomic_fetch_sub(running, 1, __ATOMIC_RELEASE); }
    static inline int ulp_running(const int* running) { return __atomic_load_n(running, __ATOMIC_ACQUIRE); }
    #include <time.h>
    static inline void ulp_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #endif
    }
    static inline double ulp_now(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
    }
    """
    Py_ssize_t ulp_take(Py_ssize_t* next) noexcept nogil
    int ulp_get(const int* flag) noexcept nogil
    void ulp_set(int* flag, int v) noexcept nogil
    void ulp_enter(int* running) noexcept nogil
    void ulp_leave(int* running) noexcept nogil
    int ulp_running(const int* running) noexcept nogil
    void ulp_relax() noexcept nogil
    double ulp_now() noexcept nogil


cdef struct Job:
    # what every worker reads (set before the first one starts)
    Parsed* parsed
    Py_buffer* bb
    Py_buffer* db
    const uint64_t* ref_sums
    const uint64_t* meta_hashes
    const int64_t* starts
    const int64_t* order
    int64_t* pos
    uint64_t* sums
    int64_t most
    Py_ssize_t upto
    int mant_bits, pool_below, g_alphabet, t_alphabet, crc
    bint write
    # what the workers share
    Py_ssize_t next  # the next entry of order to take (atomic)
    int running  # workers inside work(): raised under the GIL, lowered as each one's last access (atomic)
    int stop  # set by the first failure: the others take no more blobs (atomic)
    int* statuses  # per blob: APPLY_PENDING, then 0 or its status (each written by the one worker that took it)


cdef void work_job(Job* j, word_t* newv, word_t* oldv) noexcept nogil:
    """Take blobs (in ``j.order``) until none is left or one failed; decode, check and write each."""
    cdef Py_ssize_t k, i
    cdef int64_t s, n
    cdef int status
    cdef const uint8_t* b
    cdef uint32_t want
    cdef uint8_t* tokens = <uint8_t*>malloc(j.most)
    cdef uint64_t* old64 = <uint64_t*>malloc(j.most * sizeof(uint64_t))
    cdef uint32_t* slots = <uint32_t*>malloc(SCALE * sizeof(uint32_t))
    if tokens == NULL or old64 == NULL or slots == NULL:
        ulp_set(&j.stop, 1)  # finish() finds the blobs left pending: nothing stays written
    else:
        while not ulp_get(&j.stop):
            k = ulp_take(&j.next)
            if k >= j.upto:
                break
            i = j.order[k]
            b = <const uint8_t*>j.bb[i].buf
            status = 0
            if j.crc:
                memcpy(&want, b + j.bb[i].len - 4, 4)
                if ulp_crc32(0, b, j.bb[i].len - 4) != want:
                    status = APPLY_CRC
            if not status:
                s = j.starts[i]
                n = j.db[i].len // <Py_ssize_t>sizeof(word_t)
                status = apply_one(&j.parsed[i], <word_t*>j.db[i].buf, n, j.ref_sums[i], j.meta_hashes[i],
                                   j.mant_bits, j.pool_below, j.g_alphabet, j.t_alphabet, j.write, j.pos + s,
                                   newv + s, oldv + s, tokens, old64, slots, &j.sums[i])
            j.statuses[i] = status
            if status:
                ulp_set(&j.stop, 1)
    free(tokens)
    free(old64)
    free(slots)


cdef void undo_job(Job* j, const word_t* oldv) noexcept nogil:
    """Put back the old words of every blob written, newest index first."""
    cdef Py_ssize_t i
    for i in range(j.upto - 1, -1, -1):
        if j.statuses[i] == 0:
            put_words(<word_t*>j.db[i].buf, j.pos + j.starts[i], j.parsed[i].m, oldv + j.starts[i])


_WORDS = {wb: np.dtype(f"<u{wb}") for wb in (1, 2, 4, 8)}  # the output word dtypes, made once


cdef class SparseApply:
    """SPARSE blobs (format version 2 or 4) decoded against the arrays they were coded against and, ``write``, applied.

    ``plan`` (an :class:`ulstore.codec._apply_plan.ApplyPlan`, or any object with its fields): ``plan.blobs[i]``
    (bytes-like) was coded against ``plan.arrays[i]`` (1-d C-contiguous words of ``plan.width`` bits,
    ``plan.code`` the dtype code, ``plan.metas[i]`` the dtype code byte and the LEB128 dims of its shape),
    whose ``hash_sum64`` is ``plan.sums[i]`` (an int in [0, 2**64): OverflowError otherwise); ``plan.emask``:
    the dtype's context mask (0 for blobs flagged without exponent contexts).  ``order``, if given, is a
    permutation of the blob indices as ints; with ``write``, no two arrays may overlap in memory (ValueError).
    ``crc``: check each blob's CRC-32 too (else the caller has).

    Every header is parsed here.  Then any number of threads call
    :meth:`work` (each releases the GIL and takes the next blob of ``order``,
    default blob order, until none is left or one has failed); once one of
    them has returned, :meth:`join` waits for the others still working, and
    one call to :meth:`finish` gives the result.  A worker that starts after
    :meth:`join` has nothing left to take and returns at once.  All or nothing: if
    any blob failed, :meth:`finish` puts back every word written.
    """

    cdef Job job
    cdef Py_ssize_t c
    cdef int parse_status, wb, got_b, got_d, done, closed, ready  # ready: __init__ ran to its end
    cdef object pos, new, old
    cdef uint8_t* new_p
    cdef uint8_t* old_p
    # the job's per-blob arrays, C memory (numpy arrays of a few dozen entries cost more to make than the job
    # spends on them, with the caches as cold as a follower's between versions); one block, freed by _release
    cdef void* small

    def __cinit__(self):
        self.c = 0

    def __init__(self, plan, bint write, buffers=None, order=None, bint crc=False):
        cdef list blobs = plan.blobs, dsts = plan.arrays, metas = plan.metas
        ref_sums = plan.sums
        cdef int code = plan.code, width = plan.width, mant_bits = plan.mant_bits, pool_below = plan.pool_below
        cdef int g_alphabet = plan.g_alphabet, t_alphabet = plan.t_alphabet
        cdef uint32_t emask = plan.emask
        cdef Py_ssize_t c = len(blobs), i, k, cc
        cdef int flags = PyBUF_WRITABLE if write else PyBUF_SIMPLE, wb = width // 8
        cdef Hasher hs
        cdef int64_t total = 0
        cdef Py_buffer meta, view
        cdef uint8_t* seen
        cdef uint64_t* refs
        cdef uint64_t* mh
        cdef int64_t* starts
        cdef int64_t* order_c
        if self.c or self.job.parsed != NULL:
            raise RuntimeError("SparseApply is initialised once")
        if (len(dsts) != c or len(metas) != c or len(ref_sums) != c or wb not in (1, 2, 4, 8) or width != 8 * wb
                or not 0 < g_alphabet <= 256 or not 0 < t_alphabet <= 256):
            raise ValueError("sparse_apply needs one array, word sum and shape per blob, and a word width of 8-64 bits")
        self.c, self.wb = c, wb
        cc = max(c, 1)
        self.job.bb = <Py_buffer*>calloc(cc, sizeof(Py_buffer))
        self.job.db = <Py_buffer*>calloc(cc, sizeof(Py_buffer))
        self.job.parsed = <Parsed*>calloc(cc, sizeof(Parsed))
        # ref sums, meta hashes, sums (u64); starts (c + 1), order (i64); statuses (int)
        self.small = calloc(3 * cc + 2 * cc + 1, sizeof(uint64_t) + sizeof(int))
        if self.job.bb == NULL or self.job.db == NULL or self.job.parsed == NULL or self.small == NULL:
            raise MemoryError()
        refs = <uint64_t*>self.small
        mh = refs + cc
        self.job.sums = mh + cc
        starts = <int64_t*>(self.job.sums + cc)
        order_c = starts + cc + 1
        self.job.statuses = <int*>(order_c + cc)
        self.job.ref_sums, self.job.meta_hashes, self.job.starts, self.job.order = refs, mh, starts, order_c
        for i in range(c):
            PyObject_GetBuffer(blobs[i], &self.job.bb[i], PyBUF_SIMPLE)
            self.got_b += 1
            PyObject_GetBuffer(dsts[i], &self.job.db[i], flags)
            self.got_d += 1
            if self.job.db[i].len % wb:
                raise ValueError("sparse_apply: an array is not a whole number of words")
            refs[i] = ref_sums[i]
        if write:  # all or nothing needs each blob's words to itself: the undo restores blob by blob
            spans = sorted([(<size_t>self.job.db[i].buf, self.job.db[i].len) for i in range(c) if self.job.db[i].len])
            for i in range(1, len(spans)):
                if spans[i - 1][0] + spans[i - 1][1] > spans[i][0]:
                    raise ValueError("sparse_apply: two arrays overlap in memory (each blob needs an array of its own)")
        # parse every header first, to size the outputs; the first bad blob ends what the workers take
        self.job.upto = c
        self.parse_status = 0
        for i in range(c):
            PyObject_GetBuffer(metas[i], &meta, PyBUF_SIMPLE)
            try:
                if not self.parse_status:
                    self.parse_status = parse_sparse(<const uint8_t*>self.job.bb[i].buf, self.job.bb[i].len,
                                                     <const uint8_t*>meta.buf, meta.len, code,
                                                     self.job.db[i].len // wb, emask, width, &self.job.parsed[i])
                    if self.parse_status:
                        self.job.upto = i
                    else:
                        hs = Hasher(0, 0, 0)
                        mh[i] = hash_final(&hs, <const uint8_t*>meta.buf, meta.len)
            finally:
                PyBuffer_Release(&meta)
        self.job.most = 1
        for i in range(self.job.upto):
            total += self.job.parsed[i].m
            self.job.most = max(self.job.most, self.job.parsed[i].m)
            starts[i + 1] = total
        for i in range(self.job.upto, c):
            starts[i + 1] = total
        word = _WORDS[wb]
        if (buffers is not None and buffers[0].dtype == np.int64 and buffers[1].dtype == word
                and buffers[2].dtype == word and min(len(b) for b in buffers) >= max(total, 1)):
            self.pos, self.new, self.old = buffers  # (finish() returns them cut to the changes)
        else:
            self.pos = np.empty(max(total, 1), dtype=np.int64)
            self.new = np.empty(max(total, 1), dtype=word)
            self.old = np.empty(max(total, 1), dtype=word)
        for out, flag in ((self.pos, 0), (self.new, 1), (self.old, 2)):
            PyObject_GetBuffer(out, &view, PyBUF_WRITABLE)  # (the arrays stay alive with the job: the memory too)
            if flag == 0:
                self.job.pos = <int64_t*>view.buf
            elif flag == 1:
                self.new_p = <uint8_t*>view.buf
            else:
                self.old_p = <uint8_t*>view.buf
            PyBuffer_Release(&view)
        # the blobs parsed, in the order given (default: blob order)
        if order is None:
            for i in range(self.job.upto):
                order_c[i] = i
        else:
            if len(order) != c:
                raise ValueError("SparseApply: order must be a permutation of the blobs")
            seen = <uint8_t*>calloc(cc, 1)
            if seen == NULL:
                raise MemoryError()
            try:
                k = 0
                for x in order:
                    i = x
                    if not 0 <= i < c or seen[i]:
                        raise ValueError("SparseApply: order must be a permutation of the blobs")
                    seen[i] = 1
                    if i < self.job.upto:
                        order_c[k] = i
                        k += 1
            finally:
                free(seen)
        for i in range(cc):
            self.job.statuses[i] = APPLY_PENDING
        self.job.mant_bits, self.job.pool_below = mant_bits, pool_below
        self.job.g_alphabet, self.job.t_alphabet, self.job.crc, self.job.write = g_alphabet, t_alphabet, crc, write
        self.job.next, self.job.stop, self.job.running = 0, 0, 0
        self.ready = 1

    def work(self):
        """Decode, check and write blobs until none is left (or one failed); the GIL released throughout."""
        cdef uint8_t* new_p = self.new_p
        cdef uint8_t* old_p = self.old_p
        if self.done or self.closed:  # (a pool thread that started late) every blob was taken, or the job stopped
            return
        if not self.ready:  # (never initialised, or its __init__ raised)
            raise RuntimeError("SparseApply: work() before __init__")
        ulp_enter(&self.job.running)  # under the GIL, as finish() runs: it never releases the job under a worker
        with nogil:
            if self.wb == 1:
                work_job(&self.job, <uint8_t*>new_p, <uint8_t*>old_p)
            elif self.wb == 2:
                work_job(&self.job, <uint16_t*>new_p, <uint16_t*>old_p)
            elif self.wb == 4:
                work_job(&self.job, <uint32_t*>new_p, <uint32_t*>old_p)
            else:
                work_job(&self.job, <uint64_t*>new_p, <uint64_t*>old_p)
            ulp_leave(&self.job.running)

    def join(self, double seconds=2e-4):
        """Once a :meth:`work` call has returned (nothing is left to take): wait, spinning for at most ``seconds``
        with the GIL released, until every other worker is out of the job's memory; True if they are.

        A worker finishes its last blob within a blob's time, and being woken
        from a sleep cost as much as the last blobs, 0.1-0.2 ms a version on the
        machines measured.  False (a worker still inside: the machine is busy
        and it lost its core): wait for the workers' return another way, not
        with a spin that keeps a core from them.
        """
        cdef long spins = 0
        cdef double deadline
        cdef bint inside
        # no worker enters from here on (a check under the GIL, as work() makes it): one that took the GIL
        # between this thread's work() and now is inside, and counted; any later one returns at once
        self.closed = 1
        with nogil:
            deadline = ulp_now() + seconds
            inside = ulp_running(&self.job.running)
            while inside:
                ulp_relax()
                spins += 1
                if spins % 64 == 0 and ulp_now() > deadline:
                    break
                inside = ulp_running(&self.job.running)
        return not inside

    def finish(self):
        """``(status, index, pos, new, old, starts, sums)``, once every :meth:`work` call has returned.

        Status 0 and index -1 when every blob decoded and checked (and was
        written); otherwise the status of blob ``index`` (-20 not a format-2 or 4
        SPARSE delta of this dtype and shape, -21 wrong reference, -22
        malformed fields, -23 target checksum, -24 CRC-32, -8 not taken (out
        of memory), or a ``sparse_decode`` status) and no array changed.
        With blob order and one worker, ``index`` is the first blob that
        fails; otherwise a failing one.  ``pos[starts[i]:starts[i+1]]``,
        ``new[...]`` and ``old[...]`` are blob i's changed positions, new and
        old words; ``sums[i]`` is ``hash_sum64`` of its target (``starts`` and
        ``sums``: lists of ints).
        """
        cdef Py_ssize_t i
        cdef int status = 0, failed = -1
        cdef const int* statuses = self.job.statuses
        cdef const uint8_t* old_p = self.old_p
        if self.done:
            raise RuntimeError("SparseApply: finish() called twice")
        if not self.ready:  # (never initialised, or its __init__ raised: nothing was written)
            raise RuntimeError("SparseApply: finish() before __init__")
        if ulp_running(&self.job.running):
            raise RuntimeError("SparseApply: finish() while work() is running (call join() first)")
        self.done = 1  # no work() starts from here on (the undo below releases the GIL)
        for i in range(self.job.upto):
            if statuses[i] != 0 and statuses[i] != APPLY_PENDING:
                status, failed = statuses[i], i
                break
        if not status:
            for i in range(self.job.upto):
                if statuses[i] == APPLY_PENDING:
                    status, failed = -8, i  # never taken: a worker ran out of memory (or never ran)
                    break
        if not status and self.parse_status:
            status, failed = self.parse_status, self.job.upto
        if status and self.job.write:
            with nogil:
                if self.wb == 1:
                    undo_job(&self.job, <const uint8_t*>old_p)
                elif self.wb == 2:
                    undo_job(&self.job, <const uint16_t*>old_p)
                elif self.wb == 4:
                    undo_job(&self.job, <const uint32_t*>old_p)
                else:
                    undo_job(&self.job, <const uint64_t*>old_p)
        total = self.job.starts[self.c]
        starts = [self.job.starts[i] for i in range(self.c + 1)]
        sums = [self.job.sums[i] for i in range(self.c)]
        self._release()
        return status, failed, self.pos[:total], self.new[:total], self.old[:total], starts, sums

    cdef _release(self):
        cdef Py_ssize_t i
        self.done = 1
        for i in range(self.got_b):
            PyBuffer_Release(&self.job.bb[i])
        for i in range(self.got_d):
            PyBuffer_Release(&self.job.db[i])
        self.got_b = self.got_d = 0
        free(self.job.bb)
        free(self.job.db)
        free(self.job.parsed)
        free(self.small)
        self.job.bb = self.job.db = NULL
        self.job.parsed = NULL
        self.small = NULL

    def __dealloc__(self):
        self._release()


def sparse_apply(plan, bint write, buffers=None):
    """:class:`SparseApply` on this thread, in blob order: ``(status, index, pos, new, old, starts, sums)``.

    ``plan.blobs[i]``'s CRC-32 is the caller's to check; see :class:`SparseApply`
    for the plan and :meth:`SparseApply.finish` for the result.
    """
    job = SparseApply(plan, write, buffers)
    job.work()
    return job.finish()
