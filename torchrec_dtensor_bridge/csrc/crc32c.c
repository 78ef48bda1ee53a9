/*
 * CRC-32C (Castagnoli: reflected polynomial 0x82f63b78, register started at and finished with all ones), the
 * checksum an upload to an object store carries (checkpoint/storage/s3_streams.py; the header
 * x-amz-checksum-crc32c, which the store checks against the body it received).
 *
 *   tdb_crc32c_hardware  1 when this CPU has a CRC-32C instruction (x86-64 SSE4.2; aarch64 built with +crc), else 0.
 *   tdb_crc32c           the CRC-32C of prev's bytes followed by the n bytes at p, where prev is the CRC-32C of
 *                        the bytes before (0 for none), as zlib.crc32 chains. Without the instruction a bit at a
 *                        time: correct and slow (the caller uses another checksum then).
 *
 * With the instruction, runs of 3 * TDB_LANE bytes are taken as three lanes at once (three independent chains
 * of the instruction, whose latency is three times its issue interval), then joined: the register after
 * a || b equals shift_|b|(register after a) ^ (register of b started at zero), where shift_k (the register after
 * k zero bytes) is linear over GF(2) and applied through four 256-entry tables, built per call from its images
 * of the 32 unit registers. Those take one run over TDB_LANE zero bytes: shift_k is a multiplication by
 * x^(8k) modulo the polynomial, so it commutes with one zero bit (a multiplication by x), and unit register
 * i - 1 is unit register i after one zero bit.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tdb_kernels.h"

#define TDB_CRC32C_POLY 0x82f63b78u
#define TDB_LANE 8192u

static uint32_t zero_bit(uint32_t reg) { return (reg >> 1) ^ (TDB_CRC32C_POLY & (0u - (reg & 1u))); }

static uint32_t crc32c_bits(uint32_t reg, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        reg ^= p[i];
        for (int k = 0; k < 8; k++) reg = zero_bit(reg);
    }
    return reg;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define TDB_HW 1
#define TDB_HW_FN __attribute__((target("sse4.2")))
#define TDB_CRC8(c, b) _mm_crc32_u8((c), (b))
#define TDB_CRC64(c, w) ((uint32_t)_mm_crc32_u64((c), (w)))
static int hw_present(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define TDB_HW 1
#define TDB_HW_FN
#define TDB_CRC8(c, b) __crc32cb((c), (b))
#define TDB_CRC64(c, w) __crc32cd((c), (w))
static int hw_present(void) { return 1; }
#else
#define TDB_HW 0
static int hw_present(void) { return 0; }
#endif

#if TDB_HW
TDB_HW_FN static uint32_t hw_run(uint32_t reg, const uint8_t *p, size_t n) {
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        reg = TDB_CRC64(reg, w);
    }
    for (; n; p++, n--) reg = TDB_CRC8(reg, *p);
    return reg;
}

static uint32_t shifted(const uint32_t table[4][256], uint32_t reg) {
    return table[0][reg & 0xff] ^ table[1][(reg >> 8) & 0xff] ^ table[2][(reg >> 16) & 0xff] ^ table[3][reg >> 24];
}

TDB_HW_FN static uint32_t hw_crc(uint32_t reg, const uint8_t *p, size_t n) {
    if (n >= 3 * TDB_LANE) {
        static const uint8_t zeros[TDB_LANE];
        uint32_t unit[32], table[4][256];
        unit[31] = hw_run(1u << 31, zeros, TDB_LANE);
        for (int i = 31; i > 0; i--) unit[i - 1] = zero_bit(unit[i]);
        for (int k = 0; k < 4; k++) {
            for (int b = 0; b < 256; b++) {
                uint32_t v = 0;
                for (int j = 0; j < 8; j++)
                    if (b >> j & 1) v ^= unit[8 * k + j];
                table[k][b] = v;
            }
        }
        for (; n >= 3 * TDB_LANE; p += 3 * TDB_LANE, n -= 3 * TDB_LANE) {
            uint32_t a = reg, b = 0, c = 0;
            for (size_t i = 0; i < TDB_LANE; i += 8) {
                uint64_t wa, wb, wc;
                memcpy(&wa, p + i, 8);
                memcpy(&wb, p + TDB_LANE + i, 8);
                memcpy(&wc, p + 2 * TDB_LANE + i, 8);
                a = TDB_CRC64(a, wa);
                b = TDB_CRC64(b, wb);
                c = TDB_CRC64(c, wc);
            }
            reg = shifted(table, shifted(table, a) ^ b) ^ c;
        }
    }
    return hw_run(reg, p, n);
}
#endif

int tdb_crc32c_hardware(void) { return hw_present(); }

uint32_t tdb_crc32c(uint32_t prev, const uint8_t *p, size_t n) {
    uint32_t reg = ~prev;
#if TDB_HW
    if (hw_present()) return ~hw_crc(reg, p, n);
#endif
    return ~crc32c_bits(reg, p, n);
}
