/* AVX2 decoding of format-version-3 sections of 16-bit words on 32 lanes.
 *
 * READ ME FIRST
 * - Included by _kernels.pyx into both builds.  Only the x86-64-v3 build (compiled
 *   with -march=x86-64-v3, so __AVX2__ and __BMI2__ are defined) gets the vector
 *   loop; the portable build gets a stub that does nothing, and the scalar Cython
 *   loop decodes everything.  Both read the same format, so they give the same
 *   values; the tests compare them.
 * - Layout (docs/format.md, version 3): element i uses lane i % 32.  Elements
 *   come in groups of 8, one group per 256-bit register: register k holds lanes
 *   8k..8k+7, so the 4 registers hold the 32 states and a step decodes 32
 *   consecutive elements (4 groups).  Within a group, the token step of the 8
 *   lanes reads its renormalisation words first (in lane order), then the raw-bit
 *   step reads its words.
 * - One step per register: slot = x & 4095; e = slots[row << 12 | slot] (a gather);
 *   x = f * (x >> 12) + (slot - start); refill; raw = x & (2^nb - 1); x >>= nb;
 *   refill.  A refill shifts in the next 16-bit word for every lane whose state
 *   fell below 2^15: the lanes that need one take consecutive words in lane
 *   order, so one unaligned load of 8 words, a permutation looked up by the
 *   lane mask (PERM below) and a blend do all 8 lanes.
 * - The word position depends on the masks only, and both masks of a group are
 *   known right after its token step (whether the raw step refills does not
 *   depend on the word the token step shifted in, see mask_b below).  So the
 *   position chain does not wait for loads, and the four registers' steps
 *   overlap: the loop runs at the vector units' throughput, not at the ~70-cycle
 *   latency of one step.
 * - Untrusted input: the caller runs the loop only while 32 more elements exist
 *   and 64 more words can be read; a row index comes from the band arithmetic and
 *   is always below the number of rows the caller built; a token from a slot
 *   entry is always below the alphabet (entries come from validated tables).
 */
#ifndef ULPACK_ONE_STREAM_LOOPS_H
#define ULPACK_ONE_STREAM_LOOPS_H

#include <stdint.h>
#include <string.h>

struct ulp3_enc_entry { uint64_t rcp; uint32_t xmax; uint16_t start; uint16_t shift; } __attribute__((packed));

/* C ? A : B for C in {0, 1}, as masks: renormalisation is taken about half the time in
 * dense data, and a mispredicted branch costs more than the whole step. */
#define ULP3_SEL(C, A, B) ((((uint64_t)(A)) & (0 - (uint64_t)(C))) | (((uint64_t)(B)) & ((uint64_t)(C) - 1)))

/* The INTRA decoder's slot table of the AVX2 loops: per slot its entry and, above it, the symbol
 * its rank stands for (lut[rank]), so that one 8-byte load gives both (ULP3_INTRA_ENTRY). */
static __attribute__((unused)) void ulp3_intra_table(const uint32_t *slots, const uint32_t *lut, uint64_t *e64) {
    for (int q = 0; q < 4096; q++)
        e64[q] = slots[q] | (uint64_t)lut[slots[q] >> 24] << 32;
}

#if defined(__AVX2__)
#include <immintrin.h>
#define ULP3_HAVE_AVX2 1

/* PERM[m][j]: for lane j with bit j of mask m set, the index of its word among the
 * words the set lanes take (the number of set bits below j); 0 elsewhere. */
static const int32_t ULP3_PERM[256][8] __attribute__((aligned(32))) = {
    {0,0,0,0,0,0,0,0}, {0,0,0,0,0,0,0,0}, {0,0,0,0,0,0,0,0}, {0,1,0,0,0,0,0,0},
    {0,0,0,0,0,0,0,0}, {0,0,1,0,0,0,0,0}, {0,0,1,0,0,0,0,0}, {0,1,2,0,0,0,0,0},
    {0,0,0,0,0,0,0,0}, {0,0,0,1,0,0,0,0}, {0,0,0,1,0,0,0,0}, {0,1,0,2,0,0,0,0},
    {0,0,0,1,0,0,0,0}, {0,0,1,2,0,0,0,0}, {0,0,1,2,0,0,0,0}, {0,1,2,3,0,0,0,0},
    {0,0,0,0,0,0,0,0}, {0,0,0,0,1,0,0,0}, {0,0,0,0,1,0,0,0}, {0,1,0,0,2,0,0,0},
    {0,0,0,0,1,0,0,0}, {0,0,1,0,2,0,0,0}, {0,0,1,0,2,0,0,0}, {0,1,2,0,3,0,0,0},
    {0,0,0,0,1,0,0,0}, {0,0,0,1,2,0,0,0}, {0,0,0,1,2,0,0,0}, {0,1,0,2,3,0,0,0},
    {0,0,0,1,2,0,0,0}, {0,0,1,2,3,0,0,0}, {0,0,1,2,3,0,0,0}, {0,1,2,3,4,0,0,0},
    {0,0,0,0,0,0,0,0}, {0,0,0,0,0,1,0,0}, {0,0,0,0,0,1,0,0}, {0,1,0,0,0,2,0,0},
    {0,0,0,0,0,1,0,0}, {0,0,1,0,0,2,0,0}, {0,0,1,0,0,2,0,0}, {0,1,2,0,0,3,0,0},
    {0,0,0,0,0,1,0,0}, {0,0,0,1,0,2,0,0}, {0,0,0,1,0,2,0,0}, {0,1,0,2,0,3,0,0},
    {0,0,0,1,0,2,0,0}, {0,0,1,2,0,3,0,0}, {0,0,1,2,0,3,0,0}, {0,1,2,3,0,4,0,0},
    {0,0,0,0,0,1,0,0}, {0,0,0,0,1,2,0,0}, {0,0,0,0,1,2,0,0}, {0,1,0,0,2,3,0,0},
    {0,0,0,0,1,2,0,0}, {0,0,1,0,2,3,0,0}, {0,0,1,0,2,3,0,0}, {0,1,2,0,3,4,0,0},
    {0,0,0,0,1,2,0,0}, {0,0,0,1,2,3,0,0}, {0,0,0,1,2,3,0,0}, {0,1,0,2,3,4,0,0},
    {0,0,0,1,2,3,0,0}, {0,0,1,2,3,4,0,0}, {0,0,1,2,3,4,0,0}, {0,1,2,3,4,5,0,0},
    {0,0,0,0,0,0,0,0}, {0,0,0,0,0,0,1,0}, {0,0,0,0,0,0,1,0}, {0,1,0,0,0,0,2,0},
    {0,0,0,0,0,0,1,0}, {0,0,1,0,0,0,2,0}, {0,0,1,0,0,0,2,0}, {0,1,2,0,0,0,3,0},
    {0,0,0,0,0,0,1,0}, {0,0,0,1,0,0,2,0}, {0,0,0,1,0,0,2,0}, {0,1,0,2,0,0,3,0},
    {0,0,0,1,0,0,2,0}, {0,0,1,2,0,0,3,0}, {0,0,1,2,0,0,3,0}, {0,1,2,3,0,0,4,0},
    {0,0,0,0,0,0,1,0}, {0,0,0,0,1,0,2,0}, {0,0,0,0,1,0,2,0}, {0,1,0,0,2,0,3,0},
    {0,0,0,0,1,0,2,0}, {0,0,1,0,2,0,3,0}, {0,0,1,0,2,0,3,0}, {0,1,2,0,3,0,4,0},
    {0,0,0,0,1,0,2,0}, {0,0,0,1,2,0,3,0}, {0,0,0,1,2,0,3,0}, {0,1,0,2,3,0,4,0},
    {0,0,0,1,2,0,3,0}, {0,0,1,2,3,0,4,0}, {0,0,1,2,3,0,4,0}, {0,1,2,3,4,0,5,0},
    {0,0,0,0,0,0,1,0}, {0,0,0,0,0,1,2,0}, {0,0,0,0,0,1,2,0}, {0,1,0,0,0,2,3,0},
    {0,0,0,0,0,1,2,0}, {0,0,1,0,0,2,3,0}, {0,0,1,0,0,2,3,0}, {0,1,2,0,0,3,4,0},
    {0,0,0,0,0,1,2,0}, {0,0,0,1,0,2,3,0}, {0,0,0,1,0,2,3,0}, {0,1,0,2,0,3,4,0},
    {0,0,0,1,0,2,3,0}, {0,0,1,2,0,3,4,0}, {0,0,1,2,0,3,4,0}, {0,1,2,3,0,4,5,0},
    {0,0,0,0,0,1,2,0}, {0,0,0,0,1,2,3,0}, {0,0,0,0,1,2,3,0}, {0,1,0,0,2,3,4,0},
    {0,0,0,0,1,2,3,0}, {0,0,1,0,2,3,4,0}, {0,0,1,0,2,3,4,0}, {0,1,2,0,3,4,5,0},
    {0,0,0,0,1,2,3,0}, {0,0,0,1,2,3,4,0}, {0,0,0,1,2,3,4,0}, {0,1,0,2,3,4,5,0},
    {0,0,0,1,2,3,4,0}, {0,0,1,2,3,4,5,0}, {0,0,1,2,3,4,5,0}, {0,1,2,3,4,5,6,0},
    {0,0,0,0,0,0,0,0}, {0,0,0,0,0,0,0,1}, {0,0,0,0,0,0,0,1}, {0,1,0,0,0,0,0,2},
    {0,0,0,0,0,0,0,1}, {0,0,1,0,0,0,0,2}, {0,0,1,0,0,0,0,2}, {0,1,2,0,0,0,0,3},
    {0,0,0,0,0,0,0,1}, {0,0,0,1,0,0,0,2}, {0,0,0,1,0,0,0,2}, {0,1,0,2,0,0,0,3},
    {0,0,0,1,0,0,0,2}, {0,0,1,2,0,0,0,3}, {0,0,1,2,0,0,0,3}, {0,1,2,3,0,0,0,4},
    {0,0,0,0,0,0,0,1}, {0,0,0,0,1,0,0,2}, {0,0,0,0,1,0,0,2}, {0,1,0,0,2,0,0,3},
    {0,0,0,0,1,0,0,2}, {0,0,1,0,2,0,0,3}, {0,0,1,0,2,0,0,3}, {0,1,2,0,3,0,0,4},
    {0,0,0,0,1,0,0,2}, {0,0,0,1,2,0,0,3}, {0,0,0,1,2,0,0,3}, {0,1,0,2,3,0,0,4},
    {0,0,0,1,2,0,0,3}, {0,0,1,2,3,0,0,4}, {0,0,1,2,3,0,0,4}, {0,1,2,3,4,0,0,5},
    {0,0,0,0,0,0,0,1}, {0,0,0,0,0,1,0,2}, {0,0,0,0,0,1,0,2}, {0,1,0,0,0,2,0,3},
    {0,0,0,0,0,1,0,2}, {0,0,1,0,0,2,0,3}, {0,0,1,0,0,2,0,3}, {0,1,2,0,0,3,0,4},
    {0,0,0,0,0,1,0,2}, {0,0,0,1,0,2,0,3}, {0,0,0,1,0,2,0,3}, {0,1,0,2,0,3,0,4},
    {0,0,0,1,0,2,0,3}, {0,0,1,2,0,3,0,4}, {0,0,1,2,0,3,0,4}, {0,1,2,3,0,4,0,5},
    {0,0,0,0,0,1,0,2}, {0,0,0,0,1,2,0,3}, {0,0,0,0,1,2,0,3}, {0,1,0,0,2,3,0,4},
    {0,0,0,0,1,2,0,3}, {0,0,1,0,2,3,0,4}, {0,0,1,0,2,3,0,4}, {0,1,2,0,3,4,0,5},
    {0,0,0,0,1,2,0,3}, {0,0,0,1,2,3,0,4}, {0,0,0,1,2,3,0,4}, {0,1,0,2,3,4,0,5},
    {0,0,0,1,2,3,0,4}, {0,0,1,2,3,4,0,5}, {0,0,1,2,3,4,0,5}, {0,1,2,3,4,5,0,6},
    {0,0,0,0,0,0,0,1}, {0,0,0,0,0,0,1,2}, {0,0,0,0,0,0,1,2}, {0,1,0,0,0,0,2,3},
    {0,0,0,0,0,0,1,2}, {0,0,1,0,0,0,2,3}, {0,0,1,0,0,0,2,3}, {0,1,2,0,0,0,3,4},
    {0,0,0,0,0,0,1,2}, {0,0,0,1,0,0,2,3}, {0,0,0,1,0,0,2,3}, {0,1,0,2,0,0,3,4},
    {0,0,0,1,0,0,2,3}, {0,0,1,2,0,0,3,4}, {0,0,1,2,0,0,3,4}, {0,1,2,3,0,0,4,5},
    {0,0,0,0,0,0,1,2}, {0,0,0,0,1,0,2,3}, {0,0,0,0,1,0,2,3}, {0,1,0,0,2,0,3,4},
    {0,0,0,0,1,0,2,3}, {0,0,1,0,2,0,3,4}, {0,0,1,0,2,0,3,4}, {0,1,2,0,3,0,4,5},
    {0,0,0,0,1,0,2,3}, {0,0,0,1,2,0,3,4}, {0,0,0,1,2,0,3,4}, {0,1,0,2,3,0,4,5},
    {0,0,0,1,2,0,3,4}, {0,0,1,2,3,0,4,5}, {0,0,1,2,3,0,4,5}, {0,1,2,3,4,0,5,6},
    {0,0,0,0,0,0,1,2}, {0,0,0,0,0,1,2,3}, {0,0,0,0,0,1,2,3}, {0,1,0,0,0,2,3,4},
    {0,0,0,0,0,1,2,3}, {0,0,1,0,0,2,3,4}, {0,0,1,0,0,2,3,4}, {0,1,2,0,0,3,4,5},
    {0,0,0,0,0,1,2,3}, {0,0,0,1,0,2,3,4}, {0,0,0,1,0,2,3,4}, {0,1,0,2,0,3,4,5},
    {0,0,0,1,0,2,3,4}, {0,0,1,2,0,3,4,5}, {0,0,1,2,0,3,4,5}, {0,1,2,3,0,4,5,6},
    {0,0,0,0,0,1,2,3}, {0,0,0,0,1,2,3,4}, {0,0,0,0,1,2,3,4}, {0,1,0,0,2,3,4,5},
    {0,0,0,0,1,2,3,4}, {0,0,1,0,2,3,4,5}, {0,0,1,0,2,3,4,5}, {0,1,2,0,3,4,5,6},
    {0,0,0,0,1,2,3,4}, {0,0,0,1,2,3,4,5}, {0,0,0,1,2,3,4,5}, {0,1,0,2,3,4,5,6},
    {0,0,0,1,2,3,4,5}, {0,0,1,2,3,4,5,6}, {0,0,1,2,3,4,5,6}, {0,1,2,3,4,5,6,7},};

