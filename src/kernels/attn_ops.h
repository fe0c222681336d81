/*
 * attn_ops.h -- the attention operators on 8-bit caches (docs/serving-reference.md §2.1,
 * §2.2), each with a scalar reference (_ref) that tests hold the fast path to.
 *
 * QLI, the quantized lightning indexer. Indexer keys are Hadamard-rotated
 * (orthonormal, so fp32 dot products are unchanged) and quantized per token
 * to int8 with one scale; queries per token and head likewise. Scores:
 *   I[s] = Σ_h w_h · ReLU( qs_h · ks_s · <q8_h, k8_s> )
 * computed with integer dot products and the scales folded in.
 *
 * QSFA, quantized sparse flash attention (absorbed MLA): the latent cache
 * holds per slot kv_lora int8 values with one fp32 scale per 128-tile, and
 * the rope part in fp32. For each head, over the given slots:
 *   z_s = (<qa, dq(c_s)> + <qpe, kpe_s>) · scale,  o = Σ softmax(z)_s dq(c_s)
 * and the natural-log LSE of z, so partial results over disjoint slot sets
 * merge exactly (k3_lse_merge).
 *
 * Each runs the current kernel table's form (kernels_isa.h: the SIMD forms
 * where they take the shape, else the references).
 */
#ifndef K3_KERNELS_ATTN_OPS_H
#define K3_KERNELS_ATTN_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "k3.h"

#define K3_C8_TILE 128

/* Symmetric int8: s = max|x| / 127, q = round(x / s). Returns s (0 for x = 0). */
float k3_quant_i8(const float *x, int n, int8_t *q);
/* Per-tile int8 of n values (tiles of K3_C8_TILE, the last may be short). */
void k3_quant_i8_tiles(const float *x, int n, int8_t *q, float *scales);
/* In-place fast Walsh-Hadamard transform times n^-1/2 (orthonormal); n a power of 2. */
void k3_hadamard(float *x, int n);

/* One query token: q8 [HI, dI] with scales qs [HI]; w [HI] (scaled weights).
 * Keys: k8 rows of dI int8 and ks per slot. Writes n scores. */
void k3_qli_scores(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8, const float *ks,
                   const int64_t *slots, int n, float *scores);
void k3_qli_scores_ref(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8,
                       const float *ks, const int64_t *slots, int n, float *scores);

/* T query tokens (q8 + t HI dI, qs + t HI, w + t HI) over the same n slots
 * in one call: scores[t * lds + i], the bits of k3_qli_scores. Only where
 * the current table has such a kernel and takes the shape
 * (k3_qli_chunk_fits: the "amx" table on the unit); elsewhere score token by
 * token. pool: NULL runs on the calling thread. */
bool k3_qli_chunk_fits(int HI, int dI);
void k3_qli_chunk(k3_pool *pool, const int8_t *q8, const float *qs, const float *w, int64_t T, int HI, int dI,
                  const int8_t *k8, const float *ks, const int64_t *slots, int64_t n, float *scores, int64_t lds);

/* The latent cache as QSFA reads it. */
typedef struct k3_c8_cache {
    const int8_t *c8; /* [slots, kv_lora] */
    const float *cs;  /* [slots, n_tiles] */
    const float *kpe; /* [slots, rope] */
    int kv_lora, rope, n_tiles;
    bool bf16; /* the BF16 form where the table has it (below); false: fp32 */
} k3_c8_cache;

/* One query token, H heads: qa [H, kv_lora], qpe [H, rope]. out [H, kv_lora],
 * lse [H]. work: k3_qsfa_work(H, kv_lora, n) floats. */
int64_t k3_qsfa_work(int H, int kv_lora, int n);
void k3_qsfa(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n, float scale,
             float *out, float *lse, float *work);
void k3_qsfa_ref(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                 float scale, float *out, float *lse, float *work);

/* QSFA on the dot products (c->bf16, the default mode; kernels_isa.h has the
 * kernels: AMX tiles, vdpbf16ps, bit for bit this reference). Per 16 heads:
 *   keys: the codes (exact in BF16), then the rope key as two BF16 terms,
 *         hi = bf16(kpe), lo = bf16(kpe - hi); the query: bf16 of qa, qpe, qpe
 *   C_b:  per block b of 128 latent dims (the last may be short) and the rope
 *         block, per 32 dims in order: E = the even dims' products added from
 *         +0, O the odd ones', C_b = C_b + (E + O) from C_b = +0 (TDPBF16PS:
 *         inputs below 2^-126 read as 0, E and O flushed there)
 *   z:    z = fma(C_b, cs_b, z) over the latent blocks from 0, z = z + C_rope,
 *         z = z * scale
 *   p:    m = max z, p = exp(z - m) (k3_exp16's polynomial), l = the sum of p
 *         in slot order
 *   out:  per 128-dim block b, P_b = bf16(p · cs_b) and per 32 slots the
 *         E/O sums of P_b x codes as above; out = C · (1 / l), lse = m + log l
 * Against the exact attention it errs by the BF16 rounding of the query and
 * of P (2^-9 relative each; the bound is in tests/test_attn_ops.c).
 * Takes kv_lora % 32 == 0, rope % 16 == 0, rope <= min(kv_lora, 1024). */
bool k3_qsfa_bf16_fits(const k3_c8_cache *c);
/* Whether a model takes the BF16 form (k3_c8_cache.bf16): its BF16 dot
 * products run and it has at least min_heads heads (the model's
 * qsfa_bf16_heads: K3_QSFA_BF16_HEADS once k3_model_quantize marked its BF16
 * matrices, 0 = never), so a call fills at least half a tile's rows (callers
 * keep nh >= that many heads a call). With fewer heads the form runs a 16-row
 * product for a few and the fp32 kernels are as fast; the choice is the
 * model's, so prefill, decode and the speculative verify of a token make the
 * same one. Tests lower min_heads to run the form on the small checkpoints. */
#define K3_QSFA_BF16_HEADS 8
static inline bool k3_qsfa_bf16_wanted(int min_heads, int n_heads) { return min_heads > 0 && n_heads >= min_heads; }
void k3_qsfa_bf16_ref(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                      float scale, float *out, float *lse, float *work);

/* Merges partial attention results of P disjoint slot sets: o_p [P][H, d],
 * lse_p [P][H] -> out [H, d], lse [H]. A part with lse = -inf weighs 0. */
void k3_lse_merge(const float *const *o, const float *const *lse, int P, int H, int d, float *out, float *lse_out);
void k3_lse_merge_ref(const float *const *o, const float *const *lse, int P, int H, int d, float *out, float *lse_out);

#endif /* K3_KERNELS_ATTN_OPS_H */
