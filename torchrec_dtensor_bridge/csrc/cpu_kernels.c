/*
 * This package's CPU kernels for fp32 embedding tables (half-precision ones: cpu_kernels16.c): the pooled sum of a bag lookup, and the fused
 * optimizers' sparse updates in place, each over every table of one flat storage in one call (table t's
 * rows at element woff[t], dims[t] wide; its bags t * B .. (t + 1) * B - 1 of the T * B + 1 offsets,
 * table-major, absolute positions in ids).
 *
 * Built with the package (setup.py: compiled as C11 into a static library linked into the extension
 * torchrec_dtensor_bridge._C) and called by the extension's ops (ops.cpp); no Python or torch headers here.
 *
 *   tdb_check_tables  the batch checked (offsets in order, every id inside its table) without reading a row.
 *   tdb_pool_tables   out[b, table t's columns] = sum over bag b's ids p of psw[p] * weight_t[ids[p]], in id
 *                     order (the order fbgemm's forward and torch.embedding_bag sum in), rows prefetched
 *                     ahead (tdb_pool_sum, one table's bags).
 *
 * The update of the tables from a lookup's output gradient, in two steps:
 *
 *   tdb_group_tables  checks the batch, then sorts each table's occurrences by row (a stable LSD radix
 *              sort of 32-bit keys, 8 bits a pass, as many passes as the table's row count needs):
 *              keys[i] is the row of the i-th occurrence in row order (table t's at positions
 *              offsets[t * B] .. offsets[(t + 1) * B] - 1), occ[i] its position in ids, and bag_of[p]
 *              the bag of occurrence p.
 *   tdb_bag_square_sums_tables  (row-wise Adagrad) each bag's gradient row's sum of squares, up front.
 *   tdb_apply_tables  walks [begin, end) of that order (begin and end on row boundaries, so disjoint
 *              ranges can run on threads at once): per touched row, the gradient summed over
 *              its occurrences (times the per-sample weight), then the update of the row and
 *              its state (tdb_apply, one table). Rows are visited in increasing order and prefetched ahead.
 *   tdb_update_tables  the same on one thread, each table grouped right before it is walked (its
 *              grouping still in cache), every table's ids checked before the first write.
 *
 * The math (per touched row r with summed gradient g, the shard's width D; with L2 weight decay wd,
 * g is first replaced by g + wd * w):
 *   SGD              w -= lr * g
 *   row-wise Adagrad m[r] += sum(g^2) / D;  w -= lr / (sqrt(m[r]) + eps) * g
 *                    (decoupled decay: w = (1 - lr * wd) * w - lr / (sqrt(m[r]) + eps) * g)
 *   Adagrad          m += g^2 (element-wise);  w -= lr * g / (sqrt(m) + eps)
 *   Adam             m1 = b1 m1 + (1 - b1) g;  m2 = b2 m2 + (1 - b2) g^2 (element-wise);
 *                    w -= lr / (1 - b1^t) * m1 / (sqrt(m2 / (1 - b2^t)) + eps) + lr * wd * w  (decoupled)
 * which is fbgemm's EXACT_SGD / EXACT_ROWWISE_ADAGRAD / EXACT_ADAGRAD / ADAM (optim/update.py's semantics
 * of weight decay: fbgemm-gpu-cpu's own kernels ignore it, and it has no CPU Adam).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tdb_kernels.h"

#define TDB_PREFETCH 8 /* rows ahead, updates */
#define TDB_POOL_PREFETCH 16 /* ids ahead, pooling */

/* One copy per x86-64 feature level, picked at load time by what the CPU supports (levels, not CPU
   names: virtual machines report generic models, which "arch=<cpu>" clones never match); v3 and v4 have
   FMA, so fmaf is one instruction. GCC names these levels from version 12 on; older compilers build one plain
   copy. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && !defined(TDB_NO_CLONES)
#define TDB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TDB_CLONES
#endif

/* For helpers that only prefetch: GCC finds such a function free of side effects and, unless it is inlined
   before that analysis, deletes its calls (a larger prefetch helper called from tdb_apply lost every one of
   its prefetches that way, and the update got slower). */
