/*
 * mla.c -- the MLA/DSA layer (docs/model.md §3.4): MLAPO (everything that
 * reads the layer input, and the cache writes), then for a DSA layer QLI
 * (indexer scores and the exact top-k), then attention over the selected
 * (or all) cached slots, W_UV, the output gate and o_proj. The primitives
 * are kernels/mla.h and kernels/attn_ops.h; under DCP the selection and the
 * attention are mla_dcp.c's.
 */
#include <math.h>
#include <string.h>

#include "common/pool.h"
#include "kernels/attn_ops.h"
#include "kernels/mla.h"
#include "layers/layers.h"

/* Slots of positions [a, b) of sequence seq (one process: a block's slots
 * are consecutive), one k3_ctx_slot per block. */
static void seq_slots(const k3_ctx *ctx, int32_t seq, int64_t a, int64_t b, int64_t *out) {
    const int64_t bs = ctx->block_size;
    for (int64_t p = a; p < b;) {
        const int64_t s0 = k3_ctx_slot(ctx, seq, p), e = (p / bs + 1) * bs < b ? (p / bs + 1) * bs : b;
        for (int64_t q = p; q < e; q++) *out++ = s0 + (q - p);
        p = e;
    }
}

/* DSA: indexer scores of row t over slots [a, b) of its past (QLI on the C8
 * cache), into sc[a..b) with the slots in slots[a..b). */
static void dsa_score_range(k3_ctx *ctx, int layer, int64_t t, int a, int b, int64_t *slots, float *sc) {
    const k3_config *c = ctx->c;
    const int HI = c->index_n_heads, dI = c->index_head_dim;
    const k3_span *sp = k3_span_of(ctx, t);
    seq_slots(ctx, sp->seq, a, b, slots + a);
    if (ctx->kv == K3_KV_C8)
        k3_qli_scores(ctx->s.iq8 + t * HI * dI, ctx->s.iqs + t * HI, ctx->s.iw + t * HI, HI, dI, ctx->idx8[layer],
                      ctx->idx_s[layer], slots + a, b - a, sc + a);
    else
        k3_indexer_scores(ctx->s.iq + t * HI * dI, ctx->s.iw + t * HI, HI, dI, ctx->idx_cache[layer], slots + a, b - a,
                          sc + a);
}

static int row_len(const k3_ctx *ctx, int64_t t) {
    const k3_span *sp = k3_span_of(ctx, t);
    return (int)(sp->pos0 + (t - sp->t0) + 1);
}

/* the exact top-k of row t's scores, stored as cache slots in s.isel [T, topk] */
static void dsa_pick(k3_ctx *ctx, int64_t t, int n, const int64_t *slots, const float *sc, int ith) {
    const int topk = ctx->c->index_topk;
    int32_t *sel = ctx->s.tsel[ith];
    const int k = k3_topk(sc, n, topk, sel, ctx->s.twork[ith]);
    int64_t *dst = ctx->s.isel + t * topk;
    for (int i = 0; i < k; i++) dst[i] = slots[sel[i]];
    ctx->s.icount[t] = k;
}

/* Many rows (prefill): one row per item, in the thread's own buffers. */
static void dsa_select_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const k3_layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    for (int64_t t = lo; t < hi; t++) {
        const int n = row_len(ctx, t);
        dsa_score_range(ctx, j->layer, t, 0, n, ctx->s.tslots[ith], ctx->s.tscore[ith]);
        dsa_pick(ctx, t, n, ctx->s.tslots[ith], ctx->s.tscore[ith], ith);
    }
}

/* Few rows (decode, T < threads): the scores of row t are split over
 * `parts` items, written to the buffers of index t; then one top-k per row. */
static void dsa_score_parts(void *p, int64_t lo, int64_t hi, int ith) {
    const k3_layer_job *j = p;
    for (int64_t it = lo; it < hi; it++) {
        const int64_t t = it / j->parts;
        const int part = (int)(it % j->parts), n = row_len(j->ctx, t);
        const int a = (int)((int64_t)n * part / j->parts), b = (int)((int64_t)n * (part + 1) / j->parts);
        dsa_score_range(j->ctx, j->layer, t, a, b, j->ctx->s.tslots[t], j->ctx->s.tscore[t]);
    }
}

