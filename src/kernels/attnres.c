/* attnres.c -- the scalar reference of the AttnRes mix (see attnres.h). */
#include "attnres.h"

#include <math.h>

void k3_attnres_mix_ref(const float *const *V, int n, const float *w, int64_t D, float eps, float *out) {
    float score[K3_ATTNRES_MAX];
    float mx = -INFINITY;
    for (int e = 0; e < n; e++) {
        double ss = 0.0, dot = 0.0;
        for (int64_t d = 0; d < D; d++) {
            ss += (double)V[e][d] * V[e][d];
            dot += (double)V[e][d] * w[d];
        }
        score[e] = (float)(dot / sqrt(ss / (double)D + eps));
        if (score[e] > mx) mx = score[e];
    }
    float sum = 0.0f;
    for (int e = 0; e < n; e++) sum += (score[e] = expf(score[e] - mx));
    const float inv = 1.0f / sum;
    for (int e = 0; e < n; e++) score[e] *= inv;
    for (int64_t d = 0; d < D; d++) {
        float acc = 0.0f;
        for (int e = 0; e < n; e++) acc += score[e] * V[e][d];
        out[d] = acc;
    }
}
