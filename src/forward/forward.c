/*
 * forward.c -- the layer loop of one forward round (k3-model.md §3).
 *
 * A round is T <= max_batch token rows drawn from one or more sequences
 * (spans). Everything that is per token (projections, norms, AttnRes, FFN,
 * MoE) runs over all T rows at once; what carries state across tokens (KDA
 * recurrence and conv windows, MLA/DSA caches) runs per span. All arithmetic
 * is fp32; weights are read in their stored format by the kernels.
 */
#include <math.h>
#include <string.h>

#include "kernels/attnres.h"
#include "kernels/kda.h"
#include "kernels/mla.h"
#include "common/pool.h"
#include "kernels/attn_ops.h"
#include "forward/forward.h"
#include "layers/layers.h"
#include "kernels/router.h"

/* ---- small row helpers ------------------------------------------------- */

/* out = w ⊙ x / sqrt(mean(x²) + eps), n values (out may alias x). The sum
 * of squares in double over four interleaved partial sums: one chain of
 * dependent adds cost ~2.5 us per 2048 values, a serial step of every layer
 * in decode. */
static void rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)x[i] * x[i];
        s1 += (double)x[i + 1] * x[i + 1];
        s2 += (double)x[i + 2] * x[i + 2];
        s3 += (double)x[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += (double)x[i] * x[i];
    const double ss = (s0 + s1) + (s2 + s3);
    const float r = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

typedef struct {
    float *out;
    const float *x;
    const float *w;
    int64_t n, ldo, ldx;
    float eps;
} rms_job;

static void rms_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const rms_job *j = p;
    for (int64_t t = lo; t < hi; t++) rmsnorm(j->out + t * j->ldo, j->x + t * j->ldx, j->w, j->n, j->eps);
}

