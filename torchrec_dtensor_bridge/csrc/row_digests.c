/*
 * Per-row digests of a table's rows, for incremental checkpoints
 * (torchrec_dtensor_bridge/checkpoint/incremental/digests.py).
 *
 *   tdb_row_digests  out[r] = digest of the row_bytes bytes at base + r * stride, for r in [0, rows).
 *
 * The digest of a row of n bytes, read as w = ceil(n / 8) little-endian 64-bit words (the last one
 * zero-padded): h = sum over i of mix(word[i] + (i + 1) * G), then digest = mix(h ^ n), all modulo 2^64,
 * where mix is splitmix64's finaliser. digests.py computes the same numbers with torch ops (a pure-Python
 * install). Built with the package into the extension torchrec_dtensor_bridge._C (ops.cpp calls it); no Python
 * or torch headers.
 */
#include <stdint.h>
#include <string.h>

#include "tdb_kernels.h"

#define TDB_G 0x9e3779b97f4a7c15ULL

/* One copy per feature level (x86-64-v4 multiplies 64-bit lanes in vectors: the words of a row are mixed 8 at
   a time); GCC names these levels from version 12 on, older compilers build one plain copy. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && !defined(TDB_NO_CLONES)
#define TDB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TDB_CLONES
#endif

static inline uint64_t tdb_mix(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

TDB_CLONES
int tdb_row_digests(const uint8_t *base, int64_t rows, int64_t row_bytes, int64_t stride, uint64_t *out) {
    if (rows < 0 || row_bytes < 0) return 1;
    int64_t full = row_bytes / 8, tail = row_bytes % 8;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *p = base + r * stride;
        uint64_t h = 0, k = TDB_G;
        for (int64_t i = 0; i < full; i++, k += TDB_G) {
            uint64_t w;
            memcpy(&w, p + 8 * i, 8);
            h += tdb_mix(w + k);
        }
        if (tail) {
            uint64_t w = 0;
            memcpy(&w, p + 8 * full, (size_t)tail);
            h += tdb_mix(w + k);
        }
        out[r] = tdb_mix(h ^ (uint64_t)row_bytes);
    }
    return 0;
}