#if defined(__GNUC__)
#define TDB_PREFETCHES __attribute__((always_inline)) static inline
#else
#define TDB_PREFETCHES static inline
#endif
/* tdb_walk is inlined into tdb_apply once per common width with that width a constant: its loops then have
   fixed trip counts (unrolled), which made the update faster (BENCHMARKS.md, "This package's own CPU kernels"). */
#if defined(__GNUC__)
#define TDB_INLINE __attribute__((always_inline)) static inline
#else
#define TDB_INLINE static inline
#endif

int tdb_version(void) { return 10; }

/* Whether the last + 1 offsets run forward inside [0, n] (also cpu_kernels16.c's). */
int tdb_offsets_in_order(const int64_t* offsets, int64_t last, int64_t n) {
  if (offsets[0] < 0 || offsets[last] > n) return 0;
  for (int64_t i = 0; i < last; ++i)
    if (offsets[i + 1] < offsets[i]) return 0;
  return 1;
}

/* Whether ids[lo..hi) all lie inside [0, rows) (also cpu_kernels16.c's). */
int tdb_ids_inside(const int64_t* ids, int64_t lo, int64_t hi, int64_t rows) {
  for (int64_t p = lo; p < hi; ++p)
    if (ids[p] < 0 || ids[p] >= rows) return 0;
  return 1;
}

/* Checks a batch over several tables (table t's bags t * bags .. (t + 1) * bags - 1 of offsets, tables *
   bags + 1 absolute positions in the n ids) without reading any row: returns 0, -1 when the offsets run
   backwards or outside [0, n], or -(t + 2) when an id of table t lies outside [0, rows[t]). */
int tdb_check_tables(int64_t tables, const int64_t* rows, const int64_t* ids, int64_t n, const int64_t* offsets,
                     int64_t bags) {
  if (!tdb_offsets_in_order(offsets, tables * bags, n)) return -1;
  for (int64_t t = 0; t < tables; ++t)
    if (!tdb_ids_inside(ids, offsets[t * bags], offsets[(t + 1) * bags], rows[t])) return (int)(-2 - t);
  return 0;
}

/* One table's occurrences, bags [0, bags) of offsets (absolute positions in ids, checked by the caller:
   in order, inside ids), sorted by row into keys[lo..hi) and occ[lo..hi) (lo, hi: the first and last
   bounds), bag_of[p] its bag; tmp_keys and tmp_occ alike. Returns 0, or -1 when an id lies outside
   [0, rows). */
static int tdb_group_one(const int64_t* ids, const int64_t* offsets, int64_t bags, int64_t rows, int32_t* keys,
                         int32_t* occ, int32_t* bag_of, int32_t* tmp_keys, int32_t* tmp_occ) {
  int64_t lo = offsets[0], n = offsets[bags] - lo;
  for (int64_t b = 0; b < bags; ++b)
    for (int64_t p = offsets[b]; p < offsets[b + 1]; ++p) bag_of[p] = (int32_t)b;
  keys += lo; occ += lo; tmp_keys += lo; tmp_occ += lo;
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = ids[lo + i];
    if (id < 0 || id >= rows) return -1;
    keys[i] = (int32_t)id;
    occ[i] = (int32_t)(lo + i);
  }
  int bits = 0;
  while (bits < 32 && (((int64_t)1) << bits) < rows) ++bits;
  int32_t *src_k = keys, *src_o = occ, *dst_k = tmp_keys, *dst_o = tmp_occ;
  for (int shift = 0; shift < bits; shift += 8) {
    int64_t count[257];
    memset(count, 0, sizeof(count));
    for (int64_t i = 0; i < n; ++i) count[(((uint32_t)src_k[i]) >> shift & 0xFF) + 1]++;
    for (int k = 0; k < 256; ++k) count[k + 1] += count[k];
    for (int64_t i = 0; i < n; ++i) {
      int64_t at = count[((uint32_t)src_k[i]) >> shift & 0xFF]++;
      dst_k[at] = src_k[i];
      dst_o[at] = src_o[i];
    }
    int32_t* t = src_k; src_k = dst_k; dst_k = t;
    t = src_o; src_o = dst_o; dst_o = t;
  }
  if (src_k != keys) {
    memcpy(keys, src_k, (size_t)n * sizeof(int32_t));
    memcpy(occ, src_o, (size_t)n * sizeof(int32_t));
  }
  return 0;
}

