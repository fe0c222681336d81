/*
 * config.h -- the text model's hyper-parameters, parsed from config.json.
 *
 * Reads the nested Hugging Face layout (`text_config`, 1-based
 * `linear_attn_config` layer lists, `quantization_config`) and flat configs
 * (fields at the root). Two families: "kimi_k3" (AttnRes, SiTU, latent MoE,
 * bounded-sigmoid KDA gate, MLA output gate, optional DSA indexer) and
 * "kimi_linear" (plain residuals, SwiGLU, full-width experts, softplus gate).
 * A field this engine does not know that could change the math is refused.
 * Layer indices here are 0-based.
 */
#ifndef K3_MODEL_CONFIG_H
#define K3_MODEL_CONFIG_H

#include "k3.h"

#define K3_MAX_LAYERS 512
/* Bounds of the fixed-size arrays in the compute code, enforced here. */
#define K3_MAX_HEADS 1024       /* MLA heads: lse rows in forward.c */
#define K3_MAX_KDA_HEAD_DIM 512 /* k3_kda_recurrent_ref's value row */
#define K3_MOE_MAX_GROUPS 256   /* k3_router_select's group arrays */

typedef enum k3_layer_kind {
    K3_LAYER_KDA = 0, /* Kimi Delta Attention (linear, recurrent state) */
    K3_LAYER_MLA,     /* gated NoPE MLA, dense softmax over the past */
    K3_LAYER_DSA,     /* MLA + lightning indexer, softmax over the top-k */
} k3_layer_kind;

typedef enum k3_act {
    K3_ACT_SITU = 0, /* situ(g,u) = b1 tanh(g/b1) sigma(g) * b2 tanh(u/b2) */
    K3_ACT_SILU,     /* SwiGLU: silu(g) * u */
} k3_act;

typedef struct k3_config {
    char model_type[32]; /* of the text model: "kimi_k3" or "kimi_linear" */
    bool is_k3;          /* K3 family semantics (AttnRes etc.) */

    int64_t vocab_size;
    int64_t hidden_size; /* D */
    int32_t n_layers;
    int64_t max_positions;
    float rms_eps; /* 1e-5 in K3 */
    bool tie_word_embeddings;
    int32_t bos_id, eos_id, pad_id; /* -1 when absent */

    /* MLA */
    int32_t n_heads;     /* MLA heads */
    int32_t q_lora_rank; /* 0 = no q compression (q_proj direct) */
    int32_t kv_lora_rank;
    int32_t qk_nope_dim, qk_rope_dim, v_head_dim;
    bool mla_use_output_gate; /* sigmoid(g_proj x) gate before o_proj */

    /* KDA (linear_attn_config) */
    int32_t kda_heads, kda_head_dim, conv_size;
    bool kda_has_lower_bound; /* true: g = lb * sigmoid(exp(A) * z)   */
    float kda_lower_bound;    /* false: g = -exp(A) * softplus(z)      */
    bool kda_full_rank_gate;  /* output gate: g_proj, else g_a/g_b low rank */
    int32_t kda_gate_rank;    /* rank of g_a/g_b when low-rank (= head_dim) */

    /* AttnRes; 0 = plain residual stream */
    int32_t attn_res_block_size;

    /* FFN / MoE */
    int32_t first_k_dense; /* first_k_dense_replace */
    int32_t moe_layer_freq;
    int64_t intermediate_size; /* dense FFN width */
    int32_t n_experts, n_experts_per_tok, n_shared_experts;
    int64_t moe_intermediate; /* per expert */
    int64_t expert_dim;       /* latent width routed experts see (= D when not latent) */
    bool latent_moe;          /* routed_expert_hidden_size set */
    bool latent_moe_norm;
    bool router_sigmoid; /* sigmoid router (else softmax) */
    bool moe_renormalize;
    float routed_scaling;
    int32_t n_expert_groups, topk_groups;
    bool experts_mxfp4; /* quantization_config says mxfp4-pack-quantized */

    k3_act act;
    float situ_beta, situ_linear_beta; /* linear beta 0 = plain u */

    /* DSA lightning indexer; index_n_heads == 0 = none */
    int32_t index_n_heads, index_head_dim, index_topk;

    /* per layer */
    uint8_t layer_kind[K3_MAX_LAYERS]; /* k3_layer_kind */
    bool layer_moe[K3_MAX_LAYERS];
} k3_config;

/* Parses config.json text. The pure part, fuzzable; src names the file in
 * messages. */
k3_status k3_config_parse(k3_config *cfg, const char *json, size_t len, const char *src, k3_error *err);
/* Reads and parses DIR/config.json. */
k3_status k3_config_load(k3_config *cfg, const char *dir, k3_error *err);

/* True when layer i banks its incoming residual (AttnRes). */
static inline bool k3_config_is_bank_layer(const k3_config *c, int i) {
    return c->attn_res_block_size > 0 && i % c->attn_res_block_size == 0;
}

#endif /* K3_MODEL_CONFIG_H */