static void dsa_pick_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const k3_layer_job *j = p;
    for (int64_t t = lo; t < hi; t++)
        dsa_pick(j->ctx, t, row_len(j->ctx, t), j->ctx->s.tslots[t], j->ctx->s.tscore[t], ith);
}

/* Prefill with a chunk kernel (k3_qli_chunk, C8): the rows of a span of
 * several are scored together, in blocks whose scores fit s.iscore, over
 * the slots of the block's last (longest) row; each row's top-k reads only
 * its own range [0, row_len), so the selection is the per-row path's. The
 * rows of one-row spans take that path. */
typedef struct dsa_block_job {
    k3_ctx *ctx;
    int64_t t0; /* the block's first row */
    int64_t ld; /* its scores' row stride: the longest row's slots */
} dsa_block_job;

static void dsa_pick_block(void *p, int64_t lo, int64_t hi, int ith) {
    const dsa_block_job *j = p;
    for (int64_t r = lo; r < hi; r++)
        dsa_pick(j->ctx, j->t0 + r, row_len(j->ctx, j->t0 + r), j->ctx->s.islots, j->ctx->s.iscore + r * j->ld, ith);
}

static void dsa_select_single(void *p, int64_t lo, int64_t hi, int ith) {
    const k3_layer_job *j = p;
    for (int64_t t = lo; t < hi; t++)
        if (k3_span_of(j->ctx, t)->n < 2) dsa_select_rows(p, t, t + 1, ith);
}

static void dsa_select_chunks(k3_ctx *ctx, const k3_layer *L, int layer) {
    const k3_config *c = ctx->c;
    const int HI = c->index_n_heads, dI = c->index_head_dim;
    bool single = false;
    for (int i = 0; i < ctx->n_spans; i++) {
        const k3_span *sp = &ctx->spans[i];
        if (sp->n < 2) {
            single = true;
            continue;
        }
        const int64_t last = row_len(ctx, sp->t0 + sp->n - 1);
        int64_t rows = ctx->s.iscore_n / last;
        if (rows < 1) rows = 1; /* s.iscore holds max_ctx scores at least */
        for (int64_t t0 = sp->t0; t0 < sp->t0 + sp->n; t0 += rows) {
            const int64_t nr = sp->t0 + sp->n - t0 < rows ? sp->t0 + sp->n - t0 : rows, n = row_len(ctx, t0 + nr - 1);
            seq_slots(ctx, sp->seq, 0, n, ctx->s.islots);
            k3_qli_chunk(ctx->pool, ctx->s.iq8 + t0 * HI * dI, ctx->s.iqs + t0 * HI, ctx->s.iw + t0 * HI, nr, HI, dI,
                         ctx->idx8[layer], ctx->idx_s[layer], ctx->s.islots, n, ctx->s.iscore, n);
            dsa_block_job b = {ctx, t0, n};
            k3_pool_for(ctx->pool, nr, 1, dsa_pick_block, &b);
        }
    }
    if (single) {
        k3_layer_job j = {ctx, L, layer, 1, 1};
        k3_pool_for(ctx->pool, ctx->T, 1, dsa_select_single, &j);
    }
}

static void dsa_select(k3_ctx *ctx, const k3_layer *L, int layer) {
    const int64_t T = ctx->T;
    if (T >= ctx->nth && ctx->kv == K3_KV_C8 && ctx->s.iscore &&
        k3_qli_chunk_fits(ctx->c->index_n_heads, ctx->c->index_head_dim)) {
        dsa_select_chunks(ctx, L, layer);
        return;
    }
    if (T >= ctx->nth) {
        k3_layer_job j = {ctx, L, layer, 1, 1};
        k3_pool_for(ctx->pool, T, 1, dsa_select_rows, &j);
        return;
    }
    int longest = 0;
    for (int64_t t = 0; t < T; t++) longest = row_len(ctx, t) > longest ? row_len(ctx, t) : longest;
    int parts = (int)(2 * ctx->nth / T);
    if (parts > longest / 1024) parts = longest / 1024;
    k3_layer_job j = {ctx, L, layer, parts < 1 ? 1 : parts, 1};
    k3_pool_for(ctx->pool, T * j.parts, 1, dsa_score_parts, &j);
    k3_pool_for(ctx->pool, T, 1, dsa_pick_rows, &j);
}

