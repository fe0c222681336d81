/*
 * spec.c -- the context's side of verifying drafts (ctx.h, "verifying
 * drafts"): marking a slot for a verify chunk and bringing its KDA state to
 * the last kept position afterwards. The verify pass itself is the KDA
 * layer's (src/layers/kda.c, kda_head_verify).
 */
#include <stdlib.h>
#include <string.h>

#include "common/pool.h"
#include "ctx/ctx.h"
#include "kernels/kda.h"

static int32_t n_kda_layers(const k3_config *c) {
    int32_t n = 0;
    for (int i = 0; i < c->n_layers; i++) n += c->layer_kind[i] == K3_LAYER_KDA;
    return n;
}

int64_t k3_ctx_spec_bytes(const k3_ctx *ctx, int32_t n, int32_t mode) {
    return (int64_t)n_kda_layers(ctx->c) * n * k3_spec_pos_floats(ctx->c, mode) * (int64_t)sizeof(float);
}

/* The per-thread scratch of a verifying head: its state copy [dk, dk], its
 * windows [3, K-1, dk] and K3_CTX_SPEC_MAX output rows [dk]. */
static int64_t tspec_floats(const k3_config *c) {
    const int64_t dk = c->kda_head_dim, Km1 = c->conv_size > 0 ? c->conv_size - 1 : 0;
    return dk * dk + 3 * Km1 * dk + (int64_t)K3_CTX_SPEC_MAX * dk;
}

static k3_status spec_alloc(k3_ctx *ctx, k3_error *err) {
    const k3_config *c = ctx->c;
    if (!ctx->spec) {
        ctx->spec = calloc((size_t)ctx->max_seqs, sizeof *ctx->spec);
        ctx->kda_ord = calloc((size_t)c->n_layers, sizeof *ctx->kda_ord);
        ctx->tspec = calloc((size_t)ctx->nth, sizeof *ctx->tspec);
        if (!ctx->spec || !ctx->kda_ord || !ctx->tspec) return k3_err(err, K3_ERR_NOMEM, "verify: out of memory");
        for (int i = 0, o = 0; i < c->n_layers; i++) ctx->kda_ord[i] = c->layer_kind[i] == K3_LAYER_KDA ? o++ : -1;
    }
    for (int t = 0; t < ctx->nth; t++)
        if (!ctx->tspec[t] && !(ctx->tspec[t] = malloc(sizeof(float) * (size_t)tspec_floats(c))))
            return k3_err(err, K3_ERR_NOMEM, "verify: out of memory");
    return K3_OK;
}

void k3_spec_slots_free(k3_ctx *ctx) {
    if (ctx->spec)
        for (int32_t i = 0; i < ctx->max_seqs; i++) free(ctx->spec[i].buf);
    if (ctx->tspec)
        for (int t = 0; t < ctx->nth; t++) free(ctx->tspec[t]);
    free(ctx->spec);
    free(ctx->tspec);
    free(ctx->kda_ord);
    ctx->spec = NULL;
    ctx->tspec = NULL;
    ctx->kda_ord = NULL;
}

void k3_spec_forget(k3_ctx *ctx, int32_t seq) {
    if (ctx->spec && seq >= 0 && seq < ctx->max_seqs) ctx->spec[seq].on = false;
}

k3_status k3_ctx_spec_begin(k3_ctx *ctx, int32_t seq, int32_t n, int32_t mode, k3_error *err) {
    if (seq < 0 || seq >= ctx->max_seqs)
        return k3_err(err, K3_ERR_ARG, "verify: sequence %d out of range [0, %d)", seq, ctx->max_seqs);
    if (n < 1 || n > K3_CTX_SPEC_MAX || n > ctx->max_batch)
        return k3_err(err, K3_ERR_RANGE, "verify: a chunk of %d positions, where 1..%d fit", n,
                      K3_CTX_SPEC_MAX < ctx->max_batch ? K3_CTX_SPEC_MAX : ctx->max_batch);
    if (mode != K3_SPEC_REAPPLY && mode != K3_SPEC_STATES)
        return k3_err(err, K3_ERR_ARG, "verify: unknown rollback mode %d", mode);
    K3_TRY(spec_alloc(ctx, err));
    k3_spec_slot *sp = &ctx->spec[seq];
    const int64_t need = k3_ctx_spec_bytes(ctx, n, mode) / (int64_t)sizeof(float);
    if (need > sp->cap) {
        float *b = realloc(sp->buf, sizeof(float) * (size_t)(need > 0 ? need : 1));
        if (!b)
            return k3_err(err, K3_ERR_NOMEM, "verify: out of memory for %lld bytes of a verify chunk",
                          (long long)(need * (int64_t)sizeof(float)));
        sp->buf = b;
        sp->cap = need;
    }
    sp->on = true;
    sp->n = n;
    sp->mode = mode;
    sp->pos0 = ctx->seqs[seq].pos;
    return K3_OK;
}

