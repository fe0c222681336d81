/*
 * mla.h -- gated NoPE MLA attention in the absorbed (latent) form, and the
 * DSA lightning indexer that picks which past tokens it may attend to
 * (docs/model.md §3.4, §3.6).
 *
 * The latent cache holds one row per token slot: [c (kv_lora) | kpe (rope)],
 * ld = kv_lora + rope. A query head arrives absorbed: qa = W_UKᵀ q_nope
 * (kv_lora values) and q_pe (rope values); its output is the latent average
 * ĉ = Σ_s p_s c_s, to which the caller applies W_UV.
 */
#ifndef K3_KERNELS_MLA_H
#define K3_KERNELS_MLA_H

#include <stdint.h>

/* Attends one head over n cache slots. scores: work [n]. Writes ĉ to out
 * [kv_lora] and returns the natural-log log-sum-exp of the scaled scores. */
float k3_mla_attend(const float *qa, const float *qpe, int kv_lora, int rope, const float *cache, int64_t ld,
                    const int64_t *slots, int n, float scale, float *scores, float *out);

/* Indexer scores for one query token over n key slots:
 *   scores[i] = Σ_h w[h] · ReLU(q[h] · k[slot_i])
 * q: [HI, dI], w: [HI] (already scaled), kcache rows of dI floats. */
void k3_indexer_scores(const float *q, const float *w, int HI, int dI, const float *kcache, const int64_t *slots, int n,
                       float *scores);

/* Exact top-k of scores[0..n): highest first, ties to the lower index
 * (deterministic). Writes min(k, n) indices to sel in ascending order and
 * returns the count. work: [n] ints. */
int k3_topk(const float *scores, int n, int k, int32_t *sel, int32_t *work);

#endif /* K3_KERNELS_MLA_H */
