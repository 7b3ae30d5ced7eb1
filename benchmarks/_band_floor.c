/* The floor of a band-rank SPARSE decoder (issue 39): a prototype, not ulstore's code.
 *
 * A position code conditioned on the reference exponent (what makes the default encoding small
 * on RL deltas) has to look at every reference exponent.  This measures what that costs at best:
 * the reference's exponents are split into K contiguous bands (K - 1 thresholds), and the changed
 * elements are given as gaps between their ranks within their band plus their new words, in the
 * order the decoder meets them (32-element block, band, position).  Decoding copies the reference
 * (AVX2), classifies 32 exponents at a time, counts each band's members with a popcount, and
 * writes a change where a band's countdown runs out (pdep finds it).  The entropy decoding of the
 * gaps and residuals is NOT included: it is per change and the same as today's SPARSE decoder's.
 *
 * Usage: _band_floor REF TGT N K EDGES REPS   (REF, TGT: N raw little-endian bf16 words; EDGES:
 * the K - 1 thresholds, comma-separated).  Prints "key value" lines: CPU-time MB/s of the tensor's
 * bytes (best of REPS) of memcpy, of the decode into a new array, of the in-place apply (no copy),
 * and ns per change of the in-place apply and of a plain scatter of the known changes (the floor
 * of any in-place apply).  Exits 1 if a decode differs from TGT.  Built by benchmarks/band_floor.py.
 *
 * Keyed bands: if the bands are those of a key that changes rarely (the chain's anchor, whose
 * exponents a RL chain keeps: band_floor.py measures the bits that costs), a reader builds an
 * index of each band's members once per key and then applies every delta of the chain in time
 * proportional to its changes: rank -> position by one lookup.  Also printed: the index build per
 * element (once per key) and that apply per change ("keyed_apply"), its index 4 bytes an element.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_BANDS 16

static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint16_t *read_words(const char *path, size_t n) {
  uint16_t *buf = aligned_alloc(64, (n * 2 + 127) / 64 * 64);
  FILE *f = fopen(path, "rb");
  if (!buf || !f || fread(buf, 2, n, f) != n) {
    fprintf(stderr, "cannot read %zu words from %s\n", n, path);
    exit(2);
  }
  fclose(f);
  return buf;
}

static int band_of(uint16_t w, const uint8_t *edges, int k) {
  int e = (w >> 7) & 0xFF, b = 0;
  for (int i = 0; i < k - 1; i++) b += e >= edges[i];
  return b;
}

/* Decode: out = ref with the changes written (copy != 0), or the changes written over out.
 * gaps[b]: band b's rank gaps, ending in a sentinel; vals: new words in decode order. */
static size_t decode(const uint16_t *ref, uint16_t *out, size_t n, const uint8_t *edges, int k,
                     uint32_t *const *gaps, const uint16_t *vals, int copy) {
  __m256i thr[MAX_BANDS];
  for (int i = 0; i < k - 1; i++) thr[i] = _mm256_set1_epi8((char)edges[i]);
  uint32_t left[MAX_BANDS];
  const uint32_t *g[MAX_BANDS];
  for (int b = 0; b < k; b++) {
    g[b] = gaps[b];
    left[b] = *g[b]++;
  }
  size_t v = 0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(ref + i));
    __m256i c = _mm256_loadu_si256((const __m256i *)(ref + i + 16));
    if (copy) {
      _mm256_storeu_si256((__m256i *)(out + i), a);
      _mm256_storeu_si256((__m256i *)(out + i + 16), c);
    }
    a = _mm256_srli_epi16(_mm256_slli_epi16(a, 1), 8);
    c = _mm256_srli_epi16(_mm256_slli_epi16(c, 1), 8);
    __m256i e = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, c), 0xD8); /* 32 exponents, in order */
    uint32_t ge[MAX_BANDS + 1]; /* ge[b]: the block's elements at or above band b */
    ge[0] = 0xFFFFFFFFu;
    ge[k] = 0;
    for (int t = 0; t < k - 1; t++)
      ge[t + 1] = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(e, thr[t]), e));
    for (int b = 0; b < k; b++) {
      uint32_t m = ge[b] & ~ge[b + 1];
      uint32_t cnt = (uint32_t)__builtin_popcount(m);
      if (__builtin_expect(left[b] >= cnt, 1)) {
        left[b] -= cnt;
        continue;
      }
      while (left[b] < cnt) { /* the (left + 1)-th member of band b in this block changes */
        uint32_t bit = (uint32_t)_pdep_u32(1u << left[b], m);
        out[i + (unsigned)__builtin_ctz(bit)] = vals[v++];
        m &= ~((bit << 1) - 1);
        cnt = (uint32_t)__builtin_popcount(m);
        left[b] = *g[b]++;
      }
      left[b] -= cnt;
    }
  }
  return v;
}

