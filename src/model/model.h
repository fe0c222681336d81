/*
 * model.h -- a loaded checkpoint: config + weights bound by name and checked.
 *
 * k3_model_open (model.c) maps the safetensors, finds every tensor the config
 * implies (with or without the `language_model.` prefix), checks its dtype and
 * shape, and fills the structs below. Matrices stay in their stored format
 * (k3_mat views into the mapping). Small vectors (norm weights, biases, conv
 * taps, A_log, the AttnRes pseudo-queries) are converted to fp32 copies the
 * model owns. No tensor data is touched before this check passes.
 */
#ifndef K3_MODEL_MODEL_H
#define K3_MODEL_MODEL_H

#include "k3.h"
#include "config.h"
#include "safetensors.h"
#include "../kernels/kernels.h"

typedef struct k3_layer {
    k3_layer_kind kind;
    bool moe;

    float *input_norm;     /* [D] */
    float *post_attn_norm; /* [D] */
    float *attn_res_w;     /* [D] self_attention_res_norm ⊙ res_proj[0]; NULL w/o AttnRes */
    float *mlp_res_w;      /* [D] mlp_res_norm ⊙ mlp_res_proj[0] */

    /* attention output, shared names: KDA and MLA both have these */
    k3_mat o_proj; /* KDA [D, H*dk]; MLA [D, H*v] */
    k3_mat g_proj; /* KDA full-rank gate [H*dk, D]; MLA output gate [H*v, D] */

    /* KDA */
    k3_mat q_proj, k_proj, v_proj;   /* [H*dk, D] */
    k3_mat g_a, g_b;                 /* low-rank output gate [r, D], [H*dk, r] */
    k3_mat f_a, f_b;                 /* decay gate [dk, D], [H*dk, dk] */
    k3_mat b_proj;                   /* [H, D] */
    float *q_conv, *k_conv, *v_conv; /* [conv_size, H*dk], tap-major */
    float *A_log;                    /* [H] (stored padded to dk in K3) */
    float *dt_bias;                  /* [H*dk] */
    float *o_norm;                   /* [dk] */

    /* MLA */
    k3_mat q_a;       /* [q_lora, D]  (q_lora_rank > 0) */
    float *q_a_norm;  /* [q_lora] */
    k3_mat q_b;       /* [H*(nope+rope), q_lora]; or q_proj [.., D] when q_lora = 0 */
    k3_mat kv_a;      /* [kv_lora + rope, D] */
    float *kv_a_norm; /* [kv_lora] */
    k3_mat kv_b;      /* [H*(nope+v), kv_lora] */
    float *wuk_t;     /* [H, kv_lora, nope] fp32: W_UK_h transposed, for the
                                 absorbed query qa_h = W_UK_hᵀ q_nope_h (derived at load) */
    k3_mat wuk;       /* the same as a matrix [H*kv_lora, nope] (head h: rows
                                 h*kv_lora..), which W8A8 quantizes like kv_b */

    k3_mat mla_down; /* MLAPO: [q_a; kv_a; idx_wk; idx_weights] rows in one
                                 owned matrix, so the layer input is read once
                                 (derived at load; data NULL when the parts differ
                                 in dtype or q_lora_rank = 0) */

    k3_mat kda_in; /* KDA: [q; k; v; f_a; b_proj; g_proj (full rank)] stacked
                                 the same way */

    /* DSA indexer */
    k3_mat idx_wq_b;                    /* [HI*dI, q_lora] */
    k3_mat idx_wk;                      /* [dI, D] */
    float *idx_k_norm_w, *idx_k_norm_b; /* [dI] LayerNorm */
    k3_mat idx_weights;                 /* weights_proj [HI, D] */

    /* dense FFN */
    k3_mat ffn_gate, ffn_up; /* [I, D] */
    k3_mat ffn_down;         /* [D, I] */
    k3_mat ffn_gu;           /* [gate; up] stacked (derived at load, or empty) */

    /* MoE */
    k3_mat router;             /* [E, D] */
    float *router_bias;        /* [E] e_score_correction_bias; NULL when absent */
    k3_mat lat_down;           /* routed_expert_down_proj [Dl, D] (latent MoE) */
    k3_mat lat_up;             /* routed_expert_up_proj [D, Dl] */
    float *lat_norm;           /* routed_expert_norm [Dl] */
    k3_mat *exp_gate, *exp_up; /* [E] of [Im, Dl]  (w1, w3) */
    k3_mat *exp_down;          /* [E] of [Dl, Im]  (w2) */
    k3_mat sh_gate, sh_up;     /* [n_shared*Im, D] */
    k3_mat sh_down;            /* [D, n_shared*Im] */
    k3_mat sh_gu;              /* [sh_gate; sh_up] stacked (derived at load, or empty) */
    k3_mat moe_in;             /* latent MoE with shared experts: [lat_down; sh_gate; sh_up],
                                 everything that reads the MoE input but the router */
} k3_layer;

struct k3_model {
    k3_config cfg;
    k3_st *st; /* the mapped files */
    char *dir;

    k3_mat embed;      /* [V, D] */
    k3_mat lm_head;    /* [V, D] (embed when tied) */
    float *final_norm; /* [D] */
    float *out_res_w;  /* [D] output_attn_res_norm ⊙ proj; NULL w/o AttnRes */
    k3_layer *layers;  /* [n_layers] */

    int32_t ep_rank, ep_size;  /* routed experts held: EP rank ep_rank of ep_size (k3_model_open_ep) */
    int64_t quant_bytes_delta; /* change of weight bytes read per token by k3_model_quantize */
    bool bf16;                 /* the BF16 dot products run (k3_model_quantize marked the matrices) */
    int32_t qsfa_bf16_heads;   /* attention on the C8 cache takes QSFA's BF16 form from this many heads
                                  (attn_ops.h: K3_QSFA_BF16_HEADS with bf16, else 0 = never) */
    float **owned;             /* fp32 copies and quantized matrices to free */
    int64_t n_owned, cap_owned;
    uint8_t *pack; /* the current chunk of own_packed (one of owned) */
    size_t pack_used;
};

/* The matrix type of a float tensor (F32, F16, BF16), viewed in place. */
k3_wtype k3_model_wtype_of(k3_dtype d);

#endif /* K3_MODEL_MODEL_H */