/* Eight 32-bit table entries at 32-bit indices: what vpgatherdd does, as eight scalar loads.
 * The gather instruction is microcoded on many x86-64 CPUs (Intel Skylake to Tiger Lake with the
 * gather-data-sampling fix: ~33 cycles for 8 lanes measured on the project's Ice Lake), while these
 * loads and inserts take ~8 cycles and overlap with the vector work around them.  The asm keeps
 * the indices in memory: without it the compiler extracts them with vpextrd (two uops each). */
static inline __attribute__((always_inline)) __m256i ulp3_gather(const uint32_t *base, __m256i idx) {
    uint32_t ix[8] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)ix, idx);
    __asm__("" : "+m"(ix));
    return _mm256_setr_epi32((int)base[ix[0]], (int)base[ix[1]], (int)base[ix[2]], (int)base[ix[3]],
                             (int)base[ix[4]], (int)base[ix[5]], (int)base[ix[6]], (int)base[ix[7]]);
}

/* The INTRA lookup of 8 lanes X (states): E gets each slot's entry and SY its symbol, from
 * 64-bit entries (entry | symbol << 32, ulp3_intra_table) loaded in lanes 0, 1, 4, 5 and
 * 2, 3, 6, 7, so that one in-lane shuffle splits them: one set of loads instead of a second
 * lookup of the symbol by the entry's rank. */
#define ULP3_INTRA_ENTRY(X, E, SY)                                                               \
    {                                                                                            \
        uint32_t ix_[8] __attribute__((aligned(32)));                                            \
        _mm256_store_si256((__m256i *)ix_, _mm256_and_si256(X, v.m4095));                        \
        __asm__("" : "+m"(ix_));                                                                 \
        __m256 ea_ = _mm256_castsi256_ps(_mm256_setr_epi64x((long long)e64[ix_[0]], (long long)e64[ix_[1]], \
                                                            (long long)e64[ix_[4]], (long long)e64[ix_[5]])); \
        __m256 eb_ = _mm256_castsi256_ps(_mm256_setr_epi64x((long long)e64[ix_[2]], (long long)e64[ix_[3]], \
                                                            (long long)e64[ix_[6]], (long long)e64[ix_[7]])); \
        E = _mm256_castps_si256(_mm256_shuffle_ps(ea_, eb_, 0x88));                              \
        SY = _mm256_castps_si256(_mm256_shuffle_ps(ea_, eb_, 0xDD));                             \
    }

struct ulp3_vec {
    __m256i low, one, zero, m4095, m255, m_ffff, h16, lo_m1, lo_band, hi_band, emask, nb_intra, smask, c15, h32;
};

/* Token step of one register: returns the token, updates x (no refill yet) and
 * computes both refill masks and their word counts.  row##K: the 8 lanes' rows << 12
 * (ULP3_ROWS16; zero for intra). */
