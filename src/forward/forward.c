/*
 * forward.c -- the layer loop of one forward round (docs/model.md §3): the
 * embedding, then per layer AttnRes mix -> RMSNorm -> KDA or MLA/DSA ->
 * AttnRes mix -> RMSNorm -> dense FFN or MoE (the layers are src/layers),
 * then the head.
 *
 * A round is T <= max_batch token rows drawn from one or more sequences
 * (spans). Everything that is per token (projections, norms, AttnRes, FFN,
 * MoE) runs over all T rows at once; what carries state across tokens (KDA
 * recurrence and conv windows, MLA/DSA caches) runs per span. All arithmetic
 * is fp32; weights are read in their stored format by the kernels.
 */
#include <string.h>

#include "forward/forward.h"
#include "layers/layers.h"

void k3_forward_round(k3_ctx *ctx, const int32_t *tokens, const int32_t *out_rows, int32_t n_out, float *logits) {
    const k3_model *m = ctx->m;
    const k3_config *c = ctx->c;
    const int64_t T = ctx->T, D = c->hidden_size;
    k3_scratch *s = &ctx->s;
    const bool attn_res = c->attn_res_block_size > 0;

    /* a row given with the batch (image features) replaces the token's embedding */
    PROF(
        ctx, K3_PROF_EMBED, for (int64_t t = 0; t < T; t++) {
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
                PROF(ctx, K3_PROF_ATTNRES, k3_attnres_mix_rows(ctx, s->X, s->P, L->attn_res_w, nb));
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
        PROF(ctx, K3_PROF_NORM, k3_rmsnorm_rows(ctx, s->xn, D, X, D, L->input_norm, D, c->rms_eps));
        if (L->kind == K3_LAYER_KDA) PROF(ctx, K3_PROF_KDA, k3_kda_layer(ctx, L, i, s->xn, s->tmp));
        else k3_mla_layer(ctx, L, i, s->xn, s->tmp);
        for (int64_t k = 0; k < T * D; k++) s->P[k] += s->tmp[k];

        const float *Y = s->P;
        if (attn_res) {
            PROF(ctx, K3_PROF_ATTNRES, k3_attnres_mix_rows(ctx, s->X, s->P, L->mlp_res_w, nb));
            Y = s->X;
        }
        PROF(ctx, K3_PROF_NORM, k3_rmsnorm_rows(ctx, s->xn, D, Y, D, L->post_attn_norm, D, c->rms_eps));
        if (L->moe) k3_moe_layer(ctx, L, s->xn, s->X);
        else
            PROF(ctx, K3_PROF_FFN,
                 k3_ffn_dense(ctx, &L->ffn_gu, &L->ffn_gate, &L->ffn_up, &L->ffn_down, s->xn, T, s->X));
        for (int64_t k = 0; k < T * D; k++) s->P[k] += s->X[k];
    }
    if (!n_out) return;

    const float *Z = s->P;
    if (attn_res) {
        PROF(ctx, K3_PROF_ATTNRES, k3_attnres_mix_rows(ctx, s->X, s->P, m->out_res_w, nb));
        Z = s->X;
    }
    PROF(ctx, K3_PROF_HEAD, {
        for (int32_t r = 0; r < n_out; r++)
            k3_rmsnorm(s->xn + (int64_t)r * D, Z + (int64_t)out_rows[r] * D, m->final_norm, D, c->rms_eps);
        k3_matmul(ctx->pool, &m->lm_head, s->xn, n_out, logits);
    });
}
