/*
 * peak_avx512.c -- the register loops of peak.c on AVX-512: fp32 FMA and
 * INT8 dot products (vpdpbusd, AVX-512 VNNI); the AVX2 forms are in
 * peak_avx2.c, BF16 in peak_avx512bf16.c. Each runs iters rounds of 12
 * independent accumulators and returns the operations done.
 */
#include "kernels/peak_isa.h"

#include <immintrin.h>

double k3_peak_fma32_avx512(int64_t iters) {
    __m512 a[12];
    const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    for (int64_t r = 0; r < iters; r++)
        for (int i = 0; i < 12; i++) {
            a[i] = _mm512_fmadd_ps(a[i], x, y);
            __asm__("" : "+v"(a[i]));
        }
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return (double)iters * 12 * 16 * 2;
}

double k3_peak_int8_avx512(int64_t iters) {
    __m512i a[12];
    const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
    for (int64_t r = 0; r < iters; r++)
        for (int i = 0; i < 12; i++) {
            a[i] = _mm512_dpbusd_epi32(a[i], x, y);
            __asm__("" : "+v"(a[i]));
        }
    __m512i s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_epi32(s, a[i]);
    volatile int sink = _mm512_reduce_add_epi32(s);
    (void)sink;
    return (double)iters * 12 * 64 * 2;
}
