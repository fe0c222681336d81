/*
 * sum_avx512.c -- the transfer checksum's blocks (wire.h) with AVX-512: the
 * 64 lanes in four registers, one 256-byte block per step.
 */
#include <immintrin.h>

#include "pd/wire.h"

size_t k3_pd_sum_blocks_avx512(const uint8_t *b, size_t n, uint32_t a[K3_PD_SUM_LANES]) {
    __m512i x0 = _mm512_loadu_si512(a), x1 = _mm512_loadu_si512(a + 16), x2 = _mm512_loadu_si512(a + 32),
            x3 = _mm512_loadu_si512(a + 48);
    const __m512i q = _mm512_set1_epi32((int)K3_PD_SUM_Q);
    size_t i = 0;
    for (; i + K3_PD_SUM_BLOCK <= n; i += K3_PD_SUM_BLOCK) {
        x0 = _mm512_rol_epi32(_mm512_mullo_epi32(_mm512_xor_si512(x0, _mm512_loadu_si512(b + i)), q), K3_PD_SUM_R);
        x1 = _mm512_rol_epi32(_mm512_mullo_epi32(_mm512_xor_si512(x1, _mm512_loadu_si512(b + i + 64)), q), K3_PD_SUM_R);
        x2 =
            _mm512_rol_epi32(_mm512_mullo_epi32(_mm512_xor_si512(x2, _mm512_loadu_si512(b + i + 128)), q), K3_PD_SUM_R);
        x3 =
            _mm512_rol_epi32(_mm512_mullo_epi32(_mm512_xor_si512(x3, _mm512_loadu_si512(b + i + 192)), q), K3_PD_SUM_R);
    }
    _mm512_storeu_si512(a, x0);
    _mm512_storeu_si512(a + 16, x1);
    _mm512_storeu_si512(a + 32, x2);
    _mm512_storeu_si512(a + 48, x3);
    return i;
}
