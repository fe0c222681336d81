/*
 * kda_bf.h -- KDA's chunked form with its products on BF16 dot products
 * (kda.h, "The BF16 chunked form"): the steps the scalar reference
 * (k3_kda_chunked_bf_ref, kda.c), the vdpbf16ps kernel (kda_avx512bf16.c)
 * and the AMX one (kda_amx.c) share.
 *
 * The plain-C part (the work layout, the direct pairs of a steep sub-block)
 * is compiled into all three; the AVX-512 part (everything but the products)
 * only into the two kernels, which define the products before including this
 * file:
 *     kbf_mm(M, N, K, A, lda, B, ldb, C, ldc, pk):    C = A B
 *     kbf_mm_bt(M, N, K, A, lda, Bt, ldbt, C, ldc, pk): C = A Btᵀ
 *     kbf_mm_at(M, N, K, At, ldat, B, ldb, C, ldc, pk): C = Atᵀ B
 * fp32 operands (A row-major M x K, B row-major K x N, Bt row-major N x K,
 * At row-major K x M;
 * M, N multiples of 16, K of 32), rounded to BF16 (nearest even) as they
 * are packed; per block of 32 in k, E = the even k's products summed from
 * +0 and O the odd ones', then C = C + (E + O) from C = +0 (the contract of
 * kernels_isa.h, "BF16 dot products"); pk: packing scratch.
 */
#ifndef K3_KERNELS_KDA_BF_H
#define K3_KERNELS_KDA_BF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kda.h"

/* Rows of a sub-block (the tiles' rows), and the largest decay (as a sum of
 * log-decays) across one for which its own pairs still go on the products:
 * there a key is scaled by up to e^40 and a query or key by down to e^-40,
 * both normal in BF16 with room to spare. */
enum { KBF_SB = 16 };
#define KBF_SPREAD 40.0f

/* The work, carved from `work` (k3_kda_chunk_work_bf floats) for chunks of
 * at most `chunk` tokens (a multiple of 32). */
typedef struct kbf_ws {
    int ch;
    float *G;   /* [ch][dk] running log-decay */
    float *KQe; /* [2 ch][dk] k_t e^{G_t} rows, then q_t e^{G_t} rows */
    float *Kd;  /* [ch][dk] k_t e^{G_C - G_t} */
    float *KQs; /* [ch / 16][32][dk] per sub-block: k_t e^{G_t - G_r}, then q_t e^{G_t - G_r} */
    float *Kb;  /* [ch][dk] k_j e^{G_r - G_j} */
    float *Z;   /* [3 ch + dk][max(dv, ch)] products */
    float *U;   /* [ch][dv] V - Ke S, then Vn */
    float *L;   /* [ch][ch] */
    float *A;   /* [ch][ch] Aqk */
    float *eGC; /* [dk] */
    float *P;   /* [2][16][16][16] a steep sub-block's pairs' lanes */
    uint16_t *pk;
} kbf_ws;

static inline int64_t kbf_work(int chunk, int dk, int dv) {
    const int64_t ch = (chunk + 31) / 32 * 32, w = dv > ch ? dv : ch;
    const int64_t pk = 4 * ch * dk + 2 * (int64_t)dk * dv + 2 * ch * dv + 2 * ch * ch + 64 * (int64_t)dk;
    return 10 * ch * dk + (3 * ch + dk) * w + ch * dv + 2 * ch * ch + dk + 2 * 16 * 16 * 16 + pk / 2 + 64;
}

static inline void kbf_ws_init(kbf_ws *w, int chunk, int dk, int dv, float *work) {
    const int64_t ch = (chunk + 31) / 32 * 32, wz = dv > ch ? dv : ch;
    float *p = work;
    w->ch = (int)ch;
    w->G = p, p += ch * dk;
    w->KQe = p, p += 2 * ch * dk;
    w->Kd = p, p += ch * dk;
    w->KQs = p, p += 2 * ch * dk;
    w->Kb = p, p += ch * dk;
    w->Z = p, p += (3 * ch + dk) * wz;
    w->U = p, p += ch * dv;
    w->L = p, p += ch * ch;
    w->A = p, p += ch * ch;
    w->eGC = p, p += dk;
    w->P = p, p += 2 * 16 * 16 * 16;
    w->pk = (uint16_t *)p;
}