#define ULP3_TOKEN(K)                                                                              \
    __m256i t##K, nb##K, ma##K, mb##K, sy##K = v.zero;                                           \
    int ka##K, kb##K;                                                                            \
    {                                                                                            \
        __m256i row = row##K;                                                                    \
        __m256i e;                                                                               \
        if (mode == 1)                                                                           \
            ULP3_INTRA_ENTRY(x##K, e, sy##K)                                                     \
        else                                                                                     \
            e = ulp3_gather(slots, _mm256_add_epi32(row, _mm256_and_si256(x##K, v.m4095)));      \
        t##K = _mm256_srli_epi32(e, 24);                                                         \
        __m256i f = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 12), v.m4095), v.one); \
        x##K = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(x##K, 12)),              \
                                _mm256_and_si256(e, v.m4095));                                   \
        if (mode == 0) {                                                                         \
            nb##K = _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(t##K, 2), v.one), v.zero); \
        } else {                                                                                 \
            nb##K = v.nb_intra;                                                                  \
        }                                                                                        \
        ma##K = _mm256_cmpgt_epi32(v.low, x##K);                                                 \
        /* refilled: x' = x << 16 | w, and x' >> nb < 2^15 iff x < 2^(nb-1) (nb >= 1) */         \
        mb##K = _mm256_blendv_epi8(                                                              \
            _mm256_cmpgt_epi32(v.low, _mm256_srlv_epi32(x##K, nb##K)),                           \
            _mm256_cmpgt_epi32(_mm256_sllv_epi32(v.one, _mm256_sub_epi32(nb##K, v.one)), x##K),  \
            ma##K);                                                                              \
        ka##K = _mm256_movemask_ps(_mm256_castsi256_ps(ma##K));                                  \
        kb##K = _mm256_movemask_ps(_mm256_castsi256_ps(mb##K));                                  \
    }                                                                                            \
    int64_t pa##K = pos;                                                                         \
    pos += __builtin_popcount(ka##K);                                                            \
    int64_t pb##K = pos;                                                                         \
    pos += __builtin_popcount(kb##K);

#define ULP3_REFILL(X, P, K, M)                                                                  \
    {                                                                                            \
        __m256i w_ = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(words + 2 * (P)))); \
        w_ = _mm256_permutevar8x32_epi32(w_, _mm256_load_si256((const __m256i *)ULP3_PERM[K]));  \
        X = _mm256_blendv_epi8(X, _mm256_or_si256(_mm256_slli_epi32(X, 16), w_), M);             \
    }

/* Raw step and the values: o##K gets the 8 decoded words (a delta: their residuals) as 32-bit lanes. */
#define ULP3_FINISH(K)                                                                           \
    __m256i o##K;                                                                                \
    {                                                                                            \
        ULP3_REFILL(x##K, pa##K, ka##K, ma##K)                                                   \
        __m256i raw = _mm256_and_si256(x##K, _mm256_sub_epi32(_mm256_sllv_epi32(v.one, nb##K), v.one)); \
        x##K = _mm256_srlv_epi32(x##K, nb##K);                                                   \
        ULP3_REFILL(x##K, pb##K, kb##K, mb##K)                                                   \
        if (mode == 0) { /* the residual z (< 2^16); the values come 16 lanes at a time (ULP3_VALUES16) */ \
            o##K = _mm256_or_si256(                                                              \
                _mm256_sllv_epi32(_mm256_sub_epi32(t##K, _mm256_slli_epi32(nb##K, 2)), nb##K), raw); \
        } else {                                                                                 \
            __m256i sym = sy##K;                                          \
            o##K = _mm256_or_si256(                                                              \
                _mm256_or_si256(_mm256_slli_epi32(_mm256_srl_epi32(raw, sh), 15),                \
                                _mm256_sll_epi32(sym, sh)),                                      \
                _mm256_and_si256(raw, v.smask));                                                 \
        }                                                                                        \
    }

/* The rows << 12 of 16 consecutive reference words R (16-bit lanes: twice the elements per
 * instruction), as two registers of 8 32-bit lanes, A (elements 0-7) and B (8-15).  Contexts
 * lo .. lo + count - 1 have rows 1 .. count, every other context row 0. */
#define ULP3_ROWS16(R, A, B)                                                                     \
    {                                                                                            \
        __m256i c_ = _mm256_and_si256(_mm256_srl_epi16(R, mant), e16);                           \
        __m256i in_ = _mm256_and_si256(_mm256_cmpgt_epi16(c_, lo16), _mm256_cmpgt_epi16(hi16, c_)); \
        __m256i w_ = _mm256_and_si256(_mm256_sub_epi16(c_, lo16), in_);                          \
        A = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w_)), 12);            \
        B = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w_, 1)), 12);       \
    }

/* The values of 16 elements of a delta from their reference words R and residuals Z (16-bit
 * lanes): unkey(key(r) + unzigzag(z)) mod 2^16, where key(u) = u ^ (u < 2^15 ? 2^15 : 2^16 - 1)
 * and unkey(k) = k ^ (k >= 2^15 ? 2^15 : 2^16 - 1); 16-bit lanes wrap by themselves. */
static inline __attribute__((always_inline)) __m256i ulp3_values16(__m256i R, __m256i Z) {
    const __m256i h = _mm256_set1_epi16((short)0x8000), one = _mm256_set1_epi16(1);
    __m256i kr = _mm256_xor_si256(R, _mm256_or_si256(_mm256_srai_epi16(R, 15), h));
    __m256i d = _mm256_xor_si256(_mm256_srli_epi16(Z, 1), _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_and_si256(Z, one)));
    __m256i k = _mm256_add_epi16(kr, d);
    return _mm256_xor_si256(k, _mm256_or_si256(_mm256_xor_si256(_mm256_srai_epi16(k, 15), _mm256_set1_epi16(-1)), h));
}

/* Decode elements [i, end) of 16-bit words, 32 at a time, while at least 64 words
 * remain readable; returns the first element not decoded (i + 32k).  states (32)
 * and *pos_io are read and written back.  mode 0: delta (r the reference, band
 * lo/count over contexts (r >> mant) & emask); mode 1: intra (e64: ulp3_intra_table,
 * s low mantissa bits). */
static inline __attribute__((always_inline)) int64_t
ulp3_avx2_loop16(const uint16_t *r, uint16_t *out, int64_t i, int64_t end, const int mode,
                 int mant_bits, int emask, int lo, int count, int s,
                 const uint32_t *slots, const uint64_t *e64, const uint8_t *words,
                 int64_t n_words, int64_t *pos_io, uint32_t *states) {
    struct ulp3_vec v;
    v.low = _mm256_set1_epi32(1 << 15);
    v.one = _mm256_set1_epi32(1);
    v.zero = _mm256_setzero_si256();
    v.m4095 = _mm256_set1_epi32(4095);
    v.m255 = _mm256_set1_epi32(255);
    v.m_ffff = _mm256_set1_epi32(0xFFFF);
    v.h16 = _mm256_set1_epi32(0x8000);
    v.lo_m1 = _mm256_set1_epi32(lo - 1);
    v.lo_band = _mm256_set1_epi32(lo - 1); /* row = c - lo + 1 */
    v.hi_band = _mm256_set1_epi32(lo + count);
    v.emask = _mm256_set1_epi32(emask);
    v.nb_intra = _mm256_set1_epi32(s + 1);
    v.smask = _mm256_set1_epi32((1 << s) - 1);
    const __m128i mant = _mm_cvtsi32_si128(mant_bits);
    const __m128i sh = _mm_cvtsi32_si128(s);
    int64_t pos = *pos_io;
    __m256i x0 = _mm256_loadu_si256((const __m256i *)(states + 0));
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(states + 8));
    __m256i x2 = _mm256_loadu_si256((const __m256i *)(states + 16));
    __m256i x3 = _mm256_loadu_si256((const __m256i *)(states + 24));
    const __m256i e16 = _mm256_set1_epi16((short)emask), lo16 = _mm256_set1_epi16((short)(lo - 1));
    const __m256i hi16 = _mm256_set1_epi16((short)(lo + count)); /* contexts <= 255: no signed overflow */
    for (; i + 32 <= end && pos + 64 <= n_words; i += 32) {
        __m256i ra = v.zero, rb = v.zero, row0 = v.zero, row1 = v.zero, row2 = v.zero, row3 = v.zero;
        if (mode == 0) {
            ra = _mm256_loadu_si256((const __m256i *)(r + i));
            rb = _mm256_loadu_si256((const __m256i *)(r + i + 16));
            ULP3_ROWS16(ra, row0, row1)
            ULP3_ROWS16(rb, row2, row3)
        }
        ULP3_TOKEN(0)
        ULP3_TOKEN(1)
        ULP3_TOKEN(2)
        ULP3_TOKEN(3)
        ULP3_FINISH(0)
        ULP3_FINISH(1)
        ULP3_FINISH(2)
        ULP3_FINISH(3)
        /* 32-bit lanes to 16 (each below 2^16: packus keeps them), in element order */
        __m256i oa = _mm256_permute4x64_epi64(_mm256_packus_epi32(o0, o1), 0xD8);
        __m256i ob = _mm256_permute4x64_epi64(_mm256_packus_epi32(o2, o3), 0xD8);
        if (mode == 0) {
            oa = ulp3_values16(ra, oa);
            ob = ulp3_values16(rb, ob);
        }
        _mm256_storeu_si256((__m256i *)(out + i), oa);
        _mm256_storeu_si256((__m256i *)(out + i + 16), ob);
    }
    _mm256_storeu_si256((__m256i *)(states + 0), x0);
    _mm256_storeu_si256((__m256i *)(states + 8), x1);
    _mm256_storeu_si256((__m256i *)(states + 16), x2);
    _mm256_storeu_si256((__m256i *)(states + 24), x3);
    *pos_io = pos;
    return i;
}

static __attribute__((noinline)) int64_t ulp3_avx2_decode16(const uint16_t *r, uint16_t *out, int64_t i, int64_t end, int mode,
                                  int mant_bits, int emask, int lo, int count, int s,
                                  const uint32_t *slots, const uint64_t *e64, const uint8_t *words,
                                  int64_t n_words, int64_t *pos_io, uint32_t *states) {
    if (mode == 0)  /* two copies of the loop, each with its mode a constant */
        return ulp3_avx2_loop16(r, out, i, end, 0, mant_bits, emask, lo, count, s, slots, e64, words,
                                n_words, pos_io, states);
    return ulp3_avx2_loop16(out, out, i, end, 1, mant_bits, emask, lo, count, s, slots, e64, words,
                            n_words, pos_io, states);
}

/* ---- 32-bit words on 32 lanes: two raw steps (tails up to 29 bits, INTRA raw up to 24) ----
 *
 * As above, with words loaded as 32-bit lanes and a second raw step.  Whether the
 * first raw step refills is known from the token step alone (the identity above);
 * the second one's depends on the words the first two steps shifted in, so each
 * register's word positions wait for its own loads: the chain is a load and a few
 * vector operations per register, still far below the scalar loop's. */
#define ULP3_STEP32(K)                                                                           \
    {                                                                                            \
        __m256i rv = mode == 0 ? _mm256_loadu_si256((const __m256i *)(r + i + 8 * K)) : v.zero; \
        __m256i row = v.zero;                                                                    \
        if (mode == 0) {                                                                         \
            __m256i c = _mm256_and_si256(_mm256_srl_epi32(rv, mant), v.emask);                   \
            __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(c, v.lo_m1), _mm256_cmpgt_epi32(v.hi_band, c)); \
            row = _mm256_slli_epi32(_mm256_and_si256(_mm256_sub_epi32(c, v.lo_band), in), 12);   \
        }                                                                                        \
        __m256i e, sy = v.zero;                                                                  \
        if (mode == 1)                                                                           \
            ULP3_INTRA_ENTRY(x##K, e, sy)                                                        \
        else                                                                                     \
            e = ulp3_gather(slots, _mm256_add_epi32(row, _mm256_and_si256(x##K, v.m4095)));      \
        __m256i t = _mm256_srli_epi32(e, 24);                                                    \
        __m256i f = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 12), v.m4095), v.one); \
        x##K = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(x##K, 12)), _mm256_and_si256(e, v.m4095)); \
        __m256i nb = mode == 1 ? v.nb_intra                                                      \
                               : _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(t, 2), v.one), v.zero); \
        __m256i c0 = _mm256_min_epi32(nb, v.c15);                                                \
        __m256i c1 = _mm256_sub_epi32(nb, c0);                                                   \
        __m256i ma = _mm256_cmpgt_epi32(v.low, x##K);                                            \
        __m256i m0 = _mm256_blendv_epi8(                                                         \
            _mm256_cmpgt_epi32(v.low, _mm256_srlv_epi32(x##K, c0)),                              \
            _mm256_cmpgt_epi32(_mm256_sllv_epi32(v.one, _mm256_sub_epi32(c0, v.one)), x##K), ma); \
        int ka = _mm256_movemask_ps(_mm256_castsi256_ps(ma));                                    \
        int k0 = _mm256_movemask_ps(_mm256_castsi256_ps(m0));                                    \
        int64_t pa = pos;                                                                        \
        pos += __builtin_popcount(ka);                                                           \
        int64_t p0 = pos;                                                                        \
        pos += __builtin_popcount(k0);                                                           \
        ULP3_REFILL(x##K, pa, ka, ma)                                                            \
        __m256i raw = _mm256_and_si256(x##K, _mm256_sub_epi32(_mm256_sllv_epi32(v.one, c0), v.one)); \
        x##K = _mm256_srlv_epi32(x##K, c0);                                                      \
        ULP3_REFILL(x##K, p0, k0, m0)                                                            \
        __m256i m1 = _mm256_cmpgt_epi32(v.low, _mm256_srlv_epi32(x##K, c1));                     \
        int k1 = _mm256_movemask_ps(_mm256_castsi256_ps(m1));                                    \
        int64_t p1 = pos;                                                                        \
        pos += __builtin_popcount(k1);                                                           \
        raw = _mm256_or_si256(raw, _mm256_slli_epi32(                                            \
            _mm256_and_si256(x##K, _mm256_sub_epi32(_mm256_sllv_epi32(v.one, c1), v.one)), 15)); \
        x##K = _mm256_srlv_epi32(x##K, c1);                                                      \
        ULP3_REFILL(x##K, p1, k1, m1)                                                            \
        __m256i o;                                                                               \
        if (mode != 1) {                                                                         \
            __m256i z = _mm256_or_si256(_mm256_sllv_epi32(_mm256_sub_epi32(t, _mm256_slli_epi32(nb, 2)), nb), raw); \
            __m256i kr = _mm256_xor_si256(rv, _mm256_or_si256(_mm256_sub_epi32(v.zero, _mm256_srli_epi32(rv, 31)), v.h32)); \
            __m256i k = _mm256_add_epi32(kr, _mm256_xor_si256(_mm256_srli_epi32(z, 1),          \
                                                               _mm256_sub_epi32(v.zero, _mm256_and_si256(z, v.one)))); \
            o = _mm256_xor_si256(k, _mm256_or_si256(_mm256_sub_epi32(_mm256_srli_epi32(k, 31), v.one), v.h32)); \
        } else {                                                                                 \
            __m256i sym = sy;                                                  \
            o = _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi32(_mm256_srl_epi32(raw, sh), 31), \
                                                _mm256_sll_epi32(sym, sh)),                      \
                                _mm256_and_si256(raw, v.smask));                                 \
        }                                                                                        \
        _mm256_storeu_si256((__m256i *)(out + i + 8 * K), o);                                    \
    }

static inline __attribute__((always_inline)) int64_t
ulp3_avx2_loop32(const uint32_t *r, uint32_t *out, int64_t i, int64_t end, const int mode, int mant_bits, int emask,
                 int lo, int count, int s, const uint32_t *slots, const uint64_t *e64, const uint8_t *words,
                 int64_t n_words, int64_t *pos_io, uint32_t *states) {
    struct ulp3_vec v;
    v.low = _mm256_set1_epi32(1 << 15);
    v.one = _mm256_set1_epi32(1);
    v.zero = _mm256_setzero_si256();
    v.m4095 = _mm256_set1_epi32(4095);
    v.lo_m1 = _mm256_set1_epi32(lo - 1);
    v.lo_band = _mm256_set1_epi32(lo - 1);
    v.hi_band = _mm256_set1_epi32(lo + count);
    v.emask = _mm256_set1_epi32(emask);
    v.nb_intra = _mm256_set1_epi32(s + 1);
    v.smask = _mm256_set1_epi32((int)((1u << s) - 1));
    v.c15 = _mm256_set1_epi32(15);
    v.h32 = _mm256_set1_epi32((int)0x80000000u);
    const __m128i mant = _mm_cvtsi32_si128(mant_bits);
    const __m128i sh = _mm_cvtsi32_si128(s);
    int64_t pos = *pos_io;
    __m256i x0 = _mm256_loadu_si256((const __m256i *)(states + 0));
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(states + 8));
    __m256i x2 = _mm256_loadu_si256((const __m256i *)(states + 16));
    __m256i x3 = _mm256_loadu_si256((const __m256i *)(states + 24));
    for (; i + 32 <= end && pos + 96 <= n_words; i += 32) {
        ULP3_STEP32(0)
        ULP3_STEP32(1)
        ULP3_STEP32(2)
        ULP3_STEP32(3)
    }
    _mm256_storeu_si256((__m256i *)(states + 0), x0);
    _mm256_storeu_si256((__m256i *)(states + 8), x1);
    _mm256_storeu_si256((__m256i *)(states + 16), x2);
    _mm256_storeu_si256((__m256i *)(states + 24), x3);
    *pos_io = pos;
    return i;
}

static __attribute__((noinline)) int64_t ulp3_avx2_decode32(const uint32_t *r, uint32_t *out, int64_t i, int64_t end,
                                                          int mode, int mant_bits, int emask, int lo, int count, int s,
                                                          const uint32_t *slots, const uint64_t *e64,
                                                          const uint8_t *words, int64_t n_words, int64_t *pos_io,
                                                          uint32_t *states) {
    if (mode == 0)  /* one copy of the loop per mode, each with its mode a constant */
        return ulp3_avx2_loop32(r, out, i, end, 0, mant_bits, emask, lo, count, s, slots, e64, words, n_words,
                                pos_io, states);
    if (mode == 1)
        return ulp3_avx2_loop32(r, out, i, end, 1, mant_bits, emask, lo, count, s, slots, e64, words, n_words,
                                pos_io, states);
    return ulp3_avx2_loop32(r, out, i, end, 2, mant_bits, emask, lo, count, s, slots, e64, words, n_words, pos_io,
                            states);
}

/* ---- AVX2 encoding of 16-bit words on 32 lanes, one raw phase -------------------
 *
 * The exact reverse of the decoder above, 8 lanes per register: for each group of 8
 * elements (last group first), the raw step of its 8 lanes, then the token step.
 * A step's emitted words (x & 0xFFFF of the lanes that renormalise) must land in
 * lane order just below the current word position, because the decoder reads
 * them in lane order: PACK[m] moves the lanes set in m to the top of the register,
 * in order, and one 16-byte store at pos - 8 puts them at [pos - cnt, pos) (the 8 - cnt
 * words below are free space, overwritten later).  Division by f is the
 * reciprocal multiply of enc_put in 32-bit lanes: q = hi32(2x * rcp) >> s, exact for
 * x < 2^31 (rcp = ceil(2^(31+s) / f) < 2^32, s = ceil(log2 f)).
 */
static const int32_t ULP3_PACK[256][8] __attribute__((aligned(32))) = {
    {0,0,0,0,0,0,0,0}, {0,0,0,0,0,0,0,0}, {0,0,0,0,0,0,0,1}, {0,0,0,0,0,0,0,1},
    {0,0,0,0,0,0,0,2}, {0,0,0,0,0,0,0,2}, {0,0,0,0,0,0,1,2}, {0,0,0,0,0,0,1,2},
    {0,0,0,0,0,0,0,3}, {0,0,0,0,0,0,0,3}, {0,0,0,0,0,0,1,3}, {0,0,0,0,0,0,1,3},
    {0,0,0,0,0,0,2,3}, {0,0,0,0,0,0,2,3}, {0,0,0,0,0,1,2,3}, {0,0,0,0,0,1,2,3},
    {0,0,0,0,0,0,0,4}, {0,0,0,0,0,0,0,4}, {0,0,0,0,0,0,1,4}, {0,0,0,0,0,0,1,4},
    {0,0,0,0,0,0,2,4}, {0,0,0,0,0,0,2,4}, {0,0,0,0,0,1,2,4}, {0,0,0,0,0,1,2,4},
    {0,0,0,0,0,0,3,4}, {0,0,0,0,0,0,3,4}, {0,0,0,0,0,1,3,4}, {0,0,0,0,0,1,3,4},
    {0,0,0,0,0,2,3,4}, {0,0,0,0,0,2,3,4}, {0,0,0,0,1,2,3,4}, {0,0,0,0,1,2,3,4},
    {0,0,0,0,0,0,0,5}, {0,0,0,0,0,0,0,5}, {0,0,0,0,0,0,1,5}, {0,0,0,0,0,0,1,5},
    {0,0,0,0,0,0,2,5}, {0,0,0,0,0,0,2,5}, {0,0,0,0,0,1,2,5}, {0,0,0,0,0,1,2,5},
    {0,0,0,0,0,0,3,5}, {0,0,0,0,0,0,3,5}, {0,0,0,0,0,1,3,5}, {0,0,0,0,0,1,3,5},
    {0,0,0,0,0,2,3,5}, {0,0,0,0,0,2,3,5}, {0,0,0,0,1,2,3,5}, {0,0,0,0,1,2,3,5},
    {0,0,0,0,0,0,4,5}, {0,0,0,0,0,0,4,5}, {0,0,0,0,0,1,4,5}, {0,0,0,0,0,1,4,5},
    {0,0,0,0,0,2,4,5}, {0,0,0,0,0,2,4,5}, {0,0,0,0,1,2,4,5}, {0,0,0,0,1,2,4,5},
    {0,0,0,0,0,3,4,5}, {0,0,0,0,0,3,4,5}, {0,0,0,0,1,3,4,5}, {0,0,0,0,1,3,4,5},
    {0,0,0,0,2,3,4,5}, {0,0,0,0,2,3,4,5}, {0,0,0,1,2,3,4,5}, {0,0,0,1,2,3,4,5},
    {0,0,0,0,0,0,0,6}, {0,0,0,0,0,0,0,6}, {0,0,0,0,0,0,1,6}, {0,0,0,0,0,0,1,6},
    {0,0,0,0,0,0,2,6}, {0,0,0,0,0,0,2,6}, {0,0,0,0,0,1,2,6}, {0,0,0,0,0,1,2,6},
    {0,0,0,0,0,0,3,6}, {0,0,0,0,0,0,3,6}, {0,0,0,0,0,1,3,6}, {0,0,0,0,0,1,3,6},
    {0,0,0,0,0,2,3,6}, {0,0,0,0,0,2,3,6}, {0,0,0,0,1,2,3,6}, {0,0,0,0,1,2,3,6},
    {0,0,0,0,0,0,4,6}, {0,0,0,0,0,0,4,6}, {0,0,0,0,0,1,4,6}, {0,0,0,0,0,1,4,6},
    {0,0,0,0,0,2,4,6}, {0,0,0,0,0,2,4,6}, {0,0,0,0,1,2,4,6}, {0,0,0,0,1,2,4,6},
    {0,0,0,0,0,3,4,6}, {0,0,0,0,0,3,4,6}, {0,0,0,0,1,3,4,6}, {0,0,0,0,1,3,4,6},
    {0,0,0,0,2,3,4,6}, {0,0,0,0,2,3,4,6}, {0,0,0,1,2,3,4,6}, {0,0,0,1,2,3,4,6},
    {0,0,0,0,0,0,5,6}, {0,0,0,0,0,0,5,6}, {0,0,0,0,0,1,5,6}, {0,0,0,0,0,1,5,6},
    {0,0,0,0,0,2,5,6}, {0,0,0,0,0,2,5,6}, {0,0,0,0,1,2,5,6}, {0,0,0,0,1,2,5,6},
    {0,0,0,0,0,3,5,6}, {0,0,0,0,0,3,5,6}, {0,0,0,0,1,3,5,6}, {0,0,0,0,1,3,5,6},
    {0,0,0,0,2,3,5,6}, {0,0,0,0,2,3,5,6}, {0,0,0,1,2,3,5,6}, {0,0,0,1,2,3,5,6},
    {0,0,0,0,0,4,5,6}, {0,0,0,0,0,4,5,6}, {0,0,0,0,1,4,5,6}, {0,0,0,0,1,4,5,6},
    {0,0,0,0,2,4,5,6}, {0,0,0,0,2,4,5,6}, {0,0,0,1,2,4,5,6}, {0,0,0,1,2,4,5,6},
    {0,0,0,0,3,4,5,6}, {0,0,0,0,3,4,5,6}, {0,0,0,1,3,4,5,6}, {0,0,0,1,3,4,5,6},
    {0,0,0,2,3,4,5,6}, {0,0,0,2,3,4,5,6}, {0,0,1,2,3,4,5,6}, {0,0,1,2,3,4,5,6},
    {0,0,0,0,0,0,0,7}, {0,0,0,0,0,0,0,7}, {0,0,0,0,0,0,1,7}, {0,0,0,0,0,0,1,7},
    {0,0,0,0,0,0,2,7}, {0,0,0,0,0,0,2,7}, {0,0,0,0,0,1,2,7}, {0,0,0,0,0,1,2,7},
    {0,0,0,0,0,0,3,7}, {0,0,0,0,0,0,3,7}, {0,0,0,0,0,1,3,7}, {0,0,0,0,0,1,3,7},
    {0,0,0,0,0,2,3,7}, {0,0,0,0,0,2,3,7}, {0,0,0,0,1,2,3,7}, {0,0,0,0,1,2,3,7},
    {0,0,0,0,0,0,4,7}, {0,0,0,0,0,0,4,7}, {0,0,0,0,0,1,4,7}, {0,0,0,0,0,1,4,7},
    {0,0,0,0,0,2,4,7}, {0,0,0,0,0,2,4,7}, {0,0,0,0,1,2,4,7}, {0,0,0,0,1,2,4,7},
    {0,0,0,0,0,3,4,7}, {0,0,0,0,0,3,4,7}, {0,0,0,0,1,3,4,7}, {0,0,0,0,1,3,4,7},
    {0,0,0,0,2,3,4,7}, {0,0,0,0,2,3,4,7}, {0,0,0,1,2,3,4,7}, {0,0,0,1,2,3,4,7},
    {0,0,0,0,0,0,5,7}, {0,0,0,0,0,0,5,7}, {0,0,0,0,0,1,5,7}, {0,0,0,0,0,1,5,7},
    {0,0,0,0,0,2,5,7}, {0,0,0,0,0,2,5,7}, {0,0,0,0,1,2,5,7}, {0,0,0,0,1,2,5,7},
    {0,0,0,0,0,3,5,7}, {0,0,0,0,0,3,5,7}, {0,0,0,0,1,3,5,7}, {0,0,0,0,1,3,5,7},
    {0,0,0,0,2,3,5,7}, {0,0,0,0,2,3,5,7}, {0,0,0,1,2,3,5,7}, {0,0,0,1,2,3,5,7},
    {0,0,0,0,0,4,5,7}, {0,0,0,0,0,4,5,7}, {0,0,0,0,1,4,5,7}, {0,0,0,0,1,4,5,7},
    {0,0,0,0,2,4,5,7}, {0,0,0,0,2,4,5,7}, {0,0,0,1,2,4,5,7}, {0,0,0,1,2,4,5,7},
    {0,0,0,0,3,4,5,7}, {0,0,0,0,3,4,5,7}, {0,0,0,1,3,4,5,7}, {0,0,0,1,3,4,5,7},
    {0,0,0,2,3,4,5,7}, {0,0,0,2,3,4,5,7}, {0,0,1,2,3,4,5,7}, {0,0,1,2,3,4,5,7},
    {0,0,0,0,0,0,6,7}, {0,0,0,0,0,0,6,7}, {0,0,0,0,0,1,6,7}, {0,0,0,0,0,1,6,7},
    {0,0,0,0,0,2,6,7}, {0,0,0,0,0,2,6,7}, {0,0,0,0,1,2,6,7}, {0,0,0,0,1,2,6,7},
    {0,0,0,0,0,3,6,7}, {0,0,0,0,0,3,6,7}, {0,0,0,0,1,3,6,7}, {0,0,0,0,1,3,6,7},
    {0,0,0,0,2,3,6,7}, {0,0,0,0,2,3,6,7}, {0,0,0,1,2,3,6,7}, {0,0,0,1,2,3,6,7},
    {0,0,0,0,0,4,6,7}, {0,0,0,0,0,4,6,7}, {0,0,0,0,1,4,6,7}, {0,0,0,0,1,4,6,7},
    {0,0,0,0,2,4,6,7}, {0,0,0,0,2,4,6,7}, {0,0,0,1,2,4,6,7}, {0,0,0,1,2,4,6,7},
    {0,0,0,0,3,4,6,7}, {0,0,0,0,3,4,6,7}, {0,0,0,1,3,4,6,7}, {0,0,0,1,3,4,6,7},
    {0,0,0,2,3,4,6,7}, {0,0,0,2,3,4,6,7}, {0,0,1,2,3,4,6,7}, {0,0,1,2,3,4,6,7},
    {0,0,0,0,0,5,6,7}, {0,0,0,0,0,5,6,7}, {0,0,0,0,1,5,6,7}, {0,0,0,0,1,5,6,7},
    {0,0,0,0,2,5,6,7}, {0,0,0,0,2,5,6,7}, {0,0,0,1,2,5,6,7}, {0,0,0,1,2,5,6,7},
    {0,0,0,0,3,5,6,7}, {0,0,0,0,3,5,6,7}, {0,0,0,1,3,5,6,7}, {0,0,0,1,3,5,6,7},
    {0,0,0,2,3,5,6,7}, {0,0,0,2,3,5,6,7}, {0,0,1,2,3,5,6,7}, {0,0,1,2,3,5,6,7},
    {0,0,0,0,4,5,6,7}, {0,0,0,0,4,5,6,7}, {0,0,0,1,4,5,6,7}, {0,0,0,1,4,5,6,7},
    {0,0,0,2,4,5,6,7}, {0,0,0,2,4,5,6,7}, {0,0,1,2,4,5,6,7}, {0,0,1,2,4,5,6,7},
    {0,0,0,3,4,5,6,7}, {0,0,0,3,4,5,6,7}, {0,0,1,3,4,5,6,7}, {0,0,1,3,4,5,6,7},
    {0,0,2,3,4,5,6,7}, {0,0,2,3,4,5,6,7}, {0,1,2,3,4,5,6,7}, {0,1,2,3,4,5,6,7},
};

/* A vector-friendly copy of an EncEntry table: rcp, and start | f << 12 | s << 25. */
struct ulp3_venc { uint32_t rcp; uint32_t info; };

static void ulp3_venc_table(const struct ulp3_enc_entry *tab, int64_t n, struct ulp3_venc *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t f = tab[i].xmax >> 19;
        out[i].rcp = (uint32_t)tab[i].rcp;
        out[i].info = (uint32_t)tab[i].start | (f << 12) | ((uint32_t)(tab[i].shift - 31) << 25);
    }
}

#define ULP3_EMIT(X, EMIT)                                                                        \
    {                                                                                             \
        int m_ = _mm256_movemask_ps(_mm256_castsi256_ps(EMIT));                                   \
        __m256i w_ = _mm256_permutevar8x32_epi32(X, _mm256_load_si256((const __m256i *)ULP3_PACK[m_])); \
        w_ = _mm256_shuffle_epi8(w_, lo16);                                                       \
        w_ = _mm256_permute4x64_epi64(w_, 0x08);                                                  \
        _mm_storeu_si128((__m128i *)(words + pos - 8), _mm256_castsi256_si128(w_));              \
        pos -= __builtin_popcount(m_);                                                            \
        X = _mm256_blendv_epi8(X, _mm256_srli_epi32(X, 16), EMIT);                                \
    }

/* One raw step of chunk C (its bits BITS, below 2^C) on the 8 lanes of X: emit if x >= 2^(31 - C), then push. */
#define ULP3_ENC_RAW(X, C, BITS)                                                                   \
    {                                                                                             \
        __m256i e_ = _mm256_cmpgt_epi32(X, _mm256_sub_epi32(_mm256_sllv_epi32(one, _mm256_sub_epi32(c31, C)), one)); \
        ULP3_EMIT(X, e_)                                                                          \
        X = _mm256_or_si256(_mm256_sllv_epi32(X, C), BITS);                                       \
    }

/* Encode groups of 8 below hi (a multiple of 32), last first; x: 32 states; words
 * needs 8 free slots below the lowest word written.  Returns the word position.
 * One body for both word sizes, specialised by the constant ``wide`` where it is
 * inlined: 16-bit words (wide 0) have one raw chunk, 32-bit words (wide 1) two
 * (tails up to 29 bits, INTRA raw up to 24), pushed in reverse: the second chunk
 * first.  ``width`` is the float's bit width (the INTRA raw value's sign bit). */
static inline __attribute__((always_inline)) int64_t
ulp3_avx2_enc(const void *v, const int wide, const uint16_t *sym, int64_t hi, const int mode, int tb, int s,
              int width, const struct ulp3_venc *vt, uint64_t *x, uint16_t *words, int64_t pos) {
    const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
    const __m256i tmask = _mm256_set1_epi32((1 << tb) - 1), m4095 = _mm256_set1_epi32(4095);
    const __m256i m8191 = _mm256_set1_epi32(8191), m15 = _mm256_set1_epi32(15);
    const __m256i c4096 = _mm256_set1_epi32(4096), smask = _mm256_set1_epi32((int)((1u << s) - 1));
    const __m256i nbi = _mm256_set1_epi32(s + 1), c31 = _mm256_set1_epi32(31);
    const __m256i lo16 = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i shs = _mm_cvtsi32_si128(s), shw = _mm_cvtsi32_si128(width - 1);
    uint32_t st[32];
    for (int j = 0; j < 32; j++) st[j] = (uint32_t)x[j];
    __m256i X[4];
    for (int k = 0; k < 4; k++) X[k] = _mm256_loadu_si256((const __m256i *)(st + 8 * k));
    for (int64_t b = hi - 32; b >= 0; b -= 32) {
        for (int k = 3; k >= 0; k--) {
            int64_t g = b + 8 * k;
            __m256i sy = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sym + g)));
            __m256i va = wide ? _mm256_loadu_si256((const __m256i *)((const uint32_t *)v + g))
                              : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + g)));
            __m256i nb, raw;
            if (mode == 0) {
                nb = _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(_mm256_and_si256(sy, tmask), 2), one), zero);
                raw = _mm256_and_si256(va, _mm256_sub_epi32(_mm256_sllv_epi32(one, nb), one));
            } else {
                nb = nbi;
                raw = _mm256_or_si256(_mm256_sll_epi32(_mm256_srl_epi32(va, shw), shs), _mm256_and_si256(va, smask));
            }
            /* each lane's {rcp, info}: eight 8-byte loads (see ulp3_gather), lanes 0, 1, 4, 5 in one
             * register and 2, 3, 6, 7 in the other, so that one in-lane shuffle splits the two fields */
            uint32_t ix[8] __attribute__((aligned(32)));
            _mm256_store_si256((__m256i *)ix, sy);
            __asm__("" : "+m"(ix));
            uint64_t en[8];
            for (int j = 0; j < 8; j++) memcpy(&en[j], &vt[ix[j]], 8);
            __m256 ea = _mm256_castsi256_ps(_mm256_setr_epi64x((long long)en[0], (long long)en[1], (long long)en[4], (long long)en[5]));
            __m256 eb = _mm256_castsi256_ps(_mm256_setr_epi64x((long long)en[2], (long long)en[3], (long long)en[6], (long long)en[7]));
            __m256i rcp = _mm256_castps_si256(_mm256_shuffle_ps(ea, eb, 0x88));
            __m256i info = _mm256_castps_si256(_mm256_shuffle_ps(ea, eb, 0xDD));
            if (wide) {
                __m256i c0 = _mm256_min_epi32(nb, m15), c1 = _mm256_sub_epi32(nb, c0);
                ULP3_ENC_RAW(X[k], c1, _mm256_srli_epi32(raw, 15))  /* bits 15.. of the raw value */
                ULP3_ENC_RAW(X[k], c0, _mm256_and_si256(raw, _mm256_sub_epi32(_mm256_sllv_epi32(one, c0), one)))
            } else {
                ULP3_ENC_RAW(X[k], nb, raw)  /* nb <= 15: one chunk */
            }
            /* token step: emit if x >= f << 19 */
            __m256i f = _mm256_and_si256(_mm256_srli_epi32(info, 12), m8191);
            __m256i e2 = _mm256_cmpgt_epi32(X[k], _mm256_sub_epi32(_mm256_slli_epi32(f, 19), one));
            ULP3_EMIT(X[k], e2)
            __m256i a2 = _mm256_add_epi32(X[k], X[k]);
            __m256i pe = _mm256_mul_epu32(a2, rcp);
            __m256i po = _mm256_mul_epu32(_mm256_srli_epi64(a2, 32), _mm256_srli_epi64(rcp, 32));
            __m256i q = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
            q = _mm256_srlv_epi32(q, _mm256_and_si256(_mm256_srli_epi32(info, 25), m15));
            X[k] = _mm256_add_epi32(_mm256_add_epi32(X[k], _mm256_and_si256(info, m4095)),
                                    _mm256_mullo_epi32(q, _mm256_sub_epi32(c4096, f)));
        }
    }
    for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(st + 8 * k), X[k]);
    for (int j = 0; j < 32; j++) x[j] = st[j];
    return pos;
}

