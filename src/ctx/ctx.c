/*
 * ctx.c -- contexts, the arena: state and cache storage for n_blocks blocks,
 * the per-slot block tables their owner sets, KDA state save/restore and
 * captures (see ctx.h). Nothing here computes (the forward pass is
 * src/forward) and nothing here is sent to other ranks (src/executor mirrors
 * the calls that change a context): from the dist a context takes only its
 * place in the DCP and EP groups, for its cache layout and its experts.
 */
#include "ctx/ctx.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kernels/attn_ops.h"
#include "kernels/kda.h"
#include "model/plan.h"

/* ---- allocation ---------------------------------------------------------- */

typedef struct {
    bool failed;
    size_t bytes;
} alloc_state;

static void *zalloc(alloc_state *a, size_t n, size_t size) {
    if (a->failed) return NULL;
    if (n == 0) n = 1;
    void *p = calloc(n, size);
    if (!p) a->failed = true;
    else a->bytes += n * size;
    return p;
}

/* The cache arrays: whole pages of their own (mmap: zero, untouched until
 * used, like calloc's), so each starts on a page and the disk tier reads and
 * writes their blocks with O_DIRECT (src/kvstore). The mapping's size sits in
 * the page before the array. */
static void *cache_zalloc(alloc_state *a, size_t n, size_t size) {
    if (a->failed) return NULL;
    if (n == 0) n = 1;
    const size_t pg = 4096, bytes = (n * size + pg - 1) / pg * pg + pg;
    uint8_t *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        a->failed = true;
        return NULL;
    }
    memcpy(p, &bytes, sizeof bytes);
    a->bytes += n * size;
    return p + pg;
}

