/*
 * layers.h -- the layers of the forward pass, called by the layer loop
 * (src/forward/forward.c): the KDA layer (kda.c), the MLA/DSA layer
 * (mla.c), the latent MoE layer (moe.c), the dense FFN (ffn.c), the
 * AttnRes mix (attnres.c) and the RMSNorm (norm.c). Each works on the T
 * rows of the current round of a context (ctx.h: spans, scratch, caches)
 * and leaves its output in the buffer it is given. The primitives they are
 * made of are src/kernels.
 *
 * Two have a form for several ranks beside them, chosen inside the layer:
 * the MLA/DSA attention under DCP (mla_dcp.c: the cache holds only this
 * rank's tokens, the top-k and the attention are settled across the group)
 * and the MoE experts under EP (moe_ep.c: each rank runs its own experts).
 * Their exchanges go through src/comm; with one process (ctx->dcp = ctx->ep
 * = 1) they are never called.
 */
#ifndef K3_LAYERS_LAYERS_H
#define K3_LAYERS_LAYERS_H

#include "ctx/ctx.h"
#include "kernels/attn_ops.h"
#include "model/model.h"

/* ---- the layers ---------------------------------------------------------------- */

/* KDA layer `layer` over xn [T, D], into out [T, D]. */
void k3_kda_layer(k3_ctx *ctx, const k3_layer *L, int layer, const float *xn, float *out);
/* MLA/DSA layer `layer` over xn [T, D], into out [T, D]. */
void k3_mla_layer(k3_ctx *ctx, const k3_layer *L, int layer, const float *xn, float *out);
/* Latent MoE layer over yn [T, D] (routed and shared experts), into out [T, D]. */
void k3_moe_layer(k3_ctx *ctx, const k3_layer *L, const float *yn, float *out);
/* Dense FFN over n rows of x: gu the stacked gate and up (one matmul, then
 * the GLU per row), or empty: one matmul each; into out. */
void k3_ffn_dense(k3_ctx *ctx, const k3_mat *gu, const k3_mat *gate, const k3_mat *up, const k3_mat *down,
                  const float *x, int64_t n, float *out);
/* The AttnRes mix of every row: out[t] = sum_e alpha_e V_e[t] over V = [the
 * nb bank entries (s.bank), P]. */
void k3_attnres_mix_rows(k3_ctx *ctx, float *out, const float *P, const float *w, int nb);

/* out = w * x / sqrt(mean(x^2) + eps), n values (out may alias x). */
void k3_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
/* The same over the round's T rows (strides ldo, ldx), as pool items. */
void k3_rmsnorm_rows(k3_ctx *ctx, float *out, int64_t ldo, const float *x, int64_t ldx, const float *w, int64_t n,
                     float eps);

/* ---- what the layers share ------------------------------------------------------ */

/* The context of a pool job over one layer's rows or (row, part) items. */
typedef struct k3_layer_job {
    k3_ctx *ctx;
    const k3_layer *L;
    int layer;
    int parts; /* split jobs: parts per row */
    int hg;    /* attention: head groups per (row, part) item */
} k3_layer_job;

/* f1 = act(f1, f2) over n values: the model's gated activation. */
static inline void k3_layer_glu(const k3_config *c, float *f1, const float *f2, int64_t n) {
    k3_glu(f1, f2, n, c->act == K3_ACT_SITU ? K3_GLU_SITU : K3_GLU_SWIGLU, c->situ_beta, c->situ_linear_beta);
}

/* The span (sequence, position) of round row t. */
static inline const k3_span *k3_span_of(const k3_ctx *ctx, int64_t t) {
    for (int32_t i = 0; i < ctx->n_spans; i++)
        if (t < ctx->spans[i].t0 + ctx->spans[i].n) return &ctx->spans[i];
    K3_ASSERT(0);
    return NULL;
}

/* Whether an exchange of the layers with other ranks failed in this
 * context's rounds (the failure is sticky): K3_OK, or its status and
 * message. */
k3_status k3_layers_failed(const k3_ctx *ctx, k3_error *err);

/* Layer `layer`'s C8 latent cache as QSFA reads it, with QSFA's form: the
 * BF16 one where the model takes it (attn_ops.h), the same in prefill,
 * decode and the DCP form. */
static inline k3_c8_cache k3_mla_c8_view(const k3_ctx *ctx, int layer) {
    return (k3_c8_cache){ctx->lat8[layer],
                         ctx->lat_s[layer],
                         ctx->lat_r[layer],
                         ctx->c->kv_lora_rank,
                         ctx->c->qk_rope_dim,
                         ctx->n_tiles,
                         k3_qsfa_bf16_wanted(ctx->m->qsfa_bf16_heads, ctx->c->n_heads)};
}

/* ---- the DCP form of the MLA/DSA attention (mla_dcp.c) -------------------- */

/* Local indexer scores and top-k, the exchange, attention over the own
 * winners (or the own shard for dense layers), the exchange of (output,
 * LSE) and the exact merge, into s.chat -- the same place the one-process
 * path leaves it. */
void k3_mla_dcp_attention(k3_ctx *ctx, const k3_layer *L, int layer);

/* ---- the EP form of the MoE experts (moe_ep.c) ----------------------------- */

/* Whether this rank holds routed expert e. */
static inline bool k3_ep_owns(const k3_ctx *ctx, int e) {
    return ctx->ep <= 1 || e / (ctx->c->n_experts / ctx->ep) == ctx->ep_rank;
}
/* Sends the latent rows z of the tokens this rank sources to the owners of
 * their experts; returns the rows the own experts read (z itself with EP 1). */
const float *k3_ep_dispatch(k3_ctx *ctx, const float *z);
/* Sends the own experts' results (s.ly rows) back to their tokens' sources. */
void k3_ep_combine(k3_ctx *ctx);
/* Replaces the combined rows comb [T, Dl] of tokens sourced elsewhere by
 * their sources' rows. */
void k3_ep_gather(k3_ctx *ctx, float *comb);

#endif /* K3_LAYERS_LAYERS_H */
