# SPARSE blobs applied in place, many per call: the weight-sync follower's hot path.  Included
# from _kernels.pyx (it uses that file's section, table and checksum cores); twin: _reference_apply.py.
# Per blob, in one GIL release for all of them: parse the header and both sections' fields, check
# the reference through its word sum, decode the gap stream straight into positions, gather the
# reference words (saving each one's aligned 8-byte word, so the checksum update never reads the
# array again), decode the residuals, then write the new words in the same pass that sums the
# target checksum, putting the old words back if it fails.  A blob that fails stops the call and
# the writes of the blobs before it are undone from the saved old words.

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.string cimport memcmp

import numpy as np

cdef enum:
    AHEAD = 64  # random reads and writes prefetched this many changes ahead (more than PREFETCH: the loops are short)
    APPLY_HEADER = -20     # not a format-2 SPARSE delta blob of this dtype and shape
    APPLY_REFERENCE = -21  # the reference's word sum does not match the blob's reference hash
    APPLY_FIELDS = -22     # a malformed payload field (truncated, out of range, padding, trailing bytes)
    APPLY_TARGET = -23     # the decoded values fail the target checksum


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
    """Header and fields of a whole format-2 SPARSE blob (CRC-32 included, checked by the caller).

    ``meta`` is the target checksum's dtype-and-shape bytes (dtype code, LEB128
    dims); the blob's must equal them byte for byte.
    """
    cdef int64_t end = size - 4, pos = 9, k
    cdef uint64_t v
    cdef int ndim = 0
    cdef int status
    if end < 9 or meta_len < 1 or (b[0] != 0x55 or b[1] != 0x4C or b[2] != 0x50 or b[3] != 0x4B) or b[4] != 2 or b[5] != code or b[5] != meta[0] or b[6] != 3:
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
    status = parse_section(b, end, &pos, p.m, 32, &p.g)  # gaps: 32-bit words
    if not status:
        status = parse_section(b, end, &pos, p.m, width, &p.t)
    if not status and pos != end:
        status = APPLY_FIELDS
    return status


cdef inline uint32_t fold32(uint64_t h) noexcept nogil:
    return <uint32_t>(h ^ (h >> 32))


cdef inline uint64_t finish(uint64_t acc, uint64_t nbytes) noexcept nogil:
    return mix(acc + nbytes * <uint64_t>0x9E3779B97F4A7C15ULL)


cdef void gather_old(const int64_t* pos, Py_ssize_t m, const word_t* r, int64_t n, word_t* rs,
                     uint64_t* old64) noexcept nogil:
    """The reference word at each position, and the aligned 8-byte word holding it."""
    cdef Py_ssize_t k, per = 8 // sizeof(word_t)
    cdef int64_t base
    cdef uint64_t w
    for k in range(min(m, AHEAD)):
        __builtin_prefetch(&r[pos[k]])
    for k in range(m):
        if k + AHEAD < m:
            __builtin_prefetch(&r[pos[k + AHEAD]])
        base = pos[k] & ~(<int64_t>per - 1)
        if base + per <= n:
            w = load64(<const uint8_t*>&r[base])
        else:  # the last word is zero-padded, as in hash64
            w = 0
            memcpy(&w, &r[base], (n - base) * sizeof(word_t))
        old64[k] = w
        rs[k] = <word_t>(w >> ((pos[k] - base) * 8 * sizeof(word_t)))


