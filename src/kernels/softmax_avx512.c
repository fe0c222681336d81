/*
 * softmax_avx512.c -- k3_softmax (the vision tower's attention rows) on 16
 * lanes (vector exp of vexp_avx512.h); the scalar reference is k3_softmax_ref
 * (softmax.c), and tests/test_vision.c holds this to it.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/hsum_avx512.h"
#include "kernels/vexp_avx512.h"
#include "kernels/kernels_isa.h"

void k3_softmax_avx512(float *s, int64_t n, float scale) {
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmax = ninf;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_mask_loadu_ps(ninf, m, s + i), vs);
        _mm512_mask_storeu_ps(s + i, m, x);
        vmax = _mm512_max_ps(vmax, x);
    }
    const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, k3_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vm)));
        _mm512_mask_storeu_ps(s + i, m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / k3_hsum(vsum));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(s + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i), inv));
    }
}
