/*
 * act_avx512.c -- the gated activations (k3_glu) with AVX-512: exp from vexp_avx512.h
 * (the KDA kernels' exp), tanh from it with a short odd series near zero
 * where 1 - 2/(e^2x + 1) would cancel.
 */
#include <immintrin.h>

#include "kernels/kernels_isa.h"
#include "kernels/vexp_avx512.h"

static inline __m512 tanh16(__m512 x) {
    const __m512 ax = _mm512_abs_ps(x);
    /* |x| >= 0.2: 1 - 2 / (e^2|x| + 1), sign restored */
    const __m512 e = k3_exp16(_mm512_add_ps(ax, ax));
    __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                               _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    big = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big),
                                              _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
    /* |x| < 0.2: x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835 */
    const __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(62.0f / 2835);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-17.0f / 315));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.0f / 15));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.0f / 3));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, x2), x, x);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.2f), _CMP_LT_OQ), big, small);
}

static inline __m512 sigmoid16(__m512 g) {
    return _mm512_div_ps(_mm512_set1_ps(1.0f),
                         _mm512_add_ps(_mm512_set1_ps(1.0f), k3_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

/* Every value goes through the same vector formula (the tail too, masked),
 * so a token's result does not depend on where it sits in a batch. */
void k3_glu_avx512(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2) {
    const __m512 vb1 = _mm512_set1_ps(b1), vb2 = _mm512_set1_ps(b2);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(m, f1 + i);
        const __m512 u = kind == K3_GLU_SILU ? _mm512_set1_ps(1.0f) : _mm512_maskz_loadu_ps(m, f2 + i);
        __m512 y;
        if (kind == K3_GLU_SILU) {
            y = _mm512_mul_ps(g, sigmoid16(g));
        } else if (kind == K3_GLU_GATE) {
            y = _mm512_mul_ps(g, sigmoid16(_mm512_mul_ps(vb1, u)));
        } else if (kind == K3_GLU_SITU) {
            const __m512 a = _mm512_mul_ps(_mm512_mul_ps(vb1, tanh16(_mm512_div_ps(g, vb1))), sigmoid16(g));
            y = _mm512_mul_ps(a, b2 > 0.0f ? _mm512_mul_ps(vb2, tanh16(_mm512_div_ps(u, vb2))) : u);
        } else {
            y = _mm512_mul_ps(_mm512_mul_ps(g, sigmoid16(g)), u);
        }
        _mm512_mask_storeu_ps(f1 + i, m, y);
    }
}
