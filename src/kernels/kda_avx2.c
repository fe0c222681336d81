/*
 * kda_avx2.c -- AVX2 + FMA paths of the KDA recurrent and chunked forms (see
 * kda.h). They mirror k3_kda_recurrent_ref / k3_kda_chunked_ref: same
 * algebra, fp32 throughout, only the summation order (and FMA rounding)
 * differs. Compiled with -mavx2 -mfma; run only where the CPU has them and
 * dk, dv are multiples of 8 (k3_kda_simd_fits, which the AVX-512 recurrence
 * shares).
 *
 * Recurrent. Every column v of S evolves on its own (the recurrence mixes
 * rows, never columns), so S is walked in column panels of 16 (dk x 16 fp32,
 * 8 KB at dk = 128: L1-resident) and each panel runs through a group of up to
 * 32 tokens before the next panel is touched. Per token one pass over the
 * panel does the previous token's rank-1 update and output and this token's
 * decay and Sᵀk:
 *     row += k_{t-1}[a] u_{t-1};  o_{t-1} += q_{t-1}[a] row;
 *     row *= exp(g_t[a]);         u_t += k_t[a] row
 * The exps of a token group are taken once, before the panels.
 *
 * Chunked. docs/model.md §3.3 with sub-blocks of SB tokens inside a chunk, so
 * that the C²·dk decay factors of L and Aqk need not all be exps. For j in an
 * earlier sub-block than t, with r the first token of t's sub-block,
 *     exp(G_t - G_j) = exp(G_t - G_r) · exp(G_r - G_j)
 * (both factors <= 1: never exp(+G)), so L[t,j] = β_t Ks_t·Kb_j and
 * Aqk[t,j] = Qs_t·Kb_j with Ks_t = k_t ⊙ e^{G_t-G_r}, Qs_t = q_t ⊙ e^{G_t-G_r},
 * Kb_j = k_j ⊙ e^{G_r-G_j}: plain dot products. Kb is carried from one
 * sub-block to the next by the factor e^{G_r'-G_r} <= 1 (one exp per j, then
 * products of factors <= 1). Inside a sub-block exp(G_t - G_j) is evaluated
 * directly (the diagonal needs none). Kd_t = e^{G_C-G_t} ⊙ k_t for the state
 * update is Kb carried once more. Then, instead of W = T·(e^G ⊙ K) and
 * Vn = U - W·S,
 *     Vn = (I + L)^{-1} diag(β) (V - (e^G ⊙ K) S)
 * (one forward substitution over dv columns), O = (q ⊙ e^G) S + Aqk·Vn, and
 * S <- diag(e^{G_C}) S + Σ_t (e^{G_C-G_t} ⊙ k_t) Vn_tᵀ, the products as
 * register-tiled small matmuls vectorized over dv. e^{G_t} ⊙ k_t is formed as
 * Ks_t ⊙ e^{G_r} (again two factors <= 1). Products of factors <= 1 can only
 * underflow where the exact value is below the fp32 range too.
 *
 * Speed (one head, dk = dv = 128, 512 tokens, Zen 4, one thread): the
 * recurrent form does 4 vector ops per state element and token, the chunked
 * one 3 + 1/C plus O(C) terms (L, Aqk, the solve, Aqk·Vn) and its exps; on
 * this CPU the two land within ~10% of each other (chunk 16 best, chunk 64
 * ~30% slower than the recurrent AVX2 path), and the AVX-512 recurrence beats
 * both. See kda.h on which to use.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kernels_isa.h"
#include "kernels/vexp_avx2.h"

#define AI static inline __attribute__((always_inline))

/* ---- helpers ------------------------------------------------------------ */


/* The eight horizontal sums of a0..a7, in order, in one vector. */
AI __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The SIMD paths step over dk and dv in 8 lanes, and the recurrent ones keep
 * exp(g) of at least one token (dk floats) in an 8192-float stack buffer. */
bool k3_kda_simd_fits(const k3_kda_head *h) {
    return h->dk > 0 && h->dv > 0 && h->dk % 8 == 0 && h->dv % 8 == 0 && h->dk <= 8192;
}

/* ---- recurrent form ----------------------------------------------------- */

enum { REC_TG = 32, REC_E = 8192 }; /* tokens per group; floats of exp(g) */

/* One panel of NV 8-column vectors (columns c0..c0+8NV) through tokens
 * t0..t0+nt; E holds exp(g) of those tokens. */
