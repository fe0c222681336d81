/*
 * quant_simd.h -- private to quant_avx2.c: pieces of its W4A8 inner loop
 * (the AVX-512 kernel decodes nibbles its own way, mx4_avx512.inc).
 */
#ifndef K3_KERNELS_QUANT_SIMD_H
#define K3_KERNELS_QUANT_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* 32 MXFP4 weights (16 packed bytes) as int8 doubled E2M1 values
 * {0,1,2,3,4,6,8,12} with sign, in column order (byte j holds columns 2j in
 * its low nibble and 2j+1 in its high one). */
static inline __m256i k3_mxfp4_block_i8(const uint8_t *packed) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)packed);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, m4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), m4));
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

/* 2^(e-128): the E8M0 scale halved, for the doubled E2M1 values (subnormal
 * for e < 2; e = 255 never reaches a kernel, the loader refuses it). */
static inline float k3_mxfp4_half_scale(uint8_t e) {
    union {
        uint32_t u;
        float f;
    } sc;
    sc.u = e >= 2 ? (uint32_t)(e - 1) << 23 : e ? 0x00400000u : 0x00200000u;
    return sc.f;
}

static inline float k3_hsum256_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#endif /* K3_KERNELS_QUANT_SIMD_H */
