/*
 * kda.c -- the scalar references of the KDA recurrent and chunked forms (see
 * kda.h), the "ref" table's kernels and what kda_avx2.c and kda_avx512.c are
 * tested against, and the work the chunked forms need.
 *
 * The chunked form follows docs/model.md §3.3: inside a chunk, G_t is the
 * running sum of the log-decays, and every decay factor between two tokens is
 * evaluated as exp(G_t - G_j) with j <= t, never as exp(G_t) * exp(-G_j):
 * with g >= -5 per step, G reaches -320 in a 64-token chunk and exp(+320)
 * overflows fp32.
 */
#include "kda.h"
#include "common/error.h"
#include "kernels/bf16_scalar.h"
#include "kernels/kda_bf.h"
#include "kernels/kernels.h"
#include "model/config.h"

#include <float.h>
#include <string.h>

#include <math.h>

/* ---- recurrent form --------------------------------------------------- */

void k3_kda_recurrent_ref(const k3_kda_head *h, float *S) {
    const int dk = h->dk, dv = h->dv;
    float u[K3_MAX_KDA_HEAD_DIM]; /* dv <= K3_MAX_KDA_HEAD_DIM (config.c) */
    K3_ASSERT(dv <= K3_MAX_KDA_HEAD_DIM);
    for (int t = 0; t < h->n; t++) {
        const float *q = h->q + t * h->ld_qk;
        const float *k = h->k + t * h->ld_qk;
        const float *g = h->g + t * h->ld_qk;
        const float *v = h->v + t * h->ld_v;
        const float beta = h->beta[t * h->ld_beta];
        float *o = h->o + t * h->ld_o;
        /* S <- diag(exp g) S; then u = beta (v - Sᵀk) */
        for (int j = 0; j < dv; j++) u[j] = 0.0f;
        for (int a = 0; a < dk; a++) {
            const float e = expf(g[a]);
            float *row = S + (int64_t)a * dv;
            const float ka = k[a];
            for (int j = 0; j < dv; j++) {
                row[j] *= e;
                u[j] += row[j] * ka;
            }
        }
        for (int j = 0; j < dv; j++) u[j] = beta * (v[j] - u[j]);
        /* S <- S + k uᵀ; o = Sᵀ q */
        for (int j = 0; j < dv; j++) o[j] = 0.0f;
        for (int a = 0; a < dk; a++) {
            float *row = S + (int64_t)a * dv;
            const float ka = k[a], qa = q[a];
            for (int j = 0; j < dv; j++) {
                row[j] += ka * u[j];
                o[j] += row[j] * qa;
            }
        }
    }
}

/* ---- chunked form ----------------------------------------------------- */

int64_t k3_kda_chunk_work_simd(int chunk, int dk, int dv) {
    const int64_t C = chunk;
    /* the layout in kda_avx2.c: G, Ks/Ke, Qs/Qe, Kb/Kd: C*dk each; Y/Vn:
     * C*dv; L, Aqk: C*C; two dk-vectors of decay factors */
    return 4 * C * dk + C * dv + 2 * C * C + 2 * dk;
}

int64_t k3_kda_chunk_work(int chunk, int dk, int dv) {
    const int64_t C = chunk;
    /* the reference: G, W: C*dk each; U/Vn: C*dv; L, Aqk: C*C; eGC: dk */
    const int64_t ref = 2 * C * dk + C * dv + 2 * C * C + dk;
    const int64_t simd = k3_kda_chunk_work_simd(chunk, dk, dv);
    return ref > simd ? ref : simd;
}

