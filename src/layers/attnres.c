/*
 * attnres.c -- the AttnRes mix of a layer's input over the round's rows
 * (docs/model.md §3.2): the mix itself is kernels/attnres.h; the layer loop
 * (src/forward/forward.c) keeps the bank.
 */
#include "common/pool.h"
#include "kernels/attnres.h"
#include "layers/layers.h"

/* out[t] = Σ_e α_e V_e[t] with V = [bank_0 .. bank_{nb-1}, P], α = softmax of
 * the RMS-normalised projections on w (docs/model.md §3.2). */
typedef struct {
    const k3_ctx *ctx;
    float *out;
    const float *P;
    const float *w;
    int nb;
} mix_job;

static void mix_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const mix_job *j = p;
    const int64_t D = j->ctx->c->hidden_size, T = j->ctx->T;
    for (int64_t t = lo; t < hi; t++) {
        const float *V[K3_ATTNRES_MAX];
        for (int e = 0; e < j->nb; e++) V[e] = j->ctx->s.bank + ((int64_t)e * T + t) * D;
        V[j->nb] = j->P + t * D;
        k3_attnres_mix(V, j->nb + 1, j->w, D, j->ctx->c->rms_eps, j->out + t * D);
    }
}

void k3_attnres_mix_rows(k3_ctx *ctx, float *out, const float *P, const float *w, int nb) {
    mix_job j = {ctx, out, P, w, nb};
    k3_pool_for(ctx->pool, ctx->T, 4, mix_rows, &j);
}
