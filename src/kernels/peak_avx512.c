/*
 * peak_avx512.c -- the register loops of peak.c on AVX-512: fp32 FMA and
 * INT8 dot products (vpdpbusd, AVX-512 VNNI); the AVX2 forms are in
 * peak_avx2.c, BF16 in peak_avx512bf16.c. Each runs iters rounds of 12
 * independent accumulators and returns the operations done.
 */
#include "kernels/peak_isa.h"

#include <immintrin.h>

#define INIT_PS(i) _mm512_set1_ps((float)(i))
#define INIT_EPI32(i) _mm512_set1_epi32(i)

double k3_peak_fma32_avx512(int64_t iters) {
    const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
    K3_PEAK_ACCS(__m512, INIT_PS);
#define STEP(a) _mm512_fmadd_ps(a, x, y)
    for (int64_t r = 0; r < iters; r++) K3_PEAK_ROUND(STEP, "v");
#undef STEP
    volatile float sink = _mm512_reduce_add_ps(K3_PEAK_SUM(_mm512_add_ps));
    (void)sink;
    return (double)iters * 12 * 16 * 2;
}

double k3_peak_int8_avx512(int64_t iters) {
    const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2);
    K3_PEAK_ACCS(__m512i, INIT_EPI32);
#define STEP(a) _mm512_dpbusd_epi32(a, x, y)
    for (int64_t r = 0; r < iters; r++) K3_PEAK_ROUND(STEP, "v");
#undef STEP
    volatile int sink = _mm512_reduce_add_epi32(K3_PEAK_SUM(_mm512_add_epi32));
    (void)sink;
    return (double)iters * 12 * 64 * 2;
}