static void cache_free(void *p) {
    if (!p) return;
    uint8_t *q = (uint8_t *)p - 4096;
    size_t bytes;
    memcpy(&bytes, q, sizeof bytes);
    munmap(q, bytes);
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- the place among several ranks ------------------------------------------ */

/* Before the cache is sized: this rank's DCP and EP groups (none for d
 * NULL), checked against the model and the block size. */
static k3_status ranks_setup(k3_ctx *ctx, k3_dist *d, k3_error *err) {
    const k3_config *c = ctx->c;
    ctx->dist = d;
    ctx->dcp = k3_dist_dcp_size(d);
    ctx->dcp_rank = k3_dist_dcp_rank(d);
    ctx->dcp_il = k3_dist_interleave(d);
    ctx->ep = k3_dist_ep_size(d);
    ctx->ep_rank = k3_dist_ep_rank(d);
    if (ctx->dcp > 64) return k3_err(err, K3_ERR_UNSUPPORTED, "context: --dcp %d, at most 64 supported", ctx->dcp);
    /* a block then holds bs/D tokens of every rank (ctx.h k3_ctx_own_slot) */
    if (ctx->dcp > 1 && ctx->block_size % (ctx->dcp * ctx->dcp_il))
        return k3_err(err, K3_ERR_ARG,
                      "context: the block size %d is not a multiple of --dcp %d x --dcp-interleave %d (a block "
                      "holds the same number of tokens of every DCP rank)",
                      ctx->block_size, ctx->dcp, ctx->dcp_il);
    ctx->lbs = ctx->block_size / (ctx->dcp > 1 ? ctx->dcp : 1);
    if (ctx->ep > 1) {
        if (c->n_experts < 1)
            return k3_err(err, K3_ERR_ARG, "context: --ep %d but the model has no routed experts", ctx->ep);
        if (ctx->ep > c->n_experts || c->n_experts % ctx->ep)
            return k3_err(err, K3_ERR_ARG, "context: --ep %d does not divide the %d routed experts", ctx->ep,
                          c->n_experts);
    }
    if (ctx->m->ep_size != ctx->ep || (ctx->ep > 1 && ctx->m->ep_rank != ctx->ep_rank))
        return k3_err(err, K3_ERR_ARG,
                      "context: the model holds the experts of EP rank %d of %d, the dist is EP rank %d of %d",
                      ctx->m->ep_rank, ctx->m->ep_size, ctx->ep_rank, ctx->ep);
    return K3_OK;
}

static void exchange_free(k3_exchange_scratch *x) {
    if (!x) return;
    free(x->cand);
    free(x->cand_out);
    free(x->cand_work);
    free(x->xrow);
    free(x->wslots);
    free(x->wcount);
    free(x->att);
    free(x->att_all);
    free(x->att_send);
    free(x->att_mine);
    free(x->zr);
    free(x->sendb);
    free(x->recvb);
    free(x->sc);
    free(x);
}

/* The buffers of the DCP and EP exchanges (src/layers/mla_dcp.c, moe_ep.c),
 * for max_batch rows. */
static k3_status exchange_alloc(k3_ctx *ctx, k3_error *err) {
    const k3_config *c = ctx->c;
    k3_exchange_scratch *x = calloc(1, sizeof *x);
    if (!x) return k3_err(err, K3_ERR_NOMEM, "context: out of memory for the DCP/EP buffers");
    ctx->xs = x;
    const size_t T = (size_t)ctx->max_batch, D = (size_t)ctx->dcp;
    const size_t k = (size_t)(c->index_topk > 0 ? c->index_topk : 1), H = (size_t)c->n_heads;
    const size_t row = H * (size_t)c->kv_lora_rank + H;
    bool ok = true;
    if (ctx->dcp > 1) {
        ok = ok && (x->cand = malloc(sizeof(k3_cand) * T * k));
        ok = ok && (x->cand_out = malloc(sizeof(k3_cand) * T * k));
        ok = ok && (x->cand_work = malloc(sizeof(k3_cand) * T * k * (D > 2 ? D : 2)));
        ok = ok && (x->xrow = malloc(sizeof(int32_t) * T));
        ok = ok && (x->wslots = malloc(sizeof(int64_t) * T * k));
        ok = ok && (x->wcount = malloc(sizeof(int32_t) * T));
        ok = ok && (x->att = malloc(sizeof(float) * T * row));
        ok = ok && (x->att_all = malloc(sizeof(float) * T * row * D));
        ok = ok && (x->att_send = malloc(sizeof(float) * T * row));
        ok = ok && (x->att_mine = malloc(sizeof(float) * T * row));
    }
    if (ctx->ep > 1) {
        const size_t Dl = (size_t)c->expert_dim, K = (size_t)c->n_experts_per_tok, E = (size_t)ctx->ep;
        ok = ok && (x->zr = calloc(T * Dl, sizeof(float)));
        ok = ok && (x->sendb = malloc(sizeof(float) * T * K * Dl));
        ok = ok && (x->recvb = malloc(sizeof(float) * T * K * Dl));
        ok = ok && (x->sc = calloc(4 * E, sizeof(int)));
        if (ok) {
            x->sd = x->sc + E;
            x->rc = x->sc + 2 * E;
            x->rd = x->sc + 3 * E;
        }
    }
    if (!ok) return k3_err(err, K3_ERR_NOMEM, "context: out of memory for the DCP/EP buffers");
    return K3_OK;
}

/* Blocks a sequence needs once it holds end tokens: global blocks of
 * block_size positions, under DCP too (each rank's block holds its
 * block_size / D of them; ctx.h k3_ctx_own_slot). */

int64_t k3_ctx_cache_bytes(const k3_ctx *ctx) {
    /* each rank's slots: n_blocks blocks of bs/D */
    return k3_config_cache_bytes_per_token(ctx->c, ctx->kv) * ((int64_t)ctx->n_blocks * ctx->lbs);
}

void k3_ctx_free(k3_ctx *ctx) {
    if (!ctx) return;
    const k3_config *c = ctx->c;
    k3_scratch *s = &ctx->s;
    if (ctx->seqs)
        for (int i = 0; i < ctx->max_seqs; i++) free(ctx->seqs[i].blocks);
    free(ctx->seqs);
    for (int i = 0; c && i < c->n_layers; i++) {
        if (ctx->kda_S) free(ctx->kda_S[i]);
        if (ctx->kda_conv) free(ctx->kda_conv[i]);
        if (ctx->lat_cache) cache_free(ctx->lat_cache[i]);
        if (ctx->idx_cache) cache_free(ctx->idx_cache[i]);
        if (ctx->lat8) cache_free(ctx->lat8[i]);
        if (ctx->lat_s) cache_free(ctx->lat_s[i]);
        if (ctx->lat_r) cache_free(ctx->lat_r[i]);
        if (ctx->idx8) cache_free(ctx->idx8[i]);
        if (ctx->idx_s) cache_free(ctx->idx_s[i]);
    }
    free(ctx->lat8);
    free(ctx->lat_s);
    free(ctx->lat_r);
    free(ctx->idx8);
    free(ctx->idx_s);
    free(ctx->kda_S);
    free(ctx->kda_conv);
    free(ctx->kda_snap_off);
    free(ctx->caps);
    k3_spec_slots_free(ctx);
    free(ctx->lat_cache);
    free(ctx->idx_cache);
    free(ctx->free_blocks);
    free(ctx->spans);
    free(ctx->round_tokens);
    free(ctx->round_out);
    free(ctx->round_embeds);
    float **fl[] = {&s->P,     &s->X,   &s->xn,     &s->tmp,    &s->bank,  &s->kq,   &s->kk,   &s->kv,
                    &s->kg,    &s->kz,  &s->kfa,    &s->kbeta,  &s->ko,    &s->cq,   &s->mq,   &s->ckv,
                    &s->qn,    &s->qa,  &s->chat,   &s->mo,     &s->mgate, &s->mtmp, &s->iq,   &s->ik,
                    &s->iw,    &s->f1,  &s->f2,     &s->rlog,   &s->rw,    &s->lat,  &s->lout, &s->ly,
                    &s->rwork, &s->iqs, &s->part_o, &s->part_l, &s->fused};
    for (size_t i = 0; i < sizeof fl / sizeof fl[0]; i++) free(*fl[i]);
    free(s->iq8);
    free(s->rparts);
    free(s->rfirst);
    free(s->prow);
    free(s->isel);
    free(s->iscore);
    free(s->islots);
    free(s->icount);
    free(s->rids);
    free(s->erows);
    free(s->ecount);
    free(s->eact);
    for (int t = 0; t < ctx->nth; t++) {
        if (s->tgather) free(s->tgather[t]);
        if (s->tf1) free(s->tf1[t]);
        if (s->tf2) free(s->tf2[t]);
        if (s->tlout) free(s->tlout[t]);
    }
    free(s->tgather);
    free(s->tf1);
    free(s->tf2);
    free(s->tlout);
    for (int t = 0; t < ctx->nth; t++) {
        if (s->tscore) free(s->tscore[t]);
        if (s->tslots) free(s->tslots[t]);
        if (s->tsel) free(s->tsel[t]);
        if (s->twork) free(s->twork[t]);
        if (s->tkda) free(s->tkda[t]);
        if (s->tq) free(s->tq[t]);
        if (s->tqsfa) free(s->tqsfa[t]);
    }
    free(s->tq);
    free(s->tqsfa);
    free(s->tscore);
    free(s->tslots);
    free(s->tsel);
    free(s->twork);
    free(s->tkda);
    exchange_free(ctx->xs);
    free(ctx);
}

static k3_status ctx_create(k3_ctx **out, const k3_model *m, const k3_ctx_options *opt, int32_t n_blocks_ext,
                            int64_t max_ctx_ext, k3_error *err) {
    *out = NULL;
    const k3_config *c = &m->cfg;
    if (!opt || opt->max_seqs < 1 || opt->cache_tokens < 1)
        return k3_err(err, K3_ERR_ARG, "context: max_seqs and cache_tokens must be positive");
    if (opt->block_size < 0 || opt->max_batch < 0)
        return k3_err(err, K3_ERR_ARG, "context: block_size and max_batch must not be negative");
    if (opt->kv_cache != K3_KV_F32 && opt->kv_cache != K3_KV_C8)
        return k3_err(err, K3_ERR_ARG, "context: unknown cache type %d", (int)opt->kv_cache);
    if (opt->kv_cache == K3_KV_C8 && c->index_n_heads > 0 &&
        (c->index_head_dim & (c->index_head_dim - 1) || c->index_n_heads > 64 || c->index_head_dim > 256))
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "context: C8 indexer needs a power-of-two index_head_dim <= 256 and <= 64 heads");
    if (c->n_heads > 1024)
        return k3_err(err, K3_ERR_UNSUPPORTED, "context: %d MLA heads, at most 1024 supported", c->n_heads);
    if (c->kda_head_dim > 512 || c->conv_size > 16)
        return k3_err(err, K3_ERR_UNSUPPORTED, "context: KDA head_dim %d or conv size %d too large", c->kda_head_dim,
                      c->conv_size);

    k3_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return k3_err(err, K3_ERR_NOMEM, "context: out of memory");
    ctx->m = m;
    ctx->c = c;
    ctx->pool = opt->pool;
    ctx->nth = opt->pool ? k3_pool_size(opt->pool) : 1;
    ctx->max_seqs = opt->max_seqs;
    ctx->block_size = opt->block_size ? opt->block_size : 64;
    if (!opt->block_size && opt->dist) { /* the default under DCP: 64 up to a multiple of D*I */
        const int32_t stripe = k3_dist_dcp_size(opt->dist) * k3_dist_interleave(opt->dist);
        if (stripe > 0) ctx->block_size = (64 + stripe - 1) / stripe * stripe;
    }
    ctx->max_batch = opt->max_batch ? opt->max_batch : 512;
    ctx->cache_tokens = opt->cache_tokens;
    ctx->max_ctx = opt->cache_tokens < c->max_positions ? opt->cache_tokens : c->max_positions;
    if (max_ctx_ext > 0) ctx->max_ctx = max_ctx_ext < c->max_positions ? max_ctx_ext : c->max_positions;
    ctx->kv = opt->kv_cache;
    ctx->dense = opt->dense_attention;
    ctx->kda_chunk_min = k3_kda_recurrent_prefill() ? INT32_MAX : K3_KDA_CHUNK_MIN;
    ctx->kda_bf_min = m->bf16 && opt->kda_bf16_prefill ? k3_kda_bf_min() : INT32_MAX;
    ctx->n_tiles = (c->kv_lora_rank + K3_C8_TILE - 1) / K3_C8_TILE;
    k3_status ds = ranks_setup(ctx, opt->dist, err); /* DCP / EP, or none */
    if (ds) {
        k3_ctx_free(ctx);
        return ds;
    }
    const int32_t bs = ctx->block_size;
    /* one partial block per sequence on top, so cache_tokens fit however they
     * are spread over the sequences; under DCP the same global blocks, each
     * bs/D slots on this rank */
    ctx->n_blocks = (int32_t)((opt->cache_tokens + bs - 1) / bs) + (opt->max_seqs > 1 ? opt->max_seqs : 0);
    ctx->max_blocks_per_seq = (int32_t)((ctx->max_ctx + bs - 1) / bs);
    if (n_blocks_ext > 0) ctx->n_blocks = n_blocks_ext;

    alloc_state a = {0};
    const int64_t nL = c->n_layers, D = c->hidden_size, T = ctx->max_batch;
    const int64_t HK = (int64_t)c->kda_heads * c->kda_head_dim, dk = c->kda_head_dim;
    const int64_t Km1 = c->conv_size > 0 ? c->conv_size - 1 : 0;
    const int64_t ld = c->kv_lora_rank + c->qk_rope_dim, bslots = (int64_t)ctx->n_blocks * ctx->lbs;

    ctx->seqs = zalloc(&a, (size_t)ctx->max_seqs, sizeof(k3_seq));
    for (int i = 0; ctx->seqs && i < ctx->max_seqs; i++)
        ctx->seqs[i].blocks = zalloc(&a, (size_t)ctx->max_blocks_per_seq, sizeof(int32_t));
    /* the default block manager, only without an external owner */
    if (n_blocks_ext <= 0) ctx->free_blocks = zalloc(&a, (size_t)ctx->n_blocks, sizeof(int32_t));
    if (ctx->free_blocks) {
        /* hand out low ids first: pop from the end */
        for (int32_t b = 0; b < ctx->n_blocks; b++) ctx->free_blocks[b] = ctx->n_blocks - 1 - b;
        ctx->n_free = ctx->n_blocks;
    }
    ctx->kda_S = zalloc(&a, (size_t)nL, sizeof(float *));
    ctx->kda_conv = zalloc(&a, (size_t)nL, sizeof(float *));
    ctx->kda_snap_off = zalloc(&a, (size_t)nL, sizeof(int64_t));
    ctx->lat_cache = zalloc(&a, (size_t)nL, sizeof(float *));
    ctx->idx_cache = zalloc(&a, (size_t)nL, sizeof(float *));
    ctx->lat8 = zalloc(&a, (size_t)nL, sizeof(int8_t *));
    ctx->lat_s = zalloc(&a, (size_t)nL, sizeof(float *));
    ctx->lat_r = zalloc(&a, (size_t)nL, sizeof(float *));
    ctx->idx8 = zalloc(&a, (size_t)nL, sizeof(int8_t *));
    ctx->idx_s = zalloc(&a, (size_t)nL, sizeof(float *));
    for (int64_t i = 0; !a.failed && i < nL; i++) {
        const int kind = c->layer_kind[i];
        if (kind == K3_LAYER_KDA) {
            if (ctx->kda_snap_off) /* state_copy's layout: each KDA layer's S, then its conv windows */
                for (int64_t l = 0; l < i; l++)
                    if (c->layer_kind[l] == K3_LAYER_KDA) ctx->kda_snap_off[i] += c->kda_heads * dk * dk + 3 * Km1 * HK;
            ctx->kda_S[i] = zalloc(&a, (size_t)(ctx->max_seqs * c->kda_heads * dk * dk), sizeof(float));
            ctx->kda_conv[i] = zalloc(&a, (size_t)(ctx->max_seqs * 3 * Km1 * HK), sizeof(float));
        } else if (ctx->kv == K3_KV_F32) {
            ctx->lat_cache[i] = cache_zalloc(&a, (size_t)(bslots * ld), sizeof(float));
            if (kind == K3_LAYER_DSA)
                ctx->idx_cache[i] = cache_zalloc(&a, (size_t)(bslots * c->index_head_dim), sizeof(float));
        } else {
            ctx->lat8[i] = cache_zalloc(&a, (size_t)(bslots * c->kv_lora_rank), sizeof(int8_t));
            ctx->lat_s[i] = cache_zalloc(&a, (size_t)(bslots * ctx->n_tiles), sizeof(float));
            ctx->lat_r[i] = cache_zalloc(&a, (size_t)(bslots * c->qk_rope_dim), sizeof(float));
            if (kind == K3_LAYER_DSA) {
                ctx->idx8[i] = cache_zalloc(&a, (size_t)(bslots * c->index_head_dim), sizeof(int8_t));
                ctx->idx_s[i] = cache_zalloc(&a, (size_t)bslots, sizeof(float));
            }
        }
    }

    /* scratch for one round of T tokens */
    k3_scratch *s = &ctx->s;
    ctx->n_bank_max =
        c->attn_res_block_size > 0 ? (c->n_layers + c->attn_res_block_size - 1) / c->attn_res_block_size : 0;
    const int64_t H = c->n_heads, qh = c->qk_nope_dim + c->qk_rope_dim, kvl = c->kv_lora_rank;
    const int64_t Dl = c->expert_dim, E = c->n_experts, K = c->n_experts_per_tok;
    ctx->ff_width =
        max64(c->intermediate_size, max64((int64_t)c->n_shared_experts * c->moe_intermediate, c->moe_intermediate));
    s->P = zalloc(&a, (size_t)(T * D), sizeof(float));
    s->X = zalloc(&a, (size_t)(T * D), sizeof(float));
    s->xn = zalloc(&a, (size_t)(T * D), sizeof(float));
    s->tmp = zalloc(&a, (size_t)(T * D), sizeof(float));
    s->bank = zalloc(&a, (size_t)(ctx->n_bank_max * T * D), sizeof(float));
    s->kq = zalloc(&a, (size_t)(T * HK), sizeof(float));
    s->kk = zalloc(&a, (size_t)(T * HK), sizeof(float));
    s->kv = zalloc(&a, (size_t)(T * HK), sizeof(float));
    s->kg = zalloc(&a, (size_t)(T * HK), sizeof(float));
    s->kz = zalloc(&a, (size_t)(T * HK), sizeof(float));
    s->ko = zalloc(&a, (size_t)(T * HK), sizeof(float));
    s->kfa = zalloc(&a, (size_t)(T * max64(dk, c->kda_gate_rank)), sizeof(float));
    s->kbeta = zalloc(&a, (size_t)(T * c->kda_heads), sizeof(float));
    s->cq = zalloc(&a, (size_t)(T * c->q_lora_rank), sizeof(float));
    int64_t fused_rows = 0;
    for (int i = 0; i < c->n_layers; i++) { /* the stacked matrices' outputs */
        const k3_layer *L = &m->layers[i];
        fused_rows = max64(fused_rows, L->mla_down.data ? L->mla_down.rows : 0);
        fused_rows = max64(fused_rows, L->kda_in.data ? L->kda_in.rows : 0);
        fused_rows = max64(fused_rows, L->ffn_gu.data ? L->ffn_gu.rows : 0);
        fused_rows = max64(fused_rows, L->sh_gu.data ? L->sh_gu.rows : 0);
        fused_rows = max64(fused_rows, L->moe_in.data ? L->moe_in.rows : 0);
    }
    s->fused = zalloc(&a, (size_t)(T * fused_rows), sizeof(float));
    s->mq = zalloc(&a, (size_t)(T * H * qh), sizeof(float));
    s->ckv = zalloc(&a, (size_t)(T * ld), sizeof(float));
    s->qn = zalloc(&a, (size_t)(H * T * c->qk_nope_dim), sizeof(float));
    s->qa = zalloc(&a, (size_t)(H * T * kvl), sizeof(float));
    s->chat = zalloc(&a, (size_t)(H * T * kvl), sizeof(float));
    s->mo = zalloc(&a, (size_t)(T * H * c->v_head_dim), sizeof(float));
    s->mgate = zalloc(&a, (size_t)(T * H * c->v_head_dim), sizeof(float));
    s->mtmp = zalloc(&a, (size_t)(H * T * c->v_head_dim), sizeof(float));
    s->iq = zalloc(&a, (size_t)(T * c->index_n_heads * c->index_head_dim), sizeof(float));
    s->ik = zalloc(&a, (size_t)(T * c->index_head_dim), sizeof(float));
    s->iw = zalloc(&a, (size_t)(T * c->index_n_heads), sizeof(float));
    s->iq8 = zalloc(&a, (size_t)(T * c->index_n_heads * c->index_head_dim), sizeof(int8_t));
    s->iqs = zalloc(&a, (size_t)(T * c->index_n_heads), sizeof(float));
    s->isel = zalloc(&a, (size_t)(T * c->index_topk), sizeof(int64_t));
    if (ctx->kv == K3_KV_C8 && T > 1 && c->index_n_heads > 0) {
        s->iscore_n = T * ctx->max_ctx < K3_QLI_CHUNK_SCORES ? T * ctx->max_ctx : K3_QLI_CHUNK_SCORES;
        if (s->iscore_n < ctx->max_ctx) s->iscore_n = ctx->max_ctx;
        s->iscore = zalloc(&a, (size_t)s->iscore_n, sizeof(float));
        s->islots = zalloc(&a, (size_t)ctx->max_ctx, sizeof(int64_t));
    }
    s->n_parts = 2 * ctx->nth > K3_ATTN_PARTS_MAX ? 2 * ctx->nth : K3_ATTN_PARTS_MAX;
    s->part_o = zalloc(&a, (size_t)((s->n_parts + ctx->nth) * H * kvl), sizeof(float));
    s->part_l = zalloc(&a, (size_t)(s->n_parts * H), sizeof(float));
    s->rparts = zalloc(&a, (size_t)T, sizeof(int32_t));
    s->rfirst = zalloc(&a, (size_t)T, sizeof(int32_t));
    s->prow = zalloc(&a, (size_t)s->n_parts, sizeof(int32_t));
    s->icount = zalloc(&a, (size_t)T, sizeof(int32_t));
    s->f1 = zalloc(&a, (size_t)(T * ctx->ff_width), sizeof(float));
    s->f2 = zalloc(&a, (size_t)(T * ctx->ff_width), sizeof(float));
    s->rlog = zalloc(&a, (size_t)(T * E), sizeof(float));
    s->rids = zalloc(&a, (size_t)(T * K), sizeof(int32_t));
    s->rw = zalloc(&a, (size_t)(T * K), sizeof(float));
    s->lat = zalloc(&a, (size_t)(T * Dl), sizeof(float));
    s->lout = zalloc(&a, (size_t)(T * Dl), sizeof(float));
    s->ly = zalloc(&a, (size_t)(T * K * Dl), sizeof(float));
    s->erows = zalloc(&a, (size_t)(T * K), sizeof(int32_t));
    s->ecount = zalloc(&a, (size_t)(E + 1), sizeof(int32_t));
    s->eact = zalloc(&a, (size_t)E, sizeof(int32_t));
    s->tgather = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    s->tf1 = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    s->tf2 = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    s->tlout = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    for (int t = 0; !a.failed && t < ctx->nth; t++) {
        s->tgather[t] = zalloc(&a, (size_t)(T * Dl), sizeof(float));
        s->tf1[t] = zalloc(&a, (size_t)(T * c->moe_intermediate), sizeof(float));
        s->tf2[t] = zalloc(&a, (size_t)(T * c->moe_intermediate), sizeof(float));
        s->tlout[t] = zalloc(&a, (size_t)(T * Dl), sizeof(float));
    }
    s->rwork = zalloc(&a, (size_t)E, sizeof(float));
    s->tscore = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    s->tslots = zalloc(&a, (size_t)ctx->nth, sizeof(int64_t *));
    s->tsel = zalloc(&a, (size_t)ctx->nth, sizeof(int32_t *));
    s->twork = zalloc(&a, (size_t)ctx->nth, sizeof(int32_t *));
    s->tkda = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    s->tq = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    s->tqsfa = zalloc(&a, (size_t)ctx->nth, sizeof(float *));
    for (int t = 0; !a.failed && t < ctx->nth; t++) {
        s->tscore[t] = zalloc(&a, (size_t)ctx->max_ctx, sizeof(float));
        s->tslots[t] = zalloc(&a, (size_t)ctx->max_ctx, sizeof(int64_t));
        s->tsel[t] = zalloc(&a, (size_t)ctx->max_ctx, sizeof(int32_t));
        s->twork[t] = zalloc(&a, (size_t)ctx->max_ctx, sizeof(int32_t));
        s->tkda[t] = zalloc(&a,
                            (size_t)max64(k3_kda_chunk_work(K3_KDA_CHUNK, (int)dk, (int)dk),
                                          k3_kda_chunk_work_bf(K3_KDA_CHUNK_BF, (int)dk, (int)dk)),
                            sizeof(float));
        s->tq[t] = zalloc(&a, (size_t)(H * ld), sizeof(float));
        if (ctx->kv == K3_KV_C8)
            s->tqsfa[t] = zalloc(&a, (size_t)k3_qsfa_work((int)H, (int)kvl, (int)ctx->max_ctx), sizeof(float));
    }
    ctx->spans = zalloc(&a, (size_t)T, sizeof(k3_span));
    ctx->round_tokens = zalloc(&a, (size_t)T, sizeof(int32_t));
    ctx->round_out = zalloc(&a, (size_t)T, sizeof(int32_t));
    ctx->round_embeds = zalloc(&a, (size_t)T, sizeof(float *));
    if (!a.failed && ctx->dist && exchange_alloc(ctx, err) != K3_OK) a.failed = true;
    if (a.failed) {
        k3_ctx_free(ctx);
        return k3_err(err, K3_ERR_NOMEM, "context: out of memory (%lld tokens, %d sequences)",
                      (long long)opt->cache_tokens, opt->max_seqs);
    }
    *out = ctx;
    return K3_OK;
}