/* Every table's occurrences grouped by row (tdb_group_one), table t's bags t * bags .. (t + 1) * bags - 1
   of offsets (tables * bags + 1 absolute positions in the n ids). Checks everything before the caller
   updates anything: returns 0, -1 when the offsets run backwards or outside [0, n], or -(t + 2) when an id
   of table t lies outside [0, rows[t]). */
int tdb_group_tables(int64_t tables, const int64_t* rows, const int64_t* ids, int64_t n, const int64_t* offsets,
                     int64_t bags, int32_t* keys, int32_t* occ, int32_t* bag_of, int32_t* tmp_keys,
                     int32_t* tmp_occ) {
  if (!tdb_offsets_in_order(offsets, tables * bags, n)) return -1;
  for (int64_t t = 0; t < tables; ++t)
    if (tdb_group_one(ids, offsets + t * bags, bags, rows[t], keys, occ, bag_of, tmp_keys, tmp_occ) != 0)
      return (int)(-2 - t);
  return 0;
}

static inline void tdb_axpy(float* restrict y, const float* restrict x, float a, int64_t d) {
  for (int64_t k = 0; k < d; ++k) y[k] += a * x[k];
}

static inline float tdb_square_sum(const float* restrict x, int64_t d) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t whole = d - d % 8;
  for (int64_t k = 0; k < whole; k += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[k + j] * x[k + j];
  float s = 0;
  for (int64_t k = whole; k < d; ++k) s += x[k] * x[k];
  for (int j = 0; j < 8; ++j) s += part[j];
  return s;
}

/* Every cache line of a row read soon (the pooled sum's, the updates' rows and states), into L2
   (prefetcht1), not L1: requests to L2 are not held back by L1's few miss buffers. On the development
   machine (AMD EPYC), over 2 GiB of tables, this took the pooled sum from 29 to 18 ms (L1 prefetches of
   every line: 25 ms; of the row's two ends, as before: 29 ms) and the updates' walks from 34 to 28 ms
   (row-wise Adagrad), 31 to 25 ms (SGD) and 143 to 131 ms (Adagrad) (BENCHMARKS.md, "This package's own
   CPU kernels"). */
TDB_PREFETCHES void tdb_prefetch_to_l2(const float* p, int64_t d) {
  /* from the line holding p[0] to the one holding p[d - 1], whatever the row's alignment */
  for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)(p + d); a < end; a += 64)
    __builtin_prefetch((const void*)a, 0, 2);
}

/* Bags [b0, b1) (disjoint ranges can run on threads at once). Returns 0, or -1 (before reading any
   row) when one of their ids lies outside [0, rows), their offsets run backwards or past the n_ids
   ids, or dim > TDB_MAX_DIM. */