void k3_kda_chunked_ref(const k3_kda_head *h, float *S, int chunk, float *work) {
    const int dk = h->dk, dv = h->dv;
    float *G = work;                         /* [C, dk] running log-decay */
    float *W = G + (int64_t)chunk * dk;      /* [C, dk] */
    float *U = W + (int64_t)chunk * dk;      /* [C, dv] -> Vn */
    float *L = U + (int64_t)chunk * dv;      /* [C, C] */
    float *A = L + (int64_t)chunk * chunk;   /* [C, C] */
    float *eGC = A + (int64_t)chunk * chunk; /* [dk] */

    for (int t0 = 0; t0 < h->n; t0 += chunk) {
        const int C = h->n - t0 < chunk ? h->n - t0 : chunk;
#define Q(t) (h->q + (int64_t)(t0 + (t)) * h->ld_qk)
#define K(t) (h->k + (int64_t)(t0 + (t)) * h->ld_qk)
#define GG(t) (h->g + (int64_t)(t0 + (t)) * h->ld_qk)
#define V(t) (h->v + (int64_t)(t0 + (t)) * h->ld_v)
#define B(t) (h->beta[(int64_t)(t0 + (t)) * h->ld_beta])
#define O(t) (h->o + (int64_t)(t0 + (t)) * h->ld_o)
        for (int t = 0; t < C; t++)
            for (int d = 0; d < dk; d++) G[t * dk + d] = (t ? G[(t - 1) * dk + d] : 0.0f) + GG(t)[d];

        /* L[t,j] = beta_t sum_d k_t k_j e^{G_t - G_j}, and Aqk[t,j] likewise
         * with q_t, for j < t (Aqk also on the diagonal). */
        for (int t = 0; t < C; t++) {
            const float *kt = K(t), *qt = Q(t), *Gt = G + t * dk;
            for (int j = 0; j <= t; j++) {
                const float *kj = K(j), *Gj = G + j * dk;
                float sl = 0.0f, sa = 0.0f;
                for (int d = 0; d < dk; d++) {
                    const float e = expf(Gt[d] - Gj[d]) * kj[d];
                    sl += kt[d] * e;
                    sa += qt[d] * e;
                }
                L[t * chunk + j] = B(t) * sl;
                A[t * chunk + j] = sa;
            }
        }
        /* (I + L) [W | U] = diag(beta) [e^G ⊙ K | V], forward substitution */
        for (int t = 0; t < C; t++) {
            float *wt = W + t * dk, *ut = U + t * dv;
            const float bt = B(t);
            const float *kt = K(t), *vt = V(t), *Gt = G + t * dk;
            for (int d = 0; d < dk; d++) wt[d] = bt * expf(Gt[d]) * kt[d];
            for (int d = 0; d < dv; d++) ut[d] = bt * vt[d];
            for (int j = 0; j < t; j++) {
                const float l = L[t * chunk + j];
                const float *wj = W + j * dk, *uj = U + j * dv;
                for (int d = 0; d < dk; d++) wt[d] -= l * wj[d];
                for (int d = 0; d < dv; d++) ut[d] -= l * uj[d];
            }
        }
        /* Vn = U - W S */
        for (int t = 0; t < C; t++) {
            float *ut = U + t * dv;
            const float *wt = W + t * dk;
            for (int a = 0; a < dk; a++) {
                const float w = wt[a];
                const float *row = S + (int64_t)a * dv;
                for (int d = 0; d < dv; d++) ut[d] -= w * row[d];
            }
        }
        /* O = (q ⊙ e^G) S + Aqk Vn */
        for (int t = 0; t < C; t++) {
            float *ot = O(t);
            const float *qt = Q(t), *Gt = G + t * dk;
            for (int d = 0; d < dv; d++) ot[d] = 0.0f;
            for (int a = 0; a < dk; a++) {
                const float w = qt[a] * expf(Gt[a]);
                const float *row = S + (int64_t)a * dv;
                for (int d = 0; d < dv; d++) ot[d] += w * row[d];
            }
            for (int j = 0; j <= t; j++) {
                const float w = A[t * chunk + j];
                const float *uj = U + j * dv;
                for (int d = 0; d < dv; d++) ot[d] += w * uj[d];
            }
        }
        /* S <- diag(e^{G_C}) S + sum_t (e^{G_C - G_t} ⊙ k_t) Vn_tᵀ */
        const float *GC = G + (C - 1) * dk;
        for (int a = 0; a < dk; a++) eGC[a] = expf(GC[a]);
        for (int a = 0; a < dk; a++) {
            float *row = S + (int64_t)a * dv;
            for (int d = 0; d < dv; d++) row[d] *= eGC[a];
        }
        for (int t = 0; t < C; t++) {
            const float *kt = K(t), *Gt = G + t * dk, *ut = U + t * dv;
            for (int a = 0; a < dk; a++) {
                const float w = expf(GC[a] - Gt[a]) * kt[a];
                float *row = S + (int64_t)a * dv;
                for (int d = 0; d < dv; d++) row[d] += w * ut[d];
            }
        }
#undef Q
#undef K
#undef GG
#undef V
#undef B
#undef O
    }
}

/* ---- the BF16 chunked form (kda_bf.h) ------------------------------------ */

bool k3_kda_bf_fits(const k3_kda_head *h) {
    return h->dk > 0 && h->dv > 0 && h->dk % 32 == 0 && h->dv % 16 == 0 && h->dk <= K3_MAX_KDA_HEAD_DIM &&
        h->dv <= K3_MAX_KDA_HEAD_DIM;
}

/* the largest of a chunk (rounded up to 32), dk and dv */
static int64_t bf_ref_dim(int chunk, int dk, int dv) {
    const int64_t ch = (chunk + 31) / 32 * 32, m = dk > dv ? dk : dv;
    return ch > m ? ch : m;
}

