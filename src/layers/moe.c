/*
 * moe.c -- the latent MoE layer (docs/model.md §3.5): the router, the latent
 * down-projection (stacked with the shared experts' gate and up when the
 * loader could), the routed experts, their combine in slot order, the
 * latent norm and up-projection, and the shared experts. Under EP each rank
 * runs its own experts (moe_ep.c).
 */
#include <string.h>

#include "common/pool.h"
#include "kernels/router.h"
#include "layers/layers.h"

typedef struct {
    k3_ctx *ctx;
    const k3_layer *L;
    const float *z;   /* [T, Dl] expert inputs */
    int32_t na;       /* items [0, na): the active experts (s.eact) */
    int32_t sh_parts; /* items [na, na + sh_parts): row slices of the shared down-projection (few tokens) */
    int64_t T;        /* tokens of the pass */
} expert_job;

/* Tokens of a pass whose shared down-projection runs as row slices among
 * the routed experts' items: a decode step and a verify chunk (below the
 * tiles' 16 rows, where a slice is the whole product's kernel on fewer
 * rows, each output the same bits). */
enum { SH_JOIN_MAX = 15 };

/* Expert e over the rows routed to it: gather, w1/w3, act, w2, scatter to s.ly. */
static void run_expert(const expert_job *j, int e, k3_pool *pool, int ith) {
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    const k3_layer *L = j->L;
    k3_scratch *s = &ctx->s;
    const int64_t Dl = c->expert_dim;
    const int K = c->n_experts_per_tok;
    const int32_t r0 = s->ecount[e], ne = s->ecount[e + 1] - r0;
    float *g = s->tgather[ith], *f1 = s->tf1[ith], *f2 = s->tf2[ith], *lo = s->tlout[ith];
    for (int32_t r = 0; r < ne; r++)
        memcpy(g + (int64_t)r * Dl, j->z + (int64_t)(s->erows[r0 + r] / K) * Dl, sizeof(float) * (size_t)Dl);
    k3_matmul(pool, &L->exp_gate[e], g, ne, f1);
    k3_matmul(pool, &L->exp_up[e], g, ne, f2);
    k3_layer_glu(c, f1, f2, (int64_t)ne * L->exp_gate[e].rows);
    k3_matmul(pool, &L->exp_down[e], f1, ne, lo);
    for (int32_t r = 0; r < ne; r++)
        memcpy(s->ly + (int64_t)s->erows[r0 + r] * Dl, lo + (int64_t)r * Dl, sizeof(float) * (size_t)Dl);
}

static void expert_items(void *p, int64_t lo, int64_t hi, int ith) {
    const expert_job *j = p;
    for (int64_t a = lo; a < hi; a++) {
        if (a < j->na) {
            run_expert(j, j->ctx->s.eact[a], NULL, ith);
            continue;
        }
        /* rows [r0, r1) of the shared experts' down-projection, in whole
         * tiles of its type (the BF16 strips: 16 rows); with several tokens
         * through the thread's scratch into their columns of s.tmp */
        k3_scratch *s = &j->ctx->s;
        const k3_mat *w = &j->L->sh_down;
        const int64_t u = k3_wtype_info(w->type)->tile_rows, nu = w->rows / u, q = a - j->na;
        const int64_t r0 = nu * q / j->sh_parts * u,
                      r1 = q + 1 == j->sh_parts ? w->rows : nu * (q + 1) / j->sh_parts * u, nr = r1 - r0;
        const k3_mat rows = k3_mat_rows(w, r0, nr);
        if (j->T == 1) {
            k3_matmul(NULL, &rows, s->f1, 1, s->tmp + r0);
            continue;
        }
        float *y = s->tlout[ith];
        k3_matmul(NULL, &rows, s->f1, j->T, y);
        for (int64_t t = 0; t < j->T; t++) memcpy(s->tmp + t * w->rows + r0, y + t * nr, sizeof(float) * (size_t)nr);
    }
}