TDB_CLONES
static int tdb_pool_sum(const float* restrict weight, int64_t ldw, int64_t dim, int64_t rows, float* restrict out,
                        int64_t ldo, const int64_t* ids, int64_t n_ids, const int64_t* offsets, int64_t b0,
                        int64_t b1, const float* psw) {
  if (dim > TDB_MAX_DIM || !tdb_offsets_in_order(offsets + b0, b1 - b0, n_ids)) return -1;
  int64_t n = offsets[b1];
  if (!tdb_ids_inside(ids, offsets[b0], n, rows)) return -1;
  if (dim <= 0) return 0;
  float acc[TDB_MAX_DIM];
  if (!psw && dim % 64 == 0) {
    /* Columns in blocks of 64, summed in eight 8-float registers over the bag's rows (they stay in L1
       between blocks); each column still adds in id order: the same bits. */
    typedef float v8 __attribute__((vector_size(32), aligned(4)));
    for (int64_t b = b0; b < b1; ++b) {
      int64_t pe = offsets[b + 1];
      for (int64_t c = 0; c < dim; c += 64) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (int64_t p = offsets[b]; p < pe; ++p) {
          if (c == 0 && p + TDB_POOL_PREFETCH < n)
            tdb_prefetch_to_l2(weight + ids[p + TDB_POOL_PREFETCH] * ldw, dim);
          const v8* w = (const v8*)(weight + ids[p] * ldw + c);
          a0 += w[0]; a1 += w[1]; a2 += w[2]; a3 += w[3]; a4 += w[4]; a5 += w[5]; a6 += w[6]; a7 += w[7];
        }
        v8* o = (v8*)(out + b * ldo + c);
        o[0] = a0; o[1] = a1; o[2] = a2; o[3] = a3; o[4] = a4; o[5] = a5; o[6] = a6; o[7] = a7;
      }
    }
    return 0;
  }
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t k = 0; k < dim; ++k) acc[k] = 0.0f;
    for (int64_t p = offsets[b]; p < offsets[b + 1]; ++p) {
      if (p + TDB_POOL_PREFETCH < n) tdb_prefetch_to_l2(weight + ids[p + TDB_POOL_PREFETCH] * ldw, dim);
      const float* restrict w = weight + ids[p] * ldw;
      if (psw) {
        float s = psw[p];
        for (int64_t k = 0; k < dim; ++k) acc[k] = fmaf(s, w[k], acc[k]); /* fused, as fbgemm: the same bits */
      } else {
        for (int64_t k = 0; k < dim; ++k) acc[k] += w[k];
      }
    }
    memcpy(out + b * ldo, acc, (size_t)dim * sizeof(float));
  }
  return 0;
}

/* tdb_pool_sum over several tables of one flat storage: table t's rows at weights + woff[t] (dims[t] wide,
   rows[t] of them), its bags t * bags .. (t + 1) * bags - 1 of offsets, its sums at column doff[t] of out
   (ldo floats a row); the bags g0 .. g1 - 1 of all tables (so that ranges of them can run on threads).
   Returns 0, or -(t + 1) for table t as tdb_pool_sum's -1. */
int tdb_pool_tables(const float* weights, int64_t tables, const int64_t* woff, const int64_t* dims,
                    const int64_t* rows, float* out, int64_t ldo, const int64_t* doff, const int64_t* ids,
                    int64_t n_ids, const int64_t* offsets, int64_t bags, int64_t g0, int64_t g1, const float* psw) {
  if (bags <= 0) return 0;
  for (int64_t t = g0 / bags; t < tables && t * bags < g1; ++t) {
    int64_t b0 = g0 > t * bags ? g0 - t * bags : 0, b1 = g1 < (t + 1) * bags ? g1 - t * bags : bags;
    if (b0 < b1 && tdb_pool_sum(weights + woff[t], dims[t], dims[t], rows[t], out + doff[t], ldo, ids, n_ids,
                                offsets + t * bags, b0, b1, psw) != 0)
      return (int)(-1 - t);
  }
  return 0;
}

/* out[b] = sum of squares of bag b's gradient row: row-wise Adagrad's statistic of a row touched once,
   known before that row is visited (its update then waits on no gradient load). */
TDB_CLONES
static void tdb_bag_square_sums(const float* grad, int64_t ldg, int64_t dim, int64_t bags, float* out) {
  for (int64_t b = 0; b < bags; ++b) out[b] = tdb_square_sum(grad + b * ldg, dim);
}

/* tdb_bag_square_sums for every table: table t's gradient at column goff[t] of grad (dims[t] wide), its
   bags' sums at out + t * bags. */
