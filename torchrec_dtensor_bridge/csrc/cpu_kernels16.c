/*
 * This package's CPU kernels for half-precision tables (fp16, bf16): the pooled sum of a bag lookup and the fused
 * optimizers' sparse updates, over every table of one flat storage in one call, as cpu_kernels.c does for fp32
 * (the same argument conventions; its tdb_group_tables groups an update's occurrences first).
 *
 * Semantics are TorchRec's (fbgemm's) for half-precision tables: rows are read as fp32, pooled sums accumulate in
 * fp32 in id order and are written as fp32; an update computes in fp32 from fp32 optimizer state and writes the
 * row back rounded once, to nearest even or stochastically (unbiased: the rounded value's expectation is the fp32
 * value). The stochastic rounding's random bits come from a counter-based generator keyed by the call's seed and
 * the row's element offset in the storage: the same bits whatever the split over threads.
 *
 *   tdb_pool_tables16           out[b, table t's columns] = sum over bag b's ids p of psw[p] * weight_t[ids[p]].
 *   tdb_bag_square_sums16       row-wise Adagrad's per-bag statistic, summed column by column in order (as fbgemm's
 *                               CPU kernel sums a row's), eight bags at a time.
 *   tdb_apply_tables16          walks grouped occurrences [begin, end) (cut on row boundaries): per touched row the
 *                               gradient summed over its occurrences in order, then the update (tdb_walk16).
 *
 * The update's arithmetic for SGD, row-wise Adagrad and Adagrad is written as fbgemm's CPU kernels write theirs
 * (embedding_backward_split_cpu_template.cpp and optimizers.py of fbgemm_gpu 1.8), so that fp16 tables rounded to
 * nearest get fbgemm's bits: its CPU SGD and Adagrad round their fp32 step to fp16 before subtracting it
 * (c10::Half's -= takes a Half), and so do these kernels there; with stochastic rounding (fbgemm's CUDA
 * kernels' default), and for bf16 tables (which fbgemm's CPU kernels do not take), the update is rounded once.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tdb_kernels.h"

#define TDB_PREFETCH 8

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && !defined(TDB_NO_CLONES)
#define TDB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TDB_CLONES
#endif
/* Each expression rounds where it is written (no fused multiply-add unless fmaf says so): the bits do not depend
   on the CPU's feature level or the compiler's contraction. */
#if defined(__GNUC__) && !defined(__clang__)
#define TDB_EXACT __attribute__((optimize("fp-contract=off")))
#else
#define TDB_EXACT
#endif

/* cpu_kernels.c */
int tdb_offsets_in_order(const int64_t* offsets, int64_t last, int64_t n);
int tdb_ids_inside(const int64_t* ids, int64_t lo, int64_t hi, int64_t rows);

int tdb_version16(void) { return 2; }

/* Every cache line of the next ``bytes`` at p, into L2 (as cpu_kernels.c's tdb_prefetch_to_l2; always inlined,
   or GCC may drop a prefetch-only helper's calls). */
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline void tdb_prefetch16_to_l2(const void* p, int64_t bytes) {
  /* from the line holding the first byte to the one holding the last, whatever the alignment */
  for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + (uintptr_t)bytes; a < end; a += 64)
    __builtin_prefetch((const void*)a, 0, 2);
}

/* --- conversions ------------------------------------------------------------------------------------------ */

static inline float tdb_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t tdb_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float tdb_bf16_f32(uint16_t h) { return tdb_bits_f32((uint32_t)h << 16); }

