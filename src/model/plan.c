/*
 * plan.c -- k3_plan_compute: a deployment sized on paper from a config
 * alone. The tensor shapes are those the loader binds (src/model/model.c);
 * the byte widths those of k3's formats: BF16 as stored, W8A8 int8 with an
 * fp32 scale and an int32 sum per output row, MXFP8 one byte plus an E8M0
 * scale per 32, MXFP4 routed experts half a byte plus a scale per 32. The
 * caches as k3_ctx allocates them (k3_config_cache_bytes_per_token, the one
 * place the formula is written). Traffic per decoded token as the DCP and
 * EP forms of the layers move it (src/layers): the top-k candidates (8 B each),
 * the DCP partial outputs (kv_lora + 1 floats per head, to the head's
 * merging rank) and the merged heads (kv_lora floats), and for EP the
 * latent (fp32) once per remote owner of a token's experts, and each remote
 * expert's result plus the combined row back.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/plan.h"

#include "common/error.h"
#include "kernels/attn_ops.h"

int64_t k3_config_cache_bytes_per_token(const k3_config *c, k3_kv_type kv) {
    const int64_t kvl = c->kv_lora_rank, rope = c->qk_rope_dim, dI = c->index_head_dim;
    const int64_t tiles = (kvl + K3_C8_TILE - 1) / K3_C8_TILE;
    int64_t n = 0;
    for (int i = 0; i < c->n_layers; i++) {
        if (c->layer_kind[i] == K3_LAYER_KDA) continue;
        n += kv == K3_KV_C8 ? kvl + tiles * 4 + rope * 4 : (kvl + rope) * 4;
        if (c->layer_kind[i] == K3_LAYER_DSA) n += kv == K3_KV_C8 ? dI + 4 : dI * 4;
    }
    return n;
}

static int64_t linear_bytes(int64_t rows, int64_t cols, k3_wquant q) {
    if (q == K3_WQ_INT8) return rows * cols + rows * 8;
    if (q == K3_WQ_MXFP8 && cols % 32 == 0) return rows * cols + rows * cols / 32;
    return rows * cols * 2;
}

/* expected number of the E groups hit by k distinct experts drawn from n
 * (n/E per group) */
static double groups_hit(int64_t n, int64_t k, int64_t E) {
    if (E <= 1) return 1.0;
    /* P(a group is missed) = C(n - n/E, k) / C(n, k) */
    double p = 1.0;
    const int64_t g = n / E;
    for (int64_t i = 0; i < k; i++) p *= (double)(n - g - i) / (double)(n - i);
    return (double)E * (1.0 - (p > 0 ? p : 0));
}

