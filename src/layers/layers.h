/*
 * layers.h -- the layers of the forward pass (src/layers), called by the
 * layer loop (src/forward/forward.c). Each works on the rows of the current
 * round of a context (ctx.h: spans, scratch, caches) and leaves its output
 * in the buffer it is given.
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

/* Whether an exchange of the layers with other ranks failed in this
 * context's rounds (the failure is sticky): K3_OK, or its status and
 * message. */
k3_status k3_layers_failed(const k3_ctx *ctx, k3_error *err);

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

/* The span (sequence, position) of round row t. */
static inline const k3_span *k3_span_of(const k3_ctx *ctx, int64_t t) {
    for (int32_t i = 0; i < ctx->n_spans; i++)
        if (t < ctx->spans[i].t0 + ctx->spans[i].n) return &ctx->spans[i];
    K3_ASSERT(0);
    return NULL;
}

#endif /* K3_LAYERS_LAYERS_H */
