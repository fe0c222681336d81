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
#include "model/config.h"

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
