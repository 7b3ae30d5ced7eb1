/* The sum of mix(a[i]) - mix(b[i]) (mod 2^64): the checksum difference of the words
 * an in-place apply changed (_apply.pxi, sum_put), over a block of words.
 *
 * ulp_mix is splitmix64's finaliser, the checksum's per-word mix (the one
 * definition: _kernels.pyx declares it as mix for hash64).  The sum is modular, so any
 * order gives the same value: the AVX-512 version (8 words per register, 64-bit
 * multiplies in one instruction, AVX512DQ) and the plain one agree bit for bit.
 * The AVX-512 version is compiled into every build with a target attribute and
 * chosen at run time (ulp_mixsum_init), so the portable build uses it too where
 * the CPU has it.  Without AVX512DQ a 64-bit multiply takes several AVX2
 * instructions, which is why there is no AVX2 version.
 */
#ifndef ULPACK_MIXSUM_H
#define ULPACK_MIXSUM_H

#include <stddef.h>
#include <stdint.h>

static inline uint64_t ulp_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

#define ULP_MIX_DIFF_SUM_BODY                                   \
    {                                                           \
        uint64_t acc = 0;                                       \
        for (ptrdiff_t i = 0; i < n; i++)                       \
            acc += ulp_mix(a[i]) - ulp_mix(b[i]);               \
        return acc;                                             \
    }

static uint64_t ulp_mix_diff_sum_plain(const uint64_t* a, const uint64_t* b, ptrdiff_t n)
    ULP_MIX_DIFF_SUM_BODY

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ULP_HAVE_MIXSUM_AVX512 1
__attribute__((target("avx512f,avx512dq"), optimize("O3", "tree-vectorize")))
static uint64_t ulp_mix_diff_sum_avx512(const uint64_t* a, const uint64_t* b, ptrdiff_t n)
    ULP_MIX_DIFF_SUM_BODY
#else
#define ULP_HAVE_MIXSUM_AVX512 0
#endif

/* 1: AVX-512 (set by ulp_mixsum_init where the CPU has it, and by tests), 0: plain */
static int ulp_mixsum_simd = 0;

static int ulp_mixsum_init(void) {
#if ULP_HAVE_MIXSUM_AVX512
    __builtin_cpu_init();
    ulp_mixsum_simd = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#endif
    return ulp_mixsum_simd;
}

static int ulp_mixsum_get(void) { return ulp_mixsum_simd; }
static void ulp_mixsum_set(int simd) { ulp_mixsum_simd = simd; }

static inline uint64_t ulp_mix_diff_sum(const uint64_t* a, const uint64_t* b, ptrdiff_t n) {
#if ULP_HAVE_MIXSUM_AVX512
    if (ulp_mixsum_simd)
        return ulp_mix_diff_sum_avx512(a, b, n);
#endif
    return ulp_mix_diff_sum_plain(a, b, n);
}

#endif
