/*
 * kda.h -- Kimi Delta Attention for one head: the recurrent form (decode) and
 * the chunked form (prefill), which must agree (k3-model.md §3.3, §6.2.1).
 *
 * State S is [dk][dv] fp32, S[k][v], updated in place. Per token t:
 *   S <- diag(exp(g_t)) S;  u = beta_t (v_t - Sᵀ k_t);  S <- S + k_t uᵀ;  o_t = Sᵀ q_t
 * q and k arrive already L2-normed (q also scaled by dk^-1/2), g is the
 * log-decay (<= 0), beta in (0,1). Mirrors fla `naive_recurrent_kda` /
 * `naive_chunk_kda`.
 */
#ifndef K3_ATTN_KDA_H
#define K3_ATTN_KDA_H

#include <stdbool.h>
#include <stdint.h>

/* One head's inputs over n tokens; row t of q is q + t*ld_qk (k, g alike). */
typedef struct k3_kda_head {
    int n, dk, dv;
    const float *q, *k, *g;
    int64_t ld_qk;
    const float *v;
    int64_t ld_v;
    const float *beta;
    int64_t ld_beta;
    float *o;               /* out: row t at o + t*ld_o, dv values */
    int64_t ld_o;
} k3_kda_head;

void k3_kda_recurrent(const k3_kda_head *h, float *S);

/* Floats of work memory k3_kda_chunked needs. */
int64_t k3_kda_chunk_work(int chunk, int dk, int dv);
void k3_kda_chunked(const k3_kda_head *h, float *S, int chunk, float *work);

/* Decay gate, per channel: K3 form (has_lb) g = lb * sigmoid(exp(A) * (z + dt_bias)),
 * Kimi-Linear form g = -exp(A) * softplus(z + dt_bias). z: [n] for one head. */
void k3_kda_gate(float *z, int n, float A_log, const float *dt_bias, bool has_lb, float lb);

/* Causal depthwise short conv + SiLU over n tokens for C channels, with a
 * state of the (K-1) previous inputs per channel (state[j*C + c], oldest
 * first), updated to the last K-1 inputs. w: [C, K], tap K-1 = current token.
 * x: [n, ldx] (in place: x becomes the output). */
void k3_kda_conv(float *x, int64_t ldx, int n, int C, int K, const float *w, float *state);

#endif /* K3_ATTN_KDA_H */
