/*
 * kda.c -- the KDA layer (Kimi Delta Attention, docs/model.md §3.3): the
 * projections that read the layer input, then per span and head the short
 * convs, the gates, the recurrence and the output gate (the primitives are
 * kernels/kda.h). The recurrent state and conv windows of each sequence
 * are the context's.
 */
#include <math.h>
#include <string.h>

#include "common/pool.h"
#include "kernels/kda.h"
#include "layers/layers.h"

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The next capture (k3_ctx_capture_state) of sequence seq at position pos
 * from index *i on, or NULL: one position may be asked for by several (a
 * prefix-cache snapshot and a hold for a decode instance). */
static float *capture_next(const k3_ctx *ctx, int32_t seq, int64_t pos, int32_t *i) {
    for (; *i < ctx->n_caps; (*i)++)
        if (ctx->caps[*i].seq == seq && ctx->caps[*i].pos == pos) return ctx->caps[(*i)++].dst;
    return NULL;
}

/* The end (offset in the span) of the piece that starts at offset a: the
 * next block boundary, or the span's end. */
static int64_t piece_end(const k3_ctx *ctx, const k3_span *sp, int64_t a) {
    const int64_t bs = ctx->block_size, e = ((sp->pos0 + a) / bs + 1) * bs - sp->pos0;
    return e < sp->n ? e : sp->n;
}

/* The part of a KDA head both passes share: L2 norms of q and k, the decay
 * gate and beta, over rows [t0, t0 + n). */
static void head_gates(k3_ctx *ctx, const k3_layer *L, int h, int64_t t0, int64_t n) {
    const k3_config *c = ctx->c;
    const int H = c->kda_heads, dk = c->kda_head_dim;
    const int64_t HK = (int64_t)H * dk, ch = (int64_t)h * dk;
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int64_t t = t0; t < t0 + n; t++) {
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
}

/* o_h = rms(o_h; o_norm) ⊙ sigmoid(gate_h) (FusedRMSNormGated, eps = rms_eps) over rows [t0, t0 + n). */
static void head_out(k3_ctx *ctx, const k3_layer *L, int h, int64_t t0, int64_t n) {
    const int64_t HK = (int64_t)ctx->c->kda_heads * ctx->c->kda_head_dim, ch = (int64_t)h * ctx->c->kda_head_dim;
    for (int64_t t = t0; t < t0 + n; t++) {
        float *o = ctx->s.ko + t * HK + ch;
        const float *g = ctx->s.kg + t * HK + ch;
        k3_rmsnorm(o, o, L->o_norm, ctx->c->kda_head_dim, ctx->c->rms_eps);
        k3_glu(o, g, ctx->c->kda_head_dim, K3_GLU_GATE, 1.0f, 0.0f);
    }
}

/* One KDA head of a verify chunk (ctx.h, "verifying drafts"): the same
 * arithmetic as kda_head_items, token for token, on a copy of the head's
 * state and windows (tspec), keeping per position what k3_ctx_spec_accept
 * needs: REAPPLY the pre-conv rows and the recurrence's k, v, g, beta;
 * STATES the state and windows after each position. */