int64_t k3_kda_chunk_work_bf(int chunk, int dk, int dv) {
    /* kda_bf.h's layout, and the reference's rounded operands beside it */
    const int64_t mx = bf_ref_dim(chunk, dk, dv);
    return kbf_work(chunk, dk, dv) + 3 * mx * mx;
}

/* C = A B (A: M x K with strides ars, acs; B: K x N with strides brs, bcs)
 * by the products' contract: A and B rounded to BF16, per block of 32 k the
 * even and odd k's products summed apart from +0 (each add flushed below
 * 2^-126), C = C + (E + O) from +0. ra, rb: M*K and K*N floats of scratch. */
static void mm_ref(int M, int N, int K, const float *A, int64_t ars, int64_t acs, const float *B, int64_t brs,
                   int64_t bcs, float *C, int64_t ldc, float *ra, float *rb) {
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) ra[(int64_t)m * K + k] = bf_round(A[m * ars + k * acs]);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) rb[(int64_t)n * K + k] = bf_round(B[k * brs + n * bcs]);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *a = ra + (int64_t)m * K, *b = rb + (int64_t)n * K;
            float c = 0.0f;
            for (int k = 0; k < K; k += 32) {
                float e = 0.0f, o = 0.0f;
                for (int i = k; i < k + 32; i += 2) {
                    e = ftz(e + a[i] * b[i]);
                    o = ftz(o + a[i + 1] * b[i + 1]);
                }
                c = c + (e + o);
            }
            C[(int64_t)m * ldc + n] = c;
        }
}

/* kbf_steep (kda_bf.h) in scalar C, operation for operation. */
static void steep_ref(const k3_kda_head *h, int t0, int r, int re, float *L, float *A, int ldl, float *eg) {
    const int dk = h->dk;
    const int64_t ldq = h->ld_qk;
    float *E = eg + (int64_t)(re - r) * dk;
    for (int t = r; t < re; t++)
        for (int d = 0; d < dk; d++) eg[(int64_t)(t - r) * dk + d] = exp_poly(h->g[(int64_t)(t0 + t) * ldq + d]);
    for (int j = r; j < re; j++) {
        const float *kj = h->k + (int64_t)(t0 + j) * ldq;
        for (int d = 0; d < dk; d++) E[d] = 1.0f;
        for (int t = j; t < re; t++) {
            const float *kt = h->k + (int64_t)(t0 + t) * ldq, *qt = h->q + (int64_t)(t0 + t) * ldq;
            const float *et = eg + (int64_t)(t - r) * dk;
            float al[16] = {0}, aa[16] = {0};
            for (int d = 0; d < dk; d++) {
                if (t > j) E[d] = E[d] * et[d];
                const float x = kj[d] * E[d];
                al[d % 16] = fmaf(kt[d], x, al[d % 16]);
                aa[d % 16] = fmaf(qt[d], x, aa[d % 16]);
            }
            float sl = 0.0f, sa = 0.0f;
            for (int i = 0; i < 16; i++) sl = sl + al[i], sa = sa + aa[i];
            if (j < t) L[(int64_t)t * ldl + j] = h->beta[(int64_t)(t0 + t) * h->ld_beta] * sl;
            A[(int64_t)t * ldl + j] = sa;
        }
    }
}