static int64_t ulp3_avx2_encode16(const uint16_t *v, const uint16_t *sym, int64_t hi, int mode, int tb, int s,
                                  int width, const struct ulp3_venc *vt, uint64_t *x, uint16_t *words,
                                  int64_t pos) {
    if (mode == 0)
        return ulp3_avx2_enc(v, 0, sym, hi, 0, tb, s, width, vt, x, words, pos);
    return ulp3_avx2_enc(v, 0, sym, hi, 1, tb, s, width, vt, x, words, pos);
}

static int64_t ulp3_avx2_encode32(const uint32_t *v, const uint16_t *sym, int64_t hi, int mode, int tb, int s,
                                  const struct ulp3_venc *vt, uint64_t *x, uint16_t *words, int64_t pos) {
    if (mode == 0)
        return ulp3_avx2_enc(v, 1, sym, hi, 0, tb, s, 32, vt, x, words, pos);
    return ulp3_avx2_enc(v, 1, sym, hi, 1, tb, s, 32, vt, x, words, pos);
}

/* ---- hash64 word sums, 4 words per register ------------------------------------------
 *
 * The checksum is sum_j mix(word_j + (j + 1) * golden) mod 2^64 (splitmix64's finaliser
 * as mix), a sum, so any grouping of the words gives the same value.  AVX2 has no 64-bit
 * multiply: a * C = lo(a) lo(C) + ((hi(a) lo(C) + lo(a) hi(C)) << 32) mod 2^64, three
 * 32x32->64 multiplies.  nw words from p (a multiple of 8); salt is (index of the word
 * before the first) * golden; the sums are added to *acc (and *acc_o). */
