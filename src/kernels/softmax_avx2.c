/*
 * softmax_avx2.c -- k3_softmax (the vision tower's attention rows) on 8
 * lanes (vector exp of vexp_avx2.h), the tail in scalar; the scalar reference
 * is k3_softmax_ref (softmax.c), and tests/test_vision.c holds this to it.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/vexp_avx2.h"
#include "kernels/kernels_isa.h"

void k3_softmax_avx2(float *s, int64_t n, float scale) {
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + i), vs);
        _mm256_storeu_ps(s + i, x);
        vmax = _mm256_max_ps(vmax, x);
    }
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, vmax);
    for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
    for (int64_t k = i; k < n; k++) {
        s[k] *= scale;
        if (s[k] > mx) mx = s[k];
    }
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = k3_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(s + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
    float sum = 0;
    for (int k = 0; k < 8; k++) sum += lanes[k];
    for (int64_t k = i; k < n; k++) {
        s[k] = expf(s[k] - mx);
        sum += s[k];
    }
    const float inv = 1.0f / sum;
    const __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), vi));
    for (int64_t k = i; k < n; k++) s[k] *= inv;
}
