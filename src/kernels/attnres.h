/*
 * attnres.h -- Attention Residuals: the softmax mix over block residuals that
 * replaces K3's residual stream (docs/model.md §3.2, docs/serving-reference.md §2.4).
 *
 * For one token with candidates V_0..V_{n-1} (each D values):
 *   score_e = Σ_d w[d] V_e[d] / sqrt(mean(V_e²) + eps);  α = softmax(score)
 *   out = Σ_e α_e V_e
 * w is the fused pseudo-query res_norm ⊙ res_proj[0]. fp32 scores, with
 * double accumulation of the reductions. The engine splits the tokens of a
 * round evenly over the threads (scores and mix fused per token).
 */
#ifndef K3_KERNELS_ATTNRES_H
#define K3_KERNELS_ATTNRES_H

#include <stdint.h>

#define K3_ATTNRES_MAX 513

void k3_attnres_mix(const float *const *V, int n, const float *w, int64_t D, float eps, float *out);
/* The scalar reference (k3_attnres_mix runs the current kernel table's form). */
void k3_attnres_mix_ref(const float *const *V, int n, const float *w, int64_t D, float eps, float *out);

#endif /* K3_KERNELS_ATTNRES_H */