k3_status k3_ctx_init(k3_ctx **out, const k3_model *m, const k3_ctx_options *opt, k3_error *err) {
    return ctx_create(out, m, opt, 0, 0, err);
}

k3_status k3_ctx_init_pool(k3_ctx **out, const k3_model *m, const k3_ctx_options *opt, int32_t n_blocks,
                           int64_t max_ctx, k3_error *err) {
    *out = NULL;
    if (n_blocks < 1 || max_ctx < 1) return k3_err(err, K3_ERR_ARG, "context: n_blocks and max_ctx must be positive");
    return ctx_create(out, m, opt, n_blocks, max_ctx, err);
}

/* ---- sequences ------------------------------------------------------------- */

static void clear_state(k3_ctx *ctx, int32_t seq) {
    const k3_config *c = ctx->c;
    const int64_t HK = (int64_t)c->kda_heads * c->kda_head_dim, dk = c->kda_head_dim;
    const int64_t Km1 = c->conv_size > 0 ? c->conv_size - 1 : 0;
    for (int i = 0; i < c->n_layers; i++) {
        if (!ctx->kda_S[i]) continue;
        memset(ctx->kda_S[i] + (int64_t)seq * c->kda_heads * dk * dk, 0,
               sizeof(float) * (size_t)(c->kda_heads * dk * dk));
        memset(ctx->kda_conv[i] + (int64_t)seq * 3 * Km1 * HK, 0, sizeof(float) * (size_t)(3 * Km1 * HK));
    }
}