static void rms_all(k3_ctx *ctx, float *out, int64_t ldo, const float *x, int64_t ldx,
                    const float *w, int64_t n, float eps) {
    rms_job j = {out, x, w, n, ldo, ldx, eps};
    k3_pool_for(ctx->pool, ctx->T, 8, rms_rows, &j);
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* f1 = act(f1, f2) over n values */
static void glu(const k3_config *c, float *f1, const float *f2, int64_t n) {
    k3_glu(f1, f2, n, c->act == K3_ACT_SITU ? K3_GLU_SITU : K3_GLU_SWIGLU, c->situ_beta, c->situ_linear_beta);
}

/* ---- AttnRes ------------------------------------------------------------ */

/* out[t] = Σ_e α_e V_e[t] with V = [bank_0 .. bank_{nb-1}, P], α = softmax of
 * the RMS-normalised projections on w (k3-model.md §3.2). */
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

static void attn_res_mix(k3_ctx *ctx, float *out, const float *P, const float *w, int nb) {
    mix_job j = {ctx, out, P, w, nb};
    k3_pool_for(ctx->pool, ctx->T, 4, mix_rows, &j);
}

/* ---- KDA layer ---------------------------------------------------------- */

/* The context of a pool job over one layer's rows or (row, part) items. */
typedef struct {
    k3_ctx *ctx;
    const k3_layer *L;
    int layer;
    int parts;          /* split jobs: parts per row */
    int hg;             /* attention: head groups per (row, part) item */
} layer_job;

/* The buffer to capture sequence seq's KDA state into at position pos, or
 * NULL (k3_ctx_capture_state). */
static float *capture_at(const k3_ctx *ctx, int32_t seq, int64_t pos) {
    for (int32_t i = 0; i < ctx->n_caps; i++)
        if (ctx->caps[i].seq == seq && ctx->caps[i].pos == pos) return ctx->caps[i].dst;
    return NULL;
}

/* The end (offset in the span) of the piece that starts at offset a: the
 * next block boundary, or the span's end. */
static int64_t piece_end(const k3_ctx *ctx, const k3_span *sp, int64_t a) {
    const int64_t bs = ctx->block_size, e = ((sp->pos0 + a) / bs + 1) * bs - sp->pos0;
    return e < sp->n ? e : sp->n;
}

/* Everything of one KDA head of one span after the projections, as one pool
 * item (items = spans x heads; a decode step spreads it evenly over the
 * threads): the short convs + SiLU of the head's q, k, v channels; L2 norms
 * of q and k, the decay gate and beta; the recurrence; the output norm and
 * gate. The convs and the recurrence go over the span in pieces that end on
 * the block grid, on every rank and whatever is captured (the recurrent
 * form gives the results of one go; the chunked one restarts its chunks at
 * each boundary; a piece takes the chunked form by its own length), so the
 * state at a block boundary inside a pass is the state of a pass that ends
 * there; where a piece ends at a captured position this head's conv windows
 * and S are copied out. */
static void kda_head_items(void *p, int64_t lo, int64_t hi, int ith) {
    const layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    const k3_layer *L = j->L;
    const int H = c->kda_heads, dk = c->kda_head_dim, dv = dk, K = c->conv_size;
    const int64_t HK = (int64_t)H * dk, nS = (int64_t)H * dk * dv, off = ctx->kda_snap_off[j->layer];
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int64_t it = lo; it < hi; it++) {
        const k3_span *sp = &ctx->spans[it / H];
        const int h = (int)(it % H);
        const int64_t t0 = sp->t0, ch = (int64_t)h * dk;
        for (int which = 0; which < 3; which++) {
            float *x = which == 0 ? ctx->s.kq : which == 1 ? ctx->s.kk : ctx->s.kv;
            const float *w = which == 0 ? L->q_conv : which == 1 ? L->k_conv : L->v_conv;
            float *state = ctx->kda_conv[j->layer] + ((int64_t)sp->seq * 3 + which) * (K - 1) * HK;
            for (int64_t a = 0, b; a < sp->n; a = b) {
                b = piece_end(ctx, sp, a);
                k3_kda_conv(x + (t0 + a) * HK + ch, HK, (int)(b - a), dk, K, w + ch, HK, state + ch, HK);
                float *cap = ctx->n_caps ? capture_at(ctx, sp->seq, sp->pos0 + b) : NULL;
                for (int r = 0; cap && r < K - 1; r++)
                    memcpy(cap + off + nS + ((int64_t)which * (K - 1) + r) * HK + ch, state + r * HK + ch,
                           sizeof(float) * (size_t)dk);
            }
        }
        for (int64_t t = t0; t < t0 + sp->n; t++) {
            float *q = ctx->s.kq + t * HK + ch, *k = ctx->s.kk + t * HK + ch;
            double sq = 0.0, sk = 0.0;
            for (int d = 0; d < dk; d++) {
                sq += (double)q[d] * q[d];
                sk += (double)k[d] * k[d];
            }
            /* eps inside the sqrt, as fla's l2norm */
            const float rq = (float)(1.0 / sqrt(sq + 1e-6)) * qscale, rk = (float)(1.0 / sqrt(sk + 1e-6));
            for (int d = 0; d < dk; d++) {
                q[d] *= rq;
                k[d] *= rk;
            }
            k3_kda_gate(ctx->s.kz + t * HK + ch, dk, L->A_log[h], L->dt_bias + ch, c->kda_has_lower_bound,
                        c->kda_lower_bound);
            float *b = ctx->s.kbeta + t * H + h;
            *b = sigmoidf(*b);
        }
        float *S = ctx->kda_S[j->layer] + ((int64_t)sp->seq * H + h) * dk * dv;
        for (int64_t a = 0, b; a < sp->n; a = b) {
            b = piece_end(ctx, sp, a);
            const int64_t ta = t0 + a;
            k3_kda_head kh = {
                .n = (int)(b - a), .dk = dk, .dv = dv,
                .q = ctx->s.kq + ta * HK + ch, .k = ctx->s.kk + ta * HK + ch, .g = ctx->s.kz + ta * HK + ch,
                .ld_qk = HK,
                .v = ctx->s.kv + ta * HK + ch, .ld_v = HK,
                .beta = ctx->s.kbeta + ta * H + h, .ld_beta = H,
                .o = ctx->s.ko + ta * HK + ch, .ld_o = HK,
            };
            if (b - a >= ctx->kda_chunk_min)
                k3_kda_chunked(&kh, S, K3_KDA_CHUNK, ctx->s.tkda[ith]);
            else
                k3_kda_recurrent(&kh, S);
            float *cap = ctx->n_caps ? capture_at(ctx, sp->seq, sp->pos0 + b) : NULL;
            if (cap) memcpy(cap + off + (int64_t)h * dk * dv, S, sizeof(float) * (size_t)(dk * dv));
        }
        /* o_h = rms(o_h; o_norm) ⊙ sigmoid(gate_h) (FusedRMSNormGated, eps = rms_norm_eps) */
        for (int64_t t = t0; t < t0 + sp->n; t++) {
            float *o = ctx->s.ko + t * HK + ch;
            const float *g = ctx->s.kg + t * HK + ch;
            rmsnorm(o, o, L->o_norm, dk, c->rms_eps);
            k3_glu(o, g, dk, K3_GLU_GATE, 1.0f, 0.0f);
        }
    }
}

