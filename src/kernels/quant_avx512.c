/*
 * quant_avx512.c -- AVX-512 VNNI inner loops of the 8-bit matmuls (see
 * quant.h): vpdpbusd multiplies unsigned by signed bytes, so the activation
 * side is made non-negative with the sign trick (|a| and b·sign(a)), exact
 * since both are clamped to [-127, 127].
 */
#include <immintrin.h>

#include "quant.h"
#include "quant_simd.h"

static inline __m512i dot64(__m512i acc, __m512i a, __m512i b) {
    const __mmask64 neg = _mm512_movepi8_mask(a);
    const __m512i absa = _mm512_abs_epi8(a);
    const __m512i sb = _mm512_mask_sub_epi8(b, neg, _mm512_setzero_si512(), b);
    return _mm512_dpbusd_epi32(acc, absa, sb);
}

int32_t k3_dot_i8_avx512(const int8_t *a, const int8_t *b, int64_t n) {
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        acc = dot64(acc, _mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i));
    if (i < n) {
        const __mmask64 m = n - i >= 64 ? ~0ull : ((1ull << (n - i)) - 1);
        acc = dot64(acc, _mm512_maskz_loadu_epi8(m, a + i), _mm512_maskz_loadu_epi8(m, b + i));
    }
    return _mm512_reduce_add_epi32(acc);
}

float k3_dot_mxfp4_i8_avx512(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < cols / 32; b++) {
        const __m256i w = k3_mxfp4_block_i8(packed + 16 * b);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * b));
        const __mmask32 neg = _mm256_movepi8_mask(xv);
        const __m256i sw = _mm256_mask_sub_epi8(w, neg, _mm256_setzero_si256(), w);
        const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(xv), sw);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(k3_mxfp4_half_scale(scale[b])), acc);
    }
    return k3_hsum256_ps(acc);
}
