/*
 * mla_dcp.c -- the MLA/DSA attention under decode context parallelism
 * (docs/serving-reference.md §2.5): the DCP form of the layer of mla.c.
 *
 * Every rank of a DCP group runs the same rows; each caches only the tokens
 * it owns, so each attends only over those. For a DSA layer a row's indexer
 * scores over the own keys give a local top-k of (score, global position);
 * k3_comm_topk_exchange settles the global top-k, the same on every rank and
 * the same tokens k3_topk picks in one process; each rank attends over the
 * winners it owns. A dense layer attends over the whole own shard. Each rank
 * then has, per row and head, a partial output over a disjoint set of
 * tokens and its log-sum-exp; the ranks all-gather them and every rank
 * merges them in rank order with k3_lse_merge (the merge the thread split
 * of mla.c uses), so the result is identical on all ranks. A rank that
 * owns no winner contributes lse = -inf, weight 0.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/error.h"
#include "common/pool.h"
#include "kernels/attn_ops.h"
#include "kernels/mla.h"
#include "layers/layers.h"

k3_status k3_layers_failed(const k3_ctx *ctx, k3_error *err) {
    /* the DCP and the EP exchanges share one sticky failure: the dist's */
    return k3_comm_failed(ctx->dist, err);
}

/* ---- the attention --------------------------------------------------------- */

typedef struct {
    k3_ctx *ctx;
    const k3_layer *L;
    int layer;
    bool sparse; /* DSA selection on */
    int hg;      /* head groups per row */
} dcp_job;

/* slot of this rank's local index j of sequence seq (ctx.h) */
#define local_slot k3_ctx_local_slot

/* Rows that exchange: local indexer scores over the own keys, the local
 * top-k as candidates (sorted, padded to k). */
