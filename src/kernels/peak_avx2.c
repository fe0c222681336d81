/*
 * peak_avx2.c -- peak.c's register loops on AVX2: fp32 FMA, and vpdpbusd
 * on 256 bits (AVX-VNNI).
 */
#include "kernels/peak_isa.h"

#include <immintrin.h>

#define INIT_PS(i) _mm256_set1_ps((float)(i))
#define INIT_EPI32(i) _mm256_set1_epi32(i)

double k3_peak_fma32_avx2(int64_t iters) {
    const __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
    K3_PEAK_ACCS(__m256, INIT_PS);
#define STEP(a) _mm256_fmadd_ps(a, x, y)
    for (int64_t r = 0; r < iters; r++) K3_PEAK_ROUND(STEP, "x");
#undef STEP
    float v[8];
    _mm256_storeu_ps(v, K3_PEAK_SUM(_mm256_add_ps));
    volatile float sink = v[0];
    (void)sink;
    return (double)iters * 12 * 8 * 2;
}

__attribute__((target("avxvnni"))) double k3_peak_int8_avxvnni(int64_t iters) {
    const __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(-2);
    K3_PEAK_ACCS(__m256i, INIT_EPI32);
#define STEP(a) _mm256_dpbusd_avx_epi32(a, x, y)
    for (int64_t r = 0; r < iters; r++) K3_PEAK_ROUND(STEP, "x");
#undef STEP
    int v[8];
    _mm256_storeu_si256((__m256i *)v, K3_PEAK_SUM(_mm256_add_epi32));
    volatile int sink = v[0];
    (void)sink;
    return (double)iters * 12 * 32 * 2;
}