void k3_moe_layer(k3_ctx *ctx, const k3_layer *L, const float *yn, float *out) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T, D = c->hidden_size, Dl = c->expert_dim;
    const int E = c->n_experts, K = c->n_experts_per_tok;
    k3_scratch *s = &ctx->s;

    const double t_moe = ctx->prof_on ? k3_now() : 0.0;
    k3_matmul(ctx->pool, &L->router, yn, T, s->rlog);
    const k3_router_cfg rc =
        {E, K, c->router_sigmoid, c->moe_renormalize, c->routed_scaling, c->n_expert_groups, c->topk_groups};
    for (int64_t t = 0; t < T; t++)
        k3_router_select(&rc, s->rlog + t * E, L->router_bias, s->rids + t * K, s->rw + t * K, s->rwork);

    const float *z = yn;
    const int64_t S = c->n_shared_experts * c->moe_intermediate;
    if (L->moe_in.data) {
        /* one pass over the input for the latent projection and the shared
         * experts' gate and up; their GLU now, their down after the experts */
        const int64_t R = L->moe_in.rows;
        k3_matmul(ctx->pool, &L->moe_in, yn, T, s->fused);
        for (int64_t t = 0; t < T; t++) {
            float *row = s->fused + t * R;
            memcpy(s->lat + t * Dl, row, sizeof(float) * (size_t)Dl);
            k3_layer_glu(c, row + Dl, row + Dl + S, S);
            memcpy(s->f1 + t * S, row + Dl, sizeof(float) * (size_t)S);
        }
        z = s->lat;
    } else if (c->latent_moe) {
        k3_matmul(ctx->pool, &L->lat_down, yn, T, s->lat);
        z = s->lat;
    }
    if (ctx->ep > 1) z = k3_ep_dispatch(ctx, z); /* moe_ep.c */
    /* group the (token, slot) rows by expert: counting sort, token order kept */
    memset(s->ecount, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (int64_t i = 0; i < T * K; i++) s->ecount[s->rids[i] + 1]++;
    for (int e = 0; e < E; e++) s->ecount[e + 1] += s->ecount[e];
    for (int64_t i = 0; i < T * K; i++) s->erows[s->ecount[s->rids[i]]++] = (int32_t)i;
    for (int e = E; e > 0; e--) s->ecount[e] = s->ecount[e - 1];
    s->ecount[0] = 0;

    /* Many active experts (always, at K3's top-16 of 896): one expert per
     * item, each single-threaded, so a decode step costs one dispatch for all
     * experts. Few: one expert after the other, each matmul threaded. With
     * few tokens (a decode step, a verify chunk) the shared experts'
     * down-projection joins the job as small row slices after the experts:
     * they fill the end, where threads used to wait on the last expert
     * (~12 us per layer at one token, ~40 us at a verify chunk's 1-2 rows an
     * expert), and save its dispatch. */
    int32_t na = 0;
    for (int e = 0; e < E; e++)
        if (s->ecount[e + 1] > s->ecount[e] && k3_ep_owns(ctx, e)) s->eact[na++] = e;
    if (ctx->prof_on) {
        ctx->prof_moe[0]++;
        ctx->prof_moe[1] += na;
        ctx->prof_moe[2] += s->ecount[E];
    }
    expert_job ej = {ctx, L, z, na, 0, T};
    const k3_glu_kind kind = c->act == K3_ACT_SITU ? K3_GLU_SITU : K3_GLU_SWIGLU;
    if (k3_moe_experts(ctx->pool, L->exp_gate, L->exp_up, L->exp_down, s->eact, na, s->ecount, s->erows, K, z, Dl,
                       s->ly, Dl, kind, c->situ_beta, c->situ_linear_beta)) {
        /* every active expert in one grouped product a phase (AMX), the
         * same bits as one after the other */
    } else if (ctx->nth > 1 && na >= 2 * ctx->nth) {
        if (L->moe_in.data && T <= SH_JOIN_MAX) {
            /* slices of at most a thread's expert scratch (s.tlout, T x Dl) */
            const int64_t u = k3_wtype_info(L->sh_down.type)->tile_rows, nu = L->sh_down.rows / u;
            int32_t parts = 4 * ctx->nth;
            while (T > 1 && parts < nu && (nu / parts + 2) * u > Dl) parts *= 2;
            if (T == 1 || (nu / parts + 2) * u <= Dl) ej.sh_parts = parts;
        }
        k3_pool_for(ctx->pool, na + ej.sh_parts, 1, expert_items, &ej);
    } else {
        for (int32_t a = 0; a < na; a++) run_expert(&ej, s->eact[a], ctx->pool, 0);
    }
    if (ctx->ep > 1) k3_ep_combine(ctx);
    /* combine in slot order (fp32), then latent norm and up-projection */
    float *comb = s->lout;
    for (int64_t t = 0; t < T; t++) {
        float *y = comb + t * Dl;
        memset(y, 0, sizeof(float) * (size_t)Dl);
        for (int r = 0; r < K; r++) k3_axpy(y, s->rw[t * K + r], s->ly + (t * K + r) * Dl, Dl);
        if (c->latent_moe && c->latent_moe_norm) k3_rmsnorm(y, y, L->lat_norm, Dl, c->rms_eps);
    }
    if (ctx->ep > 1) k3_ep_gather(ctx, comb);
    if (c->latent_moe) k3_matmul(ctx->pool, &L->lat_up, comb, T, out);
    else memcpy(out, comb, sizeof(float) * (size_t)(T * D));
    if (ctx->prof_on) ctx->prof[K3_PROF_MOE] += k3_now() - t_moe;

    if (L->moe_in.data) {
        if (!ej.sh_parts) PROF(ctx, K3_PROF_FFN, k3_matmul(ctx->pool, &L->sh_down, s->f1, T, s->tmp));
        for (int64_t i = 0; i < T * D; i++) out[i] += s->tmp[i];
    } else if (c->n_shared_experts > 0) {
        PROF(ctx, K3_PROF_FFN, k3_ffn_dense(ctx, &L->sh_gu, &L->sh_gate, &L->sh_up, &L->sh_down, yn, T, s->tmp));
        for (int64_t i = 0; i < T * D; i++) out[i] += s->tmp[i];
    }
}