void k3_ctx_seq_clear_state(k3_ctx *ctx, int32_t seq) {
    if (seq < 0 || seq >= ctx->max_seqs) return;
    k3_spec_forget(ctx, seq);
    clear_state(ctx, seq);
}

void k3_ctx_seq_reset(k3_ctx *ctx, int32_t seq) {
    if (seq < 0 || seq >= ctx->max_seqs) return;
    k3_seq *s = &ctx->seqs[seq];
    if (ctx->free_blocks)
        for (int32_t b = s->n_blocks - 1; b >= 0; b--) ctx->free_blocks[ctx->n_free++] = s->blocks[b];
    s->n_blocks = 0;
    s->pos = 0;
    k3_spec_forget(ctx, seq);
    clear_state(ctx, seq);
}

k3_status k3_ctx_seq_set_blocks(k3_ctx *ctx, int32_t seq, const int32_t *blocks, int32_t n, k3_error *err) {
    if (seq < 0 || seq >= ctx->max_seqs)
        return k3_err(err, K3_ERR_ARG, "context: sequence %d out of range [0, %d)", seq, ctx->max_seqs);
    if (n < 0 || n > ctx->max_blocks_per_seq)
        return k3_err(err, K3_ERR_RANGE, "context: %d blocks for sequence %d, at most %d", n, seq,
                      ctx->max_blocks_per_seq);
    for (int32_t i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= ctx->n_blocks)
            return k3_err(err, K3_ERR_ARG, "context: block id %d out of range [0, %d)", blocks[i], ctx->n_blocks);
    k3_seq *s = &ctx->seqs[seq];
    if (n) memcpy(s->blocks, blocks, sizeof(int32_t) * (size_t)n);
    s->n_blocks = n;
    return K3_OK;
}