AI void rec_panel(const int NV, const k3_kda_head *h, float *S, int c0, int t0, int nt, const float *E) {
    const int dk = h->dk, dv = h->dv;
    float *P = S + c0;
    __m256 up[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i <= nt; i++) {
        /* tc: the token decayed in this pass; tp = tc - 1: the one updated */
        const int64_t tc = t0 + i, tp = tc - 1;
        const float *e = E + (int64_t)i * dk;
        const float *kc = i < nt ? h->k + tc * h->ld_qk : NULL;
        const float *kp = i > 0 ? h->k + tp * h->ld_qk : NULL, *qp = i > 0 ? h->q + tp * h->ld_qk : NULL;
        __m256 u[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 o[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if (i == 0) { /* decay and Sᵀk of the group's first token */
            for (int a = 0; a < dk; a++) {
                float *row = P + (int64_t)a * dv;
                const __m256 ea = _mm256_broadcast_ss(e + a), ka = _mm256_broadcast_ss(kc + a);
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {
                    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * v), ea);
                    u[v] = _mm256_fmadd_ps(ka, x, u[v]);
                    _mm256_storeu_ps(row + 8 * v, x);
                }
            }
        } else if (i == nt) { /* update and output of the group's last token */
            for (int a = 0; a < dk; a++) {
                float *row = P + (int64_t)a * dv;
                const __m256 ka = _mm256_broadcast_ss(kp + a), qa = _mm256_broadcast_ss(qp + a);
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {
                    const __m256 x = _mm256_fmadd_ps(ka, up[v], _mm256_loadu_ps(row + 8 * v));
                    o[v] = _mm256_fmadd_ps(qa, x, o[v]);
                    _mm256_storeu_ps(row + 8 * v, x);
                }
            }
        } else { /* token tp's update and output, token tc's decay and Sᵀk */
            for (int a = 0; a < dk; a++) {
                float *row = P + (int64_t)a * dv;
                const __m256 kpa = _mm256_broadcast_ss(kp + a), qpa = _mm256_broadcast_ss(qp + a);
                const __m256 ea = _mm256_broadcast_ss(e + a), kca = _mm256_broadcast_ss(kc + a);
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {
                    __m256 x = _mm256_fmadd_ps(kpa, up[v], _mm256_loadu_ps(row + 8 * v));
                    o[v] = _mm256_fmadd_ps(qpa, x, o[v]);
                    x = _mm256_mul_ps(x, ea);
                    u[v] = _mm256_fmadd_ps(kca, x, u[v]);
                    _mm256_storeu_ps(row + 8 * v, x);
                }
            }
        }
        if (i > 0) {
            float *ot = h->o + tp * h->ld_o + c0;
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) _mm256_storeu_ps(ot + 8 * v, o[v]);
        }
        if (i < nt) { /* u = beta (v - Sᵀk) */
            const __m256 b = _mm256_set1_ps(h->beta[tc * h->ld_beta]);
            const float *vt = h->v + tc * h->ld_v + c0;
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) up[v] =
                _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(vt + 8 * v), u[v]));
        }
    }
}

void k3_kda_recurrent_avx2(const k3_kda_head *h, float *S) {
    const int dk = h->dk, dv = h->dv;
    float E[REC_E];
    int tg = REC_E / dk;
    if (tg > REC_TG) tg = REC_TG;
    for (int t0 = 0; t0 < h->n; t0 += tg) {
        const int nt = h->n - t0 < tg ? h->n - t0 : tg;
        for (int i = 0; i < nt; i++) {
            const float *g = h->g + (int64_t)(t0 + i) * h->ld_qk;
            for (int a = 0; a < dk; a += 8) _mm256_storeu_ps(E + i * dk + a, k3_exp8(_mm256_loadu_ps(g + a)));
        }
        int c0 = 0;
        for (; c0 + 16 <= dv; c0 += 16) rec_panel(2, h, S, c0, t0, nt, E);
        if (c0 < dv) rec_panel(1, h, S, c0, t0, nt, E);
    }
}

/* ---- chunked form: small matmuls ---------------------------------------- */

/* A tile of MR rows x NV 8-column vectors of
 *     out[i][:] = (cin ? cs_i cin[i][:] : 0) + sgn Σ_{p<K} a(i,p) b[p][:]
 * with a(i,p) = a[i*ars + p*acs], cs_i = cscale ? cscale[i] : 1. cin may be
 * out (each element is read before it is written). */
