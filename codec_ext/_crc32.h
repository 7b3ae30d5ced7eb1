/* CRC-32 (the zlib / gzip / PNG one: reflected polynomial 0xEDB88320) of a blob.
 *
 * Every ULPack blob ends with the CRC-32 of its other bytes; zlib's crc32 (the
 * table-driven "braided" loop of zlib 1.2.12+) runs at about 2 GB/s, which on a
 * dense bf16 blob is several percent of the whole decode.  On x86-64 CPUs with
 * PCLMULQDQ (every one since 2010) this folds 64 bytes per step with carry-less
 * multiplies, ~10x faster: the method of Intel's paper "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ Instruction" (Gopal et al., 2009), with the
 * constants and loop of Chromium's zlib (crc32_simd.c).  The choice is made at run
 * time (__builtin_cpu_supports), so both builds (_kernels, _kernels_x86_64_v3) carry it;
 * elsewhere, and for the < 16 bytes left over, a byte-wise table loop.  Every path
 * computes the same function as zlib.crc32, and the tests compare them.
 */
#ifndef ULPACK_CRC32_H
#define ULPACK_CRC32_H

#include <stddef.h>
#include <stdint.h>

static uint32_t ulp_crc_table[256];
static int ulp_crc_simd = 0;

static void ulp_crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        ulp_crc_table[n] = c;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    ulp_crc_simd = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
}

/* The pre- and post-inverted register: crc = ~crc32 so far. */
static inline uint32_t ulp_crc_bytes(uint32_t crc, const uint8_t *p, size_t n) {
    while (n--)
        crc = ulp_crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* Folds len bytes (len >= 64, a multiple of 16) into the inverted register crc. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t ulp_crc_fold(const uint8_t *buf, size_t len, uint32_t crc) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = k1k2;
    buf += 64;
    len -= 64;
    while (len >= 64) { /* four independent 128-bit folds per 64 bytes */
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }
    /* fold the four into one */
    x0 = k3k4;
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) { /* single folds of 16 bytes */
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 -> 64 bits */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = k5k0;
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    /* Barrett reduction to 32 bits */
    x0 = poly;
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

/* zlib.crc32(p[:n], crc); ulp_crc_init() must have run (the module does it at import) */
static uint32_t ulp_crc32(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
    if (ulp_crc_simd && n >= 64) {
        size_t chunk = n & ~(size_t)15;
        crc = ulp_crc_fold(p, chunk, crc);
        p += chunk;
        n -= chunk;
    }
#endif
    return ~ulp_crc_bytes(crc, p, n);
}

#endif /* ULPACK_CRC32_H */
