/*
 * quant_avx2.c -- AVX2 inner loops of the 8-bit matmuls (see quant.h).
 * int8 x int8 uses the sign trick: maddubs(|a|, b·sign(a)) never saturates
 * because both sides are clamped to [-127, 127] (2·127·127 < 32768).
 */
#include <immintrin.h>

#include "quant.h"
#include "quant_simd.h"

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}


static inline __m256i dot32(__m256i a, __m256i b) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

int32_t k3_dot_i8_avx2(const int8_t *a, const int8_t *b, int64_t n) {
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        acc = _mm256_add_epi32(acc, dot32(_mm256_loadu_si256((const __m256i *)(a + i)),
                                          _mm256_loadu_si256((const __m256i *)(b + i))));
    int32_t s = hsum_epi32(acc);
    for (; i < n; i++) s += (int32_t)a[i] * b[i];
    return s;
}

float k3_dot_mxfp4_i8_avx2(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < cols / 32; b++) {
        const __m256i w = k3_mxfp4_block_i8(packed + 16 * b);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * b));
        const __m256 d = _mm256_cvtepi32_ps(dot32(xv, w));
        acc = _mm256_fmadd_ps(d, _mm256_set1_ps(k3_mxfp4_half_scale(scale[b])), acc);
    }
    return k3_hsum256_ps(acc);
}