static void kda_layer(k3_ctx *ctx, const k3_layer *L, int layer, const float *xn, float *out) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T;
    k3_scratch *s = &ctx->s;
    layer_job j = {ctx, L, layer, 1, 1};

    const int64_t H = c->kda_heads, HK = H * c->kda_head_dim, dk = c->kda_head_dim;
    if (L->kda_in.data) {
        /* one pass over x for q, k, v, f_a, b (and the full-rank gate) */
        const int64_t R = L->kda_in.rows;
        k3_matmul(ctx->pool, &L->kda_in, xn, T, s->fused);
        for (int64_t t = 0; t < T; t++) {
            const float *row = s->fused + t * R;
            memcpy(s->kq + t * HK, row, sizeof(float) * (size_t)HK);
            memcpy(s->kk + t * HK, row + HK, sizeof(float) * (size_t)HK);
            memcpy(s->kv + t * HK, row + 2 * HK, sizeof(float) * (size_t)HK);
            memcpy(s->kfa + t * dk, row + 3 * HK, sizeof(float) * (size_t)dk);
            memcpy(s->kbeta + t * H, row + 3 * HK + dk, sizeof(float) * (size_t)H);
            if (c->kda_full_rank_gate) memcpy(s->kg + t * HK, row + 3 * HK + dk + H, sizeof(float) * (size_t)HK);
        }
    } else {
        k3_matmul(ctx->pool, &L->q_proj, xn, T, s->kq);
        k3_matmul(ctx->pool, &L->k_proj, xn, T, s->kk);
        k3_matmul(ctx->pool, &L->v_proj, xn, T, s->kv);
        k3_matmul(ctx->pool, &L->f_a, xn, T, s->kfa);
        k3_matmul(ctx->pool, &L->b_proj, xn, T, s->kbeta);
        if (c->kda_full_rank_gate) k3_matmul(ctx->pool, &L->g_proj, xn, T, s->kg);
    }
    k3_matmul(ctx->pool, &L->f_b, s->kfa, T, s->kz);
    if (!c->kda_full_rank_gate) {
        k3_matmul(ctx->pool, &L->g_a, xn, T, s->kfa);
        k3_matmul(ctx->pool, &L->g_b, s->kfa, T, s->kg);
    }
    /* the pool's contiguous shares keep a head with the same thread token
     * after token, so its state usually stays in that core's caches */
    k3_pool_for(ctx->pool, (int64_t)ctx->n_spans * c->kda_heads, 1, kda_head_items, &j);
    k3_matmul(ctx->pool, &L->o_proj, s->ko, T, out);
}

/* ---- MLA / DSA layer ---------------------------------------------------- */

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
        k3_indexer_scores(ctx->s.iq + t * HI * dI, ctx->s.iw + t * HI, HI, dI, ctx->idx_cache[layer], slots + a,
                          b - a, sc + a);
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
    const layer_job *j = p;
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
    const layer_job *j = p;
    for (int64_t it = lo; it < hi; it++) {
        const int64_t t = it / j->parts;
        const int part = (int)(it % j->parts), n = row_len(j->ctx, t);
        const int a = (int)((int64_t)n * part / j->parts), b = (int)((int64_t)n * (part + 1) / j->parts);
        dsa_score_range(j->ctx, j->layer, t, a, b, j->ctx->s.tslots[t], j->ctx->s.tscore[t]);
    }
}