static inline uint16_t tdb_f32_bf16_rn(float f) {
  uint32_t u = tdb_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#if defined(__FLT16_MANT_DIG__)
static inline float tdb_f16_f32(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t tdb_f32_f16_rn(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
#else
static inline float tdb_f16_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return tdb_bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) { /* zero or subnormal: m * 2^-24 */
    float v = (float)m * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return tdb_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
static inline uint16_t tdb_f32_f16_rn(float f) {
  uint32_t u = tdb_f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
  if (a < 0x38800000u) { /* below 2^-14: a multiple of 2^-24, rounded to nearest even */
    float q = tdb_bits_f32(a) * 16777216.0f, fl = floorf(q), fr = q - fl;
    uint32_t m = (uint32_t)fl + (fr > 0.5f || (fr == 0.5f && ((uint32_t)fl & 1u)));
    return (uint16_t)(sign | m);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
#endif

/* Rounded up (in magnitude) with probability equal to the distance from the value below, given 16 random bits. */
static inline uint16_t tdb_f32_bf16_sr(float f, uint32_t r) {
  uint32_t u = tdb_f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return tdb_f32_bf16_rn(f);
  return (uint16_t)((u + (r & 0xffffu)) >> 16);
}

static inline uint16_t tdb_f32_f16_sr(float f, uint32_t r) {
  uint32_t u = tdb_f32_bits(f), a = u & 0x7fffffffu;
  if (a >= 0x38800000u && a < 0x477fe000u) /* fp16's normal range: 13 bits dropped, a random carry into them */
    return tdb_f32_f16_rn(tdb_bits_f32((u + (r & 0x1fffu)) & ~0x1fffu));
  if (a >= 0x38800000u) return tdb_f32_f16_rn(f); /* 65504 and beyond, inf, NaN */
  float q = tdb_bits_f32(a) * 16777216.0f, fl = floorf(q); /* subnormal: spacing 2^-24 */
  float v = (fl + ((float)(r & 0xffffu) * (1.0f / 65536.0f) < q - fl ? 1.0f : 0.0f)) * 5.9604644775390625e-8f;
  return tdb_f32_f16_rn((u >> 31) ? -v : v);
}

/* --- rows ------------------------------------------------------------------------------------------------- */

/* The random bits of one row's stochastic rounding: eight xorshift32 streams seeded by splitmix64 from the key
   (the call's seed and the row's element offset), 32 bits per element. */
static inline uint64_t tdb_mix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static inline void tdb_random_row(uint64_t key, uint32_t* r, int64_t dim) {
  uint32_t st[8];
  uint64_t z = key;
  for (int j = 0; j < 8; j += 2) {
    uint64_t v = tdb_mix(&z);
    st[j] = (uint32_t)v | 1u;
    st[j + 1] = (uint32_t)(v >> 32) | 1u;
  }
  for (int64_t k = 0; k < dim; k += 8)
    for (int j = 0; j < 8; ++j) {
      uint32_t x = st[j];
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      st[j] = x;
      if (k + j < dim) r[k + j] = x;
    }
}

static void tdb_f16_load_plain(const uint16_t* s, float* d, int64_t n) {
  for (int64_t k = 0; k < n; ++k) d[k] = tdb_f16_f32(s[k]);
}
static void tdb_f16_add_plain(const uint16_t* s, float* acc, int64_t n, const float* scale) {
  if (scale) {
    for (int64_t k = 0; k < n; ++k) acc[k] = fmaf(*scale, tdb_f16_f32(s[k]), acc[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) acc[k] += tdb_f16_f32(s[k]);
  }
}
static void tdb_f16_store_plain(const float* v, uint16_t* d, int64_t n, const uint32_t* r) {
  if (r) {
    for (int64_t k = 0; k < n; ++k) d[k] = tdb_f32_f16_sr(v[k], r[k] >> 16);
  } else {
    for (int64_t k = 0; k < n; ++k) d[k] = tdb_f32_f16_rn(v[k]);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* fp16 rows eight at a time with F16C: the same values as the plain functions (the conversions are exact or
   round to nearest even, as theirs; a weighted sum fuses its multiply-add, as fmaf). */
#define TDB_F16C __attribute__((target("avx2,fma,f16c")))
TDB_F16C static void tdb_f16_load_f16c(const uint16_t* s, float* d, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(d + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + k))));
  tdb_f16_load_plain(s + k, d + k, n - k);
}
TDB_F16C static void tdb_f16_add_f16c(const uint16_t* s, float* acc, int64_t n, const float* scale) {
  int64_t k = 0;
  if (scale) {
    __m256 sc = _mm256_set1_ps(*scale);
    for (; k + 8 <= n; k += 8) {
      __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + k)));
      _mm256_storeu_ps(acc + k, _mm256_fmadd_ps(sc, w, _mm256_loadu_ps(acc + k)));
    }
  } else {
    for (; k + 8 <= n; k += 8) {
      __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + k)));
      _mm256_storeu_ps(acc + k, _mm256_add_ps(_mm256_loadu_ps(acc + k), w));
    }
  }
  tdb_f16_add_plain(s + k, acc + k, n - k, scale);
}
/* Bags [b0, b1) of one fp16 table pooled, 64 columns at a time in eight registers over each bag's ids (each
   column still adds in id order, as the plain loop: the same bits); dim a multiple of 64. */