static inline __attribute__((always_inline)) __m256i ulp_mul64c(__m256i a, __m256i c_lo, __m256i c_hi) {
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), c_lo), _mm256_mul_epu32(a, c_hi));
    return _mm256_add_epi64(_mm256_mul_epu32(a, c_lo), _mm256_slli_epi64(cross, 32));
}

#define ULP_MIX4(Z)                                                                             \
    Z = _mm256_xor_si256(Z, _mm256_srli_epi64(Z, 30));                                        \
    Z = ulp_mul64c(Z, c1lo, c1hi);                                                             \
    Z = _mm256_xor_si256(Z, _mm256_srli_epi64(Z, 27));                                        \
    Z = ulp_mul64c(Z, c2lo, c2hi);                                                             \
    Z = _mm256_xor_si256(Z, _mm256_srli_epi64(Z, 31));

#define ULP_MIX_CONSTANTS                                                                        \
    const __m256i c1lo = _mm256_set1_epi64x((long long)0xBF58476D1CE4E5B9ULL);                 \
    const __m256i c1hi = _mm256_set1_epi64x((long long)(0xBF58476D1CE4E5B9ULL >> 32));         \
    const __m256i c2lo = _mm256_set1_epi64x((long long)0x94D049BB133111EBULL);                 \
    const __m256i c2hi = _mm256_set1_epi64x((long long)(0x94D049BB133111EBULL >> 32));         \
    const uint64_t G = 0x9E3779B97F4A7C15ULL;                                                   \
    const __m256i step = _mm256_set1_epi64x((long long)(8 * G));

static inline uint64_t ulp_hsum64(__m256i v) {
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, v);
    return t[0] + t[1] + t[2] + t[3];
}

static void ulp_hash_sum_words(const uint8_t *p, int64_t nw, uint64_t salt, uint64_t *acc) {
    ULP_MIX_CONSTANTS
    __m256i s0 = _mm256_set_epi64x((long long)(salt + 4 * G), (long long)(salt + 3 * G), (long long)(salt + 2 * G),
                                   (long long)(salt + G));
    __m256i s1 = _mm256_add_epi64(s0, _mm256_set1_epi64x((long long)(4 * G)));
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (int64_t j = 0; j < nw; j += 8) {
        __m256i z0 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + 8 * j)), s0);
        __m256i z1 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + 8 * j + 32)), s1);
        ULP_MIX4(z0)
        ULP_MIX4(z1)
        a0 = _mm256_add_epi64(a0, z0);
        a1 = _mm256_add_epi64(a1, z1);
        s0 = _mm256_add_epi64(s0, step);
        s1 = _mm256_add_epi64(s1, step);
    }
    *acc += ulp_hsum64(_mm256_add_epi64(a0, a1));
}

/* Both sums over the same words of two buffers (a reference and the values decoded from it). */
static void ulp_hash_sum_pair(const uint8_t *pa, const uint8_t *pb, int64_t nw, uint64_t salt, uint64_t *acc_a,
                              uint64_t *acc_b) {
    ULP_MIX_CONSTANTS
    __m256i s0 = _mm256_set_epi64x((long long)(salt + 4 * G), (long long)(salt + 3 * G), (long long)(salt + 2 * G),
                                   (long long)(salt + G));
    __m256i s1 = _mm256_add_epi64(s0, _mm256_set1_epi64x((long long)(4 * G)));
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();
    for (int64_t j = 0; j < nw; j += 8) {
        __m256i y0 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(pa + 8 * j)), s0);
        __m256i y1 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(pa + 8 * j + 32)), s1);
        __m256i z0 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(pb + 8 * j)), s0);
        __m256i z1 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(pb + 8 * j + 32)), s1);
        ULP_MIX4(y0)
        ULP_MIX4(y1)
        ULP_MIX4(z0)
        ULP_MIX4(z1)
        a0 = _mm256_add_epi64(a0, y0);
        a1 = _mm256_add_epi64(a1, y1);
        b0 = _mm256_add_epi64(b0, z0);
        b1 = _mm256_add_epi64(b1, z1);
        s0 = _mm256_add_epi64(s0, step);
        s1 = _mm256_add_epi64(s1, step);
    }
    *acc_a += ulp_hsum64(_mm256_add_epi64(a0, a1));
    *acc_b += ulp_hsum64(_mm256_add_epi64(b0, b1));
}

#else /* the portable build: no vector loop */
#define ULP3_HAVE_AVX2 0
static void ulp_hash_sum_words(const uint8_t *p, int64_t nw, uint64_t salt, uint64_t *acc) {
    (void)p; (void)nw; (void)salt; (void)acc;  /* never called: the Cython loop hashes */
}
static void ulp_hash_sum_pair(const uint8_t *pa, const uint8_t *pb, int64_t nw, uint64_t salt, uint64_t *acc_a,
                              uint64_t *acc_b) {
    (void)pa; (void)pb; (void)nw; (void)salt; (void)acc_a; (void)acc_b;
}
static __attribute__((noinline)) int64_t ulp3_avx2_decode16(const uint16_t *r, uint16_t *out, int64_t i, int64_t end, int mode,
                                  int mant_bits, int emask, int lo, int count, int s,
                                  const uint32_t *slots, const uint64_t *e64, const uint8_t *words,
                                  int64_t n_words, int64_t *pos_io, uint32_t *states) {
    (void)r; (void)out; (void)end; (void)mode; (void)mant_bits; (void)emask; (void)lo; (void)count;
    (void)s; (void)slots; (void)e64; (void)words; (void)n_words; (void)pos_io; (void)states;
    return i;
}
static int64_t ulp3_avx2_decode32(const uint32_t *r, uint32_t *out, int64_t i, int64_t end, int mode,
                                  int mant_bits, int emask, int lo, int count, int s,
                                  const uint32_t *slots, const uint64_t *e64, const uint8_t *words,
                                  int64_t n_words, int64_t *pos_io, uint32_t *states) {
    (void)r; (void)out; (void)end; (void)mode; (void)mant_bits; (void)emask; (void)lo; (void)count;
    (void)s; (void)slots; (void)e64; (void)words; (void)n_words; (void)pos_io; (void)states;
    return i;
}
struct ulp3_venc { uint32_t rcp; uint32_t info; };
static void ulp3_venc_table(const struct ulp3_enc_entry *tab, int64_t n, struct ulp3_venc *out) {
    (void)tab; (void)n; (void)out;
}
static int64_t ulp3_avx2_encode16(const uint16_t *v, const uint16_t *sym, int64_t hi, int mode, int tb, int s,
                                  int width, const struct ulp3_venc *vt, uint64_t *x, uint16_t *words,
                                  int64_t pos) {
    (void)v; (void)sym; (void)hi; (void)mode; (void)tb; (void)s; (void)width; (void)vt; (void)x; (void)words;
    return pos;
}
static int64_t ulp3_avx2_encode32(const uint32_t *v, const uint16_t *sym, int64_t hi, int mode, int tb, int s,
                                  const struct ulp3_venc *vt, uint64_t *x, uint16_t *words, int64_t pos) {
    (void)v; (void)sym; (void)hi; (void)mode; (void)tb; (void)s; (void)vt; (void)x; (void)words;
    return pos;
}
#endif


/* ---- encoding (portable C: both builds) ------------------------------------------
 *
 * The scalar inner loops of rans_encode3 for one raw phase (8- and 16-bit words),
 * written in C so that the compiler keeps the lane states and the word position in
 * registers.  Same math as enc_put / enc_raw in _kernels.pyx (see there):
 *   raw:   if x >= 2^(31 - c): emit x & 0xFFFF, x >>= 16;  x = x << c | bits
 *   token: if x >= xmax: emit, x >>= 16;  x = x + start + ((x * rcp) >> shift) * (4096 - f)
 * Words are written at words[pos - 1] before pos moves (so the write is
 * unconditional); the caller's buffer has one spare slot.
 */

static inline __attribute__((always_inline)) uint64_t
ulp3_put_raw(uint64_t x, uint64_t bits, int c, uint16_t *words, int64_t *pos) {
    uint64_t emit = x >= ((uint64_t)1 << (31 - c));
    words[*pos - 1] = (uint16_t)x;
    *pos -= (int64_t)emit;
    x = ULP3_SEL(emit, x >> 16, x);
    return (x << c) | bits;
}

static inline __attribute__((always_inline)) uint64_t
ulp3_put_token(uint64_t x, const struct ulp3_enc_entry *e, uint16_t *words, int64_t *pos, int rare) {
    if (rare) {
        if (x >= e->xmax) {
            words[--*pos] = (uint16_t)x;
            x >>= 16;
        }
    } else {
        uint64_t emit = x >= e->xmax;
        words[*pos - 1] = (uint16_t)x;
        *pos -= (int64_t)emit;
        x = ULP3_SEL(emit, x >> 16, x);
    }
    return x + e->start + ((x * e->rcp) >> e->shift) * (4096 - (e->xmax >> 19));
}