static void dsa_pick_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const layer_job *j = p;
    for (int64_t t = lo; t < hi; t++)
        dsa_pick(j->ctx, t, row_len(j->ctx, t), j->ctx->s.tslots[t], j->ctx->s.tscore[t], ith);
}

static void dsa_select(k3_ctx *ctx, const k3_layer *L, int layer) {
    const int64_t T = ctx->T;
    if (T >= ctx->nth) {
        layer_job j = {ctx, L, layer, 1, 1};
        k3_pool_for(ctx->pool, T, 1, dsa_select_rows, &j);
        return;
    }
    int longest = 0;
    for (int64_t t = 0; t < T; t++) longest = row_len(ctx, t) > longest ? row_len(ctx, t) : longest;
    int parts = (int)(2 * ctx->nth / T);
    if (parts > longest / 1024) parts = longest / 1024;
    layer_job j = {ctx, L, layer, parts < 1 ? 1 : parts, 1};
    k3_pool_for(ctx->pool, T * j.parts, 1, dsa_score_parts, &j);
    k3_pool_for(ctx->pool, T, 1, dsa_pick_rows, &j);
}

/* Attention for (row, part, head group) items: each part is a contiguous
 * share of the row's slots, each group a contiguous share of the heads (the
 * heads are independent, so the split changes no result); with one part the
 * result goes straight to ĉ, with several to the partials that
 * mla_merge_rows combines by log-sum-exp. */
static void mla_attend_items(void *p, int64_t lo, int64_t hi, int ith) {
    const layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    const int H = c->n_heads, nope = c->qk_nope_dim, rope = c->qk_rope_dim, kvl = c->kv_lora_rank;
    const int64_t T = ctx->T, ld = kvl + rope, qh = nope + rope;
    const float scale = 1.0f / sqrtf((float)(nope + rope));
    for (int64_t it = lo; it < hi; it++) {
        const int64_t tp = it / j->hg; /* (row, part) */
        const int g = (int)(it % j->hg), h0 = H * g / j->hg, nh = H * (g + 1) / j->hg - h0;
        const int64_t t = tp / j->parts;
        const int part = (int)(tp % j->parts);
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
        const int a = (int)((int64_t)n * part / j->parts), b = (int)((int64_t)n * (part + 1) / j->parts);
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
            memcpy(qa + (int64_t)h * kvl, ctx->s.qa + ((int64_t)(h0 + h) * T + t) * kvl,
                   sizeof(float) * (size_t)kvl);
            memcpy(qpe + (int64_t)h * rope, ctx->s.mq + t * H * qh + (h0 + h) * qh + nope,
                   sizeof(float) * (size_t)rope);
        }
        float *out, *lse, lse_buf[K3_MAX_HEADS]; /* nh <= n_heads <= K3_MAX_HEADS (config.c) */
        if (j->parts > 1) {
            out = ctx->s.part_o + tp * H * kvl + (int64_t)h0 * kvl;
            lse = ctx->s.part_l + tp * H + h0;
        } else {
            out = ctx->s.part_o + (int64_t)ith * H * kvl;
            lse = lse_buf;
        }
        if (ctx->kv == K3_KV_C8) {
            const k3_c8_cache cc = {ctx->lat8[j->layer], ctx->lat_s[j->layer], ctx->lat_r[j->layer], kvl, rope,
                                    ctx->n_tiles};
            k3_qsfa(qa, qpe, nh, &cc, slots, b - a, scale, out, lse, ctx->s.tqsfa[ith]);
        } else {
            for (int h = 0; h < nh; h++)
                lse[h] = b > a ? k3_mla_attend(qa + (int64_t)h * kvl, qpe + (int64_t)h * rope, kvl, rope,
                                               ctx->lat_cache[j->layer], ld, slots, b - a, scale,
                                               ctx->s.tscore[ith], out + (int64_t)h * kvl)
                               : -INFINITY;
        }
        if (j->parts == 1)
            for (int h = 0; h < nh; h++)
                memcpy(ctx->s.chat + ((int64_t)(h0 + h) * T + t) * kvl, out + (int64_t)h * kvl,
                       sizeof(float) * (size_t)kvl);
    }
}