void k3_ctx_seq_set_pos(k3_ctx *ctx, int32_t seq, int64_t pos) {
    if (seq < 0 || seq >= ctx->max_seqs || pos < 0) return;
    ctx->seqs[seq].pos = pos;
}

int64_t k3_ctx_state_bytes(const k3_ctx *ctx) {
    const k3_config *c = ctx->c;
    const int64_t HK = (int64_t)c->kda_heads * c->kda_head_dim, dk = c->kda_head_dim;
    const int64_t Km1 = c->conv_size > 0 ? c->conv_size - 1 : 0;
    int64_t n = 0;
    for (int i = 0; i < c->n_layers; i++)
        if (ctx->kda_S[i]) n += (int64_t)c->kda_heads * dk * dk + 3 * Km1 * HK;
    return n * (int64_t)sizeof(float);
}

/* save (dir 0) or restore (dir 1) the KDA state of one slot, layer by layer
 * at kda_snap_off (the layout captures use too): S then the conv windows */
static void state_copy(const k3_ctx *ctx, int32_t seq, float *buf, int dir) {
    const k3_config *c = ctx->c;
    const int64_t HK = (int64_t)c->kda_heads * c->kda_head_dim, dk = c->kda_head_dim;
    const int64_t Km1 = c->conv_size > 0 ? c->conv_size - 1 : 0;
    const size_t nS = (size_t)c->kda_heads * dk * dk, nC = (size_t)(3 * Km1 * HK);
    for (int i = 0; i < c->n_layers; i++) {
        if (!ctx->kda_S[i]) continue;
        float *S = ctx->kda_S[i] + (int64_t)seq * nS, *C = ctx->kda_conv[i] + (int64_t)seq * nC;
        float *b = buf + ctx->kda_snap_off[i];
        if (dir == 0) {
            memcpy(b, S, sizeof(float) * nS);
            memcpy(b + nS, C, sizeof(float) * nC);
        } else {
            memcpy(S, b, sizeof(float) * nS);
            memcpy(C, b + nS, sizeof(float) * nC);
        }
    }
}

