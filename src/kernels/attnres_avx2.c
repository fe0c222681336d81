/*
 * attnres_avx2.c -- AVX2 path of the AttnRes mix (see attnres.h), the
 * "avx2" and "avx512" tables': one
 * pass over each candidate for its sum of squares and its projection on w,
 * then the softmax weights, then one pass writing the mix.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/kernels_isa.h"

static inline double hsum_pd(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

void k3_attnres_mix_avx2(const float *const *V, int n, const float *w, int64_t D, float eps, float *out) {
    float score[K3_ATTNRES_MAX];
    float mx = -INFINITY;
    for (int e = 0; e < n; e++) {
        /* accumulate in double, 2 x 4 lanes (two chains of dependent FMAs,
         * not one: this runs serially in decode), as the reference does in one */
        __m256d ss = _mm256_setzero_pd(), dot = _mm256_setzero_pd(), ss1 = ss, dot1 = dot;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(V[e] + d));
            const __m256d v1 = _mm256_cvtps_pd(_mm_loadu_ps(V[e] + d + 4));
            ss = _mm256_fmadd_pd(v, v, ss);
            ss1 = _mm256_fmadd_pd(v1, v1, ss1);
            dot = _mm256_fmadd_pd(v, _mm256_cvtps_pd(_mm_loadu_ps(w + d)), dot);
            dot1 = _mm256_fmadd_pd(v1, _mm256_cvtps_pd(_mm_loadu_ps(w + d + 4)), dot1);
        }
        for (; d + 4 <= D; d += 4) {
            const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(V[e] + d));
            ss = _mm256_fmadd_pd(v, v, ss);
            dot = _mm256_fmadd_pd(v, _mm256_cvtps_pd(_mm_loadu_ps(w + d)), dot);
        }
        double s2 = hsum_pd(_mm256_add_pd(ss, ss1)), dt = hsum_pd(_mm256_add_pd(dot, dot1));
        for (; d < D; d++) {
            s2 += (double)V[e][d] * V[e][d];
            dt += (double)V[e][d] * w[d];
        }
        score[e] = (float)(dt / sqrt(s2 / (double)D + eps));
        if (score[e] > mx) mx = score[e];
    }
    float sum = 0.0f;
    for (int e = 0; e < n; e++) sum += (score[e] = expf(score[e] - mx));
    const float inv = 1.0f / sum;
    for (int e = 0; e < n; e++) score[e] *= inv;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int e = 0; e < n; e++) acc = _mm256_fmadd_ps(_mm256_set1_ps(score[e]), _mm256_loadu_ps(V[e] + d), acc);
        _mm256_storeu_ps(out + d, acc);
    }
    for (; d < D; d++) {
        float acc = 0.0f;
        for (int e = 0; e < n; e++) acc += score[e] * V[e][d];
        out[d] = acc;
    }
}