/* Element i of a delta: table index (its symbol) and raw tail. */
#define ULP3_DELTA_ELEM(SYM, Z, IDX, RAW, NB)                                              \
    {                                                                                      \
        uint32_t s_ = (SYM);                                                               \
        int nb_ = (int)((s_ & tmask) >> 2) - 1;                                            \
        NB = nb_ < 0 ? 0 : nb_;                                                            \
        RAW = (uint64_t)(Z) & (((uint64_t)1 << NB) - 1);                                   \
        IDX = s_;                                                                          \
    }

/* Element i of an intra blob: table index (the symbol) and raw sign + low mantissa. */
#define ULP3_INTRA_ELEM(SYM, X, IDX, RAW, NB)                                              \
    {                                                                                      \
        uint64_t v_ = (uint64_t)(X);                                                       \
        NB = s + 1;                                                                        \
        RAW = ((v_ >> (width - 1)) << s) | (v_ & smask);                                   \
        IDX = (SYM);                                                                       \
    }

#define ULP3_ENC_LOOPS(NAME, WORD, SYMT)                                                              \
/* whole groups of 4 elements below hi, 4 lanes, last group first */                                 \
static inline __attribute__((always_inline)) int64_t NAME##_4(const WORD *v, const SYMT *sym, int64_t hi, int mode, int tb, int s,         \
                        int width, const struct ulp3_enc_entry *tab,            \
                        uint64_t *x, uint16_t *words, int64_t pos, int rare) {                        \
    uint64_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];                                              \
    const uint32_t tmask = (1u << tb) - 1;                                                            \
    const uint64_t smask = ((uint64_t)1 << s) - 1;                                                    \
    (void)width; (void)smask; (void)tmask;                                                  \
    for (int64_t g = hi - 4; g >= 0; g -= 4) {                                                        \
        uint64_t r0, r1, r2, r3;                                                                      \
        int n0, n1, n2, n3;                                                                           \
        uint32_t s0 = sym[g], s1 = sym[g + 1], s2 = sym[g + 2], s3 = sym[g + 3];                      \
        /* sparse deltas: tokens below 8 have no tail, and most groups have only those */            \
        if (mode != 0 || !rare || ((s0 | s1 | s2 | s3) & tmask) >= 8) {                               \
            uint64_t i_;                                                                              \
            if (mode == 0) {                                                                          \
                ULP3_DELTA_ELEM(s0, v[g], i_, r0, n0)                                                 \
                ULP3_DELTA_ELEM(s1, v[g + 1], i_, r1, n1)                                             \
                ULP3_DELTA_ELEM(s2, v[g + 2], i_, r2, n2)                                             \
                ULP3_DELTA_ELEM(s3, v[g + 3], i_, r3, n3)                                             \
            } else {                                                                                  \
                ULP3_INTRA_ELEM(s0, v[g], i_, r0, n0)                                                 \
                ULP3_INTRA_ELEM(s1, v[g + 1], i_, r1, n1)                                             \
                ULP3_INTRA_ELEM(s2, v[g + 2], i_, r2, n2)                                             \
                ULP3_INTRA_ELEM(s3, v[g + 3], i_, r3, n3)                                             \
            }                                                                                         \
            (void)i_;                                                                                 \
            x3 = ulp3_put_raw(x3, r3, n3, words, &pos);                                               \
            x2 = ulp3_put_raw(x2, r2, n2, words, &pos);                                               \
            x1 = ulp3_put_raw(x1, r1, n1, words, &pos);                                               \
            x0 = ulp3_put_raw(x0, r0, n0, words, &pos);                                               \
        }                                                                                             \
        x3 = ulp3_put_token(x3, &tab[s3], words, &pos, rare);                                         \
        x2 = ulp3_put_token(x2, &tab[s2], words, &pos, rare);                                         \
        x1 = ulp3_put_token(x1, &tab[s1], words, &pos, rare);                                         \
        x0 = ulp3_put_token(x0, &tab[s0], words, &pos, rare);                                         \
    }                                                                                                 \
    x[0] = x0; x[1] = x1; x[2] = x2; x[3] = x3;                                                       \
    return pos;                                                                                       \
}                                                                                                     \
/* whole groups of 8 elements below hi, 32 lanes (group g uses lanes g % 32 .. + 7) */                \
static inline __attribute__((always_inline)) int64_t NAME##_8(const WORD *v, const SYMT *sym, int64_t hi, int mode, int tb, int s,         \
                        int width, const struct ulp3_enc_entry *tab,            \
                        uint64_t *x, uint16_t *words, int64_t pos, int rare) {                        \
    const uint32_t tmask = (1u << tb) - 1;                                                            \
    const uint64_t smask = ((uint64_t)1 << s) - 1;                                                    \
    (void)width; (void)smask; (void)tmask;                                                  \
    for (int64_t g = hi - 8; g >= 0; g -= 8) {                                                        \
        uint64_t *xs = x + (g & 31);                                                                  \
        uint64_t idx[8], raw[8];                                                                      \
        int nb[8];                                                                                    \
        for (int j = 0; j < 8; j++) {                                                                 \
            if (mode == 0) ULP3_DELTA_ELEM(sym[g + j], v[g + j], idx[j], raw[j], nb[j])               \
            else ULP3_INTRA_ELEM(sym[g + j], v[g + j], idx[j], raw[j], nb[j])                         \
        }                                                                                             \
        uint64_t y[8];                                                                                \
        for (int j = 0; j < 8; j++) y[j] = xs[j];                                                     \
        for (int j = 7; j >= 0; j--) y[j] = ulp3_put_raw(y[j], raw[j], nb[j], words, &pos);           \
        for (int j = 7; j >= 0; j--) y[j] = ulp3_put_token(y[j], &tab[idx[j]], words, &pos, rare);    \
        for (int j = 0; j < 8; j++) xs[j] = y[j];                                                     \
    }                                                                                                 \
    return pos;                                                                                       \
}

ULP3_ENC_LOOPS(ulp3_enc8, uint8_t, uint16_t)
ULP3_ENC_LOOPS(ulp3_enc16, uint16_t, uint16_t)

/* Encode the whole groups below ``hi`` (a multiple of the group size) of 8- or 16-bit
 * words with one raw phase; returns the new word position. */
static int64_t ulp3_encode_p1(const void *v, int word_bytes, const uint16_t *sym, int64_t hi, int mode, int tb,
                              int s, int width, const void *table, int lanes, uint64_t *x, uint16_t *words,
                              int64_t pos, int rare) {
    const struct ulp3_enc_entry *tab = (const struct ulp3_enc_entry *)table;
#define ULP3_CALL(NAME, W, M, R)                                                                     \
    return lanes == 4 ? NAME##_4((const W *)v, sym, hi, M, tb, s, width, tab, x, words, pos, R) \
                      : NAME##_8((const W *)v, sym, hi, M, tb, s, width, tab, x, words, pos, R)
    if (word_bytes == 1) {
        if (mode == 0) { if (rare) ULP3_CALL(ulp3_enc8, uint8_t, 0, 1); ULP3_CALL(ulp3_enc8, uint8_t, 0, 0); }
        ULP3_CALL(ulp3_enc8, uint8_t, 1, 0);
    }
    if (mode == 0) { if (rare) ULP3_CALL(ulp3_enc16, uint16_t, 0, 1); ULP3_CALL(ulp3_enc16, uint16_t, 0, 0); }
    ULP3_CALL(ulp3_enc16, uint16_t, 1, 0);
#undef ULP3_CALL
}


/* ---- scalar decoding on 4 lanes (portable C: both builds) ---------------------------
 *
 * Deltas of 8- and 16-bit words on 4 lanes (the layout of small payloads, such as the
 * sparse deltas of RL training, where ~99% of the residuals are 0).  Token 0 owns
 * slots [0, f0) of its row when it is the row's first token (f0[c] is that frequency
 * for context c, or 0; 64-bit entries for the gather), so a group of 4 whose slots all
 * fall there decodes without a
 * table lookup, copying the reference: x = f0 * (x >> 12) + slot.  Any other group
 * takes the general step.  Runs while 8 more words can be read (4 tokens + 4 raw
 * steps refill at most once each), so no read is checked here; the caller
 * finishes with checked reads.  Returns the first element not decoded, and appends
 * to changed[*n_changed] the first element of every group of the general step (the
 * only ones whose values may differ from the reference: room for (end - i) / 4).
 */
/* One token step (general: table lookup) on state X, unchecked refill; T gets the token. */
#define ULP3_DEC4_TOKEN(X, C, T)                                                                       \
    {                                                                                                  \
        uint32_t e_ = slots[ctx_base[C] + (X & 4095)];                                                 \
        int64_t y_ = (int64_t)(((e_ >> 12) & 0xFFF) + 1) * (X >> 12) + (e_ & 0xFFF);                  \
        uint16_t w_;                                                                                   \
        memcpy(&w_, words + 2 * pos, 2);                                                               \
        int64_t need_ = y_ < 32768;                                                                    \
        X = (int64_t)ULP3_SEL(need_, (y_ << 16) | w_, y_);                                             \
        pos += need_;                                                                                  \
        T = e_ >> 24;                                                                                  \
    }
/* Raw step on state X for token T, unchecked refill, and the value of element I. */
#define ULP3_DEC4_RAW(X, T, I)                                                                         \
    {                                                                                                  \
        int nb_ = (int)(T >> 2) - 1;                                                                   \
        nb_ = nb_ < 0 ? 0 : nb_;                                                                       \
        uint32_t raw_ = (uint32_t)X & ((1u << nb_) - 1);                                               \
        int64_t y_ = X >> nb_;                                                                         \
        uint16_t w_;                                                                                   \
        memcpy(&w_, words + 2 * pos, 2);                                                               \
        int64_t need_ = y_ < 32768;                                                                    \
        X = (int64_t)ULP3_SEL(need_, (y_ << 16) | w_, y_);                                             \
        pos += need_;                                                                                  \
        uint32_t z_ = ((T - 4 * (uint32_t)nb_) << nb_) | raw_;                                         \
        uint32_t v_ = r[I];                                                                            \
        uint32_t k_ = ((v_ ^ (((0u - (v_ >> (width - 1))) & wmask) | h)) + ((z_ >> 1) ^ (0u - (z_ & 1)))) & wmask; \
        out[I] = (__typeof__(out[0]))(k_ ^ ((((k_ >> (width - 1)) - 1) & wmask) | h));                 \
    }

#if defined(__AVX2__)
/* The zero-group loop in AVX2: the 4 states as 64-bit lanes, f0 looked up by context
 * with four scalar loads (a gather instruction is slower, see ulp3_gather).
 * The chain per group is shift, 32x32 multiply, add (7 cycles) instead of the
 * scalar loop's instruction count. */
#define ULP3_ZERO_LOOP(WORD)                                                                           \
    {                                                                                                  \
        __m256i X = _mm256_setr_epi64x(x0, x1, x2, x3);                                                \
        const __m256i m4095 = _mm256_set1_epi64x(4095), lowm1 = _mm256_set1_epi64x(32767);             \
        while (i + 4 <= end) {                                                                         \
            __m256i g = _mm256_setr_epi64x((long long)f0[((uint32_t)r[i] >> mant) & emask],             \
                                           (long long)f0[((uint32_t)r[i + 1] >> mant) & emask],         \
                                           (long long)f0[((uint32_t)r[i + 2] >> mant) & emask],         \
                                           (long long)f0[((uint32_t)r[i + 3] >> mant) & emask]);        \
            __m256i sl = _mm256_and_si256(X, m4095);                                                   \
            __m256i y = _mm256_add_epi64(_mm256_mul_epu32(g, _mm256_srli_epi64(X, 12)), sl);           \
            __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi64(g, sl), _mm256_cmpgt_epi64(y, lowm1));    \
            if (_mm256_movemask_pd(_mm256_castsi256_pd(ok)) != 15)                                     \
                break;                                                                                 \
            X = y;                                                                                     \
            memcpy(out + i, r + i, 4 * sizeof(WORD));                                                  \
            i += 4;                                                                                    \
        }                                                                                              \
        int64_t xs_[4];                                                                                \
        _mm256_storeu_si256((__m256i *)xs_, X);                                                        \
        x0 = xs_[0]; x1 = xs_[1]; x2 = xs_[2]; x3 = xs_[3];                                            \
    }
#else
#define ULP3_ZERO_LOOP(WORD)                                                                           \
    /* groups of 4 zero tokens: s < f0 and no refill; (f0 - 1 - s) | (y - 2^15) >= 0 says both */     \
    while (i + 4 <= end) {                                                                             \
        int64_t g0 = f0[((uint32_t)r[i] >> mant) & emask], g1 = f0[((uint32_t)r[i + 1] >> mant) & emask]; \
        int64_t g2 = f0[((uint32_t)r[i + 2] >> mant) & emask], g3 = f0[((uint32_t)r[i + 3] >> mant) & emask]; \
        int64_t s0 = x0 & 4095, s1 = x1 & 4095, s2 = x2 & 4095, s3 = x3 & 4095;                       \
        int64_t y0 = g0 * (x0 >> 12) + s0, y1 = g1 * (x1 >> 12) + s1;                                 \
        int64_t y2 = g2 * (x2 >> 12) + s2, y3 = g3 * (x3 >> 12) + s3;                                 \
        if (((g0 - 1 - s0) | (g1 - 1 - s1) | (g2 - 1 - s2) | (g3 - 1 - s3) |                           \
             (y0 - 32768) | (y1 - 32768) | (y2 - 32768) | (y3 - 32768)) < 0)                           \
            break;                                                                                     \
        x0 = y0; x1 = y1; x2 = y2; x3 = y3;                                                            \
        memcpy(out + i, r + i, 4 * sizeof(WORD));                                                      \
        i += 4;                                                                                        \
    }