TDB_F16C static void tdb_f16_pool_f16c(const uint16_t* weight, int64_t ldw, int64_t dim, float* out, int64_t ldo,
                                       const int64_t* ids, const int64_t* offsets, int64_t b0, int64_t b1,
                                       const float* psw, int64_t n) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t pe = offsets[b + 1];
    for (int64_t c = 0; c < dim; c += 64) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t p = offsets[b]; p < pe; ++p) {
        if (c == 0 && p + 16 < n) tdb_prefetch16_to_l2(weight + ids[p + 16] * ldw, dim * 2);
        const __m128i* w = (const __m128i*)(weight + ids[p] * ldw + c);
#define TDB_ROW8(k) _mm256_cvtph_ps(_mm_loadu_si128(w + (k)))
        if (psw) {
          __m256 s = _mm256_set1_ps(psw[p]);
          a0 = _mm256_fmadd_ps(s, TDB_ROW8(0), a0); a1 = _mm256_fmadd_ps(s, TDB_ROW8(1), a1);
          a2 = _mm256_fmadd_ps(s, TDB_ROW8(2), a2); a3 = _mm256_fmadd_ps(s, TDB_ROW8(3), a3);
          a4 = _mm256_fmadd_ps(s, TDB_ROW8(4), a4); a5 = _mm256_fmadd_ps(s, TDB_ROW8(5), a5);
          a6 = _mm256_fmadd_ps(s, TDB_ROW8(6), a6); a7 = _mm256_fmadd_ps(s, TDB_ROW8(7), a7);
        } else {
          a0 = _mm256_add_ps(a0, TDB_ROW8(0)); a1 = _mm256_add_ps(a1, TDB_ROW8(1));
          a2 = _mm256_add_ps(a2, TDB_ROW8(2)); a3 = _mm256_add_ps(a3, TDB_ROW8(3));
          a4 = _mm256_add_ps(a4, TDB_ROW8(4)); a5 = _mm256_add_ps(a5, TDB_ROW8(5));
          a6 = _mm256_add_ps(a6, TDB_ROW8(6)); a7 = _mm256_add_ps(a7, TDB_ROW8(7));
        }
#undef TDB_ROW8
      }
      float* o = out + b * ldo + c;
      _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + 8, a1); _mm256_storeu_ps(o + 16, a2);
      _mm256_storeu_ps(o + 24, a3); _mm256_storeu_ps(o + 32, a4); _mm256_storeu_ps(o + 40, a5);
      _mm256_storeu_ps(o + 48, a6); _mm256_storeu_ps(o + 56, a7);
    }
  }
}
TDB_F16C static void tdb_f16_store_f16c(const float* v, uint16_t* d, int64_t n, const uint32_t* r) {
  int64_t k = 0;
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), low = _mm256_set1_epi32(0x387fffff);
  const __m256i high = _mm256_set1_epi32(0x477fe000), keep = _mm256_set1_epi32(~0x1fff);
  const __m256i carry = _mm256_set1_epi32(0x1fff), sign = _mm256_set1_epi32((int)0x80000000u);
  const __m256 scale = _mm256_set1_ps(16777216.0f), unit = _mm256_set1_ps(5.9604644775390625e-8f);
  const __m256 fraction = _mm256_set1_ps(1.0f / 65536.0f), one = _mm256_set1_ps(1.0f);
  for (; k + 8 <= n; k += 8) {
    __m256 x = _mm256_loadu_ps(v + k);
    if (r) { /* tdb_f32_f16_sr eight at a time: the same bits */
      __m256i u = _mm256_castps_si256(x), a = _mm256_and_si256(u, magnitude);
      __m256i bits = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i*)(r + k)), 16);
      /* fp16's normal range: a random carry into the 13 bits dropped, then truncation (exact) */
      __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(a, low), _mm256_cmpgt_epi32(high, a)));
      __m256 t = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, _mm256_and_si256(bits, carry)), keep));
      /* below it: a multiple of 2^-24, rounded up with probability the distance from the one below */
      __m256 small = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_add_epi32(low, _mm256_set1_epi32(1)), a));
      __m256 q = _mm256_mul_ps(_mm256_castsi256_ps(a), scale), fl = _mm256_floor_ps(q);
      __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(bits), fraction),
                                              _mm256_sub_ps(q, fl), _CMP_LT_OQ), one);
      __m256 sub = _mm256_or_ps(_mm256_mul_ps(_mm256_add_ps(fl, up), unit),
                                _mm256_castsi256_ps(_mm256_and_si256(u, sign)));
      x = _mm256_blendv_ps(_mm256_blendv_ps(x, sub, small), t, normal); /* 65504 and beyond: to nearest */
    }
    _mm_storeu_si128((__m128i*)(d + k), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  tdb_f16_store_plain(v + k, d + k, n - k, r ? r + k : NULL);
}
#endif