k3_status k3_plan_compute(const char *path, const k3_plan_options *opt, k3_plan *out, k3_error *err) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return k3_err(err, K3_ERR_IO, "plan: cannot open %s", path);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 65536 > cap) {
            char *nb = realloc(buf, cap = cap ? 2 * cap : 1 << 20);
            if (!nb) {
                free(buf);
                fclose(f);
                return k3_err(err, K3_ERR_NOMEM, "plan: out of memory");
            }
            buf = nb;
        }
        const size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0) break;
    }
    fclose(f);
    k3_config *c = calloc(1, sizeof *c);
    if (!c) {
        free(buf);
        return k3_err(err, K3_ERR_NOMEM, "plan: out of memory");
    }
    k3_status s = k3_config_parse(c, buf, len, path, err);
    free(buf);
    if (s) {
        free(c);
        return s;
    }
    const int64_t D = opt->dcp > 0 ? opt->dcp : 1, E = opt->ep > 0 ? opt->ep : 1;
    const int64_t L = opt->context > 0 ? opt->context : 1 << 20;
    const int64_t k = opt->index_topk > 0 ? opt->index_topk : c->index_topk;
    if (c->n_experts > 0 ? (E > c->n_experts || c->n_experts % E) : E > 1) {
        s = k3_err(err, K3_ERR_ARG, "plan: --ep %lld does not divide the %d routed experts", (long long)E,
                   c->n_experts);
        free(c);
        return s;
    }
    const k3_wquant q = opt->quant.linear;
    const int64_t Hd = c->hidden_size, V = c->vocab_size;
    int64_t w = V * Hd * 2 + (c->tie_word_embeddings ? 0 : V * Hd * 2) + Hd * 4, ex = 0;
    const int64_t cache = k3_config_cache_bytes_per_token(c, opt->kv_cache);
    int64_t state = 0, lse = 0, nd = 0, nm = 0, nk = 0, nmoe = 0;
    double spec_ex[17] = {0};
    const int64_t kvl = c->kv_lora_rank, rope = c->qk_rope_dim, H = c->n_heads;
    for (int i = 0; i < c->n_layers; i++) {
        w += 2 * Hd * 4; /* the two norms (and AttnRes vectors, about the same) */
        if (c->layer_kind[i] == K3_LAYER_KDA) {
            const int64_t Hk = c->kda_heads, dk = c->kda_head_dim, HK = Hk * dk;
            nk++;
            w += 3 * linear_bytes(HK, Hd, q) + linear_bytes(Hd, HK, q) + linear_bytes(dk, Hd, q) +
                linear_bytes(HK, dk, q) + linear_bytes(Hk, Hd, q);
            w += c->kda_full_rank_gate ? linear_bytes(HK, Hd, q)
                                       : linear_bytes(c->kda_gate_rank, Hd, q) + linear_bytes(HK, c->kda_gate_rank, q);
            w += (3 * HK * c->conv_size + HK + Hk + dk) * 4;
            state += (Hk * dk * dk + 3 * HK * (c->conv_size - 1)) * 4;
            out->spec_reapply_bytes_per_pos += (6 * HK + Hk) * 4;
            out->spec_states_bytes_per_pos += (Hk * dk * dk + 3 * HK * (c->conv_size - 1)) * 4;
        } else {
            const int64_t qk = c->qk_nope_dim + rope;
            if (c->q_lora_rank > 0) w += linear_bytes(c->q_lora_rank, Hd, q) + linear_bytes(H * qk, c->q_lora_rank, q);
            else w += linear_bytes(H * qk, Hd, q);
            w += linear_bytes(kvl + rope, Hd, q) + linear_bytes(H * (c->qk_nope_dim + c->v_head_dim), kvl, q) +
                linear_bytes(Hd, H * c->v_head_dim, q);
            if (c->mla_use_output_gate) w += linear_bytes(H * c->v_head_dim, Hd, q);
            /* the head-split merge (H divisible by D), else every partial */
            lse += H % D == 0 ? (D - 1) * (H / D) * (2 * kvl + 1) * 4 : (D - 1) * H * (kvl + 1) * 4;
            if (c->layer_kind[i] == K3_LAYER_DSA) {
                const int64_t HI = c->index_n_heads, dI = c->index_head_dim;
                nd++;
                w += linear_bytes(HI * dI, c->q_lora_rank > 0 ? c->q_lora_rank : Hd, q) + linear_bytes(dI, Hd, q) +
                    linear_bytes(HI, Hd, q) + 2 * dI * 4;
            } else {
                nm++;
            }
        }
        if (c->layer_moe[i]) {
            const int64_t Ex = c->n_experts, Dl = c->expert_dim, Im = c->moe_intermediate;
            nmoe++;
            w += Ex * Hd * 2 + Ex * 4; /* router (kept as stored) */
            if (c->latent_moe) w += linear_bytes(Dl, Hd, q) + linear_bytes(Hd, Dl, q) + Dl * 4;
            const int64_t S = (int64_t)c->n_shared_experts * Im;
            if (S) w += 2 * linear_bytes(S, Hd, q) + linear_bytes(Hd, S, q);
            const int64_t per = c->experts_mxfp4 ? 3 * (Im * Dl / 2 + Im * Dl / 32) : 3 * Im * Dl * 2;
            ex += Ex * per;
            /* a pass of n positions reads the union of their experts: expected
             * Ex (1 - (1 - K/Ex)^n) of them when the positions route independently */
            for (int n = 1; n <= 16; n++)
                spec_ex[n] +=
                    (double)per * (double)Ex * (1.0 - pow(1.0 - (double)c->n_experts_per_tok / (double)Ex, (double)n));
            /* per token: latent to each remote owner, each remote result back,
             * the combined row to the other E-1 ranks of the group */
            const double hit = groups_hit(Ex, c->n_experts_per_tok, E);
            out->ep_dispatch_bytes += (int64_t)llround(hit * (double)(E - 1) / (double)E * (double)Dl * 4);
            out->ep_combine_bytes +=
                (int64_t)llround((double)c->n_experts_per_tok * (double)(E - 1) / (double)E * (double)Dl * 4) +
                (E - 1) * Dl * 4;
            out->ep_source_recv_bytes +=
                (int64_t)llround((double)c->n_experts_per_tok * (double)(E - 1) / (double)E * (double)Dl * 4);
            out->ep_source_sent_bytes +=
                (int64_t)llround(hit * (double)(E - 1) / (double)E * (double)Dl * 4) + (E - 1) * Dl * 4;
        } else if (c->intermediate_size > 0) {
            w += 3 * linear_bytes(c->intermediate_size, Hd, q);
        }
    }
    int lg = 0;
    while ((1LL << lg) < D) lg++;
    out->weight_bytes = w + ex;
    out->expert_bytes = ex;
    /* a pass reads one embedding row, not the table (unless it is the head too) */
    const int64_t emb_table = c->tie_word_embeddings ? 0 : V * Hd * 2;
    for (int n = 1; n <= 16; n++) out->verify_read_bytes[n] = w - emb_table + (int64_t)llround(spec_ex[n]);
    out->decode_read_bytes = out->verify_read_bytes[1];
    out->cache_bytes_per_token = cache;
    out->cache_bytes_per_seq = cache * L;
    out->cache_bytes_per_1m = cache * (1 << 20);
    out->state_bytes_per_seq = state;
    out->weight_bytes_per_rank = w + ex / E;
    out->cache_bytes_per_rank = cache * ((L + D - 1) / D);
    out->mem_bytes_per_rank = out->weight_bytes_per_rank + out->cache_bytes_per_rank + state;
    /* prefill -> decode: the prompt's rows of every MLA/DSA layer and one KDA
     * state (src/pd); under DCP each decode rank takes its own rows and the
     * whole state */
    out->pd_bytes_per_seq = cache * L + state;
    out->pd_bytes_per_rank = out->cache_bytes_per_rank + state;
    out->n_dsa = (int32_t)nd;
    out->n_mla = (int32_t)nm;
    out->n_kda = (int32_t)nk;
    out->n_moe = (int32_t)nmoe;
    out->topk_allgather_bytes = D > 1 ? nd * (D - 1) * k * 8 : 0;
    out->topk_butterfly_bytes = D > 1 ? nd * lg * k * 8 : 0;
    out->lse_bytes = D > 1 ? lse : 0;
    if (E == 1)
        out->ep_dispatch_bytes = out->ep_combine_bytes = out->ep_source_recv_bytes = out->ep_source_sent_bytes = 0;
    /* the collectives of one decoded step (src/layers/mla_dcp.c, src/comm/topk.c, src/layers/moe_ep.c) */
    const int32_t lse_calls = D > 1 ? (int32_t)((nd + nm) * (H % D == 0 ? 2 : 1)) : 0;
    const int32_t ep_calls = E > 1 ? (int32_t)(3 * nmoe) : 0;
    const int32_t step = D > 1 || E > 1 ? 1 : 0;
    out->collectives_allgather = lse_calls + (D > 1 ? (int32_t)nd : 0) + ep_calls + step;
    out->collectives_butterfly = lse_calls + (D > 1 ? (int32_t)nd * lg : 0) + ep_calls + step;
    free(c);
    return K3_OK;
}