static void kda_head_verify(k3_ctx *ctx, const k3_layer *L, int layer, const k3_span *sp, int h, int ith) {
    const k3_config *c = ctx->c;
    const int H = c->kda_heads, dk = c->kda_head_dim, dv = dk, K = c->conv_size;
    const int64_t HK = (int64_t)H * dk, Km1 = K > 0 ? K - 1 : 0, ch = (int64_t)h * dk, t0 = sp->t0;
    const k3_spec_slot *slot = &ctx->spec[sp->seq];
    const int32_t mode = slot->mode;
    const int64_t per = k3_spec_pos_floats(c, mode), nS = (int64_t)H * dk * dv;
    float *buf = k3_spec_at(ctx, sp->seq, layer, 0);
    float *Sx = ctx->tspec[ith], *win = Sx + (int64_t)dk * dv, *obuf = win + 3 * Km1 * dk;
    (void)obuf;
    /* the short convs on a copy of the windows (stride dk) */
    for (int which = 0; which < 3; which++) {
        float *x = which == 0 ? ctx->s.kq : which == 1 ? ctx->s.kk : ctx->s.kv;
        const float *w = which == 0 ? L->q_conv : which == 1 ? L->k_conv : L->v_conv;
        const float *state = ctx->kda_conv[layer] + ((int64_t)sp->seq * 3 + which) * Km1 * HK;
        float *wc = win + (int64_t)which * Km1 * dk;
        for (int64_t r = 0; r < Km1; r++) memcpy(wc + r * dk, state + r * HK + ch, sizeof(float) * (size_t)dk);
        if (mode == K3_SPEC_REAPPLY) { /* the pre-conv rows kept, then the chunk's rows in one call */
            for (int64_t r = 0; r < sp->n; r++)
                memcpy(buf + r * per + which * HK + ch, x + (t0 + r) * HK + ch, sizeof(float) * (size_t)dk);
            k3_kda_conv(x + t0 * HK + ch, HK, (int)sp->n, dk, K, w + ch, HK, wc, dk);
            continue;
        }
        for (int64_t r = 0; r < sp->n; r++) { /* the windows after each position kept */
            k3_kda_conv(x + (t0 + r) * HK + ch, HK, 1, dk, K, w + ch, HK, wc, dk);
            for (int64_t j = 0; j < Km1; j++)
                memcpy(buf + r * per + nS + ((int64_t)which * Km1 + j) * HK + ch, wc + j * dk,
                       sizeof(float) * (size_t)dk);
        }
    }
    head_gates(ctx, L, h, t0, sp->n);
    memcpy(Sx, ctx->kda_S[layer] + ((int64_t)sp->seq * H + h) * dk * dv, sizeof(float) * (size_t)(dk * dv));
    for (int64_t r = 0; r < sp->n; r++) {
        const int64_t t = t0 + r;
        if (mode == K3_SPEC_REAPPLY) {
            float *post = buf + r * per + 3 * HK + (int64_t)h * (3 * dk + 1);
            memcpy(post, ctx->s.kk + t * HK + ch, sizeof(float) * (size_t)dk);
            memcpy(post + dk, ctx->s.kv + t * HK + ch, sizeof(float) * (size_t)dk);
            memcpy(post + 2 * dk, ctx->s.kz + t * HK + ch, sizeof(float) * (size_t)dk);
            post[3 * dk] = ctx->s.kbeta[t * H + h];
        }
    }
    k3_kda_head kh = {
        .n = mode == K3_SPEC_STATES ? 1 : (int)sp->n,
        .dk = dk,
        .dv = dv,
        .q = ctx->s.kq + t0 * HK + ch,
        .k = ctx->s.kk + t0 * HK + ch,
        .g = ctx->s.kz + t0 * HK + ch,
        .ld_qk = HK,
        .v = ctx->s.kv + t0 * HK + ch,
        .ld_v = HK,
        .beta = ctx->s.kbeta + t0 * H + h,
        .ld_beta = H,
        .o = ctx->s.ko + t0 * HK + ch,
        .ld_o = HK,
    };
    if (mode == K3_SPEC_REAPPLY) {
        k3_kda_recurrent(&kh, Sx);
    } else {
        for (int64_t r = 0; r < sp->n; r++) { /* one position at a time, the state after each kept */
            k3_kda_recurrent(&kh, Sx);
            memcpy(buf + r * per + ch * dv, Sx, sizeof(float) * (size_t)(dk * dv));
            kh.q += HK;
            kh.k += HK;
            kh.g += HK;
            kh.v += HK;
            kh.beta += H;
            kh.o += HK;
        }
    }
    head_out(ctx, L, h, t0, sp->n);
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
    const k3_layer_job *j = p;
    k3_ctx *ctx = j->ctx;
    const k3_config *c = ctx->c;
    const k3_layer *L = j->L;
    const int H = c->kda_heads, dk = c->kda_head_dim, dv = dk, K = c->conv_size;
    const int64_t HK = (int64_t)H * dk, nS = (int64_t)H * dk * dv, off = ctx->kda_snap_off[j->layer];
    for (int64_t it = lo; it < hi; it++) {
        const k3_span *sp = &ctx->spans[it / H];
        const int h = (int)(it % H);
        if (k3_spec_on(ctx, sp->seq)) {
            kda_head_verify(ctx, L, j->layer, sp, h, ith);
            continue;
        }
        const int64_t t0 = sp->t0, ch = (int64_t)h * dk;
        for (int which = 0; which < 3; which++) {
            float *x = which == 0 ? ctx->s.kq : which == 1 ? ctx->s.kk : ctx->s.kv;
            const float *w = which == 0 ? L->q_conv : which == 1 ? L->k_conv : L->v_conv;
            float *state = ctx->kda_conv[j->layer] + ((int64_t)sp->seq * 3 + which) * (K - 1) * HK;
            for (int64_t a = 0, b; a < sp->n; a = b) {
                b = piece_end(ctx, sp, a);
                k3_kda_conv(x + (t0 + a) * HK + ch, HK, (int)(b - a), dk, K, w + ch, HK, state + ch, HK);
                float *cap;
                for (int32_t ci = 0; ctx->n_caps && (cap = capture_next(ctx, sp->seq, sp->pos0 + b, &ci));)
                    for (int r = 0; r < K - 1; r++)
                        memcpy(cap + off + nS + ((int64_t)which * (K - 1) + r) * HK + ch, state + r * HK + ch,
                               sizeof(float) * (size_t)dk);
            }
        }
        head_gates(ctx, L, h, t0, sp->n);
        float *S = ctx->kda_S[j->layer] + ((int64_t)sp->seq * H + h) * dk * dv;
        for (int64_t a = 0, b; a < sp->n; a = b) {
            b = piece_end(ctx, sp, a);
            const int64_t ta = t0 + a;
            k3_kda_head kh = {
                .n = (int)(b - a),
                .dk = dk,
                .dv = dv,
                .q = ctx->s.kq + ta * HK + ch,
                .k = ctx->s.kk + ta * HK + ch,
                .g = ctx->s.kz + ta * HK + ch,
                .ld_qk = HK,
                .v = ctx->s.kv + ta * HK + ch,
                .ld_v = HK,
                .beta = ctx->s.kbeta + ta * H + h,
                .ld_beta = H,
                .o = ctx->s.ko + ta * HK + ch,
                .ld_o = HK,
            };
            if (b - a < ctx->kda_bf_min || !k3_kda_chunked_bf(&kh, S, K3_KDA_CHUNK_BF, ctx->s.tkda[ith])) {
                if (b - a >= ctx->kda_chunk_min) k3_kda_chunked(&kh, S, K3_KDA_CHUNK, ctx->s.tkda[ith]);
                else k3_kda_recurrent(&kh, S);
            }
            float *cap;
            for (int32_t ci = 0; ctx->n_caps && (cap = capture_next(ctx, sp->seq, sp->pos0 + b, &ci));)
                memcpy(cap + off + (int64_t)h * dk * dv, S, sizeof(float) * (size_t)(dk * dv));
        }
        head_out(ctx, L, h, t0, sp->n);
    }
}

void k3_kda_layer(k3_ctx *ctx, const k3_layer *L, int layer, const float *xn, float *out) {
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T;
    k3_scratch *s = &ctx->s;
    k3_layer_job j = {ctx, L, layer, 1, 1};

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
