/*
 * kda.h -- Kimi Delta Attention for one head: the recurrent form (decode) and
 * the chunked form (prefill), which must agree (docs/model.md §3.3, §6.2.1).
 *
 * State S is [dk][dv] fp32, S[k][v], updated in place. Per token t:
 *   S <- diag(exp(g_t)) S;  u = beta_t (v_t - Sᵀ k_t);  S <- S + k_t uᵀ;  o_t = Sᵀ q_t
 * q and k arrive already L2-normed (q also scaled by dk^-1/2), g is the
 * log-decay (<= 0), beta in (0,1). Mirrors fla `naive_recurrent_kda` /
 * `naive_chunk_kda`.
 */
#ifndef K3_KERNELS_KDA_H
#define K3_KERNELS_KDA_H

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
    float *o; /* out: row t at o + t*ld_o, dv values */
    int64_t ld_o;
} k3_kda_head;

/* The forms below run the current kernel table's (kernels_isa.h): the
 * AVX2/AVX-512 paths where the CPU has them and dk, dv are multiples of 8
 * (dk <= 8192), else the scalar references (_ref, kda.c), which tests
 * hold the fast paths to.
 *
 * Which form for a span: on the CPU the recurrent form is the one to use at
 * every length. Per state element and token it does 4 vector ops against the
 * chunked form's ~3 + O(C) terms and exps, and its panel walk keeps S in L1;
 * measured (dk = dv = 128, Zen 4) the AVX-512 recurrence beats the AVX2
 * chunked form at every span length and chunk size, and the AVX2 recurrence
 * is within ~12% of chunk 16 and ahead of chunk 64. It also makes a prefill
 * bit-identical to decoding the same tokens one by one. The chunked form
 * stays for cross-checks; its BF16 form (below) is the faster one on the
 * AMX tiles (off by default, docs/amx.md). */
void k3_kda_recurrent(const k3_kda_head *h, float *S);
void k3_kda_recurrent_ref(const k3_kda_head *h, float *S);
/* Whether the current table's recurrent form is the faster one for prefill
 * spans of every length (AVX-512), so a context need not cut spans into
 * chunked pieces. */
bool k3_kda_recurrent_prefill(void);

/* Floats of work memory k3_kda_chunked (any path) needs. */
int64_t k3_kda_chunk_work(int chunk, int dk, int dv);
/* Chunks of `chunk` tokens (the last may be short); work: k3_kda_chunk_work
 * floats, no alignment needed. */
void k3_kda_chunked(const k3_kda_head *h, float *S, int chunk, float *work);
void k3_kda_chunked_ref(const k3_kda_head *h, float *S, int chunk, float *work);

/* Floats of work memory the SIMD chunked form needs (<= k3_kda_chunk_work). */
int64_t k3_kda_chunk_work_simd(int chunk, int dk, int dv);

/* The BF16 chunked form: the chunked form's products (the intra-chunk key
 * and query products with the decays folded in, the state's contributions
 * Ke S and Qe S, Aqk Vn, and the state update Kdᵀ Vn) on BF16 dot products
 * with fp32 sums, everything else (the decays and their exps, the forward
 * substitution, the epilogues) in fp32 (kda_bf.h; docs/amx.md, "KDA's
 * chunked form on the tiles"). Chunks of a multiple of 32 tokens
 * (K3_KDA_CHUNK_BF in a context), sub-blocks of 16. The kernels (AMX tiles,
 * vdpbf16ps) give k3_kda_chunked_bf_ref's bits. */
#define K3_KDA_CHUNK_BF 32
/* The shortest prefill piece for which the tiles' kernel beats the fp32
 * recurrence (measured, docs/amx.md). */
#define K3_KDA_BF_MIN_AMX 16
bool k3_kda_bf_fits(const k3_kda_head *h); /* dk % 32 == 0, dv % 16 == 0, both <= K3_MAX_KDA_HEAD_DIM */
int64_t k3_kda_chunk_work_bf(int chunk, int dk, int dv);
void k3_kda_chunked_bf_ref(const k3_kda_head *h, float *S, int chunk, float *work);
/* Whether the current table has a BF16 chunked kernel (the BF16 tables:
 * "avx512-bf16", "amx" on the unit). */
bool k3_kda_bf_available(void);
/* The shortest piece for which the current table's BF16 chunked kernel
 * beats the fp32 recurrence: K3_KDA_BF_MIN_AMX on "amx"; INT32_MAX where it
 * has none or none worth taking ("avx512-bf16": vdpbf16ps measured slower
 * than the recurrence on the Xeon). A context takes it only where asked
 * (k3_ctx_options.kda_bf16_prefill: off by default for the bit identity of
 * prefill and decode, docs/amx.md). */
int32_t k3_kda_bf_min(void);
/* The current table's BF16 chunked kernel; false (nothing done) where it has
 * none or h does not fit. */
bool k3_kda_chunked_bf(const k3_kda_head *h, float *S, int chunk, float *work);

/* Decay gate, per channel: K3 form (has_lb) g = lb * sigmoid(exp(A) * (z + dt_bias)),
 * Kimi-Linear form g = -exp(A) * softplus(z + dt_bias). z: [n] for one head. */
void k3_kda_gate(float *z, int n, float A_log, const float *dt_bias, bool has_lb, float lb);

/* Causal depthwise short conv + SiLU over n tokens for C channels, with a
 * state of the (K-1) previous inputs per channel (state[j*lds + c], oldest
 * first), updated to the last K-1 inputs. w[j*ldw + c]: tap j of channel c,
 * tap K-1 = current token. x: [n, ldx] (in place: x becomes the output). */
void k3_kda_conv(float *x, int64_t ldx, int n, int C, int K, const float *w, int64_t ldw, float *state, int64_t lds);

#endif /* K3_KERNELS_KDA_H */