/* Whether sub-block [r, re) may take its own pairs on the products: no
 * channel decays by more than KBF_SPREAD across it. */
static inline int kbf_flat(const float *G, int dk, int r, int re) {
    const float *a = G + (int64_t)r * dk, *b = G + (int64_t)(re - 1) * dk;
    for (int d = 0; d < dk; d++)
        if (!(a[d] - b[d] <= KBF_SPREAD)) return 0;
    return 1;
}

/* A steep sub-block's own pairs r <= j <= t < re go in fp32: with eg_t =
 * e^{g_t} (per channel, once a token) and E = Π_{j<i<=t} eg_i carried from
 * E = 1 at t = j, x = k_j ⊙ E, L[t][j] = β_t Σ k_t x (j < t) and Aqk[t][j] =
 * Σ q_t x; each sum over d in 16 lanes (lane i: the d ≡ i mod 16, in order,
 * one FMA a term), then the lanes added in order from +0. Products of
 * factors <= 1 only: nothing overflows, and what underflows is below fp32's
 * range exactly too. */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "kernels/bf16_avx512.h"
#include "kernels/vexp_avx512.h"

#define KBF_INLINE static inline __attribute__((always_inline))

/* A (M x K fp32, row stride lda) as BF16 rows of K words in the products'
 * word order idx (k3b_idx_natural for the tiles, k3b_idx_eo for vdpbf16ps). */
static inline void kbf_pack_a(int M, int K, const float *A, int64_t lda, uint16_t *pa, __m512i idx) {
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k += 32)
            _mm512_storeu_si512((void *)(pa + (int64_t)m * K + k), k3b_block(A + m * lda + k, 32, idx));
}

/* B = Btᵀ (Bt: N x K, row-major) in the kernels' B layout ([N / 16][K / 2]
 * [16] dwords): 16 rows of Bt's blocks in the word order idx, transposed as
 * dwords. */
static inline void kbf_pack_bt(int N, int K, const float *Bt, int64_t ldbt, uint16_t *pb, __m512i idx) {
    for (int n = 0; n < N; n += 16)
        for (int k = 0; k < K; k += 32) {
            __m512i v[16];
            for (int i = 0; i < 16; i++) v[i] = k3b_block(Bt + (int64_t)(n + i) * ldbt + k, 32, idx);
            k3b_tr16(v);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512((void *)(pb + ((int64_t)n * (K / 2) + (int64_t)(k / 2 + i) * 16) * 2), v[i]);
        }
}

static void kbf_mm(int M, int N, int K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                   uint16_t *pk);
static void kbf_mm_bt(int M, int N, int K, const float *A, int64_t lda, const float *Bt, int64_t ldbt, float *C,
                      int64_t ldc, uint16_t *pk);
static void kbf_mm_at(int M, int N, int K, const float *At, int64_t ldat, const float *B, int64_t ldb, float *C,
                      int64_t ldc, uint16_t *pk);

KBF_INLINE __m512 kbf_ld(const float *p) { return _mm512_loadu_ps(p); }
KBF_INLINE void kbf_st(float *p, __m512 v) { _mm512_storeu_ps(p, v); }

/* The pairs of steep sub-block [r, re) (above): per block of 128 channels,
 * key j's decays carried in registers down the tokens t, each pair's 16
 * lanes kept in P (pl: L's, pa: Aqk's, [t - r][j - r][16]); then per row t
 * the lanes of its 16 pairs transposed and added in order. eg: (re - r) x dk
 * floats of work. */