typedef struct {
  /* bags of a table whose width is a multiple of 64 (NULL: none) */
  void (*pool)(const uint16_t*, int64_t, int64_t, float*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
               const float*, int64_t);
  void (*load)(const uint16_t*, float*, int64_t);
  void (*add)(const uint16_t*, float*, int64_t, const float*);
  void (*store)(const float*, uint16_t*, int64_t, const uint32_t*);
} tdb_f16_rows;

/* The fp16 row functions for this CPU: F16C's where it has it. */
static const tdb_f16_rows* tdb_f16(void) {
  static const tdb_f16_rows plain = {NULL, tdb_f16_load_plain, tdb_f16_add_plain, tdb_f16_store_plain};
#if defined(__x86_64__) && defined(__GNUC__)
  static const tdb_f16_rows f16c = {tdb_f16_pool_f16c, tdb_f16_load_f16c, tdb_f16_add_f16c, tdb_f16_store_f16c};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return &f16c;
#endif
  return &plain;
}

static inline void tdb_load_row16(const uint16_t* w, int wtype, float* v, int64_t dim, const tdb_f16_rows* f16) {
  if (wtype == TDB_F16) {
    f16->load(w, v, dim);
  } else {
    for (int64_t k = 0; k < dim; ++k) v[k] = tdb_bf16_f32(w[k]);
  }
}

/* Row w (dim wide) written from the fp32 values v: rounded to nearest even, or stochastically with the random
   bits r (tdb_random_row's; NULL: to nearest). */
static inline void tdb_store_row16(uint16_t* w, int wtype, const float* v, int64_t dim, const uint32_t* r,
                                   const tdb_f16_rows* f16) {
  if (wtype == TDB_F16) {
    f16->store(v, w, dim, r);
  } else if (r) {
    for (int64_t k = 0; k < dim; ++k) w[k] = tdb_f32_bf16_sr(v[k], r[k] >> 16);
  } else {
    for (int64_t k = 0; k < dim; ++k) w[k] = tdb_f32_bf16_rn(v[k]);
  }
}

/* --- pooling ---------------------------------------------------------------------------------------------- */