#endif

/* The general step of a group of 4, in the style of ulp3_dec4_intra16: the four token steps first,
 * and the 8 refill decisions from them alone (the raw step of nb bits refills iff
 * (y << 16*a) < 2^(15+nb), whatever word the token step shifted in: y < 2^(nb-1) after a refill,
 * y >> nb < 2^15 without), so the word positions are a sum tree and no step waits for a load of
 * another lane's word; refills as shifts (a lane that takes no word shifts it out again).  Run in
 * a loop of its own when zero groups are rare (a dense delta): ~5% faster there than the chained
 * form (ULP3_DEC4_TOKEN/RAW above: each refill's position known once the previous lane's word was
 * loaded), which the groups between zero runs keep. */
#define ULP3_D4_TOKEN(X, C, Y, T, NB, A, B)                                                            \
    {                                                                                                  \
        uint32_t e_ = slots[ctx_base[C] + ((uint64_t)X & 4095)];                                       \
        Y = (uint64_t)(((e_ >> 12) & 0xFFF) + 1) * ((uint64_t)X >> 12) + (e_ & 0xFFF);                 \
        T = e_ >> 24;                                                                                  \
        int n_ = (int)(T >> 2) - 1;                                                                    \
        NB = n_ < 0 ? 0 : n_;                                                                          \
        A = Y < 32768;                                                                                 \
        B = ((Y << 16) >> ((A ^ 1) << 4)) < ((uint64_t)1 << (15 + NB));                               \
    }
#define ULP3_D4_RAW(X, Y, T, NB, A, B, PA, P0, I)                                                      \
    {                                                                                                  \
        uint16_t wa_, w0_;                                                                             \
        memcpy(&wa_, words + 2 * (PA), 2);                                                             \
        memcpy(&w0_, words + 2 * (P0), 2);                                                             \
        uint64_t xa_ = ((Y << 16) | wa_) >> ((A ^ 1) << 4);                                            \
        uint32_t raw_ = (uint32_t)xa_ & ((1u << NB) - 1);                                              \
        X = (int64_t)((((xa_ >> NB) << 16) | w0_) >> ((B ^ 1) << 4));                                  \
        uint32_t z_ = ((T - 4 * (uint32_t)NB) << NB) | raw_;                                           \
        uint32_t v_ = r[I];                                                                            \
        uint32_t k_ = ((v_ ^ (((0u - (v_ >> (width - 1))) & wmask) | h)) + ((z_ >> 1) ^ (0u - (z_ & 1)))) & wmask; \
        out[I] = (__typeof__(out[0]))(k_ ^ ((((k_ >> (width - 1)) - 1) & wmask) | h));                 \
    }
#define ULP3_D4_GROUP                                                                                  \
    {                                                                                                  \
        uint32_t c0 = ((uint32_t)r[i] >> mant) & emask, c1 = ((uint32_t)r[i + 1] >> mant) & emask;     \
        uint32_t c2 = ((uint32_t)r[i + 2] >> mant) & emask, c3 = ((uint32_t)r[i + 3] >> mant) & emask; \
        uint64_t y0, y1, y2, y3, a0, a1, a2, a3, b0, b1, b2, b3;                                       \
        uint32_t t0, t1, t2, t3;                                                                       \
        int nb0, nb1, nb2, nb3;                                                                        \
        changed[(*n_changed)++] = (uint32_t)i; /* the groups the zero loop did not copy */              \
        ULP3_D4_TOKEN(x0, c0, y0, t0, nb0, a0, b0)                                                     \
        ULP3_D4_TOKEN(x1, c1, y1, t1, nb1, a1, b1)                                                     \
        ULP3_D4_TOKEN(x2, c2, y2, t2, nb2, a2, b2)                                                     \
        ULP3_D4_TOKEN(x3, c3, y3, t3, nb3, a3, b3)                                                     \
        /* words in stream order: token refills of lanes 0..3, then raw refills of lanes 0..3 */       \
        int64_t pa1 = pos + (int64_t)a0, pa2 = pa1 + (int64_t)a1, pa3 = pa2 + (int64_t)a2;             \
        int64_t p00 = pa3 + (int64_t)a3, p01 = p00 + (int64_t)b0, p02 = p01 + (int64_t)b1;             \
        int64_t p03 = p02 + (int64_t)b2;                                                               \
        ULP3_D4_RAW(x0, y0, t0, nb0, a0, b0, pos, p00, i)                                              \
        ULP3_D4_RAW(x1, y1, t1, nb1, a1, b1, pa1, p01, i + 1)                                          \
        ULP3_D4_RAW(x2, y2, t2, nb2, a2, b2, pa2, p02, i + 2)                                          \
        ULP3_D4_RAW(x3, y3, t3, nb3, a3, b3, pa3, p03, i + 3)                                          \
        pos = p03 + (int64_t)b3;                                                                       \
    }

/* zero_groups: whether to try the zero-group loop first (the caller's choice from the table: token 0
 * common enough that groups of four zeros are; a dense delta's groups would only fail it). */
#define ULP3_DEC4(NAME, WORD)                                                                          \
static __attribute__((noinline)) int64_t NAME(const WORD *r, WORD *out, int64_t i, int64_t end, int mant, \
                    uint32_t emask, const int32_t *ctx_base, const uint64_t *f0, const uint32_t *slots, \
                    const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states,           \
                    uint32_t *changed, int64_t *n_changed, int zero_groups) {                          \
    const int width = 8 * (int)sizeof(WORD);                                                           \
    const uint32_t wmask = (uint32_t)((1ull << width) - 1), h = 1u << (width - 1);                     \
    int64_t x0 = states[0], x1 = states[1], x2 = states[2], x3 = states[3];                            \
    int64_t pos = *pos_io;                                                                             \
    if (!zero_groups) {                                                                                \
        for (; i + 4 <= end && pos + 8 <= n_words; i += 4)                                             \
            ULP3_D4_GROUP                                                                              \
    } else {                                                                                           \
        for (;;) {                                                                                     \
            ULP3_ZERO_LOOP(WORD)                                                                       \
            if (i + 4 > end || pos + 8 > n_words)                                                      \
                break;                                                                                 \
            /* a lone group between zero runs: the chained step (fewer instructions, no tree to build; \
             * the tree's step measured 8% slower on an RL delta of 65,536 elements) */                \
            uint32_t c0 = ((uint32_t)r[i] >> mant) & emask, c1 = ((uint32_t)r[i + 1] >> mant) & emask; \
            uint32_t c2 = ((uint32_t)r[i + 2] >> mant) & emask, c3 = ((uint32_t)r[i + 3] >> mant) & emask; \
            uint32_t t0, t1, t2, t3;                                                                   \
            changed[(*n_changed)++] = (uint32_t)i; /* the groups the zero loop did not copy */          \
            ULP3_DEC4_TOKEN(x0, c0, t0)                                                                \
            ULP3_DEC4_TOKEN(x1, c1, t1)                                                                \
            ULP3_DEC4_TOKEN(x2, c2, t2)                                                                \
            ULP3_DEC4_TOKEN(x3, c3, t3)                                                                \
            ULP3_DEC4_RAW(x0, t0, i)                                                                   \
            ULP3_DEC4_RAW(x1, t1, i + 1)                                                               \
            ULP3_DEC4_RAW(x2, t2, i + 2)                                                               \
            ULP3_DEC4_RAW(x3, t3, i + 3)                                                               \
            i += 4;                                                                                    \
        }                                                                                              \
    }                                                                                                  \
    states[0] = (uint32_t)x0; states[1] = (uint32_t)x1; states[2] = (uint32_t)x2; states[3] = (uint32_t)x3; \
    *pos_io = pos;                                                                                     \
    return i;                                                                                          \
}

ULP3_DEC4(ulp3_dec4_delta8, uint8_t)
ULP3_DEC4(ulp3_dec4_delta16, uint16_t)

/* INTRA 16-bit words on 4 lanes (one raw phase of c = s + 1 <= 15 bits): the layout of
 * every bf16/fp16 tensor under ~200K elements.  The general loop below (ulp3_gen16_decode)
 * ran ~290 instructions a group of 4, its per-lane values spilled to the stack, and the
 * loop is bound by that count, not by the lanes' latency.  Here the four states live in
 * locals, a slot's frequency, offset and symbol are 16-bit fields of one table entry
 * (ulp3_intra4_table, built per section), refills are shifts, and s is a compile-time
 * constant (one instance per s).  The eight refill decisions of a group are known from the
 * token step alone (the raw step refills iff (y << 16*na) < 2^(15+c), whatever word the
 * token step shifted in), so the word positions are a sum tree, not a chain through loads.
 * Runs while 8 more words can be read (each of the 8 steps refills at most once);
 * returns the first element not decoded; the caller finishes with checked reads. */
/* The slot table of ulp3_dec4_intra16: per slot its frequency, its offset in the symbol's
 * range and the symbol in place in the value (lut[rank] << s), each a 16-bit field that one
 * load reads without shifts or masks. */
struct ulp3_i4 { uint16_t f, bias, hi, pad; };
/* Built a symbol's run of slots at a time (slot_table3's layout: a run of f slots, offsets 0 .. f - 1):
 * each entry is the run's first plus its offset, one 8-byte store, instead of a lookup of lut per slot
 * (a third of a 4,096-element blob's decode).  A slot whose run would not fit (never, in a table
 * slot_table3 made) is converted on its own. */
static void ulp3_intra4_table(const uint32_t *slots, const uint32_t *lut, int s, struct ulp3_i4 *t4) {
    int q = 0;
    while (q < 4096) {
        uint32_t e = slots[q];
        uint32_t f = ((e >> 12) & 0xFFF) + 1, bias = e & 0xFFF;
        int run = (int)f - (int)bias;
        if (run < 1 || run > 4096 - q)
            run = 1;
        /* f, bias, hi (the value keeps 16 bits, as in the general loop), pad: little-endian fields */
        uint64_t first = (uint64_t)f | ((uint64_t)bias << 16) | ((uint64_t)(uint16_t)(lut[e >> 24] << s) << 32);
        for (int j = 0; j < run; j++) {
            uint64_t v = first + ((uint64_t)j << 16);
            memcpy(&t4[q + j], &v, sizeof v);
        }
        q += run;
    }
}
/* Refills as shifts: a state that takes a word becomes (y << 16 | w) >> 0, one that does not
 * (y << 16 | w) >> 16 = y, so no select and no branch (either is taken about half the time). */
#define ULP3_I4_TOKEN(X, Y, E, A, B)                                                                   \
    {                                                                                                  \
        E = t4 + (X & 4095);                                                                           \
        Y = (uint64_t)E->f * (X >> 12) + E->bias;                                                      \
        A = Y < 32768;                                                                                 \
        B = ((Y << 16) >> ((A ^ 1) << 4)) < lim;                                                       \
    }
#define ULP3_I4_RAW(X, Y, E, A, B, PA, P0, I)                                                          \
    {                                                                                                  \
        uint16_t wa_, w0_;                                                                             \
        memcpy(&wa_, words + 2 * (PA), 2);                                                             \
        memcpy(&w0_, words + 2 * (P0), 2);                                                             \
        uint64_t xa_ = ((Y << 16) | wa_) >> ((A ^ 1) << 4);                                            \
        X = (((xa_ >> c) << 16) | w0_) >> ((B ^ 1) << 4);                                              \
        out[I] = (uint16_t)(E->hi | ((xa_ << (15 - s)) & 0x8000) | (xa_ & smask));                     \
    }