static void kbf_steep(const k3_kda_head *h, int t0, int r, int re, float *L, float *A, int ldl, float *eg, float *P) {
    const int dk = h->dk;
    const int64_t ldq = h->ld_qk;
    float *pl = P, *pa = P + 16 * 16 * 16;
    for (int t = r; t < re; t++)
        for (int d = 0; d < dk; d += 16)
            kbf_st(eg + (int64_t)(t - r) * dk + d, k3_exp16(kbf_ld(h->g + (int64_t)(t0 + t) * ldq + d)));
    memset(P, 0, sizeof(float) * 2 * 16 * 16 * 16);
    for (int d0 = 0; d0 < dk; d0 += 128) {
        const int nv = (dk - d0) / 16 < 8 ? (dk - d0) / 16 : 8;
        for (int j = r; j < re; j++) {
            const float *kj = h->k + (int64_t)(t0 + j) * ldq + d0;
            __m512 E[8], K[8];
            for (int v = 0; v < nv; v++) E[v] = _mm512_set1_ps(1.0f), K[v] = kbf_ld(kj + 16 * v);
            for (int t = j; t < re; t++) {
                const float *kt = h->k + (int64_t)(t0 + t) * ldq + d0, *qt = h->q + (int64_t)(t0 + t) * ldq + d0;
                const float *et = eg + (int64_t)(t - r) * dk + d0;
                float *ql = pl + ((t - r) * 16 + (j - r)) * 16, *qa = pa + ((t - r) * 16 + (j - r)) * 16;
                __m512 al = kbf_ld(ql), aa = kbf_ld(qa);
                for (int v = 0; v < nv; v++) {
                    if (t > j) E[v] = _mm512_mul_ps(E[v], kbf_ld(et + 16 * v));
                    const __m512 x = _mm512_mul_ps(K[v], E[v]);
                    al = _mm512_fmadd_ps(kbf_ld(kt + 16 * v), x, al);
                    aa = _mm512_fmadd_ps(kbf_ld(qt + 16 * v), x, aa);
                }
                kbf_st(ql, al);
                kbf_st(qa, aa);
            }
        }
    }
    for (int t = r; t < re; t++)
        for (int w = 0; w < 2; w++) {
            __m512i v[16];
            for (int i = 0; i < 16; i++)
                v[i] = _mm512_loadu_si512((const void *)((w ? pa : pl) + ((t - r) * 16 + i) * 16));
            k3b_tr16(v);
            __m512 s = _mm512_setzero_ps();
            for (int i = 0; i < 16; i++) s = _mm512_add_ps(s, _mm512_castsi512_ps(v[i]));
            float z[16];
            _mm512_storeu_ps(z, s);
            const float bt = h->beta[(int64_t)(t0 + t) * h->ld_beta];
            for (int j = r; j <= t; j++) {
                if (w) A[(int64_t)t * ldl + j] = z[j - r];
                else if (j < t) L[(int64_t)t * ldl + j] = bt * z[j - r];
            }
        }
}

