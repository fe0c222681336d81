/*
 * softmax.c -- the scalar reference of k3_softmax (kernels.h), the "ref"
 * table's; softmax_avx2.c and softmax_avx512.c are held to it.
 */
#include "kernels/kernels.h"

#include <math.h>

void k3_softmax_ref(float *s, int64_t n, float scale) {
    float mx = -INFINITY;
    for (int64_t k = 0; k < n; k++) {
        s[k] *= scale;
        if (s[k] > mx) mx = s[k];
    }
    float sum = 0;
    for (int64_t k = 0; k < n; k++) {
        s[k] = expf(s[k] - mx);
        sum += s[k];
    }
    const float inv = 1.0f / sum;
    for (int64_t k = 0; k < n; k++) s[k] *= inv;
}