void tdb_bag_square_sums_tables(const float* grad, int64_t ldg, int64_t tables, const int64_t* goff,
                                const int64_t* dims, int64_t bags, float* out) {
  for (int64_t t = 0; t < tables; ++t) tdb_bag_square_sums(grad + goff[t], ldg, dims[t], bags, out + t * bags);
}

/* Hyper-parameters of tdb_apply, in this order (Adam's bias corrections for its step t computed by the
   caller). */
enum { TDB_LR, TDB_EPS, TDB_WD, TDB_BETA1, TDB_BETA2, TDB_ADAM_STEP_SIZE, TDB_ADAM_BC2, TDB_HYPER };

/* tdb_apply's walk over occurrences [begin, end), its arguments checked (decay NONE when wd is 0); acc: a
   scratch row of at least dim floats. */
TDB_INLINE void tdb_walk(int kind, int decay, float* weight, int64_t ldw, int64_t dim, float* state, float* state2,
              int64_t lds, const float* grad, int64_t ldg, const float* psw, const int32_t* keys,
              const int32_t* occ, const int32_t* bag_of, const float* bag_sq, int64_t begin, int64_t end,
              const float* hp, float* acc) {
  const float lr = hp[TDB_LR], eps = hp[TDB_EPS], wd = hp[TDB_WD];
  int l2 = decay == TDB_DECAY_L2;
  int64_t i = begin;
  while (i < end) {
    if (i + TDB_PREFETCH < end) { /* the row TDB_PREFETCH occurrences ahead and its state, into L2 */
      int64_t ahead = keys[i + TDB_PREFETCH];
      tdb_prefetch_to_l2(weight + ahead * ldw, dim);
      if (kind == TDB_ROWWISE_ADAGRAD) __builtin_prefetch(state + ahead, 1, 3);
      if (kind == TDB_ADAGRAD || kind == TDB_ADAM) tdb_prefetch_to_l2(state + ahead * lds, dim);
      if (kind == TDB_ADAM) tdb_prefetch_to_l2(state2 + ahead * lds, dim);
      if (kind == TDB_ADAGRAD || kind == TDB_ADAM) { /* their update waits on the gradient: fetch it early */
        const float* g_ahead = grad + (int64_t)bag_of[occ[i + TDB_PREFETCH]] * ldg;
        for (int64_t k = 0; k < dim; k += 16) __builtin_prefetch(g_ahead + k, 0, 1);
      }
    }
    int64_t row = keys[i], j = i + 1;
    while (j < end && keys[j] == row) ++j;
    const float* g;
    float scale, square_sum = -1.0f;
    float* w = weight + row * ldw;
    if (j - i == 1 && !l2) { /* most rows: one occurrence, its bag's gradient read in place */
      int32_t p = occ[i];
      g = grad + (int64_t)bag_of[p] * ldg;
      scale = psw ? psw[p] : 1.0f;
      if (kind == TDB_ROWWISE_ADAGRAD) square_sum = bag_sq[bag_of[p]];
    } else {
      memset(acc, 0, (size_t)dim * sizeof(float));
      for (int64_t k = i; k < j; ++k) {
        int32_t p = occ[k];
        tdb_axpy(acc, grad + (int64_t)bag_of[p] * ldg, psw ? psw[p] : 1.0f, dim);
      }
      if (l2) tdb_axpy(acc, w, wd, dim); /* the decayed gradient, which the statistics see too */
      g = acc;
      scale = 1.0f;
    }
    if (kind == TDB_SGD) {
      tdb_axpy(w, g, -lr * scale, dim);
    } else if (kind == TDB_ROWWISE_ADAGRAD) {
      if (square_sum < 0.0f) square_sum = tdb_square_sum(g, dim);
      float m = state[row] + scale * scale * square_sum / (float)dim;
      state[row] = m;
      if (decay == TDB_DECAY_DECOUPLED)
        for (int64_t k = 0; k < dim; ++k) w[k] *= 1.0f - lr * wd;
      tdb_axpy(w, g, -lr * scale / (sqrtf(m) + eps), dim);
    } else if (kind == TDB_ADAGRAD) {
      float* m = state + row * lds;
      for (int64_t k = 0; k < dim; ++k) {
        float gk = scale * g[k];
        m[k] += gk * gk;
        w[k] -= lr * gk / (sqrtf(m[k]) + eps);
      }
    } else {
      float* m1 = state + row * lds;
      float* m2 = state2 + row * lds;
      const float b1 = hp[TDB_BETA1], b2 = hp[TDB_BETA2], step_size = hp[TDB_ADAM_STEP_SIZE];
      const float bc2 = hp[TDB_ADAM_BC2], decayed = decay == TDB_DECAY_DECOUPLED ? lr * wd : 0.0f;
      for (int64_t k = 0; k < dim; ++k) {
        float gk = scale * g[k];
        m1[k] = b1 * m1[k] + (1.0f - b1) * gk;
        m2[k] = b2 * m2[k] + (1.0f - b2) * gk * gk;
        float before = w[k];
        w[k] = before - step_size * m1[k] / (sqrtf(m2[k] / bc2) + eps) - decayed * before;
      }
    }
    i = j;
  }
}