/* Attention for (part, head group) items of a wave of rows (mla_attend_local):
 * part p of the wave is part p - rfirst[t] of row t = prow[p], a contiguous
 * share of the row's slots; each group a contiguous share of the heads (the
 * heads are independent, so the split changes no result). A row of one part
 * goes straight to ĉ, the parts of a split row to the partials that
 * mla_merge_rows combines by log-sum-exp. */
static void mla_attend_items(void *p, int64_t lo, int64_t hi, int ith) {
    const k3_layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    const int H = c->n_heads, nope = c->qk_nope_dim, rope = c->qk_rope_dim, kvl = c->kv_lora_rank;
    const int64_t T = ctx->T, ld = kvl + rope, qh = nope + rope;
    const float scale = 1.0f / sqrtf((float)(nope + rope));
    const k3_scratch *s = &ctx->s;
    for (int64_t it = lo; it < hi; it++) {
        const int64_t tp = it / j->hg; /* the part in the wave */
        const int g = (int)(it % j->hg), h0 = H * g / j->hg, nh = H * (g + 1) / j->hg - h0;
        const int64_t t = s->prow[tp];
        const int parts = s->rparts[t], part = (int)(tp - s->rfirst[t]);
        const int64_t *all;
        int n;
        if (j->L->kind == K3_LAYER_DSA && !ctx->dense) {
            all = ctx->s.isel + t * c->index_topk;
            n = ctx->s.icount[t];
        } else {
            const k3_span *sp = k3_span_of(ctx, t);
            n = (int)(sp->pos0 + (t - sp->t0) + 1);
            all = NULL;
        }
        const int a = (int)((int64_t)n * part / parts), b = (int)((int64_t)n * (part + 1) / parts);
        const int64_t *slots = all ? all + a : NULL;
        if (!slots) {
            const k3_span *sp = k3_span_of(ctx, t);
            int64_t *sl = ctx->s.tslots[ith];
            seq_slots(ctx, sp->seq, a, b, sl);
            slots = sl;
        }
        /* this row's absorbed query, heads [h0, h0+nh): [nh, kvl] then [nh, rope] */
        float *qa = ctx->s.tq[ith], *qpe = qa + (int64_t)nh * kvl;
        for (int h = 0; h < nh; h++) {
            memcpy(qa + (int64_t)h * kvl, ctx->s.qa + ((int64_t)(h0 + h) * T + t) * kvl, sizeof(float) * (size_t)kvl);
            memcpy(qpe + (int64_t)h * rope, ctx->s.mq + t * H * qh + (h0 + h) * qh + nope,
                   sizeof(float) * (size_t)rope);
        }
        float *out, *lse, lse_buf[K3_MAX_HEADS]; /* nh <= n_heads <= K3_MAX_HEADS (config.c) */
        if (parts > 1) {
            out = ctx->s.part_o + tp * H * kvl + (int64_t)h0 * kvl;
            lse = ctx->s.part_l + tp * H + h0;
        } else {
            out = ctx->s.part_o + ((int64_t)s->n_parts + ith) * H * kvl;
            lse = lse_buf;
        }
        if (ctx->kv == K3_KV_C8) {
            const k3_c8_cache cc = k3_mla_c8_view(ctx, j->layer);
            k3_qsfa(qa, qpe, nh, &cc, slots, b - a, scale, out, lse, ctx->s.tqsfa[ith]);
        } else {
            for (int h = 0; h < nh; h++)
                lse[h] = b > a
                    ? k3_mla_attend(qa + (int64_t)h * kvl, qpe + (int64_t)h * rope, kvl, rope, ctx->lat_cache[j->layer],
                                    ld, slots, b - a, scale, ctx->s.tscore[ith], out + (int64_t)h * kvl)
                    : -INFINITY;
        }
        if (parts == 1)
            for (int h = 0; h < nh; h++)
                memcpy(ctx->s.chat + ((int64_t)(h0 + h) * T + t) * kvl, out + (int64_t)h * kvl,
                       sizeof(float) * (size_t)kvl);
    }
}

typedef struct {
    k3_ctx *ctx;
    int64_t r0; /* the wave's first row */
} merge_job;

/* Rows r0 + [lo, hi) of a wave: each split row's parts merged by
 * log-sum-exp into ĉ. */
