/*
 * act_avx2.c -- the gated activations (k3_glu) with AVX2+FMA: exp from vexp_avx2.h
 * (the KDA kernels' exp), tanh from it with a short odd series near zero
 * where 1 - 2/(e^2x + 1) would cancel.
 */
#include <immintrin.h>

#include "kernels/kernels_isa.h"
#include "kernels/vexp_avx2.h"

static inline __m256 tanh8(__m256 x) {
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    /* |x| >= 0.2: 1 - 2 / (e^2|x| + 1), sign restored */
    const __m256 e = k3_exp8(_mm256_add_ps(ax, ax));
    __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                               _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    big = _mm256_or_ps(big, _mm256_and_ps(x, _mm256_set1_ps(-0.0f)));
    /* |x| < 0.2: x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835 */
    const __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(62.0f / 2835);
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-17.0f / 315));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.0f / 15));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.0f / 3));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, x2), x, x);
    return _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.2f), _CMP_LT_OQ));
}

static inline __m256 sigmoid8(__m256 g) {
    return _mm256_div_ps(_mm256_set1_ps(1.0f),
                         _mm256_add_ps(_mm256_set1_ps(1.0f), k3_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* Every value goes through the same vector formula (the tail too, masked),
 * so a token's result does not depend on where it sits in a batch. */
void k3_glu_avx2(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2) {
    const __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < n; i += 8) {
        const int left = n - i >= 8 ? 8 : (int)(n - i);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
        const __m256 g = _mm256_maskload_ps(f1 + i, m);
        const __m256 u = kind == K3_GLU_SILU ? _mm256_set1_ps(1.0f) : _mm256_maskload_ps(f2 + i, m);
        __m256 y;
        if (kind == K3_GLU_SILU) {
            y = _mm256_mul_ps(g, sigmoid8(g));
        } else if (kind == K3_GLU_GATE) {
            y = _mm256_mul_ps(g, sigmoid8(_mm256_mul_ps(vb1, u)));
        } else if (kind == K3_GLU_SITU) {
            const __m256 a = _mm256_mul_ps(_mm256_mul_ps(vb1, tanh8(_mm256_div_ps(g, vb1))), sigmoid8(g));
            y = _mm256_mul_ps(a, b2 > 0.0f ? _mm256_mul_ps(vb2, tanh8(_mm256_div_ps(u, vb2))) : u);
        } else {
            y = _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), u);
        }
        _mm256_maskstore_ps(f1 + i, m, y);
    }
}