static void dcp_local_topk(void *p, int64_t lo, int64_t hi, int ith) {
    const dcp_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    k3_exchange_scratch *x = ctx->xs;
    const int HI = c->index_n_heads, dI = c->index_head_dim, k = c->index_topk;
    for (int64_t t = lo; t < hi; t++) {
        if (x->xrow[t] < 0) continue;
        const k3_span *sp = k3_span_of(ctx, t);
        const int64_t n = sp->pos0 + (t - sp->t0) + 1;
        const int nl = (int)k3_ctx_local_tokens(ctx, n);
        int64_t *slots = ctx->s.tslots[ith];
        float *sc = ctx->s.tscore[ith];
        for (int i = 0; i < nl; i++) slots[i] = local_slot(ctx, sp->seq, i);
        if (ctx->kv == K3_KV_C8)
            k3_qli_scores(ctx->s.iq8 + t * HI * dI, ctx->s.iqs + t * HI, ctx->s.iw + t * HI, HI, dI,
                          ctx->idx8[j->layer], ctx->idx_s[j->layer], slots, nl, sc);
        else
            k3_indexer_scores(ctx->s.iq + t * HI * dI, ctx->s.iw + t * HI, HI, dI, ctx->idx_cache[j->layer], slots, nl,
                              sc);
        int32_t *sel = ctx->s.tsel[ith];
        const int kk = k3_topk(sc, nl, k, sel, ctx->s.twork[ith]);
        k3_cand *cd = x->cand + (size_t)x->xrow[t] * k;
        for (int i = 0; i < kk; i++)
            cd[i] = (k3_cand){sc[sel[i]], (int32_t)k3_dcp_global(sel[i], ctx->dcp_rank, ctx->dcp, ctx->dcp_il)};
        k3_cand_sort(cd, kk);
        for (int i = kk; i < k; i++) cd[i] = (k3_cand){-INFINITY, -1};
    }
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The own winners of each sparse row, as slots in position order. */
static void dcp_winners(void *p, int64_t lo, int64_t hi, int ith) {
    const dcp_job *j = p;
    k3_ctx *ctx = j->ctx;
    k3_exchange_scratch *x = ctx->xs;
    const int k = ctx->c->index_topk, D = ctx->dcp, I = ctx->dcp_il, r = ctx->dcp_rank;
    for (int64_t t = lo; t < hi; t++) {
        const k3_span *sp = k3_span_of(ctx, t);
        int64_t *w = x->wslots + (size_t)t * k;
        int n = 0;
        if (x->xrow[t] < 0) { /* the row sees at most k tokens: all of them win */
            const int64_t nl = k3_ctx_local_tokens(ctx, sp->pos0 + (t - sp->t0) + 1);
            for (int64_t i = 0; i < nl; i++) w[n++] = local_slot(ctx, sp->seq, i);
        } else {
            const k3_cand *g = x->cand_out + (size_t)x->xrow[t] * k;
            const int64_t seen = sp->pos0 + (t - sp->t0) + 1; /* positions [0, seen) are valid */
            for (int i = 0; i < k; i++)
                if (g[i].pos >= 0 && g[i].pos < seen && k3_dcp_owner(g[i].pos, D, I) == r)
                    w[n++] = k3_dcp_local(g[i].pos, D, I);
            qsort(w, (size_t)n, sizeof *w, cmp_i64);
            for (int i = 0; i < n; i++) w[i] = local_slot(ctx, sp->seq, w[i]);
        }
        x->wcount[t] = n;
    }
    (void)ith;
}

/* (row, head group) items: attention over the row's own slots, into the
 * row's [o (H*kvl) | lse (H)] of x->att. */
static void dcp_attend(void *p, int64_t lo, int64_t hi, int ith) {
    const dcp_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    k3_exchange_scratch *x = ctx->xs;
    const int H = c->n_heads, nope = c->qk_nope_dim, rope = c->qk_rope_dim, kvl = c->kv_lora_rank;
    const int64_t T = ctx->T, ld = kvl + rope, qh = nope + rope, row = (int64_t)H * kvl + H;
    const float scale = 1.0f / sqrtf((float)(nope + rope));
    for (int64_t it = lo; it < hi; it++) {
        const int64_t t = it / j->hg;
        const int g = (int)(it % j->hg), h0 = H * g / j->hg, nh = H * (g + 1) / j->hg - h0;
        const int64_t *slots;
        int n;
        if (j->sparse) {
            slots = x->wslots + (size_t)t * c->index_topk;
            n = x->wcount[t];
        } else {
            const k3_span *sp = k3_span_of(ctx, t);
            n = (int)k3_ctx_local_tokens(ctx, sp->pos0 + (t - sp->t0) + 1);
            int64_t *sl = ctx->s.tslots[ith];
            for (int i = 0; i < n; i++) sl[i] = local_slot(ctx, sp->seq, i);
            slots = sl;
        }
        float *qa = ctx->s.tq[ith], *qpe = qa + (int64_t)nh * kvl;
        for (int h = 0; h < nh; h++) {
            memcpy(qa + (int64_t)h * kvl, ctx->s.qa + ((int64_t)(h0 + h) * T + t) * kvl, sizeof(float) * (size_t)kvl);
            memcpy(qpe + (int64_t)h * rope, ctx->s.mq + t * H * qh + (h0 + h) * qh + nope,
                   sizeof(float) * (size_t)rope);
        }
        float *out = x->att + t * row + (int64_t)h0 * kvl, *lse = x->att + t * row + (int64_t)H * kvl + h0;
        if (n == 0) {
            memset(out, 0, sizeof(float) * (size_t)nh * kvl);
            for (int h = 0; h < nh; h++) lse[h] = -INFINITY;
        } else if (ctx->kv == K3_KV_C8) {
            const k3_c8_cache cc = k3_mla_c8_view(ctx, j->layer);
            k3_qsfa(qa, qpe, nh, &cc, slots, n, scale, out, lse, ctx->s.tqsfa[ith]);
        } else {
            for (int h = 0; h < nh; h++)
                lse[h] =
                    k3_mla_attend(qa + (int64_t)h * kvl, qpe + (int64_t)h * rope, kvl, rope, ctx->lat_cache[j->layer],
                                  ld, slots, n, scale, ctx->s.tscore[ith], out + (int64_t)h * kvl);
        }
    }
}

/* Rows: the exact merge of the D partials, into s.chat [H, T, kvl]. */
static void dcp_merge(void *p, int64_t lo, int64_t hi, int ith) {
    const dcp_job *j = p;
    k3_ctx *ctx = j->ctx;
    const int H = ctx->c->n_heads, kvl = ctx->c->kv_lora_rank, D = ctx->dcp;
    const int64_t T = ctx->T, row = (int64_t)H * kvl + H;
    k3_exchange_scratch *x = ctx->xs;
    for (int64_t t = lo; t < hi; t++) {
        const float *o[64], *l[64];
        for (int q = 0; q < D; q++) {
            o[q] = x->att_all + ((int64_t)q * T + t) * row;
            l[q] = o[q] + (int64_t)H * kvl;
        }
        float *out = ctx->s.tq[ith], lse[1024];
        k3_lse_merge(o, l, D, H, kvl, out, lse);
        for (int h = 0; h < H; h++)
            memcpy(ctx->s.chat + ((int64_t)h * T + t) * kvl, out + (int64_t)h * kvl, sizeof(float) * (size_t)kvl);
    }
}

/* The merge split over heads (vLLM's "ag_rs"): rank q receives every rank's
 * partials of its H/D heads (all-to-all), merges them, and the merged heads
 * are all-gathered. Each head is merged once, on one rank, in rank order,
 * so every rank ends with the same result; a rank receives
 * (D-1)/D * H * (kv_lora + 1) + (D-1)/D * H * kv_lora floats per row,
 * instead of (D-1) * H * (kv_lora + 1) for gathering every partial. */
static void merge_by_heads(k3_ctx *ctx) {
    const k3_config *c = ctx->c;
    k3_exchange_scratch *x = ctx->xs;
    const int H = c->n_heads, kvl = c->kv_lora_rank, D = ctx->dcp, me = ctx->dcp_rank, hg = H / D;
    const int64_t T = ctx->T, row = (int64_t)H * kvl + H, part = (int64_t)hg * (kvl + 1);
    /* send: to rank q, per row, heads [q*hg, (q+1)*hg): o then lse */
    for (int q = 0; q < D; q++)
        for (int64_t t = 0; t < T; t++) {
            float *dst = x->att_send + ((int64_t)q * T + t) * part;
            const float *src = x->att + t * row;
            memcpy(dst, src + (int64_t)q * hg * kvl, sizeof(float) * (size_t)hg * kvl);
            memcpy(dst + (int64_t)hg * kvl, src + (int64_t)H * kvl + q * hg, sizeof(float) * (size_t)hg);
        }
    int cnt[64], dsp[64];
    for (int q = 0; q < D; q++) {
        cnt[q] = (int)(sizeof(float) * (size_t)(T * part));
        dsp[q] = q * cnt[q];
    }
    k3_comm_alltoallv(ctx->dist, K3_GROUP_DCP, K3_COMM_LSE, x->att_send, cnt, dsp, x->att_all, cnt, dsp);
    for (int64_t t = 0; t < T; t++) {
        const float *o[64], *l[64];
        for (int q = 0; q < D; q++) {
            o[q] = x->att_all + ((int64_t)q * T + t) * part;
            l[q] = o[q] + (int64_t)hg * kvl;
        }
        float lse[1024];
        k3_lse_merge(o, l, D, hg, kvl, x->att_mine + t * hg * kvl, lse);
    }
    (void)me;
    /* everyone's merged heads: [D][T][hg*kvl] */
    float *all = x->att_all + (int64_t)D * T * part;
    k3_comm_allgather(ctx->dist, K3_GROUP_DCP, K3_COMM_LSE, x->att_mine, sizeof(float) * (size_t)(T * hg * kvl), all);
    for (int q = 0; q < D; q++)
        for (int64_t t = 0; t < T; t++)
            for (int i = 0; i < hg; i++)
                memcpy(ctx->s.chat + ((int64_t)(q * hg + i) * T + t) * kvl, all + (((int64_t)q * T + t) * hg + i) * kvl,
                       sizeof(float) * (size_t)kvl);
}

/* QLI on the own keys and the local top-k, the exchange, the own winners. */
static void dcp_select(k3_ctx *ctx, dcp_job *j, int32_t nx) {
    k3_exchange_scratch *x = ctx->xs;
    const int k = ctx->c->index_topk;
    k3_pool_for(ctx->pool, ctx->T, 1, dcp_local_topk, j);
    if (nx && k3_comm_topk_exchange(ctx->dist, x->cand, nx, k, x->cand_out, x->cand_work))
        for (int64_t i = 0; i < (int64_t)nx * k; i++) /* failed (the error is sticky): no winners */
            x->cand_out[i] = (k3_cand){-INFINITY, -1};
    k3_pool_for(ctx->pool, ctx->T, 1, dcp_winners, j);
}

void k3_mla_dcp_attention(k3_ctx *ctx, const k3_layer *L, int layer) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T;
    const int H = c->n_heads;
    k3_exchange_scratch *x = ctx->xs;
    dcp_job j = {ctx, L, layer, L->kind == K3_LAYER_DSA && !ctx->dense, 1};
    if (T < ctx->nth) j.hg = 2 * ctx->nth < H ? 2 * ctx->nth : H;
    if (j.sparse) {
        const int k = c->index_topk;
        /* rows that see more than k tokens take part in the exchange; every
         * rank knows which (the lengths are replicated) */
        int32_t nx = 0;
        for (int64_t t = 0; t < T; t++) {
            const k3_span *sp = k3_span_of(ctx, t);
            x->xrow[t] = sp->pos0 + (t - sp->t0) + 1 > k ? nx++ : -1;
        }
        PROF(ctx, K3_PROF_QLI, dcp_select(ctx, &j, nx));
    }
    k3_pool_for(ctx->pool, T * j.hg, 1, dcp_attend, &j);
    if (H % ctx->dcp == 0) {
        merge_by_heads(ctx);
        return;
    }
    /* heads that do not split evenly: every rank gathers every partial */
    const size_t row = (size_t)H * c->kv_lora_rank + (size_t)H;
    k3_comm_allgather(ctx->dist, K3_GROUP_DCP, K3_COMM_LSE, x->att, sizeof(float) * row * (size_t)T, x->att_all);
    k3_pool_for(ctx->pool, T, 1, dcp_merge, &j);
}