/* s a compile-time constant (see ulp3_dec4_intra16): shifts by immediates, fewer registers */
static inline __attribute__((always_inline)) int64_t
ulp3_dec4_intra16_s(uint16_t *out, int64_t i, int64_t end, const int s, const struct ulp3_i4 *t4,
                    const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states) {
    const int c = s + 1;
    const uint64_t smask = ((uint64_t)1 << s) - 1, lim = (uint64_t)1 << (15 + c);
    uint64_t x0 = states[0], x1 = states[1], x2 = states[2], x3 = states[3];
    int64_t pos = *pos_io;
    for (; i + 4 <= end && pos + 8 <= n_words; i += 4) {
        uint64_t y0, y1, y2, y3;
        const struct ulp3_i4 *e0, *e1, *e2, *e3;
        uint64_t a0, a1, a2, a3, b0, b1, b2, b3;
        ULP3_I4_TOKEN(x0, y0, e0, a0, b0)
        ULP3_I4_TOKEN(x1, y1, e1, a1, b1)
        ULP3_I4_TOKEN(x2, y2, e2, a2, b2)
        ULP3_I4_TOKEN(x3, y3, e3, a3, b3)
        /* words in stream order: token refills of lanes 0..3, then raw refills of lanes 0..3 */
        int64_t a01 = (int64_t)(a0 + a1), pa1 = pos + (int64_t)a0, pa2 = pos + a01, pa3 = pa2 + (int64_t)a2;
        int64_t p00 = pa2 + (int64_t)(a2 + a3);
        int64_t p01 = p00 + (int64_t)b0, p02 = p00 + (int64_t)(b0 + b1), p03 = p02 + (int64_t)b2;
        ULP3_I4_RAW(x0, y0, e0, a0, b0, pos, p00, i)
        ULP3_I4_RAW(x1, y1, e1, a1, b1, pa1, p01, i + 1)
        ULP3_I4_RAW(x2, y2, e2, a2, b2, pa2, p02, i + 2)
        ULP3_I4_RAW(x3, y3, e3, a3, b3, pa3, p03, i + 3)
        pos = p03 + (int64_t)b3;
    }
    states[0] = (uint32_t)x0; states[1] = (uint32_t)x1; states[2] = (uint32_t)x2; states[3] = (uint32_t)x3;
    *pos_io = pos;
    return i;
}
#define ULP3_I4_CASE(S) case S: return ulp3_dec4_intra16_s(out, i, end, S, t4, words, n_words, pos_io, states);
static __attribute__((noinline)) int64_t ulp3_dec4_intra16(uint16_t *out, int64_t i, int64_t end, int s,
                                                            const void *table, const uint8_t *words,
                                                            int64_t n_words, int64_t *pos_io, uint32_t *states) {
    const struct ulp3_i4 *t4 = (const struct ulp3_i4 *)table;
    switch (s) {  /* 0 <= s, s + 1 <= 15: checked by the caller */
        ULP3_I4_CASE(0) ULP3_I4_CASE(1) ULP3_I4_CASE(2) ULP3_I4_CASE(3) ULP3_I4_CASE(4)
        ULP3_I4_CASE(5) ULP3_I4_CASE(6) ULP3_I4_CASE(7) ULP3_I4_CASE(8) ULP3_I4_CASE(9)
        ULP3_I4_CASE(10) ULP3_I4_CASE(11) ULP3_I4_CASE(12) ULP3_I4_CASE(13) ULP3_I4_CASE(14)
        default: return i;  /* not reached: the caller's scalar loop decodes (same values) */
    }
}


/* ---- scalar loops for any word width and raw-phase count (portable C: both builds) ----
 *
 * Groups of G = 4 (4 lanes) or 8 (32 lanes) elements; P raw phases of <= 15 bits each
 * (1 for 8/16-bit deltas, 2 for 32-bit, 5 for 64-bit).  Same order and math as the
 * Cython loops (enc3_groups, dec3_groups) and the twin, with the group size and the
 * phase count compile-time constants so that the compiler unrolls and keeps states
 * in registers.  The decoder runs while G * (1 + P) more words can be read (each
 * step refills at most once) and returns the first element it did not decode; the
 * caller finishes with checked reads.
 */
#define ULP3_GEN_LOOPS(NAME, WORD, SYMT, P)                                                          \
static inline __attribute__((always_inline)) int64_t                                                 \
NAME##_enc(const WORD *v, const SYMT *sym, int64_t hi, const int G, int lanes, int mode, int tb, int s, \
           int width, const struct ulp3_enc_entry *tab, uint64_t *x, uint16_t *words, int64_t pos,   \
           int rare) {                                                                               \
    const uint64_t tmask = ((uint64_t)1 << tb) - 1, smask = ((uint64_t)1 << s) - 1;                  \
    for (int64_t g = hi - G; g >= 0; g -= G) {                                                       \
        uint64_t *xs = x + (g & (lanes - 1));                                                            \
        uint64_t raw[8], y[8];                                                                       \
        int nb[8];                                                                                   \
        for (int j = 0; j < G; j++) {                                                                \
            uint64_t v_ = (uint64_t)v[g + j];                                                        \
            if (mode == 0) {                                                                         \
                int n_ = (int)((sym[g + j] & tmask) >> 2) - 1;                                       \
                nb[j] = n_ < 0 ? 0 : n_;                                                             \
                raw[j] = nb[j] ? v_ & (~(uint64_t)0 >> (64 - nb[j])) : 0;                            \
            } else {                                                                                 \
                nb[j] = s + 1;                                                                       \
                raw[j] = ((v_ >> (width - 1)) << s) | (v_ & smask);                                  \
            }                                                                                        \
            y[j] = xs[j];                                                                            \
        }                                                                                            \
        for (int p = P - 1; p >= 0; p--)                                                             \
            for (int j = G - 1; j >= 0; j--) {                                                       \
                int c = nb[j] - 15 * p;                                                              \
                c = c < 0 ? 0 : c > 15 ? 15 : c;                                                     \
                y[j] = ulp3_put_raw(y[j], (raw[j] >> (15 * p)) & ((1u << c) - 1), c, words, &pos);   \
            }                                                                                        \
        for (int j = G - 1; j >= 0; j--)                                                             \
            y[j] = ulp3_put_token(y[j], &tab[sym[g + j]], words, &pos, rare);                        \
        for (int j = 0; j < G; j++) xs[j] = y[j];                                                    \
    }                                                                                                \
    return pos;                                                                                      \
}                                                                                                    \
static int64_t NAME##_encode(const WORD *v, const SYMT *sym, int64_t hi, int lanes, int mode, int tb, int s, \
                             int width, const void *table, uint64_t *x, uint16_t *words, int64_t pos,   \
                             int rare) {                                                              \
    const struct ulp3_enc_entry *tab = (const struct ulp3_enc_entry *)table;                         \
    if (lanes == 4) {                                                                                \
        if (mode == 0) return NAME##_enc(v, sym, hi, 4, 4, 0, tb, s, width, tab, x, words, pos, rare); \
        return NAME##_enc(v, sym, hi, 4, 4, 1, tb, s, width, tab, x, words, pos, rare);              \
    }                                                                                                \
    if (mode == 0) return NAME##_enc(v, sym, hi, 8, lanes, 0, tb, s, width, tab, x, words, pos, rare); \
    return NAME##_enc(v, sym, hi, 8, lanes, 1, tb, s, width, tab, x, words, pos, rare);              \
}                                                                                                    \
static inline __attribute__((always_inline)) int64_t                                                 \
NAME##_dec(const WORD *r, WORD *out, int64_t i, int64_t end, const int G, int lanes, const int mode, \
           int mant, uint32_t emask, const int32_t *ctx_base, const uint32_t *slots, const uint32_t *lut, \
           int s, const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states) {         \
    const int width = 8 * (int)sizeof(WORD);                                                         \
    const uint64_t wmask = ~(uint64_t)0 >> (64 - width), h = (uint64_t)1 << (width - 1);             \
    const uint64_t smask = ((uint64_t)1 << s) - 1;                                                   \
    int64_t pos = *pos_io;                                                                           \
    for (; i + G <= end && pos + G * (1 + P) <= n_words; i += G) {                                   \
        uint32_t *xs = states + (i & (lanes - 1));                                                      \
        uint64_t y[8], raw[8];                                                                       \
        uint32_t t[8];                                                                               \
        int nb[8], na[8], n0[8];                                                                     \
        /* the token step; whether it, and the first raw step, refill is known before any word \
         * is read (refilled: (y << 16 | w) >> c < 2^15 iff y < 2^(c-1)), so the word       \
         * positions do not wait for loads */                                                       \
        _Pragma("GCC unroll 8")                                                                     \
        for (int j = 0; j < G; j++) {                                                                \
            int32_t row = mode == 0 ? ctx_base[((uint64_t)r[i + j] >> mant) & emask] : 0;           \
            uint64_t x_ = xs[j];                                                                     \
            uint32_t e = slots[row + (x_ & 4095)];                                                   \
            y[j] = (((e >> 12) & 0xFFF) + 1) * (x_ >> 12) + (e & 0xFFF);                             \
            t[j] = e >> 24;                                                                          \
            int n_ = mode != 1 ? (int)(t[j] >> 2) - 1 : s + 1;                                       \
            nb[j] = n_ < 0 ? 0 : n_;                                                                 \
            int c = nb[j] < 15 ? nb[j] : 15;                                                         \
            na[j] = y[j] < 32768;                                                                    \
            n0[j] = (int)ULP3_SEL(na[j], c >= 1 && y[j] < ((uint64_t)1 << (c - 1)), (y[j] >> c) < 32768); \
        }                                                                                            \
        int64_t pa[8], p0[8];                                                                        \
        for (int j = 0; j < G; j++) { pa[j] = pos; pos += na[j]; }                                  \
        for (int j = 0; j < G; j++) { p0[j] = pos; pos += n0[j]; }                                  \
        for (int j = 0; j < G; j++) {                                                                \
            uint16_t wa, w0;                                                                         \
            memcpy(&wa, words + 2 * pa[j], 2);                                                       \
            memcpy(&w0, words + 2 * p0[j], 2);                                                       \
            uint64_t xa = ULP3_SEL(na[j], (y[j] << 16) | wa, y[j]);                                  \
            int c = nb[j] < 15 ? nb[j] : 15;                                                         \
            raw[j] = xa & ((1u << c) - 1);                                                           \
            uint64_t xb = xa >> c;                                                                   \
            y[j] = ULP3_SEL(n0[j], (xb << 16) | w0, xb);                                             \
        }                                                                                            \
        for (int p = 1; p < P; p++)                                                                  \
            for (int j = 0; j < G; j++) {                                                            \
                int c = nb[j] - 15 * p;                                                              \
                c = c < 0 ? 0 : c > 15 ? 15 : c;                                                     \
                raw[j] |= (y[j] & ((1u << c) - 1)) << (15 * p);                                      \
                uint64_t z = y[j] >> c;                                                              \
                uint16_t w_;                                                                         \
                memcpy(&w_, words + 2 * pos, 2);                                                     \
                uint64_t need = z < 32768;                                                           \
                y[j] = ULP3_SEL(need, (z << 16) | w_, z);                                            \
                pos += (int64_t)need;                                                                \
            }                                                                                        \
        for (int j = 0; j < G; j++) {                                                                \
            uint64_t val;                                                                            \
            if (mode != 1) {                                                                         \
                uint64_t z = ((uint64_t)(t[j] - 4 * (uint32_t)nb[j]) << nb[j]) | raw[j];             \
                uint64_t ref = mode == 0 ? (uint64_t)r[i + j] : 0;                                   \
                uint64_t k = ((ref ^ (((0 - (ref >> (width - 1))) & wmask) | h)) + ((z >> 1) ^ (0 - (z & 1)))) & wmask; \
                val = k ^ ((((k >> (width - 1)) - 1) & wmask) | h);                                  \
            } else {                                                                                 \
                val = ((raw[j] >> s) << (width - 1)) | ((uint64_t)lut[t[j]] << s) | (raw[j] & smask); \
            }                                                                                        \
            out[i + j] = (WORD)val;                                                                  \
            xs[j] = (uint32_t)y[j];                                                                  \
        }                                                                                            \
    }                                                                                                \
    *pos_io = pos;                                                                                   \
    return i;                                                                                        \
}                                                                                                    \
static __attribute__((noinline)) int64_t                                                             \
NAME##_decode(const WORD *r, WORD *out, int64_t i, int64_t end, int lanes, int mode, int mant,       \
              uint32_t emask, const int32_t *ctx_base, const uint32_t *slots, const uint32_t *lut, int s, \
              const uint8_t *words, int64_t n_words, int64_t *pos_io, uint32_t *states) {            \
    const int G = lanes < 8 ? 4 : 8;                                                                 \
    if (G == 4) {                                                                                    \
        if (mode == 0) return NAME##_dec(r, out, i, end, 4, 4, 0, mant, emask, ctx_base, slots, lut, s, words, n_words, pos_io, states); \
        if (mode == 1) return NAME##_dec(r, out, i, end, 4, 4, 1, mant, emask, ctx_base, slots, lut, s, words, n_words, pos_io, states); \
        return NAME##_dec(r, out, i, end, 4, 4, 2, mant, emask, ctx_base, slots, lut, s, words, n_words, pos_io, states); \
    }                                                                                                \
    if (mode == 0) return NAME##_dec(r, out, i, end, 8, lanes, 0, mant, emask, ctx_base, slots, lut, s, words, n_words, pos_io, states); \
    if (mode == 1) return NAME##_dec(r, out, i, end, 8, lanes, 1, mant, emask, ctx_base, slots, lut, s, words, n_words, pos_io, states); \
    return NAME##_dec(r, out, i, end, 8, lanes, 2, mant, emask, ctx_base, slots, lut, s, words, n_words, pos_io, states); \
}

ULP3_GEN_LOOPS(ulp3_gen8, uint8_t, uint16_t, 1)
ULP3_GEN_LOOPS(ulp3_gen16, uint16_t, uint16_t, 1)
ULP3_GEN_LOOPS(ulp3_gen32, uint32_t, uint16_t, 2)
ULP3_GEN_LOOPS(ulp3_gen64, uint64_t, uint32_t, 5)
ULP3_GEN_LOOPS(ulp3_gen64i, uint64_t, uint16_t, 4)

#endif /* ULPACK_ONE_STREAM_LOOPS_H */