/* The members of each band in position order: idx[start[b] .. start[b + 1]). */
static void build_index(const uint16_t *key, size_t n, const uint8_t *edges, int k, uint32_t *idx, size_t *start) {
  size_t fill[MAX_BANDS + 1] = {0};
  for (size_t i = 0; i < n; i++) fill[band_of(key[i], edges, k) + 1]++;
  for (int b = 0; b < k; b++) fill[b + 1] += fill[b];
  memcpy(start, fill, sizeof(size_t) * (size_t)(k + 1));
  for (size_t i = 0; i < n; i++) idx[fill[band_of(key[i], edges, k)]++] = (uint32_t)i;
}

/* The in-place apply on a built index: band-major rank gaps (sentinel-ended) and new words. */
static void apply_keyed(uint16_t *out, const uint32_t *idx, const size_t *start, int k, uint32_t *const *gaps,
                        const uint16_t *vals) {
  size_t v = 0;
  for (int b = 0; b < k; b++) {
    const uint32_t *members = idx + start[b], *g = gaps[b];
    size_t r = (size_t)-1;
    for (uint32_t gap = *g++; gap != 0xFFFFFFFFu; gap = *g++) {
      r += (size_t)gap + 1;
      out[members[r]] = vals[v++];
    }
  }
}

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s REF TGT N K EDGES REPS\n", argv[0]);
    return 2;
  }
  size_t n = (size_t)strtoull(argv[3], NULL, 10);
  int k = atoi(argv[4]), reps = atoi(argv[6]);
  uint8_t edges[MAX_BANDS] = {0};
  char *s = argv[5];
  for (int i = 0; i < k - 1; i++, s = strchr(s, ',') ? strchr(s, ',') + 1 : s) edges[i] = (uint8_t)atoi(s);
  if (k < 1 || k > MAX_BANDS || n % 32) {
    fprintf(stderr, "K must be 1..%d and N a multiple of 32\n", MAX_BANDS);
    return 2;
  }
  uint16_t *ref = read_words(argv[1], n), *tgt = read_words(argv[2], n);
  /* the encoder: every band's rank gaps, and the new words in decode order */
  uint32_t *gaps[MAX_BANDS], rank[MAX_BANDS] = {0}, last[MAX_BANDS];
  size_t count[MAX_BANDS] = {0}, m = 0;
  uint16_t *vals = malloc(n * 2 + 2), *pos_words = malloc(n * 2 + 2);
  size_t *pos = malloc(sizeof(size_t) * (n + 1));
  for (int b = 0; b < k; b++) {
    gaps[b] = malloc(sizeof(uint32_t) * (n + 1));
    last[b] = (uint32_t)-1;
  }
  for (size_t i = 0; i < n; i += 32)
    for (int b = 0; b < k; b++)
      for (size_t j = i; j < i + 32; j++) {
        if (band_of(ref[j], edges, k) != b) continue;
        if (ref[j] != tgt[j]) {
          gaps[b][count[b]++] = rank[b] - last[b] - 1;
          last[b] = rank[b];
          vals[m] = tgt[j];
          pos[m] = j;
          pos_words[m++] = tgt[j];
        }
        rank[b]++;
      }
  for (int b = 0; b < k; b++) gaps[b][count[b]] = 0xFFFFFFFFu; /* no more changes in this band */
  /* the keyed encoder: the same changes, band-major (the order apply_keyed meets them) */
  uint32_t *kgaps[MAX_BANDS];
  uint16_t *kvals = malloc(n * 2 + 2);
  size_t kv = 0;
  for (int b = 0; b < k; b++) {
    size_t c = 0;
    uint32_t r = 0, prev = (uint32_t)-1;
    kgaps[b] = malloc(sizeof(uint32_t) * (count[b] + 1));
    for (size_t j = 0; j < n; j++) {
      if (band_of(ref[j], edges, k) != b) continue;
      if (ref[j] != tgt[j]) {
        kgaps[b][c++] = r - prev - 1;
        prev = r;
        kvals[kv++] = tgt[j];
      }
      r++;
    }
    kgaps[b][c] = 0xFFFFFFFFu;
  }
  uint32_t *idx = malloc(sizeof(uint32_t) * n);
  size_t start[MAX_BANDS + 1];
  uint16_t *out = aligned_alloc(64, n * 2 + 64), *work = aligned_alloc(64, n * 2 + 64);
  double t_copy = 1e30, t_dec = 1e30, t_apply = 1e30, t_scatter = 1e30, t_index = 1e30, t_keyed = 1e30;
  for (int r = 0; r < reps; r++) {
    double t0 = cpu_now();
    memcpy(work, ref, n * 2);
    double t1 = cpu_now();
    size_t got = decode(ref, out, n, edges, k, gaps, vals, 1);
    double t2 = cpu_now();
    if (got != m || memcmp(out, tgt, n * 2)) return 1;
    memcpy(work, ref, n * 2);
    double t3 = cpu_now();
    decode(work, work, n, edges, k, gaps, vals, 0);
    double t4 = cpu_now();
    if (memcmp(work, tgt, n * 2)) return 1;
    memcpy(work, ref, n * 2);
    double t5 = cpu_now();
    for (size_t c = 0; c < m; c++) work[pos[c]] = pos_words[c];
    double t6 = cpu_now();
    if (memcmp(work, tgt, n * 2)) return 1;
    double t7 = cpu_now();
    build_index(ref, n, edges, k, idx, start);
    double t8 = cpu_now();
    memcpy(work, ref, n * 2);
    double t9 = cpu_now();
    apply_keyed(work, idx, start, k, kgaps, kvals);
    double t10 = cpu_now();
    if (memcmp(work, tgt, n * 2)) return 1;
    t_index = t8 - t7 < t_index ? t8 - t7 : t_index;
    t_keyed = t10 - t9 < t_keyed ? t10 - t9 : t_keyed;
    t_copy = t1 - t0 < t_copy ? t1 - t0 : t_copy;
    t_dec = t2 - t1 < t_dec ? t2 - t1 : t_dec;
    t_apply = t4 - t3 < t_apply ? t4 - t3 : t_apply;
    t_scatter = t6 - t5 < t_scatter ? t6 - t5 : t_scatter;
  }
  printf("changes %zu\n", m);
  printf("memcpy_MBps %.1f\ndecode_MBps %.1f\napply_MBps %.1f\n", n * 2 / t_copy / 1e6, n * 2 / t_dec / 1e6,
         n * 2 / t_apply / 1e6);
  printf("apply_ns_per_change %.2f\nscatter_ns_per_change %.2f\n", m ? t_apply / m * 1e9 : 0.0,
         m ? t_scatter / m * 1e9 : 0.0);
  printf("index_ns_per_element %.3f\nkeyed_apply_ns_per_change %.2f\n", t_index / n * 1e9, m ? t_keyed / m * 1e9 : 0.0);
  return 0;
}
