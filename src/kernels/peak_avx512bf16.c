/*
 * peak_avx512bf16.c -- peak.c's register loop of BF16 dot products
 * (vdpbf16ps): 12 independent accumulators, 32 multiply-adds each a round.
 */
#include "kernels/peak_isa.h"

#include <immintrin.h>

double k3_peak_bf16_avx512(int64_t iters) {
    __m512 a[12];
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    for (int64_t r = 0; r < iters; r++)
        for (int i = 0; i < 12; i++) {
            a[i] = _mm512_dpbf16_ps(a[i], x, y);
            __asm__("" : "+v"(a[i]));
        }
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return (double)iters * 12 * 32 * 2;
}