static void mla_merge_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const int H = ctx->c->n_heads, kvl = ctx->c->kv_lora_rank;
    const int64_t T = ctx->T;
    for (int64_t t = lo; t < hi; t++) {
        const float *o[64], *l[64];
        for (int q = 0; q < j->parts; q++) {
            o[q] = ctx->s.part_o + (t * j->parts + q) * H * kvl;
            l[q] = ctx->s.part_l + (t * j->parts + q) * H;
        }
        float *out = ctx->s.tq[ith], lse[K3_MAX_HEADS];
        k3_lse_merge(o, l, j->parts, H, kvl, out, lse);
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
    const layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const int64_t T = ctx->T, kvl = ctx->c->kv_lora_rank, nope = ctx->c->qk_nope_dim;
    for (int64_t h = lo; h < hi; h++) {
        const k3_mat wuk = k3_mat_rows(&j->L->wuk, h * kvl, kvl);
        k3_matmul(NULL, &wuk, ctx->s.qn + h * T * nope, T, ctx->s.qa + h * T * kvl);
    }
}

/* o_h = W_UV_h ĉ_h for heads [lo, hi), into their columns of s.mo */
static void value_items(void *p, int64_t lo, int64_t hi, int ith) {
    const layer_job *j = p;
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
        rms_all(ctx, s->cq, c->q_lora_rank, s->cq, c->q_lora_rank, L->q_a_norm, c->q_lora_rank, 1e-6f);
        k3_matmul(ctx->pool, &L->q_b, s->cq, T, s->mq);
    } else {
        k3_matmul(ctx->pool, &L->q_b, xn, T, s->mq);
    }
    rms_all(ctx, s->ckv, ld, s->ckv, ld, L->kv_a_norm, kvl, 1e-6f);
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
    layer_job j = {ctx, L, layer, 1, 1};
    k3_pool_for(ctx->pool, H, 1, absorb_items, &j);
}

static void mla_attend_local(k3_ctx *ctx, const k3_layer *L, int layer);

static void mla_layer(k3_ctx *ctx, const k3_layer *L, int layer, const float *xn, float *out) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T;
    const int H = c->n_heads;
    const int vd = c->v_head_dim;
    k3_scratch *s = &ctx->s;

    PROF(ctx, K3_PROF_MLAPO, mlapo(ctx, L, layer, xn));
    layer_job aj = {ctx, L, layer, 1, 1};
    if (ctx->dcp > 1) PROF(ctx, K3_PROF_QSFA, k3_mla_dcp_attention(ctx, L, layer)); /* src/layers/mla_dcp.c */
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
 * (selected) slots, into s.chat. */
static void mla_attend_local(k3_ctx *ctx, const k3_layer *L, int layer) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T;
    const int H = c->n_heads;
    if (L->kind == K3_LAYER_DSA && !ctx->dense) PROF(ctx, K3_PROF_QLI, dsa_select(ctx, L, layer));

    /* Few rows (decode): split each row's slots across the threads and merge
     * the parts by log-sum-exp, as decode context parallelism does; below
     * 256 slots a part, split the heads instead (nothing to merge). */
    layer_job aj = {ctx, L, layer, 1, 1};
    if (T < ctx->nth) {
        int64_t longest = 0;
        for (int32_t i = 0; i < ctx->n_spans; i++) {
            const int64_t e = ctx->spans[i].pos0 + ctx->spans[i].n;
            longest = e > longest ? e : longest;
        }
        if (L->kind == K3_LAYER_DSA && !ctx->dense && longest > c->index_topk) longest = c->index_topk;
        int parts = (int)((2 * ctx->nth) / T);
        if (parts > longest / 256) parts = (int)(longest / 256);
        if (parts > 64) parts = 64;
        aj.parts = parts < 1 ? 1 : parts;
        if (aj.parts == 1) aj.hg = 2 * ctx->nth < H ? 2 * ctx->nth : H;
    }
    PROF(ctx, K3_PROF_QSFA, {
        k3_pool_for(ctx->pool, T * aj.parts * aj.hg, 1, mla_attend_items, &aj);
        if (aj.parts > 1) k3_pool_for(ctx->pool, T, 1, mla_merge_rows, &aj);
    });
}

/* ---- FFN and MoE ---------------------------------------------------------- */