TDB_CLONES TDB_EXACT
static int tdb_pool_sum16(const uint16_t* restrict weight, int wtype, int64_t ldw, int64_t dim, int64_t rows,
                          float* restrict out, int64_t ldo, const int64_t* ids, int64_t n_ids, const int64_t* offsets,
                          int64_t b0, int64_t b1, const float* psw) {
  if (dim > TDB_MAX_DIM || !tdb_offsets_in_order(offsets + b0, b1 - b0, n_ids)) return -1;
  int64_t n = offsets[b1];
  if (!tdb_ids_inside(ids, offsets[b0], n, rows)) return -1;
  if (dim <= 0) return 0;
  const tdb_f16_rows* f16 = tdb_f16();
  if (wtype == TDB_F16 && f16->pool && dim % 64 == 0) {
    f16->pool(weight, ldw, dim, out, ldo, ids, offsets, b0, b1, psw, n);
    return 0;
  }
  float acc[TDB_MAX_DIM];
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t k = 0; k < dim; ++k) acc[k] = 0.0f;
    for (int64_t p = offsets[b]; p < offsets[b + 1]; ++p) {
      if (p + 16 < n) tdb_prefetch16_to_l2(weight + ids[p + 16] * ldw, dim * 2);
      const uint16_t* restrict w = weight + ids[p] * ldw;
      if (wtype == TDB_F16) {
        f16->add(w, acc, dim, psw ? psw + p : NULL);
      } else if (psw) {
        float s = psw[p];
        for (int64_t k = 0; k < dim; ++k) acc[k] = fmaf(s, tdb_bf16_f32(w[k]), acc[k]);
      } else {
        for (int64_t k = 0; k < dim; ++k) acc[k] += tdb_bf16_f32(w[k]);
      }
    }
    memcpy(out + b * ldo, acc, (size_t)dim * sizeof(float));
  }
  return 0;
}

/* tdb_pool_tables (cpu_kernels.c) for 16-bit weights of type wtype. */
int tdb_pool_tables16(const uint16_t* weights, int wtype, int64_t tables, const int64_t* woff, const int64_t* dims,
                      const int64_t* rows, float* out, int64_t ldo, const int64_t* doff, const int64_t* ids,
                      int64_t n_ids, const int64_t* offsets, int64_t bags, int64_t g0, int64_t g1, const float* psw) {
  if (bags <= 0) return 0;
  if (wtype != TDB_F16 && wtype != TDB_BF16) return TDB_BAD_ARGUMENTS;
  for (int64_t t = g0 / bags; t < tables && t * bags < g1; ++t) {
    int64_t b0 = g0 > t * bags ? g0 - t * bags : 0, b1 = g1 < (t + 1) * bags ? g1 - t * bags : bags;
    if (b0 < b1 && tdb_pool_sum16(weights + woff[t], wtype, dims[t], dims[t], rows[t], out + doff[t], ldo, ids,
                                  n_ids, offsets + t * bags, b0, b1, psw) != 0)
      return (int)(-1 - t);
  }
  return 0;
}

/* --- updates ---------------------------------------------------------------------------------------------- */

/* out[b] = sum over the columns of bag b's gradient row of g^2, column by column in order (eight bags at once:
   eight independent sums); table t's gradient at column goff[t] of grad, its bags' sums at out + t * bags. */
TDB_CLONES TDB_EXACT
void tdb_bag_square_sums16(const float* grad, int64_t ldg, int64_t tables, const int64_t* goff, const int64_t* dims,
                           int64_t bags, float* out) {
  for (int64_t t = 0; t < tables; ++t) {
    const float* g = grad + goff[t];
    int64_t dim = dims[t], b = 0;
    float* o = out + t * bags;
    for (; b + 8 <= bags; b += 8) {
      float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < dim; ++k)
        for (int j = 0; j < 8; ++j) {
          float x = g[(b + j) * ldg + k];
          s[j] = s[j] + x * x;
        }
      memcpy(o + b, s, sizeof(s));
    }
    for (; b < bags; ++b) {
      float s = 0.0f;
      for (int64_t k = 0; k < dim; ++k) s = s + g[b * ldg + k] * g[b * ldg + k];
      o[b] = s;
    }
  }
}

enum { TDB_LR, TDB_EPS, TDB_WD, TDB_BETA1, TDB_BETA2, TDB_ADAM_STEP_SIZE, TDB_ADAM_BC2 };

/* One table's walk over occurrences [begin, end) (keys, occ, bag_of: tdb_group_tables'), its rows at weight (dim
   wide, 16-bit of type wtype), its state at state / state2 (per row for row-wise Adagrad, else like the rows);
   row keys of the random streams start at key0 (the table's element offset in the storage). */