static void mla_merge_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const merge_job *j = p;
    k3_ctx *ctx = j->ctx;
    const int H = ctx->c->n_heads, kvl = ctx->c->kv_lora_rank;
    const int64_t T = ctx->T;
    const k3_scratch *s = &ctx->s;
    for (int64_t t = j->r0 + lo; t < j->r0 + hi; t++) {
        const int parts = s->rparts[t];
        if (parts < 2) continue;
        const float *o[K3_ATTN_PARTS_MAX], *l[K3_ATTN_PARTS_MAX];
        for (int q = 0; q < parts; q++) {
            o[q] = ctx->s.part_o + ((int64_t)s->rfirst[t] + q) * H * kvl;
            l[q] = ctx->s.part_l + ((int64_t)s->rfirst[t] + q) * H;
        }
        float *out = ctx->s.tq[ith], lse[K3_MAX_HEADS];
        k3_lse_merge(o, l, parts, H, kvl, out, lse);
        for (int h = 0; h < H; h++)
            memcpy(ctx->s.chat + ((int64_t)h * T + t) * kvl, out + (int64_t)h * kvl, sizeof(float) * (size_t)kvl);
    }
}

/* LayerNorm(x; w, b, eps 1e-6), fp32 */
static void layernorm(float *x, const float *w, const float *b, int n) {
    double mean = 0.0, var = 0.0;
    for (int d = 0; d < n; d++) mean += x[d];
    mean /= n;
    for (int d = 0; d < n; d++) var += (x[d] - mean) * (x[d] - mean);
    var /= n;
    const float r = (float)(1.0 / sqrt(var + 1e-6));
    for (int d = 0; d < n; d++) x[d] = (float)(x[d] - mean) * r * w[d] + b[d];
}

/* qa_h = W_UK_hᵀ q_nope_h for heads [lo, hi), each product on this thread */
static void absorb_items(void *p, int64_t lo, int64_t hi, int ith) {
    const k3_layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const int64_t T = ctx->T, kvl = ctx->c->kv_lora_rank, nope = ctx->c->qk_nope_dim;
    for (int64_t h = lo; h < hi; h++) {
        const k3_mat wuk = k3_mat_rows(&j->L->wuk, h * kvl, kvl);
        k3_matmul(NULL, &wuk, ctx->s.qn + h * T * nope, T, ctx->s.qa + h * T * kvl);
    }
}

/* o_h = W_UV_h ĉ_h for heads [lo, hi), into their columns of s.mo */
static void value_items(void *p, int64_t lo, int64_t hi, int ith) {
    const k3_layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T, H = c->n_heads, kvl = c->kv_lora_rank, nope = c->qk_nope_dim, vd = c->v_head_dim;
    k3_scratch *s = &ctx->s;
    for (int64_t h = lo; h < hi; h++) {
        const k3_mat wuv = k3_mat_rows(&j->L->kv_b, h * (nope + vd) + nope, vd);
        k3_matmul(NULL, &wuv, s->chat + h * T * kvl, T, s->mtmp + h * T * vd);
        for (int64_t t = 0; t < T; t++)
            memcpy(s->mo + t * H * vd + h * vd, s->mtmp + (h * T + t) * vd, sizeof(float) * (size_t)vd);
    }
}

/* MLAPO: everything from the normed hidden state to the attention inputs, in
 * one pass per round: the q latent cq (which the indexer reuses), the
 * absorbed query qa = W_UKᵀ q_nope per head, q_pe, and the writes of the
 * latent (c, kpe) and the indexer key into their cache slots -- quantized
 * (per-128-tile int8; Hadamard + per-token int8 for the indexer) when the
 * cache is C8. */
