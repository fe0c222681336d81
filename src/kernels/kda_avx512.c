/*
 * kda_avx512.c -- AVX-512 (F) path of the KDA recurrent form (see kda.h
 * and kda_avx2.c, whose header describes the panel walk). Mirrors
 * k3_kda_recurrent_ref.
 *
 * Same algorithm as the AVX2 path with 16-lane vectors and panels of 32
 * columns. On Zen 4 a 512-bit op runs as two 256-bit halves, so the FMA peak
 * is AVX2's; the gain is that the per-row scalars (k, q, exp g) ride along as
 * embedded broadcasts instead of separate broadcast loads, and one panel row
 * is 8 ops, so each accumulator chain has room for its 4-cycle latency.
 */
#include <immintrin.h>
#include <stdint.h>

#include "kernels/kernels_isa.h"
#include "kernels/vexp_avx512.h"

#define AI static inline __attribute__((always_inline))


enum { REC_TG = 32, REC_E = 8192 }; /* tokens per group; floats of exp(g) */

/* One panel of NV 16-column vectors at c0 through tokens t0..t0+nt (E: their
 * exp(g)); the last vector's columns are limited by mask m. */
AI void rec_panel(const int NV, const k3_kda_head *h, float *S, int c0, int t0, int nt, const float *E, __mmask16 m) {
    const int dk = h->dk, dv = h->dv;
    float *P = S + c0;
    __mmask16 mv[8];
    __m512 up[8];
    for (int v = 0; v < NV; v++) {
        mv[v] = v == NV - 1 ? m : (__mmask16)0xffff;
        up[v] = _mm512_setzero_ps();
    }
    for (int i = 0; i <= nt; i++) {
        /* tc: the token decayed in this pass; tp = tc - 1: the one updated */
        const int64_t tc = t0 + i, tp = tc - 1;
        const float *e = E + (int64_t)i * dk;
        const float *kc = i < nt ? h->k + tc * h->ld_qk : NULL;
        const float *kp = i > 0 ? h->k + tp * h->ld_qk : NULL, *qp = i > 0 ? h->q + tp * h->ld_qk : NULL;
        __m512 u[8], o[8];
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) u[v] = o[v] = _mm512_setzero_ps();
        if (i == 0) {
            for (int a = 0; a < dk; a++) {
                float *row = P + (int64_t)a * dv;
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {
                    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mv[v], row + 16 * v), _mm512_set1_ps(e[a]));
                    u[v] = _mm512_fmadd_ps(_mm512_set1_ps(kc[a]), x, u[v]);
                    _mm512_mask_storeu_ps(row + 16 * v, mv[v], x);
                }
            }
        } else if (i == nt) {
            for (int a = 0; a < dk; a++) {
                float *row = P + (int64_t)a * dv;
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {
                    const __m512 x =
                        _mm512_fmadd_ps(_mm512_set1_ps(kp[a]), up[v], _mm512_maskz_loadu_ps(mv[v], row + 16 * v));
                    o[v] = _mm512_fmadd_ps(_mm512_set1_ps(qp[a]), x, o[v]);
                    _mm512_mask_storeu_ps(row + 16 * v, mv[v], x);
                }
            }
        } else {
            for (int a = 0; a < dk; a++) {
                float *row = P + (int64_t)a * dv;
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {
                    __m512 x =
                        _mm512_fmadd_ps(_mm512_set1_ps(kp[a]), up[v], _mm512_maskz_loadu_ps(mv[v], row + 16 * v));
                    o[v] = _mm512_fmadd_ps(_mm512_set1_ps(qp[a]), x, o[v]);
                    x = _mm512_mul_ps(x, _mm512_set1_ps(e[a]));
                    u[v] = _mm512_fmadd_ps(_mm512_set1_ps(kc[a]), x, u[v]);
                    _mm512_mask_storeu_ps(row + 16 * v, mv[v], x);
                }
            }
        }
        if (i > 0) {
            float *ot = h->o + tp * h->ld_o + c0;
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) _mm512_mask_storeu_ps(ot + 16 * v, mv[v], o[v]);
        }
        if (i < nt) { /* u = beta (v - Sᵀk) */
            const __m512 b = _mm512_set1_ps(h->beta[tc * h->ld_beta]);
            const float *vt = h->v + tc * h->ld_v + c0;
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) up[v] =
                _mm512_mul_ps(b, _mm512_sub_ps(_mm512_maskz_loadu_ps(mv[v], vt + 16 * v), u[v]));
        }
    }
}

void k3_kda_recurrent_avx512(const k3_kda_head *h, float *S) {
    const int dk = h->dk, dv = h->dv;
    float E[REC_E];
    int tg = REC_E / dk;
    if (tg > REC_TG) tg = REC_TG;
    for (int t0 = 0; t0 < h->n; t0 += tg) {
        const int nt = h->n - t0 < tg ? h->n - t0 : tg;
        for (int i = 0; i < nt; i++) {
            const float *g = h->g + (int64_t)(t0 + i) * h->ld_qk;
            int a = 0;
            for (; a + 16 <= dk; a += 16) _mm512_storeu_ps(E + i * dk + a, k3_exp16(_mm512_loadu_ps(g + a)));
            if (a < dk) /* dk % 8 == 0: one half vector */
                _mm512_mask_storeu_ps(E + i * dk + a, 0xff, k3_exp16(_mm512_maskz_loadu_ps(0xff, g + a)));
        }
        int c0 = 0;
        if (nt == 1 && dv == 128) {
            /* a decode step: the whole state in one panel, two passes in
             * address order (the first streams it in, the second finds it
             * in L2); the per-element arithmetic is the same as below */
            rec_panel(8, h, S, 0, t0, nt, E, 0xffff);
            continue;
        }
        for (; c0 + 32 <= dv; c0 += 32) rec_panel(2, h, S, c0, t0, nt, E, 0xffff);
        if (dv - c0 == 24) rec_panel(2, h, S, c0, t0, nt, E, 0xff);
        else if (dv - c0 == 16) rec_panel(1, h, S, c0, t0, nt, E, 0xffff);
        else if (dv - c0 == 8) rec_panel(1, h, S, c0, t0, nt, E, 0xff);
    }
}
