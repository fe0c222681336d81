/*
 * sum_avx2.c -- the transfer checksum's blocks (wire.h) with AVX2: the 64
 * lanes in eight registers, one 256-byte block per step.
 */
#include <immintrin.h>

#include "pd/wire.h"

static inline __m256i step(__m256i x, const uint8_t *p, __m256i q) {
    const __m256i y = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_loadu_si256((const __m256i *)p)), q);
    return _mm256_or_si256(_mm256_slli_epi32(y, K3_PD_SUM_R), _mm256_srli_epi32(y, 32 - K3_PD_SUM_R));
}

size_t k3_pd_sum_blocks_avx2(const uint8_t *b, size_t n, uint32_t a[K3_PD_SUM_LANES]) {
    __m256i x[8];
    for (int k = 0; k < 8; k++) x[k] = _mm256_loadu_si256((const __m256i *)(a + 8 * k));
    const __m256i q = _mm256_set1_epi32((int)K3_PD_SUM_Q);
    size_t i = 0;
    for (; i + K3_PD_SUM_BLOCK <= n; i += K3_PD_SUM_BLOCK)
        for (int k = 0; k < 8; k++) x[k] = step(x[k], b + i + 32 * (size_t)k, q);
    for (int k = 0; k < 8; k++) _mm256_storeu_si256((__m256i *)(a + 8 * k), x[k]);
    return i;
}
