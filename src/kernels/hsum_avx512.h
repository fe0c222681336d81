/*
 * hsum_avx512.h -- horizontal sums of 16 fp32 lanes in one fixed tree, for
 * the AVX-512 files (compiled with their -m flags; include only from
 * *_avx512.c). k3_hsum4 and k3_hsum add every vector in the same order
 * (256-bit halves, then pairs, quads, eights), so a sum does not depend on
 * whether it was reduced alone or with three others: the kernels that batch
 * their reductions stay batch invariant.
 */
#ifndef K3_KERNELS_HSUM_AVX512_H
#define K3_KERNELS_HSUM_AVX512_H

#include <immintrin.h>

static inline __attribute__((always_inline)) __m256 k3_half_sum16(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
}

/* The four horizontal sums of a, b, c, d. */
static inline __attribute__((always_inline)) __m128 k3_hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(k3_half_sum16(a), k3_half_sum16(b)),
                              _mm256_hadd_ps(k3_half_sum16(c), k3_half_sum16(d)));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* k3_hsum4's tree for one vector. */
static inline __attribute__((always_inline)) float k3_hsum(__m512 v) {
    __m256 h = k3_half_sum16(v);
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h, h), _mm256_hadd_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

#endif /* K3_KERNELS_HSUM_AVX512_H */