static void mlapo(k3_ctx *ctx, const k3_layer *L, int layer, const float *xn) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T;
    const int H = c->n_heads, nope = c->qk_nope_dim, rope = c->qk_rope_dim, kvl = c->kv_lora_rank;
    const int64_t qh = nope + rope, ld = kvl + rope;
    k3_scratch *s = &ctx->s;
    const bool c8 = ctx->kv == K3_KV_C8;

    /* the down-projections that read x: one fused matmul when the loader
     * could stack them (L->mla_down), else one each */
    const int HI = c->index_n_heads, dI = c->index_head_dim;
    const bool dsa = L->kind == K3_LAYER_DSA;
    if (L->mla_down.data) {
        const int64_t R = L->mla_down.rows, ql = c->q_lora_rank;
        k3_matmul(ctx->pool, &L->mla_down, xn, T, s->fused);
        for (int64_t t = 0; t < T; t++) {
            const float *row = s->fused + t * R;
            memcpy(s->cq + t * ql, row, sizeof(float) * (size_t)ql);
            memcpy(s->ckv + t * ld, row + ql, sizeof(float) * (size_t)ld);
            if (dsa) {
                memcpy(s->ik + t * dI, row + ql + ld, sizeof(float) * (size_t)dI);
                memcpy(s->iw + t * HI, row + ql + ld + dI, sizeof(float) * (size_t)HI);
            }
        }
    } else {
        if (c->q_lora_rank > 0) k3_matmul(ctx->pool, &L->q_a, xn, T, s->cq);
        k3_matmul(ctx->pool, &L->kv_a, xn, T, s->ckv);
        if (dsa) {
            k3_matmul(ctx->pool, &L->idx_wk, xn, T, s->ik);
            k3_matmul(ctx->pool, &L->idx_weights, xn, T, s->iw);
        }
    }
    if (c->q_lora_rank > 0) {
        k3_rmsnorm_rows(ctx, s->cq, c->q_lora_rank, s->cq, c->q_lora_rank, L->q_a_norm, c->q_lora_rank, 1e-6f);
        k3_matmul(ctx->pool, &L->q_b, s->cq, T, s->mq);
    } else {
        k3_matmul(ctx->pool, &L->q_b, xn, T, s->mq);
    }
    k3_rmsnorm_rows(ctx, s->ckv, ld, s->ckv, ld, L->kv_a_norm, kvl, 1e-6f);
    for (int32_t i = 0; i < ctx->n_spans; i++) {
        const k3_span *sp = &ctx->spans[i];
        for (int32_t r = 0; r < sp->n; r++) {
            const int64_t slot = k3_ctx_own_slot(ctx, sp->seq, sp->pos0 + r);
            if (slot < 0) continue; /* another DCP rank caches it */
            const float *row = s->ckv + (int64_t)(sp->t0 + r) * ld;
            if (c8) {
                k3_quant_i8_tiles(row, kvl, ctx->lat8[layer] + slot * kvl, ctx->lat_s[layer] + slot * ctx->n_tiles);
                memcpy(ctx->lat_r[layer] + slot * rope, row + kvl, sizeof(float) * (size_t)rope);
            } else {
                memcpy(ctx->lat_cache[layer] + slot * ld, row, sizeof(float) * (size_t)ld);
            }
        }
    }

    if (dsa) {
        k3_matmul(ctx->pool, &L->idx_wq_b, s->cq, T, s->iq);
        const float wscale = 1.0f / sqrtf((float)HI) / sqrtf((float)dI);
        for (int64_t t = 0; t < T; t++) {
            layernorm(s->ik + t * dI, L->idx_k_norm_w, L->idx_k_norm_b, dI);
            for (int h = 0; h < HI; h++) s->iw[t * HI + h] *= wscale;
            if (c8) {
                /* rotate (orthonormal: fp32 scores unchanged) to spread
                 * outliers before the per-token / per-head int8 */
                k3_hadamard(s->ik + t * dI, dI);
                for (int h = 0; h < HI; h++) {
                    float *q = s->iq + (t * HI + h) * dI;
                    k3_hadamard(q, dI);
                    s->iqs[t * HI + h] = k3_quant_i8(q, dI, s->iq8 + (t * HI + h) * dI);
                }
            }
        }
        for (int32_t i = 0; i < ctx->n_spans; i++) {
            const k3_span *sp = &ctx->spans[i];
            for (int32_t r = 0; r < sp->n; r++) {
                const int64_t slot = k3_ctx_own_slot(ctx, sp->seq, sp->pos0 + r);
                if (slot < 0) continue;
                const float *k = s->ik + (int64_t)(sp->t0 + r) * dI;
                if (c8) ctx->idx_s[layer][slot] = k3_quant_i8(k, dI, ctx->idx8[layer] + slot * dI);
                else memcpy(ctx->idx_cache[layer] + slot * dI, k, sizeof(float) * (size_t)dI);
            }
        }
    }

    /* absorbed query per head: qa_h = W_UK_hᵀ q_nope_h, a head per pool item */
    for (int h = 0; h < H; h++) {
        float *qn = s->qn + (int64_t)h * T * nope;
        for (int64_t t = 0; t < T; t++)
            memcpy(qn + t * nope, s->mq + t * H * qh + h * qh, sizeof(float) * (size_t)nope);
    }
    k3_layer_job j = {ctx, L, layer, 1, 1};
    k3_pool_for(ctx->pool, H, 1, absorb_items, &j);
}