/* gu: gate and up stacked (one matmul into [n, 2I], then the GLU per row),
 * or empty: one matmul each */
static void dense_ffn(k3_ctx *ctx, const k3_mat *gu, const k3_mat *gate, const k3_mat *up, const k3_mat *down,
                      const float *x, int64_t n, float *out) {
    k3_scratch *s = &ctx->s;
    const int64_t I = gate->rows;
    if (gu->data) {
        k3_matmul(ctx->pool, gu, x, n, s->fused);
        for (int64_t t = 0; t < n; t++) {
            float *row = s->fused + t * 2 * I;
            glu(ctx->c, row, row + I, I);
            memcpy(s->f1 + t * I, row, sizeof(float) * (size_t)I);
        }
    } else {
        k3_matmul(ctx->pool, gate, x, n, s->f1);
        k3_matmul(ctx->pool, up, x, n, s->f2);
        glu(ctx->c, s->f1, s->f2, n * I);
    }
    k3_matmul(ctx->pool, down, s->f1, n, out);
}

typedef struct {
    k3_ctx *ctx;
    const k3_layer *L;
    const float *z;   /* [T, Dl] expert inputs */
    int32_t na;       /* items [0, na): the active experts (s.eact) */
    int32_t sh_parts; /* items [na, na + sh_parts): row slices of the shared down-projection (T == 1) */
} expert_job;

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
    glu(c, f1, f2, (int64_t)ne * L->exp_gate[e].rows);
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
        /* rows [r0, r1) of the shared experts' down-projection, one token */
        const k3_mat *w = &j->L->sh_down;
        const int64_t q = a - j->na, r0 = w->rows * q / j->sh_parts, r1 = w->rows * (q + 1) / j->sh_parts;
        const k3_mat rows = k3_mat_rows(w, r0, r1 - r0);
        k3_matmul(NULL, &rows, j->ctx->s.f1, 1, j->ctx->s.tmp + r0);
    }
}

static void moe_layer(k3_ctx *ctx, const k3_layer *L, const float *yn, float *out) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T, D = c->hidden_size, Dl = c->expert_dim;
    const int E = c->n_experts, K = c->n_experts_per_tok;
    k3_scratch *s = &ctx->s;

    const double t_moe = ctx->prof_on ? k3_now() : 0.0;
    k3_matmul(ctx->pool, &L->router, yn, T, s->rlog);
    const k3_router_cfg rc = {E, K, c->router_sigmoid, c->moe_renormalize, c->routed_scaling,
                              c->n_expert_groups, c->topk_groups};
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
            glu(c, row + Dl, row + Dl + S, S);
            memcpy(s->f1 + t * S, row + Dl, sizeof(float) * (size_t)S);
        }
        z = s->lat;
    } else if (c->latent_moe) {
        k3_matmul(ctx->pool, &L->lat_down, yn, T, s->lat);
        z = s->lat;
    }
    if (ctx->ep > 1) z = k3_ep_dispatch(ctx, z); /* src/layers/moe_ep.c */
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
     * one token the shared experts' down-projection joins the job as small
     * row slices after the experts: they fill the end, where threads used to
     * wait on the last expert (~12 us per layer), and save its dispatch. */
    int32_t na = 0;
    for (int e = 0; e < E; e++)
        if (s->ecount[e + 1] > s->ecount[e] && k3_ep_owns(ctx, e)) s->eact[na++] = e;
    expert_job ej = {ctx, L, z, na, 0};
    if (ctx->nth > 1 && na >= 2 * ctx->nth) {
        if (L->moe_in.data && T == 1) ej.sh_parts = 4 * ctx->nth;
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
        if (c->latent_moe && c->latent_moe_norm) rmsnorm(y, y, L->lat_norm, Dl, c->rms_eps);
    }
    if (ctx->ep > 1) k3_ep_gather(ctx, comb);
    if (c->latent_moe) k3_matmul(ctx->pool, &L->lat_up, comb, T, out);
    else memcpy(out, comb, sizeof(float) * (size_t)(T * D));
    if (ctx->prof_on) ctx->prof[K3_PROF_MOE] += k3_now() - t_moe;

    if (L->moe_in.data) {
        if (!ej.sh_parts) PROF(ctx, K3_PROF_FFN, k3_matmul(ctx->pool, &L->sh_down, s->f1, T, s->tmp));
        for (int64_t i = 0; i < T * D; i++) out[i] += s->tmp[i];
    } else if (c->n_shared_experts > 0) {
        PROF(ctx, K3_PROF_FFN, dense_ffn(ctx, &L->sh_gu, &L->sh_gate, &L->sh_up, &L->sh_down, yn, T, s->tmp));
        for (int64_t i = 0; i < T * D; i++) out[i] += s->tmp[i];
    }
}