/* kbf_chunk (kda_bf.h) in scalar C, operation for operation. */
static void bf_chunk_ref(const k3_kda_head *h, float *S, int t0, int C, kbf_ws *w, float *ra, float *rb) {
    const int dk = h->dk, dv = h->dv, ch = w->ch, Cp = (C + 31) / 32 * 32;
    const int64_t ldq = h->ld_qk;
    float *G = w->G;
#define KQ(t) (h->k + (int64_t)(t0 + (t)) * ldq)
#define QQ(t) (h->q + (int64_t)(t0 + (t)) * ldq)
#define GR(t) (G + (int64_t)(t)*dk)
#define BT(t) (h->beta[(int64_t)(t0 + (t)) * h->ld_beta])
    for (int t = 0; t < C; t++)
        for (int d = 0; d < dk; d++) GR(t)[d] = (t ? GR(t - 1)[d] : 0.0f) + h->g[(int64_t)(t0 + t) * ldq + d];
    const float *GC = GR(C - 1);
    for (int t = 0; t < Cp; t++) {
        const int r = t / KBF_SB * KBF_SB;
        float *ke = w->KQe + (int64_t)t * dk, *qe = w->KQe + (int64_t)(Cp + t) * dk, *kd = w->Kd + (int64_t)t * dk;
        float *ks = w->KQs + ((int64_t)r * 2 + (t - r)) * dk, *qs = ks + (int64_t)KBF_SB * dk;
        for (int d = 0; d < dk; d++) {
            if (t >= C) {
                ke[d] = qe[d] = kd[d] = ks[d] = qs[d] = 0.0f;
                continue;
            }
            const float k = KQ(t)[d], q = QQ(t)[d], g = GR(t)[d];
            const float e = exp_poly(g), e2 = exp_poly(GC[d] - g), e3 = exp_poly(g - GR(r)[d]);
            ke[d] = k * e;
            qe[d] = q * e;
            kd[d] = k * e2;
            ks[d] = k * e3;
            qs[d] = q * e3;
        }
    }
    for (int d = 0; d < dk; d++) w->eGC[d] = exp_poly(GC[d]);
    float *L = w->L, *A = w->A;
    memset(L, 0, sizeof(float) * (size_t)Cp * ch);
    memset(A, 0, sizeof(float) * (size_t)Cp * ch);
    for (int r = 0; r < C; r += KBF_SB) {
        const int re = r + KBF_SB < C ? r + KBF_SB : C, flat = kbf_flat(G, dk, r, re);
        const int nj = flat ? re : r, np = (nj + 15) / 16 * 16;
        for (int j = 0; j < np; j++)
            for (int d = 0; d < dk; d++)
                w->Kb[(int64_t)j * dk + d] = j < nj ? KQ(j)[d] * exp_poly(GR(r)[d] - GR(j)[d]) : 0.0f;
        if (np > 0) {
            mm_ref(2 * KBF_SB, np, dk, w->KQs + (int64_t)r * 2 * dk, dk, 1, w->Kb, 1, dk, w->Z, np, ra, rb);
            for (int t = r; t < re; t++) {
                const float *zl = w->Z + (int64_t)(t - r) * np, *za = w->Z + (int64_t)(KBF_SB + t - r) * np;
                for (int j = 0; j < nj && j < t; j++) L[(int64_t)t * ch + j] = BT(t) * zl[j];
                for (int j = 0; j < nj && j <= t; j++) A[(int64_t)t * ch + j] = za[j];
            }
        }
        if (!flat) steep_ref(h, t0, r, re, L, A, ch, w->Kb);
    }
    float *Z = w->Z, *ZO = Z + (int64_t)Cp * dv, *Z2 = Z + (int64_t)2 * Cp * dv, *U = w->U;
    mm_ref(2 * Cp, dv, dk, w->KQe, dk, 1, S, dv, 1, Z, dv, ra, rb);
    for (int t = 0; t < Cp; t++)
        for (int d = 0; d < dv; d++)
            U[(int64_t)t * dv + d] = t < C ? h->v[(int64_t)(t0 + t) * h->ld_v + d] - Z[(int64_t)t * dv + d] : 0.0f;
    for (int t = 0; t < C; t++)
        for (int d = 0; d < dv; d++) {
            float acc = BT(t) * U[(int64_t)t * dv + d];
            for (int j = 0; j < t; j++) acc = fmaf(-L[(int64_t)t * ch + j], U[(int64_t)j * dv + d], acc);
            U[(int64_t)t * dv + d] = acc;
        }
    mm_ref(Cp, dv, Cp, A, ch, 1, U, dv, 1, Z2, dv, ra, rb);
    for (int t = 0; t < C; t++)
        for (int d = 0; d < dv; d++)
            h->o[(int64_t)(t0 + t) * h->ld_o + d] = ZO[(int64_t)t * dv + d] + Z2[(int64_t)t * dv + d];
    mm_ref(dk, dv, Cp, w->Kd, 1, dk, U, dv, 1, Z, dv, ra, rb);
    for (int a = 0; a < dk; a++)
        for (int d = 0; d < dv; d++)
            S[(int64_t)a * dv + d] = fmaf(w->eGC[a], S[(int64_t)a * dv + d], Z[(int64_t)a * dv + d]);
#undef KQ
#undef QQ
#undef GR
#undef BT
}

void k3_kda_chunked_bf_ref(const k3_kda_head *h, float *S, int chunk, float *work) {
    K3_ASSERT(chunk > 0 && chunk % 32 == 0 && k3_kda_bf_fits(h));
    kbf_ws w;
    kbf_ws_init(&w, chunk, h->dk, h->dv, work);
    const int64_t mx = bf_ref_dim(chunk, h->dk, h->dv);
    float *ra = work + kbf_work(chunk, h->dk, h->dv), *rb = ra + 2 * mx * mx;
    for (int t0 = 0; t0 < h->n; t0 += chunk) bf_chunk_ref(h, S, t0, h->n - t0 < chunk ? h->n - t0 : chunk, &w, ra, rb);
}
