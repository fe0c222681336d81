/*
 * ffn.c -- the dense FFN (docs/model.md §3.5): the first layers' MLP and the
 * MoE layers' shared experts when they are not stacked with the latent
 * projection (moe.c).
 */
#include <string.h>

#include "layers/layers.h"

/* gu: gate and up stacked (one matmul into [n, 2I], then the GLU per row),
 * or empty: one matmul each */
void k3_ffn_dense(k3_ctx *ctx, const k3_mat *gu, const k3_mat *gate, const k3_mat *up, const k3_mat *down,
                  const float *x, int64_t n, float *out) {
    k3_scratch *s = &ctx->s;
    const int64_t I = gate->rows;
    if (gu->data) {
        k3_matmul(ctx->pool, gu, x, n, s->fused);
        for (int64_t t = 0; t < n; t++) {
            float *row = s->fused + t * 2 * I;
            k3_layer_glu(ctx->c, row, row + I, I);
            memcpy(s->f1 + t * I, row, sizeof(float) * (size_t)I);
        }
    } else {
        k3_matmul(ctx->pool, gate, x, n, s->f1);
        k3_matmul(ctx->pool, up, x, n, s->f2);
        k3_layer_glu(ctx->c, s->f1, s->f2, n * I);
    }
    k3_matmul(ctx->pool, down, s->f1, n, out);
}
