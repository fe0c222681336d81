/*
 * moe.h -- the MoE router and the gated activations (k3-model.md §3.5).
 *
 * Router: scores s = sigmoid(logits) (or softmax); experts chosen by the top-k
 * of s + correction bias (ties to the lower id); weights from the unbiased s,
 * renormalised to sum 1 when asked, then times routed_scaling_factor. With
 * n_group > topk_group the groups are first ranked by the sum of their two
 * best biased scores (DeepSeek's noaux_tc).
 */
#ifndef K3_MOE_MOE_H
#define K3_MOE_MOE_H

#include <stdbool.h>
#include <stdint.h>

typedef struct k3_router_cfg {
    int n_experts, top_k;
    bool sigmoid, renormalize;
    float scaling;
    int n_group, topk_group;
} k3_router_cfg;

/* logits [E] (overwritten with the scores); bias [E] or NULL. Writes top_k
 * expert ids (best first) and their weights. work: [E] floats. */
void k3_router_select(const k3_router_cfg *rc, float *logits, const float *bias,
                      int32_t *ids, float *weights, float *work);

/* situ(g, u) = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2); b2 <= 0 means plain u. */
static inline float k3_situ(float g, float u, float b1, float b2);
/* silu(g) * u */
static inline float k3_swiglu(float g, float u);

#include <math.h>
static inline float k3_situ(float g, float u, float b1, float b2) {
    const float a = b1 * tanhf(g / b1) / (1.0f + expf(-g));
    return a * (b2 > 0.0f ? b2 * tanhf(u / b2) : u);
}
static inline float k3_swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

#endif /* K3_MOE_MOE_H */