/* ---- the layer loop -------------------------------------------------------- */

void k3_forward_round(k3_ctx *ctx, const int32_t *tokens, const int32_t *out_rows,
                      int32_t n_out, float *logits) {
    const k3_model *m = ctx->m;
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T, D = c->hidden_size;
    k3_scratch *s = &ctx->s;
    const bool attn_res = c->attn_res_block_size > 0;

    /* a row given with the batch (image features) replaces the token's embedding */
    PROF(ctx, K3_PROF_EMBED, for (int64_t t = 0; t < T; t++) {
        if (ctx->round_embeds[t]) memcpy(s->P + t * D, ctx->round_embeds[t], sizeof(float) * (size_t)D);
        else k3_mat_get_row(&m->embed, tokens[t], s->P + t * D);
    });

    int nb = 0; /* bank entries */
    for (int i = 0; i < c->n_layers; i++) {
        const k3_layer *L = &m->layers[i];
        /* AttnRes: X = mix(P, bank) (P itself while the bank is empty); a bank
         * layer stores the raw incoming P and restarts the block sum. */
        const float *X = s->P;
        if (attn_res) {
            if (nb > 0) {
                PROF(ctx, K3_PROF_ATTNRES, attn_res_mix(ctx, s->X, s->P, L->attn_res_w, nb));
                X = s->X;
            }
            if (k3_config_is_bank_layer(c, i)) {
                float *dst = s->bank + (int64_t)nb * T * D;
                memcpy(dst, s->P, sizeof(float) * (size_t)(T * D));
                if (X == s->P) { /* keep X (= the incoming P) alive */
                    X = dst;
                }
                memset(s->P, 0, sizeof(float) * (size_t)(T * D));
                nb++;
            }
        }
        PROF(ctx, K3_PROF_NORM, rms_all(ctx, s->xn, D, X, D, L->input_norm, D, c->rms_eps));
        if (L->kind == K3_LAYER_KDA) PROF(ctx, K3_PROF_KDA, kda_layer(ctx, L, i, s->xn, s->tmp));
        else mla_layer(ctx, L, i, s->xn, s->tmp);
        for (int64_t k = 0; k < T * D; k++) s->P[k] += s->tmp[k];

        const float *Y = s->P;
        if (attn_res) {
            PROF(ctx, K3_PROF_ATTNRES, attn_res_mix(ctx, s->X, s->P, L->mlp_res_w, nb));
            Y = s->X;
        }
        PROF(ctx, K3_PROF_NORM, rms_all(ctx, s->xn, D, Y, D, L->post_attn_norm, D, c->rms_eps));
        if (L->moe) moe_layer(ctx, L, s->xn, s->X);
        else PROF(ctx, K3_PROF_FFN, dense_ffn(ctx, &L->ffn_gu, &L->ffn_gate, &L->ffn_up, &L->ffn_down, s->xn, T, s->X));
        for (int64_t k = 0; k < T * D; k++) s->P[k] += s->X[k];
    }
    if (!n_out) return;

    const float *Z = s->P;
    if (attn_res) {
        PROF(ctx, K3_PROF_ATTNRES, attn_res_mix(ctx, s->X, s->P, m->out_res_w, nb));
        Z = s->X;
    }
    PROF(ctx, K3_PROF_HEAD, {
        for (int32_t r = 0; r < n_out; r++)
            rmsnorm(s->xn + (int64_t)r * D, Z + (int64_t)out_rows[r] * D, m->final_norm, D, c->rms_eps);
        k3_matmul(ctx->pool, &m->lm_head, s->xn, n_out, logits);
    });
}
