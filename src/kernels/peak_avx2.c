/*
 * peak_avx2.c -- peak.c's register loops on AVX2: fp32 FMA, and vpdpbusd
 * on 256 bits (AVX-VNNI).
 */
#include "kernels/peak_isa.h"

#include <immintrin.h>

double k3_peak_fma32_avx2(int64_t iters) {
    __m256 a[12];
    const __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
    for (int64_t r = 0; r < iters; r++)
        for (int i = 0; i < 12; i++) {
            a[i] = _mm256_fmadd_ps(a[i], x, y);
            __asm__("" : "+x"(a[i]));
        }
    __m256 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm256_add_ps(s, a[i]);
    float v[8];
    _mm256_storeu_ps(v, s);
    volatile float sink = v[0];
    (void)sink;
    return (double)iters * 12 * 8 * 2;
}

__attribute__((target("avxvnni"))) double k3_peak_int8_avxvnni(int64_t iters) {
    __m256i a[12];
    const __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(-2);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_epi32(i);
    for (int64_t r = 0; r < iters; r++)
        for (int i = 0; i < 12; i++) {
            a[i] = _mm256_dpbusd_avx_epi32(a[i], x, y);
            __asm__("" : "+x"(a[i]));
        }
    __m256i s = a[0];
    for (int i = 1; i < 12; i++) s = _mm256_add_epi32(s, a[i]);
    int v[8];
    _mm256_storeu_si256((__m256i *)v, s);
    volatile int sink = v[0];
    (void)sink;
    return (double)iters * 12 * 32 * 2;
}