void k3_ctx_state_save(const k3_ctx *ctx, int32_t seq, void *dst) {
    if (seq >= 0 && seq < ctx->max_seqs) state_copy(ctx, seq, dst, 0);
}

void k3_ctx_state_restore(k3_ctx *ctx, int32_t seq, const void *src) {
    if (seq < 0 || seq >= ctx->max_seqs) return;
    k3_spec_forget(ctx, seq);
    state_copy(ctx, seq, (float *)src, 1);
}

k3_status k3_ctx_capture_state(k3_ctx *ctx, int32_t seq, int64_t pos, void *dst, k3_error *err) {
    if (seq < 0 || seq >= ctx->max_seqs || pos < 1 || !dst)
        return k3_err(err, K3_ERR_ARG, "capture: bad slot %d, position %lld or no buffer", seq, (long long)pos);
    if (ctx->n_caps == ctx->cap_caps) {
        const int32_t cap = ctx->cap_caps ? 2 * ctx->cap_caps : 16;
        k3_capture *c = realloc(ctx->caps, sizeof *c * (size_t)cap);
        if (!c) return k3_err(err, K3_ERR_NOMEM, "capture: out of memory");
        ctx->caps = c;
        ctx->cap_caps = cap;
    }
    ctx->caps[ctx->n_caps++] = (k3_capture){seq, pos, dst};
    return K3_OK;
}

