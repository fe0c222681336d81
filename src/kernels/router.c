/* router.c -- the MoE router (see router.h). */
#include "router.h"

#include <math.h>

#include "common/error.h"
#include "model/config.h"

/* Is expert a ranked before b on key[]: higher, ties to the lower id. */
static bool better(const float *key, int a, int b) { return key[a] > key[b] || (key[a] == key[b] && a < b); }

void k3_router_select(const k3_router_cfg *rc, float *logits, const float *bias, int32_t *ids, float *weights,
                      float *work) {
    const int E = rc->n_experts, K = rc->top_k;
    float *key = work; /* biased score used for choosing */
    if (rc->sigmoid) {
        for (int e = 0; e < E; e++) logits[e] = 1.0f / (1.0f + expf(-logits[e]));
    } else {
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int e = 0; e < E; e++) sum += (logits[e] = expf(logits[e] - mx));
        for (int e = 0; e < E; e++) logits[e] /= sum;
    }
    for (int e = 0; e < E; e++) key[e] = logits[e] + (bias ? bias[e] : 0.0f);

    if (rc->n_group > 1 && rc->topk_group < rc->n_group) {
        /* keep only the topk_group groups with the best sum of two scores */
        const int gs = E / rc->n_group;
        /* config.c caps num_expert_group at K3_MOE_MAX_GROUPS */
        float gscore[K3_MOE_MAX_GROUPS];
        bool keep[K3_MOE_MAX_GROUPS];
        K3_ASSERT(rc->n_group <= K3_MOE_MAX_GROUPS);
        for (int g = 0; g < rc->n_group; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * gs; e < (g + 1) * gs; e++) {
                if (key[e] > b1) {
                    b2 = b1;
                    b1 = key[e];
                } else if (key[e] > b2) b2 = key[e];
            }
            gscore[g] = b1 + b2;
            keep[g] = false;
        }
        for (int r = 0; r < rc->topk_group; r++) {
            int best = -1;
            for (int g = 0; g < rc->n_group; g++)
                if (!keep[g] && (best < 0 || better(gscore, g, best))) best = g;
            keep[best] = true;
        }
        for (int e = 0; e < E; e++)
            if (!keep[e / gs]) key[e] = -INFINITY;
    }

    /* top-K by selection: K is small (<= 16 in K3) */
    for (int r = 0; r < K; r++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int q = 0; q < r; q++) taken |= ids[q] == e;
            if (!taken && (best < 0 || better(key, e, best))) best = e;
        }
        ids[r] = best;
    }
    float sum = 0.0f;
    for (int r = 0; r < K; r++) sum += logits[ids[r]];
    for (int r = 0; r < K; r++) {
        float w = logits[ids[r]];
        /* official KimiMoEGate: only top_k > 1 renormalizes */
        if (rc->renormalize && K > 1) w /= (sum + 1e-20f);
        weights[r] = w * rc->scaling;
    }
}