TDB_CLONES TDB_EXACT
static void tdb_walk16(int kind, int decay, uint16_t* weight, int wtype, int stochastic, uint64_t seed, int64_t key0,
                       int64_t dim, float* state, float* state2, const float* grad, int64_t ldg, const float* psw,
                       const int32_t* keys, const int32_t* occ, const int32_t* bag_of, const float* bag_sq,
                       int64_t begin, int64_t end, const double* hp) {
  const float lr = (float)hp[TDB_LR], wd = (float)hp[TDB_WD];
  const double eps = hp[TDB_EPS];
  /* fp16 rounded to nearest: fbgemm's CPU kernels' rounding, whose SGD and Adagrad round their step to fp16
     before subtracting it (c10::Half's -= takes a Half); otherwise the update is rounded once */
  const int as_fbgemm = wtype == TDB_F16 && !stochastic;
  float acc[TDB_MAX_DIM], wf[TDB_MAX_DIM];
  uint32_t bits[TDB_MAX_DIM];
  const tdb_f16_rows* f16 = tdb_f16();
  int64_t i = begin;
  while (i < end) {
    if (i + TDB_PREFETCH < end) {
      int64_t ahead = keys[i + TDB_PREFETCH];
      tdb_prefetch16_to_l2(weight + ahead * dim, dim * 2);
      if (kind == TDB_ROWWISE_ADAGRAD) __builtin_prefetch(state + ahead, 1, 3);
      if (kind == TDB_ADAGRAD || kind == TDB_ADAM) tdb_prefetch16_to_l2(state + ahead * dim, dim * 4);
      if (kind == TDB_ADAM) tdb_prefetch16_to_l2(state2 + ahead * dim, dim * 4);
    }
    int64_t row = keys[i], j = i + 1;
    while (j < end && keys[j] == row) ++j;
    uint16_t* w16 = weight + row * dim;
    tdb_load_row16(w16, wtype, wf, dim, f16);
    const float* g;
    float square_sum = -1.0f;
    if (j - i == 1 && !psw) { /* most rows: one occurrence, its bag's gradient in place */
      g = grad + (int64_t)bag_of[occ[i]] * ldg;
      if (bag_sq) square_sum = bag_sq[bag_of[occ[i]]];
    } else { /* fbgemm's grad_buffer: the occurrences' gradients (times their weights) added in order */
      for (int64_t k = 0; k < dim; ++k) acc[k] = 0.0f;
      for (int64_t q = i; q < j; ++q) {
        const float* gq = grad + (int64_t)bag_of[occ[q]] * ldg;
        if (psw) {
          float s = psw[occ[q]];
          for (int64_t k = 0; k < dim; ++k) acc[k] = fmaf(gq[k], s, acc[k]);
        } else {
          for (int64_t k = 0; k < dim; ++k) acc[k] = acc[k] + gq[k];
        }
      }
      g = acc;
    }
    if (kind == TDB_ROWWISE_ADAGRAD) {
      if (square_sum < 0.0f || decay == TDB_DECAY_L2) {
        square_sum = 0.0f;
        for (int64_t k = 0; k < dim; ++k) {
          float x = decay == TDB_DECAY_L2 ? g[k] + wd * wf[k] : g[k];
          square_sum = square_sum + x * x;
        }
      }
      float m = state[row] + square_sum / (float)dim;
      state[row] = m;
      float mult = lr / (sqrtf(m) + (float)eps);
      float corr = decay == TDB_DECAY_L2 ? 1.0f - mult * wd : decay == TDB_DECAY_DECOUPLED ? 1.0f - lr * wd : 1.0f;
      for (int64_t k = 0; k < dim; ++k) wf[k] = corr * wf[k] - g[k] * mult;
    } else {
      if (decay == TDB_DECAY_L2) { /* the decayed gradient, which the statistics see too */
        if (g != acc) memcpy(acc, g, (size_t)dim * sizeof(float));
        for (int64_t k = 0; k < dim; ++k) acc[k] = acc[k] + wd * wf[k];
        g = acc;
      }
      if (kind == TDB_SGD) {
        if (as_fbgemm)
          for (int64_t k = 0; k < dim; ++k) wf[k] = wf[k] - tdb_f16_f32(tdb_f32_f16_rn(lr * g[k]));
        else
          for (int64_t k = 0; k < dim; ++k) wf[k] = wf[k] - lr * g[k];
      } else if (kind == TDB_ADAGRAD) {
        float* m = state + row * dim;
        for (int64_t k = 0; k < dim; ++k) {
          m[k] = as_fbgemm ? fmaf(g[k], g[k], m[k]) : m[k] + g[k] * g[k];
          float step = as_fbgemm ? (float)((double)(lr * g[k]) / (sqrt((double)m[k]) + (double)(float)eps))
                                 : lr * g[k] / (sqrtf(m[k]) + (float)eps);
          wf[k] = wf[k] - (as_fbgemm ? tdb_f16_f32(tdb_f32_f16_rn(step)) : step);
        }
      } else {
        float* m1 = state + row * dim;
        float* m2 = state2 + row * dim;
        const float b1 = (float)hp[TDB_BETA1], b2 = (float)hp[TDB_BETA2], step_size = (float)hp[TDB_ADAM_STEP_SIZE];
        const float bc2 = (float)hp[TDB_ADAM_BC2], decayed = decay == TDB_DECAY_DECOUPLED ? lr * wd : 0.0f;
        for (int64_t k = 0; k < dim; ++k) {
          m1[k] = b1 * m1[k] + (1.0f - b1) * g[k];
          m2[k] = b2 * m2[k] + (1.0f - b2) * g[k] * g[k];
          float before = wf[k];
          wf[k] = before - step_size * m1[k] / (sqrtf(m2[k] / bc2) + (float)eps) - decayed * before;
        }
      }
    }
    if (stochastic) tdb_random_row(seed ^ (uint64_t)(key0 + row * dim), bits, dim);
    tdb_store_row16(w16, wtype, wf, dim, stochastic ? bits : NULL, f16);
    i = j;
  }
}