void k3_ctx_forget_captures(k3_ctx *ctx) { ctx->n_caps = 0; }

int64_t k3_ctx_seq_pos(const k3_ctx *ctx, int32_t seq) {
    if (seq < 0 || seq >= ctx->max_seqs) return -1;
    return ctx->seqs[seq].pos;
}

/* ---- measurement --------------------------------------------------------------- */

const char *k3_prof_op_name(k3_prof_op op) {
    static const char *names[K3_PROF_COUNT] = {"embed", "attnres", "norm", "kda", "mlapo", "qli",
                                               "qsfa",  "mla_out", "ffn",  "moe", "head"};
    return op >= 0 && op < K3_PROF_COUNT ? names[op] : "?";
}

void k3_ctx_profile_enable(k3_ctx *ctx, bool on) { ctx->prof_on = on; }

void k3_ctx_profile_take(k3_ctx *ctx, k3_profile *out) {
    for (int i = 0; i < K3_PROF_COUNT; i++) {
        out->seconds[i] = ctx->prof[i];
        ctx->prof[i] = 0.0;
    }
    out->moe_calls = ctx->prof_moe[0];
    out->moe_experts = ctx->prof_moe[1];
    out->moe_rows = ctx->prof_moe[2];
    memset(ctx->prof_moe, 0, sizeof ctx->prof_moe);
}