AI void mm_tile(const int MR, const int NV, int K, const float *a, int64_t ars, int64_t acs, const float *b,
                int64_t ldb, float *out, int64_t ldo, const float *cin, int64_t ldc, const float *cscale, float sgn) {
    __m256 acc[4][2];
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++)
        acc[i][v] = _mm256_setzero_ps();
    for (int p = 0; p < K; p++) {
        __m256 bv[2];
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) bv[v] = _mm256_loadu_ps(b + (int64_t)p * ldb + 8 * v);
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {
            const __m256 ai = _mm256_broadcast_ss(a + i * ars + p * acs);
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) acc[i][v] = _mm256_fmadd_ps(ai, bv[v], acc[i][v]);
        }
    }
    const __m256 s = _mm256_set1_ps(sgn);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {
        __m256 r = _mm256_mul_ps(acc[i][v], s);
        if (cin) {
            const __m256 c = _mm256_loadu_ps(cin + i * ldc + 8 * v);
            r = cscale ? _mm256_fmadd_ps(_mm256_set1_ps(cscale[i]), c, r) : _mm256_add_ps(c, r);
        }
        _mm256_storeu_ps(out + i * ldo + 8 * v, r);
    }
}

/* out [M, N] = cin-term + sgn a [M, K] · b [K, N], N % 8 == 0 (see mm_tile).
 * tri: a is lower triangular (a(i,p) = 0 for p > i), so row tile i0 only
 * runs p < i0 + 4; the tile's own entries above the diagonal must be 0. */
static void mm(int M, int N, int K, const float *a, int64_t ars, int64_t acs, const float *b, int64_t ldb, float *out,
               int64_t ldo, const float *cin, int64_t ldc, const float *cscale, float sgn, int tri) {
    for (int c0 = 0; c0 < N; c0 += 16) {
        const int nv = N - c0 >= 16 ? 2 : 1;
        for (int i0 = 0; i0 < M; i0 += 4) {
            const int mr = M - i0 < 4 ? M - i0 : 4;
            const int kk = tri ? (i0 + mr < K ? i0 + mr : K) : K;
            const float *ai = a + i0 * ars;
            float *oi = out + i0 * ldo + c0;
            const float *ci = cin ? cin + i0 * ldc + c0 : NULL;
            const float *si = cscale ? cscale + i0 : NULL;
#define TILE(MR, NV) mm_tile(MR, NV, kk, ai, ars, acs, b + c0, ldb, oi, ldo, ci, ldc, si, sgn)
            if (nv == 2) {
                switch (mr) {
                case 4: TILE(4, 2); break;
                case 3: TILE(3, 2); break;
                case 2: TILE(2, 2); break;
                default: TILE(1, 2); break;
                }
            } else {
                switch (mr) {
                case 4: TILE(4, 1); break;
                case 3: TILE(3, 1); break;
                case 2: TILE(2, 1); break;
                default: TILE(1, 1); break;
                }
            }
#undef TILE
        }
    }
}

/* Rows t of x [C, N] (row stride ldx), in place:
 *     x[t] <- beta_t x[t] - Σ_{j<t} l[t][j] x[j]
 * i.e. x <- (I + L)^{-1} diag(beta) x, L strictly lower (row stride ldl). */
AI void solve_cols(const int NV, int C, float *x, int64_t ldx, const float *l, int64_t ldl, const float *beta,
                   int64_t ldb) {
    for (int t = 0; t < C; t++) {
        float *xt = x + (int64_t)t * ldx;
        const __m256 bt = _mm256_set1_ps(beta[t * ldb]);
        __m256 acc[8];
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) acc[v] = _mm256_mul_ps(bt, _mm256_loadu_ps(xt + 8 * v));
        const float *lt = l + (int64_t)t * ldl;
        for (int j = 0; j < t; j++) {
            const __m256 lj = _mm256_broadcast_ss(lt + j);
            const float *xj = x + (int64_t)j * ldx;
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) acc[v] =
                _mm256_fnmadd_ps(lj, _mm256_loadu_ps(xj + 8 * v), acc[v]);
        }
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) _mm256_storeu_ps(xt + 8 * v, acc[v]);
    }
}