/* One chunk of C tokens from t0 (C <= w->ch). */
static void kbf_chunk(const k3_kda_head *h, float *S, int t0, int C, kbf_ws *w) {
    const int dk = h->dk, dv = h->dv, ch = w->ch, Cp = (C + 31) / 32 * 32;
    const int64_t ldq = h->ld_qk;
    const float *q0 = h->q + (int64_t)t0 * ldq, *k0 = h->k + (int64_t)t0 * ldq, *g0 = h->g + (int64_t)t0 * ldq;
    const float *b0 = h->beta + (int64_t)t0 * h->ld_beta;
    float *G = w->G;
#define KQ(t) (k0 + (int64_t)(t)*ldq)
#define QQ(t) (q0 + (int64_t)(t)*ldq)
#define GR(t) (G + (int64_t)(t)*dk)
    /* G_t = G_{t-1} + g_t from G = +0 */
    for (int d = 0; d < dk; d += 16) {
        __m512 s = _mm512_setzero_ps();
        for (int t = 0; t < C; t++) {
            s = _mm512_add_ps(s, kbf_ld(g0 + (int64_t)t * ldq + d));
            kbf_st(GR(t) + d, s);
        }
    }
    const float *GC = GR(C - 1);
    /* Ke, Qe, Kd, and Ks, Qs of each sub-block; rows past C zero */
    for (int t = 0; t < Cp; t++) {
        const int r = t / KBF_SB * KBF_SB;
        float *ke = w->KQe + (int64_t)t * dk, *qe = w->KQe + (int64_t)(Cp + t) * dk, *kd = w->Kd + (int64_t)t * dk;
        float *ks = w->KQs + ((int64_t)r * 2 + (t - r)) * dk, *qs = ks + (int64_t)KBF_SB * dk;
        if (t >= C) {
            memset(ke, 0, sizeof(float) * (size_t)dk);
            memset(qe, 0, sizeof(float) * (size_t)dk);
            memset(kd, 0, sizeof(float) * (size_t)dk);
            memset(ks, 0, sizeof(float) * (size_t)dk);
            memset(qs, 0, sizeof(float) * (size_t)dk);
            continue;
        }
        const float *kt = KQ(t), *qt = QQ(t), *Gt = GR(t), *Gr = GR(r);
        for (int d = 0; d < dk; d += 16) {
            const __m512 k = kbf_ld(kt + d), q = kbf_ld(qt + d), g = kbf_ld(Gt + d);
            const __m512 e = k3_exp16(g), e2 = k3_exp16(_mm512_sub_ps(kbf_ld(GC + d), g)),
                         e3 = k3_exp16(_mm512_sub_ps(g, kbf_ld(Gr + d)));
            kbf_st(ke + d, _mm512_mul_ps(k, e));
            kbf_st(qe + d, _mm512_mul_ps(q, e));
            kbf_st(kd + d, _mm512_mul_ps(k, e2));
            kbf_st(ks + d, _mm512_mul_ps(k, e3));
            kbf_st(qs + d, _mm512_mul_ps(q, e3));
        }
    }
    for (int d = 0; d < dk; d += 16) kbf_st(w->eGC + d, k3_exp16(kbf_ld(GC + d)));

    /* L and Aqk: per sub-block r, [Ks; Qs] (32 rows) times Kb_j = k_j
     * e^{G_r - G_j} for the earlier tokens (factors <= 1) and, where the
     * sub-block is flat, its own (factors <= e^KBF_SPREAD) */
    float *L = w->L, *A = w->A;
    memset(L, 0, sizeof(float) * (size_t)Cp * ch);
    memset(A, 0, sizeof(float) * (size_t)Cp * ch);
    for (int r = 0; r < C; r += KBF_SB) {
        const int re = r + KBF_SB < C ? r + KBF_SB : C, flat = kbf_flat(G, dk, r, re);
        const int nj = flat ? re : r, np = (nj + 15) / 16 * 16;
        const float *Gr = GR(r);
        for (int j = 0; j < np; j++) {
            float *kb = w->Kb + (int64_t)j * dk;
            if (j >= nj) {
                memset(kb, 0, sizeof(float) * (size_t)dk);
                continue;
            }
            for (int d = 0; d < dk; d += 16)
                kbf_st(kb + d,
                       _mm512_mul_ps(kbf_ld(KQ(j) + d), k3_exp16(_mm512_sub_ps(kbf_ld(Gr + d), kbf_ld(GR(j) + d)))));
        }
        if (np > 0) {
            kbf_mm_bt(2 * KBF_SB, np, dk, w->KQs + (int64_t)r * 2 * dk, dk, w->Kb, dk, w->Z, np, w->pk);
            for (int t = r; t < re; t++) {
                const float *zl = w->Z + (int64_t)(t - r) * np, *za = w->Z + (int64_t)(KBF_SB + t - r) * np;
                const float bt = b0[(int64_t)t * h->ld_beta];
                for (int j = 0; j < nj && j < t; j++) L[(int64_t)t * ch + j] = bt * zl[j];
                for (int j = 0; j < nj && j <= t; j++) A[(int64_t)t * ch + j] = za[j];
            }
        }
        if (!flat) kbf_steep(h, t0, r, re, L, A, ch, w->Kb, w->P);
    }

    /* [Ke; Qe] S: U = V - Ke S, and Qe S (kept in Z) */
    float *Z = w->Z, *ZO = Z + (int64_t)Cp * dv, *Z2 = Z + (int64_t)2 * Cp * dv, *U = w->U;
    kbf_mm(2 * Cp, dv, dk, w->KQe, dk, S, dv, Z, dv, w->pk);
    for (int t = 0; t < Cp; t++) {
        float *u = U + (int64_t)t * dv;
        if (t >= C) {
            memset(u, 0, sizeof(float) * (size_t)dv);
            continue;
        }
        const float *v = h->v + (int64_t)(t0 + t) * h->ld_v, *z = Z + (int64_t)t * dv;
        for (int d = 0; d < dv; d += 16) kbf_st(u + d, _mm512_sub_ps(kbf_ld(v + d), kbf_ld(z + d)));
    }
    /* Vn = (I + L)^{-1} diag(beta) U, forward substitution */
    for (int t = 0; t < C; t++) {
        float *u = U + (int64_t)t * dv;
        const __m512 bt = _mm512_set1_ps(b0[(int64_t)t * h->ld_beta]);
        const float *lt = L + (int64_t)t * ch;
        for (int d = 0; d < dv; d += 128) { /* eight chains at once: the FMA's latency hidden */
            const int nv = (dv - d) / 16 < 8 ? (dv - d) / 16 : 8;
            __m512 acc[8];
            for (int v = 0; v < nv; v++) acc[v] = _mm512_mul_ps(bt, kbf_ld(u + d + 16 * v));
            for (int j = 0; j < t; j++) {
                const __m512 l = _mm512_set1_ps(lt[j]);
                const float *uj = U + (int64_t)j * dv + d;
                if (nv == 8) {
#pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) acc[v] = _mm512_fnmadd_ps(l, kbf_ld(uj + 16 * v), acc[v]);
                } else
                    for (int v = 0; v < nv; v++) acc[v] = _mm512_fnmadd_ps(l, kbf_ld(uj + 16 * v), acc[v]);
            }
            for (int v = 0; v < nv; v++) kbf_st(u + d + 16 * v, acc[v]);
        }
    }
    /* O = Qe S + Aqk Vn */
    kbf_mm(Cp, dv, Cp, A, ch, U, dv, Z2, dv, w->pk);
    for (int t = 0; t < C; t++) {
        float *o = h->o + (int64_t)(t0 + t) * h->ld_o;
        const float *za = ZO + (int64_t)t * dv, *zb = Z2 + (int64_t)t * dv;
        for (int d = 0; d < dv; d += 16) kbf_st(o + d, _mm512_add_ps(kbf_ld(za + d), kbf_ld(zb + d)));
    }
    /* S <- e^{G_C} S + Kdᵀ Vn */
    kbf_mm_at(dk, dv, Cp, w->Kd, dk, U, dv, Z, dv, w->pk);
    for (int a = 0; a < dk; a++) {
        const __m512 e = _mm512_set1_ps(w->eGC[a]);
        float *row = S + (int64_t)a * dv;
        const float *z = Z + (int64_t)a * dv;
        for (int d = 0; d < dv; d += 16) kbf_st(row + d, _mm512_fmadd_ps(e, kbf_ld(row + d), kbf_ld(z + d)));
    }
#undef KQ
#undef QQ
#undef GR
}

static void kbf_run(const k3_kda_head *h, float *S, int chunk, float *work) {
    kbf_ws w;
    kbf_ws_init(&w, chunk, h->dk, h->dv, work);
    for (int t0 = 0; t0 < h->n; t0 += chunk) kbf_chunk(h, S, t0, h->n - t0 < chunk ? h->n - t0 : chunk, &w);
}

#endif /* AVX-512 BF16 */

#endif /* K3_KERNELS_KDA_BF_H */