typedef struct {
    k3_ctx *ctx;
    int32_t seq, n_keep;
} accept_job;

/* One (KDA layer, head) of the accept: the state and windows after the kept
 * positions. */
static void accept_items(void *p, int64_t lo, int64_t hi, int ith) {
    const accept_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    const k3_spec_slot *sp = &ctx->spec[j->seq];
    const int H = c->kda_heads, dk = c->kda_head_dim, dv = dk, K = c->conv_size;
    const int64_t HK = (int64_t)H * dk, nS = (int64_t)H * dk * dv, Km1 = K > 0 ? K - 1 : 0;
    const int64_t per = k3_spec_pos_floats(c, sp->mode);
    const int32_t m = j->n_keep;
    for (int64_t it = lo; it < hi; it++) {
        const int layer = (int)(it / H), h = (int)(it % H);
        if (c->layer_kind[layer] != K3_LAYER_KDA) continue;
        const int64_t ch = (int64_t)h * dk;
        float *S = ctx->kda_S[layer] + ((int64_t)j->seq * H + h) * dk * dv;
        float *W = ctx->kda_conv[layer] + (int64_t)j->seq * 3 * Km1 * HK;
        const float *b0 = k3_spec_at(ctx, j->seq, layer, 0);
        if (sp->mode == K3_SPEC_STATES) {
            const float *b = b0 + (int64_t)(m - 1) * per;
            memcpy(S, b + ch * dv, sizeof(float) * (size_t)(dk * dv));
            for (int64_t r = 0; r < 3 * Km1; r++)
                memcpy(W + r * HK + ch, b + nS + r * HK + ch, sizeof(float) * (size_t)dk);
            continue;
        }
        /* the recurrence over the kept positions, from their saved inputs
         * (q is not read by the state's update; o goes to scratch) */
        const float *post = b0 + 3 * HK + (int64_t)h * (3 * dk + 1);
        k3_kda_head kh = {
            .n = m,
            .dk = dk,
            .dv = dv,
            .q = post,
            .k = post,
            .g = post + 2 * dk,
            .ld_qk = per,
            .v = post + dk,
            .ld_v = per,
            .beta = post + 3 * dk,
            .ld_beta = per,
            .o = ctx->tspec[ith],
            .ld_o = dv,
        };
        k3_kda_recurrent(&kh, S);
        /* each window: the last K-1 of [its K-1 rows, the kept positions' pre-conv rows] */
        for (int which = 0; which < 3; which++) {
            float *w = W + (int64_t)which * Km1 * HK + ch;
            for (int64_t r = 0; r < Km1; r++) {
                const int64_t src = m + r; /* in [window rows, new rows] */
                if (src < Km1) memmove(w + r * HK, w + src * HK, sizeof(float) * (size_t)dk);
                else memcpy(w + r * HK, b0 + (src - Km1) * per + which * HK + ch, sizeof(float) * (size_t)dk);
            }
        }
    }
}

k3_status k3_ctx_spec_accept(k3_ctx *ctx, int32_t seq, int32_t n_keep, k3_error *err) {
    if (seq < 0 || seq >= ctx->max_seqs || !ctx->spec || !ctx->spec[seq].on)
        return k3_err(err, K3_ERR_ARG, "verify: sequence %d has no verify chunk to accept", seq);
    k3_spec_slot *sp = &ctx->spec[seq];
    if (n_keep < 0 || n_keep > sp->n)
        return k3_err(err, K3_ERR_RANGE, "verify: keeping %d of a chunk of %d positions", n_keep, sp->n);
    if (ctx->seqs[seq].pos != sp->pos0 + sp->n)
        return k3_err(err, K3_ERR_ARG, "verify: sequence %d's chunk was not run (position %lld, expected %lld)", seq,
                      (long long)ctx->seqs[seq].pos, (long long)(sp->pos0 + sp->n));
    if (n_keep > 0) {
        accept_job j = {ctx, seq, n_keep};
        k3_pool_for(ctx->pool, (int64_t)ctx->c->n_layers * ctx->c->kda_heads, 1, accept_items, &j);
    }
    ctx->seqs[seq].pos = sp->pos0 + n_keep;
    sp->on = false;
    return K3_OK;
}