cdef uint64_t sum_put(const uint64_t* old64, const int64_t* pos, Py_ssize_t m, const word_t* values,
                      word_t* dst) noexcept nogil:
    """As sum_update_core, from the saved 8-byte words (no read of the array); with ``dst``, also writes the values.

    One pass without a branch on how the changes fall into 8-byte words: each
    change updates the word being built (started from its saved old word when
    the change opens a word) and the sum takes the word's difference only at
    the word's last change.
    """
    cdef Py_ssize_t k, per = 8 // sizeof(word_t), bits = 8 * sizeof(word_t)
    cdef uint64_t lane = (<uint64_t>-1) >> (64 - 8 * sizeof(word_t))
    cdef uint64_t cur = 0, old, salt, acc = 0, last
    cdef int64_t w, prev = -1, after
    cdef int shift
    for k in range(m):
        w = <int64_t>(<uint64_t>pos[k] // <uint64_t>per)  # a shift: per is a power of two known at compile time
        old = old64[k]
        cur = cur if w == prev else old
        shift = <int>((pos[k] - w * per) * bits)
        cur = (cur & ~(lane << shift)) | (<uint64_t>values[k] << shift)
        if dst != NULL:
            dst[pos[k]] = values[k]
        after = pos[k + 1] if k + 1 < m else pos[k] + per  # the next change's position (past this word at the end)
        last = <uint64_t>((after - w * per) >= per)
        salt = (<uint64_t>w + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
        acc += (mix(cur + salt) - mix(old + salt)) & (0 - last)
        prev = w
    return acc


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
    cdef int64_t q[256]
    cdef uint32_t freqs[256]
    cdef int32_t row0 = 0
    cdef int status
    if fold32(finish(ref_sum, nbytes)) != p.ref_hash:
        return APPLY_REFERENCE
    memset(q, 0, sizeof(q))
    status = read_table_core(p.g.table, p.g.table_len, &m, 1, g_alphabet, SCALE_BITS, q)
    if status:
        return status - 100
    normalize_core(q, 1, g_alphabet, SCALE_BITS, freqs)
    slot_core(freqs, 1, g_alphabet, slots)
    status = rans_decode_core(dst, m, 0, 0, &row0, slots, p.g.words, p.g.n_words, p.g.states, tokens)
    if not status:
        status = gap_positions(tokens, m, p.g.tail, p.g.tail_len, p.g.tail_bits, n, pos)
    if not status:
        gather_old(pos, m, dst, n, old, old64)
    if not status:
        status = sparse_tokens(old, m, mant_bits, p.emask, pool_below, p.t.table, p.t.table_len, t_alphabet,
                               p.t.states, p.t.words, p.t.n_words, tokens)
    if not status:
        status = unpack_core(tokens, m, p.t.tail, p.t.tail_len, p.t.tail_bits, newv)
    if not status:
        for k in range(m):
            if newv[k] == 0:
                return -7
        reconstruct_block(old, newv, 0, m)
        acc = ref_sum + sum_put(old64, pos, m, newv, dst if write else NULL)
        if fold32(finish(acc, nbytes) ^ meta_hash) != p.target_hash:
            if write:
                put_words(dst, pos, m, old)
            return APPLY_TARGET
        target[0] = acc
    return status


cdef int apply_all(Parsed* parsed, int upto, int parse_status, Py_buffer* dsts, const uint64_t* ref_sums,
                   const uint64_t* meta_hashes, int mant_bits, int pool_below, int g_alphabet, int t_alphabet,
                   bint write, const int64_t* starts, int64_t* pos, word_t* newv, word_t* old, uint64_t* sums,
                   int* failed) noexcept nogil:
    cdef int i, j, status = 0
    cdef int64_t most = 1, n, s
    cdef uint8_t* tokens
    cdef uint64_t* old64
    cdef uint32_t* slots
    for i in range(upto):
        most = max(most, parsed[i].m)
    tokens = <uint8_t*>malloc(most)
    old64 = <uint64_t*>malloc(most * sizeof(uint64_t))
    slots = <uint32_t*>malloc(SCALE * sizeof(uint32_t))
    failed[0] = -1
    if tokens == NULL or old64 == NULL or slots == NULL:
        status = -8
        failed[0] = 0
    else:
        for i in range(upto):
            s = starts[i]
            n = dsts[i].len // <Py_ssize_t>sizeof(word_t)
            status = apply_one(&parsed[i], <word_t*>dsts[i].buf, n, ref_sums[i], meta_hashes[i], mant_bits,
                               pool_below, g_alphabet, t_alphabet, write, pos + s, newv + s, old + s, tokens,
                               old64, slots, &sums[i])
            if status:
                failed[0] = i
                break
        if not status and parse_status:
            status = parse_status
            failed[0] = upto
        if status and write:  # undo, newest first
            for j in range(failed[0] - 1, -1, -1):
                put_words(<word_t*>dsts[j].buf, pos + starts[j], parsed[j].m, old + starts[j])
    free(tokens)
    free(old64)
    free(slots)
    return status


def sparse_apply(list blobs, list dsts, const uint64_t[::1] ref_sums, list metas, int code, int width, int mant_bits,
                 uint32_t emask, int pool_below, int g_alphabet, int t_alphabet, bint write, buffers=None):
    """Decode SPARSE blobs (format version 2) against the arrays they were coded against and, ``write``, apply them.

    ``blobs[i]`` (bytes-like, CRC-32 already checked by the caller) was coded
    against ``dsts[i]`` (1-d C-contiguous words of ``width`` bits, ``code`` the
    dtype code, ``metas[i]`` the dtype code byte and the LEB128 dims of its
    shape), whose ``hash_sum64`` is ``ref_sums[i]``.  ``emask``: the dtype's
    context mask (0 for blobs flagged without exponent contexts).

    Returns ``(status, index, pos, new, old, starts, sums)``: status 0 and index
    -1 when every blob decoded and checked (and was written); otherwise the
    status of blob ``index`` (-20 not a format-2 SPARSE delta of this dtype and
    shape, -21 wrong reference, -22 malformed fields, -23 target checksum, or a
    ``sparse_decode`` status) and no array changed (earlier writes are undone).
    ``pos[starts[i]:starts[i+1]]``, ``new[...]`` and ``old[...]`` are blob i's
    changed positions, new and old words (for blobs before ``index``);
    ``sums[i]`` is ``hash_sum64`` of its target.  ``buffers``: optional
    ``(pos, new, old)`` arrays (int64 and words) that these three are views of
    when they are large enough (no fresh pages per call).
    """
    cdef Py_ssize_t c = len(blobs), i
    cdef int status = 0, parse_status = 0, failed = -1, upto, got_b = 0, got_m = 0, got_d = 0, wb = width // 8
    cdef int flags = PyBUF_WRITABLE if write else PyBUF_SIMPLE
    cdef Py_buffer* bb = <Py_buffer*>calloc(max(c, 1), sizeof(Py_buffer))
    cdef Py_buffer* db = <Py_buffer*>calloc(max(c, 1), sizeof(Py_buffer))
    cdef Py_buffer* mb = <Py_buffer*>calloc(max(c, 1), sizeof(Py_buffer))
    cdef Parsed* parsed = <Parsed*>calloc(max(c, 1), sizeof(Parsed))
    cdef uint64_t* meta_hashes = <uint64_t*>calloc(max(c, 1), sizeof(uint64_t))
    cdef Hasher hs
    cdef int64_t total = 0
    cdef int64_t[::1] starts_v, pos_v
    cdef uint64_t[::1] sums_v
    cdef uint8_t[::1] new_b, old_b
    if bb == NULL or db == NULL or mb == NULL or parsed == NULL or meta_hashes == NULL:
        free(bb)
        free(db)
        free(mb)
        free(parsed)
        free(meta_hashes)
        raise MemoryError()
    try:
        if (len(dsts) != c or len(metas) != c or ref_sums.shape[0] != c or wb not in (1, 2, 4, 8) or width != 8 * wb
                or not 0 < g_alphabet <= 256 or not 0 < t_alphabet <= 256):
            raise ValueError("sparse_apply needs one array, word sum and shape per blob, and a word width of 8-64 bits")
        for i in range(c):
            PyObject_GetBuffer(blobs[i], &bb[i], PyBUF_SIMPLE)
            got_b += 1
            PyObject_GetBuffer(metas[i], &mb[i], PyBUF_SIMPLE)
            got_m += 1
            PyObject_GetBuffer(dsts[i], &db[i], flags)
            got_d += 1
            if db[i].len % wb:
                raise ValueError("sparse_apply: an array is not a whole number of words")
        # parse every header first, to size the outputs; the first bad blob ends the run
        upto = c
        for i in range(c):
            parse_status = parse_sparse(<const uint8_t*>bb[i].buf, bb[i].len, <const uint8_t*>mb[i].buf, mb[i].len,
                                        code, db[i].len // wb, emask, width, &parsed[i])
            if parse_status:
                upto = i
                break
            hs = Hasher(0, 0, 0)
            meta_hashes[i] = hash_final(&hs, <const uint8_t*>mb[i].buf, mb[i].len)
        starts = np.zeros(c + 1, dtype=np.int64)
        starts_v = starts
        for i in range(upto):
            total += parsed[i].m
            starts_v[i + 1] = total
        for i in range(upto, c):
            starts_v[i + 1] = total
        word = np.dtype(f"<u{wb}")
        if (buffers is not None and buffers[0].dtype == np.int64 and buffers[1].dtype == word
                and buffers[2].dtype == word and min(len(b) for b in buffers) >= max(total, 1)):
            pos, new, old = buffers[0][:max(total, 1)], buffers[1][:max(total, 1)], buffers[2][:max(total, 1)]
        else:
            pos = np.empty(max(total, 1), dtype=np.int64)
            new = np.empty(max(total, 1), dtype=word)
            old = np.empty(max(total, 1), dtype=word)
        sums = np.zeros(c, dtype=np.uint64)
        pos_v, sums_v = pos, sums
        new_b, old_b = new.view(np.uint8), old.view(np.uint8)
        with nogil:
            if wb == 1:
                status = apply_all(parsed, upto, parse_status, db, &ref_sums[0] if c else NULL, meta_hashes, mant_bits,
                                   pool_below, g_alphabet, t_alphabet, write, &starts_v[0], &pos_v[0],
                                   <uint8_t*>&new_b[0], <uint8_t*>&old_b[0], &sums_v[0] if c else NULL, &failed)
            elif wb == 2:
                status = apply_all(parsed, upto, parse_status, db, &ref_sums[0] if c else NULL, meta_hashes, mant_bits,
                                   pool_below, g_alphabet, t_alphabet, write, &starts_v[0], &pos_v[0],
                                   <uint16_t*>&new_b[0], <uint16_t*>&old_b[0], &sums_v[0] if c else NULL, &failed)
            elif wb == 4:
                status = apply_all(parsed, upto, parse_status, db, &ref_sums[0] if c else NULL, meta_hashes, mant_bits,
                                   pool_below, g_alphabet, t_alphabet, write, &starts_v[0], &pos_v[0],
                                   <uint32_t*>&new_b[0], <uint32_t*>&old_b[0], &sums_v[0] if c else NULL, &failed)
            else:
                status = apply_all(parsed, upto, parse_status, db, &ref_sums[0] if c else NULL, meta_hashes, mant_bits,
                                   pool_below, g_alphabet, t_alphabet, write, &starts_v[0], &pos_v[0],
                                   <uint64_t*>&new_b[0], <uint64_t*>&old_b[0], &sums_v[0] if c else NULL, &failed)
        return status, failed, pos[:total], new[:total], old[:total], starts, sums
    finally:
        for i in range(got_b):
            PyBuffer_Release(&bb[i])
        for i in range(got_m):
            PyBuffer_Release(&mb[i])
        for i in range(got_d):
            PyBuffer_Release(&db[i])
        free(bb)
        free(db)
        free(mb)
        free(parsed)
        free(meta_hashes)
