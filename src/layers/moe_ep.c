/*
 * moe_ep.c -- the routed experts under expert parallelism (docs/serving-reference.md §4.3):
 * the EP form of the MoE layer.
 *
 * Routed expert e lives on EP rank e / (n_experts / E). Every rank has the
 * router's choices for every row (they are computed on replicated rows), so
 * both ends of every message know its size and order without asking: row t
 * is sourced by EP rank t mod E, which sends its latent once to each other
 * rank owning one of t's experts (dispatch, MPI all-to-all); the owners run
 * their experts over all rows routed to them -- the same rows in the same
 * order as one process, so the same results -- and send each result back to
 * the row's source (combine); the source sums its rows in slot order as one
 * process does, and the combined rows go to the other ranks of the group
 * (also counted as combine), since everything after the MoE is replicated.
 */
#include <string.h>

#include "comm/comm.h"
#include "layers/layers.h"

static inline int owner(const k3_ctx *ctx, int32_t e) { return e / (ctx->c->n_experts / ctx->ep); }

/* whether row t has an expert on EP rank o */
static bool row_hits(const k3_ctx *ctx, int64_t t, int o) {
    const int K = ctx->c->n_experts_per_tok;
    for (int r = 0; r < K; r++)
        if (owner(ctx, ctx->s.rids[t * K + r]) == o) return true;
    return false;
}

static void displs(const int *count, int *displ, int n) {
    int o = 0;
    for (int i = 0; i < n; i++) {
        displ[i] = o;
        o += count[i];
    }
}

const float *k3_ep_dispatch(k3_ctx *ctx, const float *z) {
    k3_exchange_scratch *x = ctx->xs;
    const int E = ctx->ep, me = ctx->ep_rank;
    const int64_t T = ctx->T, Dl = ctx->c->expert_dim;
    const size_t rb = sizeof(float) * (size_t)Dl;
    /* send: to each o != me the latents of my rows that hit o, in row order */
    float *sp = x->sendb;
    for (int o = 0; o < E; o++) {
        x->sc[o] = 0;
        for (int64_t t = me; t < T && o != me; t += E)
            if (row_hits(ctx, t, o)) {
                memcpy(sp, z + t * Dl, rb);
                sp += Dl;
                x->sc[o] += (int)rb;
            }
        x->rc[o] = 0;
        for (int64_t t = o; t < T && o != me; t += E)
            if (row_hits(ctx, t, me)) x->rc[o] += (int)rb;
    }
    displs(x->sc, x->sd, E);
    displs(x->rc, x->rd, E);
    k3_comm_alltoallv(ctx->dist, K3_GROUP_EP, K3_COMM_EP_DISPATCH, x->sendb, x->sc, x->sd, x->recvb, x->rc, x->rd);
    /* the rows my experts read: received ones, and my own */
    for (int o = 0; o < E; o++) {
        const float *rp = x->recvb + x->rd[o] / (int)sizeof(float);
        for (int64_t t = o; t < T; t += E) {
            if (!row_hits(ctx, t, me)) continue;
            if (o == me) memcpy(x->zr + t * Dl, z + t * Dl, rb);
            else {
                memcpy(x->zr + t * Dl, rp, rb);
                rp += Dl;
            }
        }
    }
    return x->zr;
}

void k3_ep_combine(k3_ctx *ctx) {
    k3_exchange_scratch *x = ctx->xs;
    const int E = ctx->ep, me = ctx->ep_rank, K = ctx->c->n_experts_per_tok;
    const int64_t T = ctx->T, Dl = ctx->c->expert_dim;
    const size_t rb = sizeof(float) * (size_t)Dl;
    float *sp = x->sendb;
    for (int o = 0; o < E; o++) {
        x->sc[o] = x->rc[o] = 0;
        if (o == me) continue;
        /* to source o: my experts' results for its rows, in (row, slot) order */
        for (int64_t t = o; t < T; t += E)
            for (int r = 0; r < K; r++)
                if (owner(ctx, ctx->s.rids[t * K + r]) == me) {
                    memcpy(sp, ctx->s.ly + (t * K + r) * Dl, rb);
                    sp += Dl;
                    x->sc[o] += (int)rb;
                }
        /* from owner o: its results for my rows */
        for (int64_t t = me; t < T; t += E)
            for (int r = 0; r < K; r++)
                if (owner(ctx, ctx->s.rids[t * K + r]) == o) x->rc[o] += (int)rb;
    }
    displs(x->sc, x->sd, E);
    displs(x->rc, x->rd, E);
    k3_comm_alltoallv(ctx->dist, K3_GROUP_EP, K3_COMM_EP_COMBINE, x->sendb, x->sc, x->sd, x->recvb, x->rc, x->rd);
    for (int o = 0; o < E; o++) {
        if (o == me) continue;
        const float *rp = x->recvb + x->rd[o] / (int)sizeof(float);
        for (int64_t t = me; t < T; t += E)
            for (int r = 0; r < K; r++)
                if (owner(ctx, ctx->s.rids[t * K + r]) == o) {
                    memcpy(ctx->s.ly + (t * K + r) * Dl, rp, rb);
                    rp += Dl;
                }
    }
}

void k3_ep_gather(k3_ctx *ctx, float *comb) {
    k3_exchange_scratch *x = ctx->xs;
    const int E = ctx->ep, me = ctx->ep_rank;
    const int64_t T = ctx->T, Dl = ctx->c->expert_dim;
    const size_t rb = sizeof(float) * (size_t)Dl;
    float *sp = x->sendb;
    int mine = 0;
    for (int64_t t = me; t < T; t += E) {
        memcpy(sp, comb + t * Dl, rb);
        sp += Dl;
        mine++;
    }
    for (int o = 0; o < E; o++) {
        x->sc[o] = o == me ? 0 : mine * (int)rb;
        x->sd[o] = 0; /* the same rows to everyone */
        int theirs = 0;
        for (int64_t t = o; t < T; t += E) theirs++;
        x->rc[o] = o == me ? 0 : theirs * (int)rb;
    }
    displs(x->rc, x->rd, E);
    k3_comm_alltoallv(ctx->dist, K3_GROUP_EP, K3_COMM_EP_COMBINE, x->sendb, x->sc, x->sd, x->recvb, x->rc, x->rd);
    for (int o = 0; o < E; o++) {
        if (o == me) continue;
        const float *rp = x->recvb + x->rd[o] / (int)sizeof(float);
        for (int64_t t = o; t < T; t += E) {
            memcpy(comb + t * Dl, rp, rb);
            rp += Dl;
        }
    }
}
