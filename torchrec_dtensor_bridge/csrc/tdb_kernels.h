/*
 * The C kernels' entry points (cpu_kernels.c, cpu_kernels16.c, row_digests.c, crc32c.c), as ops.cpp calls them. The
 * argument conventions are documented beside each definition; the C files are compiled as C11 (setup.py), so
 * their arithmetic is contracted nowhere it is not written (no implicit fused multiply-add).
 */
#ifndef TDB_KERNELS_H
#define TDB_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TDB_BAD_ARGUMENTS (-1000000) /* arguments refused (kind, decay, width, weights' type), before any write */
#define TDB_MAX_DIM 8192              /* the widest table the kernels take (kernels/native.py's MAX_DIM) */
/* An update's optimizer kind (the kinds' `native` codes, optim_kinds.py) and weight decay mode */
#define TDB_SGD 0
#define TDB_ROWWISE_ADAGRAD 1
#define TDB_ADAGRAD 2
#define TDB_ADAM 3
#define TDB_DECAY_NONE 0
#define TDB_DECAY_L2 1
#define TDB_DECAY_DECOUPLED 2
#define TDB_F16 1
#define TDB_BF16 2
#define TDB_HYPER_VALUES 7 /* lr, eps, weight decay, beta1, beta2, Adam's step size, Adam's second bias correction */

int tdb_version(void);
int tdb_version16(void);

int tdb_check_tables(int64_t tables, const int64_t* rows, const int64_t* ids, int64_t n, const int64_t* offsets,
                     int64_t bags);
int tdb_group_tables(int64_t tables, const int64_t* rows, const int64_t* ids, int64_t n, const int64_t* offsets,
                     int64_t bags, int32_t* keys, int32_t* occ, int32_t* bag_of, int32_t* tmp_keys, int32_t* tmp_occ);

int tdb_pool_tables(const float* weights, int64_t tables, const int64_t* woff, const int64_t* dims,
                    const int64_t* rows, float* out, int64_t ldo, const int64_t* doff, const int64_t* ids,
                    int64_t n_ids, const int64_t* offsets, int64_t bags, int64_t g0, int64_t g1, const float* psw);
int tdb_pool_tables16(const uint16_t* weights, int wtype, int64_t tables, const int64_t* woff, const int64_t* dims,
                      const int64_t* rows, float* out, int64_t ldo, const int64_t* doff, const int64_t* ids,
                      int64_t n_ids, const int64_t* offsets, int64_t bags, int64_t g0, int64_t g1, const float* psw);

void tdb_bag_square_sums_tables(const float* grad, int64_t ldg, int64_t tables, const int64_t* goff,
                                const int64_t* dims, int64_t bags, float* out);
void tdb_bag_square_sums16(const float* grad, int64_t ldg, int64_t tables, const int64_t* goff, const int64_t* dims,
                           int64_t bags, float* out);

int tdb_apply_tables(int kind, int decay, float* weights, int64_t tables, const int64_t* woff, const int64_t* dims,
                     float* state, const int64_t* soff, float* state2, const int64_t* s2off, const float* grad,
                     int64_t ldg, const int64_t* goff, const float* psw, const int32_t* keys, const int32_t* occ,
                     const int32_t* bag_of, const float* bag_sq, const int64_t* offsets, int64_t bags,
                     int64_t begin, int64_t end, const float* hp);
int tdb_apply_tables16(int kind, int decay, uint16_t* weights, int wtype, int stochastic, uint64_t seed,
                       int64_t tables, const int64_t* woff, const int64_t* dims, float* state, const int64_t* soff,
                       float* state2, const int64_t* s2off, const float* grad, int64_t ldg, const int64_t* goff,
                       const float* psw, const int32_t* keys, const int32_t* occ, const int32_t* bag_of,
                       const float* bag_sq, const int64_t* offsets, int64_t bags, int64_t begin, int64_t end,
                       const double* hp);
int tdb_update_tables(int kind, int decay, float* weights, int64_t tables, const int64_t* woff, const int64_t* dims,
                      const int64_t* rows, float* state, const int64_t* soff, float* state2, const int64_t* s2off,
                      const float* grad, int64_t ldg, const int64_t* goff, const float* psw, const int64_t* ids,
                      int64_t n, const int64_t* offsets, int64_t bags, int32_t* keys, int32_t* occ, int32_t* bag_of,
                      int32_t* tmp_keys, int32_t* tmp_occ, float* bag_sq, const float* hp);

int tdb_row_digests(const uint8_t* base, int64_t rows, int64_t row_bytes, int64_t stride, uint64_t* out);

int tdb_crc32c_hardware(void);
uint32_t tdb_crc32c(uint32_t prev, const uint8_t* p, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* TDB_KERNELS_H */