/* Returns 0, or -1 for an unknown kind or decay mode (decoupled is row-wise Adagrad's and Adam's only)
   or a width above TDB_MAX_DIM. state: row-wise Adagrad's per-row momentum, Adagrad's or Adam's
   element-wise momentum1 (lds a row); state2: Adam's momentum2. bag_sq: tdb_bag_square_sums of grad for
   row-wise Adagrad without L2 decay (else unused, may be NULL). hp: TDB_HYPER floats. Widths 64 and 128
   walk with the width a constant (TDB_INLINE), others with it a variable: the same arithmetic. */
TDB_CLONES
static int tdb_apply(int kind, int decay, float* weight, int64_t ldw, int64_t dim, float* state, float* state2,
              int64_t lds, const float* grad, int64_t ldg, const float* psw, const int32_t* keys,
              const int32_t* occ, const int32_t* bag_of, const float* bag_sq, int64_t begin, int64_t end,
              const float* hp) {
  if (kind < TDB_SGD || kind > TDB_ADAM || dim > TDB_MAX_DIM) return -1;
  if (decay < TDB_DECAY_NONE || decay > TDB_DECAY_DECOUPLED) return -1;
  if (decay == TDB_DECAY_DECOUPLED && kind != TDB_ROWWISE_ADAGRAD && kind != TDB_ADAM) return -1;
  if (decay == TDB_DECAY_L2 && kind == TDB_ADAM) return -1;
  if (hp[TDB_WD] == 0.0f) decay = TDB_DECAY_NONE;
  if (kind == TDB_ROWWISE_ADAGRAD && decay != TDB_DECAY_L2 && bag_sq == NULL) return -1;
  if (dim <= 0) return 0;
  float acc[TDB_MAX_DIM];
#define TDB_WALK(d) tdb_walk(kind, decay, weight, ldw, d, state, state2, lds, grad, ldg, psw, keys, occ, bag_of, \
                             bag_sq, begin, end, hp, acc)
  switch (dim) {
    case 64: TDB_WALK(64); break;
    case 128: TDB_WALK(128); break;
    default: TDB_WALK(dim);
  }
#undef TDB_WALK
  return 0;
}

/* tdb_apply over the tables tdb_group_tables grouped: table t's rows at weights + woff[t] (dims[t] wide), its
   state at state + soff[t] and state2 + s2off[t] (per row for row-wise Adagrad, else like its rows), its
   gradient at column goff[t] of grad, its bags' square sums (row-wise Adagrad) at bag_sq + t * bags; the
   grouped occurrences begin .. end - 1 of all tables (cut on row boundaries, so that ranges of them can
   run on threads). Returns 0, or TDB_BAD_ARGUMENTS (tdb_apply's -1). */
