/*
 * peak_avx512bf16.c -- peak.c's register loop of BF16 dot products
 * (vdpbf16ps): 12 independent accumulators, 32 multiply-adds each a round.
 */
#include "kernels/peak_isa.h"

#include <immintrin.h>

#define INIT_PS(i) _mm512_set1_ps((float)(i))

double k3_peak_bf16_avx512(int64_t iters) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);
    K3_PEAK_ACCS(__m512, INIT_PS);
#define STEP(a) _mm512_dpbf16_ps(a, x, y)
    for (int64_t r = 0; r < iters; r++) K3_PEAK_ROUND(STEP, "v");
#undef STEP
    volatile float sink = _mm512_reduce_add_ps(K3_PEAK_SUM(_mm512_add_ps));
    (void)sink;
    return (double)iters * 12 * 32 * 2;
}