/* The update of the tables tdb_group_tables grouped (as tdb_apply_tables in cpu_kernels.c), 16-bit weights of
   type wtype, rounded to nearest (stochastic 0) or stochastically with seed; bag_sq: tdb_bag_square_sums16 of grad
   for row-wise Adagrad without per-sample weights (else NULL); hp: 7 doubles (lr, eps, wd, beta1, beta2, Adam's
   step size and second bias correction). Returns 0 or TDB_BAD_ARGUMENTS (an unknown kind, decay, type or a
   width above TDB_MAX_DIM; checked before any write). */
int tdb_apply_tables16(int kind, int decay, uint16_t* weights, int wtype, int stochastic, uint64_t seed,
                       int64_t tables, const int64_t* woff, const int64_t* dims, float* state, const int64_t* soff,
                       float* state2, const int64_t* s2off, const float* grad, int64_t ldg, const int64_t* goff,
                       const float* psw, const int32_t* keys, const int32_t* occ, const int32_t* bag_of,
                       const float* bag_sq, const int64_t* offsets, int64_t bags, int64_t begin, int64_t end,
                       const double* hp) {
  if (kind < TDB_SGD || kind > TDB_ADAM || decay < TDB_DECAY_NONE || decay > TDB_DECAY_DECOUPLED) return TDB_BAD_ARGUMENTS;
  if (decay == TDB_DECAY_DECOUPLED && kind != TDB_ROWWISE_ADAGRAD && kind != TDB_ADAM) return TDB_BAD_ARGUMENTS;
  if ((decay == TDB_DECAY_L2 && kind == TDB_ADAM) || (wtype != TDB_F16 && wtype != TDB_BF16)) return TDB_BAD_ARGUMENTS;
  for (int64_t t = 0; t < tables; ++t)
    if (dims[t] > TDB_MAX_DIM) return TDB_BAD_ARGUMENTS;
  if (hp[TDB_WD] == 0.0) decay = TDB_DECAY_NONE;
  for (int64_t t = 0; t < tables; ++t) {
    int64_t lo = offsets[t * bags], hi = offsets[(t + 1) * bags];
    int64_t a = lo > begin ? lo : begin, z = hi < end ? hi : end;
    if (a >= z || dims[t] <= 0) continue;
    tdb_walk16(kind, decay, weights + woff[t], wtype, stochastic, seed, woff[t], dims[t],
               state ? state + soff[t] : NULL, state2 ? state2 + s2off[t] : NULL, grad + goff[t], ldg, psw, keys, occ,
               bag_of, bag_sq ? bag_sq + t * bags : NULL, a, z, hp);
  }
  return 0;
}
