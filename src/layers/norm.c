/*
 * norm.c -- the RMSNorm of the layers and of the layer loop (layers.h).
 */
#include <math.h>

#include "common/pool.h"
#include "layers/layers.h"

/* out = w ⊙ x / sqrt(mean(x²) + eps), n values (out may alias x). The sum
 * of squares in double over four interleaved partial sums: one chain of
 * dependent adds cost ~2.5 us per 2048 values, a serial step of every layer
 * in decode. */
void k3_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)x[i] * x[i];
        s1 += (double)x[i + 1] * x[i + 1];
        s2 += (double)x[i + 2] * x[i + 2];
        s3 += (double)x[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += (double)x[i] * x[i];
    const double ss = (s0 + s1) + (s2 + s3);
    const float r = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

typedef struct {
    float *out;
    const float *x;
    const float *w;
    int64_t n, ldo, ldx;
    float eps;
} rms_job;

static void rms_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const rms_job *j = p;
    for (int64_t t = lo; t < hi; t++) k3_rmsnorm(j->out + t * j->ldo, j->x + t * j->ldx, j->w, j->n, j->eps);
}

void k3_rmsnorm_rows(k3_ctx *ctx, float *out, int64_t ldo, const float *x, int64_t ldx, const float *w, int64_t n,
                     float eps) {
    rms_job j = {out, x, w, n, ldo, ldx, eps};
    k3_pool_for(ctx->pool, ctx->T, 8, rms_rows, &j);
}