/* tdb_apply on table t of the tables' arrays (as tdb_apply_tables takes them), occurrences [a, z). */
static int tdb_apply_table(int kind, int decay, float* weights, int64_t t, const int64_t* woff, const int64_t* dims,
                           float* state, const int64_t* soff, float* state2, const int64_t* s2off, const float* grad,
                           int64_t ldg, const int64_t* goff, const float* psw, const int32_t* keys,
                           const int32_t* occ, const int32_t* bag_of, const float* bag_sq, int64_t bags, int64_t a,
                           int64_t z, const float* hp) {
  int64_t lds = kind == TDB_ROWWISE_ADAGRAD ? 1 : dims[t];
  return tdb_apply(kind, decay, weights + woff[t], dims[t], dims[t], state ? state + soff[t] : NULL,
                   state2 ? state2 + s2off[t] : NULL, lds, grad + goff[t], ldg, psw, keys, occ, bag_of,
                   bag_sq ? bag_sq + t * bags : NULL, a, z, hp) != 0 ? TDB_BAD_ARGUMENTS : 0;
}

int tdb_apply_tables(int kind, int decay, float* weights, int64_t tables, const int64_t* woff, const int64_t* dims,
                     float* state, const int64_t* soff, float* state2, const int64_t* s2off, const float* grad,
                     int64_t ldg, const int64_t* goff, const float* psw, const int32_t* keys, const int32_t* occ,
                     const int32_t* bag_of, const float* bag_sq, const int64_t* offsets, int64_t bags,
                     int64_t begin, int64_t end, const float* hp) {
  for (int64_t t = 0; t < tables; ++t) {
    int64_t lo = offsets[t * bags], hi = offsets[(t + 1) * bags];
    int64_t a = lo > begin ? lo : begin, z = hi < end ? hi : end;
    if (a < z && tdb_apply_table(kind, decay, weights, t, woff, dims, state, soff, state2, s2off, grad, ldg, goff,
                                 psw, keys, occ, bag_of, bag_sq, bags, a, z, hp) != 0)
      return TDB_BAD_ARGUMENTS;
  }
  return 0;
}

/* The whole update of every table on one thread, each table grouped just before it is walked (its
   grouping still in cache): the batch checked first (tdb_check_tables, whose codes it returns), so that
   nothing is written unless every id is valid; then per table tdb_group_one, its bags' square sums
   (row-wise Adagrad, when bag_sq is not NULL: tables * bags floats) and tdb_apply over all of it.
   Returns 0, tdb_check_tables' codes, or TDB_BAD_ARGUMENTS (tdb_apply's -1). */
int tdb_update_tables(int kind, int decay, float* weights, int64_t tables, const int64_t* woff, const int64_t* dims,
                      const int64_t* rows, float* state, const int64_t* soff, float* state2, const int64_t* s2off,
                      const float* grad, int64_t ldg, const int64_t* goff, const float* psw, const int64_t* ids,
                      int64_t n, const int64_t* offsets, int64_t bags, int32_t* keys, int32_t* occ, int32_t* bag_of,
                      int32_t* tmp_keys, int32_t* tmp_occ, float* bag_sq, const float* hp) {
  int rc = tdb_check_tables(tables, rows, ids, n, offsets, bags);
  if (rc != 0) return rc;
  for (int64_t t = 0; t < tables; ++t) {
    const int64_t* off = offsets + t * bags;
    if (off[bags] == off[0]) continue;
    tdb_group_one(ids, off, bags, rows[t], keys, occ, bag_of, tmp_keys, tmp_occ); /* checked above */
    if (bag_sq) tdb_bag_square_sums(grad + goff[t], ldg, dims[t], bags, bag_sq + t * bags);
    if (tdb_apply_table(kind, decay, weights, t, woff, dims, state, soff, state2, s2off, grad, ldg, goff, psw, keys,
                        occ, bag_of, bag_sq, bags, off[0], off[bags], hp) != 0)
      return TDB_BAD_ARGUMENTS;
  }
  return 0;
}