static void solve(int C, int N, float *x, int64_t ldx, const float *l, int64_t ldl, const float *beta, int64_t ldb) {
    int c = 0;
    for (; c + 64 <= N; c += 64) solve_cols(8, C, x + c, ldx, l, ldl, beta, ldb);
    if (c + 32 <= N) {
        solve_cols(4, C, x + c, ldx, l, ldl, beta, ldb);
        c += 32;
    }
    if (c + 16 <= N) {
        solve_cols(2, C, x + c, ldx, l, ldl, beta, ldb);
        c += 16;
    }
    if (c + 8 <= N) solve_cols(1, C, x + c, ldx, l, ldl, beta, ldb);
}

/* ---- chunked form ------------------------------------------------------- */

/* Sub-block: tokens whose mutual decays are direct exps. Measured at dk = dv =
 * 128 (Zen 4): 4 beats 8 by ~4% and 16 by ~15%. Inside a sub-block each pair
 * costs dk exps, across sub-blocks only FMAs; smaller sub-blocks only add
 * carry multiplies (one per earlier row and sub-block). */
enum { SB = 4 };

void k3_kda_chunked_avx2(const k3_kda_head *h, float *S, int chunk, float *work) {
    const int dk = h->dk, dv = h->dv;
    const int64_t cd = (int64_t)chunk * dk;
    float *G = work;                       /* [chunk, dk] running log-decay */
    float *Ks = G + cd;                    /* [chunk, dk] k_t e^{G_t-G_r}, then k_t e^{G_t} */
    float *Qs = Ks + cd;                   /* [chunk, dk] q_t e^{G_t-G_r}, then q_t e^{G_t} */
    float *Kb = Qs + cd;                   /* [chunk, dk] k_j e^{G_r-G_j}, then e^{G_C-G_t} k_t */
    float *U = Kb + cd;                    /* [chunk, dv] V - Ke S, then Vn */
    float *L = U + (int64_t)chunk * dv;    /* [chunk, chunk] */
    float *A = L + (int64_t)chunk * chunk; /* [chunk, chunk] Aqk, 0 above the diagonal */
    float *f = A + (int64_t)chunk * chunk; /* [dk] decay factors */
    float *f2 = f + dk;                    /* [dk] */

    for (int t0 = 0; t0 < h->n; t0 += chunk) {
        const int C = h->n - t0 < chunk ? h->n - t0 : chunk;
        const float *q0 = h->q + (int64_t)t0 * h->ld_qk, *k0 = h->k + (int64_t)t0 * h->ld_qk;
        const float *g0 = h->g + (int64_t)t0 * h->ld_qk, *b0 = h->beta + (int64_t)t0 * h->ld_beta;
        const int64_t ldq = h->ld_qk, ldb = h->ld_beta;
#define Q(t) (q0 + (int64_t)(t)*ldq)
#define K(t) (k0 + (int64_t)(t)*ldq)
#define GR(t) (G + (int64_t)(t)*dk)
        /* G_t = Σ_{i<=t} g_i, summed in the reference's order */
        for (int d = 0; d < dk; d += 8) {
            __m256 s = _mm256_setzero_ps();
            for (int t = 0; t < C; t++) {
                s = _mm256_add_ps(s, _mm256_loadu_ps(g0 + (int64_t)t * ldq + d));
                _mm256_storeu_ps(GR(t) + d, s);
            }
        }
        for (int t = 0; t < C; t++) memset(A + (int64_t)t * chunk, 0, sizeof(float) * (size_t)C);

        for (int r = 0; r < C; r += SB) {
            const int re = r + SB < C ? r + SB : C;
            /* Kb_j = k_j e^{G_r - G_j} for j < r: carry the earlier ones by
             * e^{G_r - G_rp}, take the previous sub-block's directly */
            if (r > 0) {
                const int rp = r - SB;
                for (int d = 0; d < dk; d += 8)
                    _mm256_storeu_ps(f + d,
                                     k3_exp8(_mm256_sub_ps(_mm256_loadu_ps(GR(r) + d), _mm256_loadu_ps(GR(rp) + d))));
                for (int j = 0; j < rp; j++)
                    for (int d = 0; d < dk; d += 8)
                        _mm256_storeu_ps(Kb + (int64_t)j * dk + d,
                                         _mm256_mul_ps(_mm256_loadu_ps(Kb + (int64_t)j * dk + d),
                                                       _mm256_loadu_ps(f + d)));
                for (int j = rp; j < r; j++)
                    for (int d = 0; d < dk; d += 8) {
                        const __m256 e = k3_exp8(_mm256_sub_ps(_mm256_loadu_ps(GR(r) + d), _mm256_loadu_ps(GR(j) + d)));
                        _mm256_storeu_ps(Kb + (int64_t)j * dk + d, _mm256_mul_ps(_mm256_loadu_ps(K(j) + d), e));
                    }
            }
            /* Ks_t, Qs_t relative to r */
            for (int t = r; t < re; t++)
                for (int d = 0; d < dk; d += 8) {
                    const __m256 e = k3_exp8(_mm256_sub_ps(_mm256_loadu_ps(GR(t) + d), _mm256_loadu_ps(GR(r) + d)));
                    _mm256_storeu_ps(Ks + (int64_t)t * dk + d, _mm256_mul_ps(_mm256_loadu_ps(K(t) + d), e));
                    _mm256_storeu_ps(Qs + (int64_t)t * dk + d, _mm256_mul_ps(_mm256_loadu_ps(Q(t) + d), e));
                }
            /* earlier sub-blocks: L[t,j] = β_t Ks_t·Kb_j, Aqk[t,j] = Qs_t·Kb_j,
             * four t at a time (rows past re repeat the last one, unused) */
            for (int t = r; t < re; t += 4) {
                const float *ks[4], *qs[4];
                _Pragma("GCC unroll 8") for (int i = 0; i < 4; i++) {
                    const int ti = t + i < re ? t + i : re - 1;
                    ks[i] = Ks + (int64_t)ti * dk;
                    qs[i] = Qs + (int64_t)ti * dk;
                }
                for (int j = 0; j < r; j++) {
                    const float *kb = Kb + (int64_t)j * dk;
                    __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, a0 = l0, a1 = l0, a2 = l0, a3 = l0;
                    for (int d = 0; d < dk; d += 8) {
                        const __m256 x = _mm256_loadu_ps(kb + d);
                        l0 = _mm256_fmadd_ps(_mm256_loadu_ps(ks[0] + d), x, l0);
                        l1 = _mm256_fmadd_ps(_mm256_loadu_ps(ks[1] + d), x, l1);
                        l2 = _mm256_fmadd_ps(_mm256_loadu_ps(ks[2] + d), x, l2);
                        l3 = _mm256_fmadd_ps(_mm256_loadu_ps(ks[3] + d), x, l3);
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[0] + d), x, a0);
                        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[1] + d), x, a1);
                        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[2] + d), x, a2);
                        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[3] + d), x, a3);
                    }
                    float s[8];
                    _mm256_storeu_ps(s, hsum8x8(l0, l1, l2, l3, a0, a1, a2, a3));
                    for (int i = 0; i < 4 && t + i < re; i++) {
                        L[(int64_t)(t + i) * chunk + j] = b0[(t + i) * ldb] * s[i];
                        A[(int64_t)(t + i) * chunk + j] = s[4 + i];
                    }
                }
            }
            /* this sub-block: exp(G_t - G_j) directly for r <= j < t, four
             * (t, j) pairs at a time (the last group pads with its last pair) */
            int pt[SB * SB], pj[SB * SB], np = 0;
            for (int t = r + 1; t < re; t++)
                for (int j = r; j < t; j++) pt[np] = t, pj[np++] = j;
            for (int p = 0; p < np; p += 4) {
                const float *kt[4], *qt[4], *Gt[4], *kj[4], *Gj[4];
                _Pragma("GCC unroll 8") for (int i = 0; i < 4; i++) {
                    const int pi = p + i < np ? p + i : np - 1;
                    kt[i] = K(pt[pi]), qt[i] = Q(pt[pi]), Gt[i] = GR(pt[pi]);
                    kj[i] = K(pj[pi]), Gj[i] = GR(pj[pi]);
                }
                __m256 l[4], a[4];
                _Pragma("GCC unroll 8") for (int i = 0; i < 4; i++) l[i] = a[i] = _mm256_setzero_ps();
                for (int d = 0; d < dk; d += 8) {
                    _Pragma("GCC unroll 8") for (int i = 0; i < 4; i++) {
                        const __m256 e = k3_exp8(_mm256_sub_ps(_mm256_loadu_ps(Gt[i] + d), _mm256_loadu_ps(Gj[i] + d)));
                        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(kj[i] + d), e);
                        l[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kt[i] + d), x, l[i]);
                        a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qt[i] + d), x, a[i]);
                    }
                }
                float s[8];
                _mm256_storeu_ps(s, hsum8x8(l[0], l[1], l[2], l[3], a[0], a[1], a[2], a[3]));
                for (int i = 0; i < 4 && p + i < np; i++) {
                    const int t = pt[p + i], j = pj[p + i];
                    L[(int64_t)t * chunk + j] = b0[t * ldb] * s[i];
                    A[(int64_t)t * chunk + j] = s[4 + i];
                }
            }
            /* the diagonal, Aqk[t,t] = q_t·k_t (no decay), eight at a time */
            for (int t = r; t < re; t += 8) {
                __m256 a[8];
                _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int d = 0; d < dk; d += 8) _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
                        const int ti = t + i < re ? t + i : re - 1;
                        a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(Q(ti) + d), _mm256_loadu_ps(K(ti) + d), a[i]);
                    }
                float s[8];
                _mm256_storeu_ps(s, hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
                for (int i = 0; i < 8 && t + i < re; i++) A[(int64_t)(t + i) * chunk + t + i] = s[i];
            }
            /* Ke_t = Ks_t e^{G_r}, Qe_t = Qs_t e^{G_r} */
            for (int d = 0; d < dk; d += 8) _mm256_storeu_ps(f2 + d, k3_exp8(_mm256_loadu_ps(GR(r) + d)));
            for (int t = r; t < re; t++)
                for (int d = 0; d < dk; d += 8) {
                    const __m256 e = _mm256_loadu_ps(f2 + d);
                    float *ks = Ks + (int64_t)t * dk + d, *qs = Qs + (int64_t)t * dk + d;
                    _mm256_storeu_ps(ks, _mm256_mul_ps(_mm256_loadu_ps(ks), e));
                    _mm256_storeu_ps(qs, _mm256_mul_ps(_mm256_loadu_ps(qs), e));
                }
        }

        float *o0 = h->o + (int64_t)t0 * h->ld_o;
        /* U = V - Ke S;  O = Qe S */
        mm(C, dv, dk, Ks, dk, 1, S, dv, U, dv, h->v + (int64_t)t0 * h->ld_v, h->ld_v, NULL, -1.0f, 0);
        mm(C, dv, dk, Qs, dk, 1, S, dv, o0, h->ld_o, NULL, 0, NULL, 1.0f, 0);
        /* Vn = (I + L)^{-1} diag(β) U;  O += Aqk Vn */
        solve(C, dv, U, dv, L, chunk, b0, ldb);
        mm(C, dv, C, A, chunk, 1, U, dv, o0, h->ld_o, o0, h->ld_o, NULL, 1.0f, 1);
        /* S <- diag(e^{G_C}) S + Σ_t (e^{G_C - G_t} ⊙ k_t) Vn_tᵀ */
        /* Kd_t = e^{G_C - G_t} ⊙ k_t: Kb (relative to the last sub-block's
         * start rl) carried by e^{G_C - G_rl}; the last sub-block directly */
        const float *GC = GR(C - 1);
        const int rl = (C - 1) / SB * SB;
        for (int d = 0; d < dk; d += 8)
            _mm256_storeu_ps(f + d, k3_exp8(_mm256_sub_ps(_mm256_loadu_ps(GC + d), _mm256_loadu_ps(GR(rl) + d))));
        for (int t = 0; t < rl; t++)
            for (int d = 0; d < dk; d += 8)
                _mm256_storeu_ps(Kb + (int64_t)t * dk + d,
                                 _mm256_mul_ps(_mm256_loadu_ps(Kb + (int64_t)t * dk + d), _mm256_loadu_ps(f + d)));
        for (int t = rl; t < C; t++)
            for (int d = 0; d < dk; d += 8) {
                const __m256 e = k3_exp8(_mm256_sub_ps(_mm256_loadu_ps(GC + d), _mm256_loadu_ps(GR(t) + d)));
                _mm256_storeu_ps(Kb + (int64_t)t * dk + d, _mm256_mul_ps(_mm256_loadu_ps(K(t) + d), e));
            }
        for (int d = 0; d < dk; d += 8) _mm256_storeu_ps(f + d, k3_exp8(_mm256_loadu_ps(GC + d)));
        mm(dk, dv, C, Kb, 1, dk, U, dv, S, dv, S, dv, f, 1.0f, 0);
#undef Q
#undef K
#undef GR
    }
}
