/*
 * hooks.h -- what the context (ctx.c) and the forward pass (forward.c) call
 * into src/dist for DCP and EP. All of them are no-ops or not called when
 * the context has no dist (ctx->dcp == ctx->ep == 1).
 */
#ifndef K3_DIST_HOOKS_H
#define K3_DIST_HOOKS_H

#include "dist.h"
#include "engine/ctx.h"

/* The exchange buffers of a context (sized for max_batch rows). */
typedef struct k3_dist_scratch {
    /* DCP */
    k3_cand *cand, *cand_out, *cand_work; /* [T*k], [T*k], [T*k*max(D,2)] */
    int32_t *xrow;                        /* [T] row -> exchanged row, or -1 */
    int64_t *wslots;                      /* [T*k] own winners' slots */
    int32_t *wcount;                      /* [T] */
    float *att, *att_all;                 /* [T*(H*kvl+H)], [D*T*(H*kvl+H)] */
    float *att_send, *att_mine;           /* head-split merge: [T*(H*kvl+H)], [T*(H/D)*kvl] */
    /* EP */
    float *zr;                            /* [T, Dl] the latents the own experts read */
    float *sendb, *recvb;                 /* [T*K*Dl] each */
    int *sc, *sd, *rc, *rd;               /* [E] byte counts and displacements */
} k3_dist_scratch;

/* Before the cache is sized: takes the groups from d into ctx (dcp, ep and
 * their ranks) and checks them against the model and the options. */
k3_status k3_dist_ctx_setup(k3_ctx *ctx, k3_dist *d, k3_error *err);
/* After the rest of the context: the DCP / EP exchange buffers. */
k3_status k3_dist_ctx_alloc(k3_ctx *ctx, k3_error *err);
void k3_dist_ctx_free(k3_ctx *ctx);

/* Tokens among a sequence's first n that this rank caches. */
int64_t k3_dist_local_tokens(const k3_ctx *ctx, int64_t n);

/* DCP attention of one MLA/DSA layer over the round: local indexer scores
 * and top-k, the exchange, attention over the own winners (or the own shard
 * for dense layers), the exchange of (output, LSE) and the exact merge,
 * into s.chat -- the same place the one-process path leaves it. */
void k3_dcp_attention(k3_ctx *ctx, const k3_layer *L, int layer);

/* EP: whether this rank holds routed expert e. */
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

#endif /* K3_DIST_HOOKS_H */