static void mla_attend_local(k3_ctx *ctx, const k3_layer *L, int layer);

void k3_mla_layer(k3_ctx *ctx, const k3_layer *L, int layer, const float *xn, float *out) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T;
    const int H = c->n_heads;
    const int vd = c->v_head_dim;
    k3_scratch *s = &ctx->s;

    PROF(ctx, K3_PROF_MLAPO, mlapo(ctx, L, layer, xn));
    k3_layer_job aj = {ctx, L, layer, 1, 1};
    if (ctx->dcp > 1) PROF(ctx, K3_PROF_QSFA, k3_mla_dcp_attention(ctx, L, layer)); /* mla_dcp.c */
    else mla_attend_local(ctx, L, layer);
    const double t_out = ctx->prof_on ? k3_now() : 0.0;

    /* o_h = W_UV_h ĉ_h (a head per pool item), gated, then o_proj */
    k3_pool_for(ctx->pool, H, 1, value_items, &aj);
    if (c->mla_use_output_gate) {
        k3_matmul(ctx->pool, &L->g_proj, xn, T, s->mgate);
        k3_glu(s->mo, s->mgate, T * H * vd, K3_GLU_GATE, 1.0f, 0.0f);
    }
    k3_matmul(ctx->pool, &L->o_proj, s->mo, T, out);
    if (ctx->prof_on) ctx->prof[K3_PROF_MLA_OUT] += k3_now() - t_out;
}

/* Attention of one process: the DSA selection, then each row over its
 * (selected) slots, into s.chat. A row over many slots is split into parts
 * by its own slot count (ctx.h, K3_ATTN_PARTS_MAX), whatever else the round
 * holds; the rows go in waves whose parts fit the partials, each wave one
 * pass over (part, head group) items and one merge of its split rows. */
static void attend_waves(k3_ctx *ctx, const k3_layer *L, int layer, bool dsa) {
    const int64_t T = ctx->T;
    const int H = ctx->c->n_heads;
    k3_scratch *s = &ctx->s;
    const int cap = 2 * ctx->nth < K3_ATTN_PARTS_MAX ? 2 * ctx->nth : K3_ATTN_PARTS_MAX;
    for (int64_t r0 = 0; r0 < T;) {
        int32_t np = 0;
        int64_t r1 = r0;
        for (; r1 < T; r1++) {
            const int64_t n = dsa ? s->icount[r1] : row_len(ctx, r1);
            int parts = (int)(n / K3_ATTN_PART_KEYS);
            parts = parts < 1 ? 1 : parts > cap ? cap : parts;
            if (np + parts > s->n_parts) break;
            s->rparts[r1] = parts;
            s->rfirst[r1] = np;
            for (int q = 0; q < parts; q++) s->prow[np + q] = (int32_t)r1;
            np += parts;
        }
        /* few items: split the heads too (nothing to merge) */
        int hg = np < 2 * ctx->nth ? (2 * ctx->nth + np - 1) / np : 1;
        if (hg > H) hg = H;
        /* QSFA's BF16 form: at least the model's qsfa_bf16_heads heads a call */
        if (ctx->kv == K3_KV_C8 && k3_qsfa_bf16_wanted(ctx->m->qsfa_bf16_heads, H) && hg > H / ctx->m->qsfa_bf16_heads)
            hg = H / ctx->m->qsfa_bf16_heads;
        k3_layer_job aj = {ctx, L, layer, 1, hg};
        k3_pool_for(ctx->pool, (int64_t)np * hg, 1, mla_attend_items, &aj);
        merge_job mj = {ctx, r0};
        if (np > r1 - r0) k3_pool_for(ctx->pool, r1 - r0, 1, mla_merge_rows, &mj);
        r0 = r1;
    }
}

static void mla_attend_local(k3_ctx *ctx, const k3_layer *L, int layer) {
    const bool dsa = L->kind == K3_LAYER_DSA && !ctx->dense;
    if (dsa) PROF(ctx, K3_PROF_QLI, dsa_select(ctx, L, layer));
    PROF(ctx, K3_PROF_QSFA, attend_waves(ctx, L, layer, dsa));
}