k3_status k3_ctx_seq_fill_synthetic(k3_ctx *ctx, int32_t seq, int64_t n, uint64_t seed, k3_error *err) {
    const k3_config *c = ctx->c;
    if (seq < 0 || seq >= ctx->max_seqs) return k3_err(err, K3_ERR_ARG, "fill: sequence %d out of range", seq);
    k3_seq *s = &ctx->seqs[seq];
    if (n < 0 || s->pos + n > ctx->max_ctx)
        return k3_err(err, K3_ERR_RANGE, "fill: %lld + %lld tokens exceed the context of %lld", (long long)s->pos,
                      (long long)n, (long long)ctx->max_ctx);
    const int64_t end = s->pos + n;
    const int64_t need = k3_ctx_blocks_for(ctx, end) - s->n_blocks;
    if (!ctx->free_blocks && need > 0)
        return k3_err(err, K3_ERR_ARG, "fill: this context's blocks are owned by an engine");
    if (need > ctx->n_free)
        return k3_err(err, K3_ERR_RANGE, "fill: cache full: %lld blocks needed, %d free", (long long)need, ctx->n_free);
    while (s->n_blocks < k3_ctx_blocks_for(ctx, end)) s->blocks[s->n_blocks++] = ctx->free_blocks[--ctx->n_free];
    uint64_t r = seed * 0x9E3779B97F4A7C15ull + 1;
#define RND() \
    ((float)((int64_t)((r = r * 6364136223846793005ull + 1442695040888963407ull) >> 40) - 8388608) / 8388608.0f)
    const int kvl = c->kv_lora_rank, rope = c->qk_rope_dim, dI = c->index_head_dim;
    float row[4096];
    if (kvl + rope > 4096 || dI > 4096)
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "fill: synthetic cache rows are at most 4096 floats (kv_lora_rank + qk_rope_head_dim = %d, "
                      "index_head_dim = %d)",
                      kvl + rope, dI);
    for (int i = 0; i < c->n_layers; i++) {
        if (c->layer_kind[i] == K3_LAYER_KDA) continue;
        for (int64_t p = s->pos; p < end; p++) {
            /* under DCP every rank draws every row, and keeps its own */
            const int64_t slot = k3_ctx_own_slot(ctx, seq, p);
            for (int j = 0; j < kvl + rope && j < 4096; j++) row[j] = RND();
            if (slot < 0) {
                if (c->layer_kind[i] == K3_LAYER_DSA)
                    for (int j = 0; j < dI && j < 4096; j++) (void)RND();
                continue;
            }
            if (ctx->kv == K3_KV_C8) {
                k3_quant_i8_tiles(row, kvl, ctx->lat8[i] + slot * kvl, ctx->lat_s[i] + slot * ctx->n_tiles);
                memcpy(ctx->lat_r[i] + slot * rope, row + kvl, sizeof(float) * (size_t)rope);
            } else {
                memcpy(ctx->lat_cache[i] + slot * (kvl + rope), row, sizeof(float) * (size_t)(kvl + rope));
            }
            if (c->layer_kind[i] != K3_LAYER_DSA) continue;
            for (int j = 0; j < dI && j < 4096; j++) row[j] = RND();
            if (ctx->kv == K3_KV_C8) ctx->idx_s[i][slot] = k3_quant_i8(row, dI, ctx->idx8[i] + slot * dI);
            else memcpy(ctx->idx_cache[i] + slot * dI, row, sizeof(float) * (size_t)dI);
        }
    }
#undef RND
    s->pos = end;
    return K3_OK;
}
