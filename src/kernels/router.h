/*
 * router.h -- the MoE router (docs/model.md §3.5; the gated activations are k3_glu in
 * kernels.h).
 *
 * Router: scores s = sigmoid(logits) (or softmax); experts chosen by the top-k
 * of s + correction bias (ties to the lower id); weights from the unbiased s,
 * renormalised to sum 1 when asked, then times routed_scaling_factor. With
 * n_group > topk_group the groups are first ranked by the sum of their two
 * best biased scores (DeepSeek's noaux_tc).
 */
#ifndef K3_KERNELS_ROUTER_H
#define K3_KERNELS_ROUTER_H

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
void k3_router_select(const k3_router_cfg *rc, float *logits, const float *bias, int32_t *ids, float *weights,
                      float *work);

#endif /* K3_KERNELS_ROUTER_H */
