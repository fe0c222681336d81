/*
 * attn_ops_avx512.c -- QLI scores with AVX-512 VNNI, and QSFA with AVX-512
 * (see attn_ops.h).
 *
 * Sixteen keys at a time, one per lane: the block of 16 keys x dI bytes is
 * transposed in registers (16 x 16 dwords at a time: unpacks, then 128-bit
 * shuffles) so that register g holds bytes 4g..4g+3 of every key, made
 * unsigned by + 128 for vpdpbusd; each head's dot products with the 16 keys
 * are then dI/4 vpdpbusd against that head's query bytes broadcast, with
 * 128 Σ q_h taken off after. Integer dot products, so exact; the ReLU and the
 * weighted sum over heads then run in head order with a multiply and an add,
 * as the scalar reference does. Heads go sixteen at a time (the last group
 * padded with zero queries and weights, which add exact zeros).
 *
 * QSFA by blocks of slots (k3_qsfa_avx512 below).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kernels_isa.h"
#include "vexp_avx512.h"

enum { QLI_MAX_G = 64, QLI_MAX_HEADS = 64 };

bool k3_qli_avx512_fits(int HI, int dI) { return HI <= QLI_MAX_HEADS && dI % 64 == 0 && dI / 4 <= QLI_MAX_G; }

/* r[0..15]: dwords [16 c, 16 c + 16) of 16 keys -> out[j]: dword 16 c + j of
 * keys 0..15 in lanes 0..15 */
static inline __attribute__((always_inline)) void transpose16(const __m512i r[16], __m512i out[16]) {
    __m512i t[16], u[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);     /* a0 b0 a1 b1 per 128 bits */
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]); /* a2 b2 a3 b3 */
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);     /* a0 b0 c0 d0 */
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);     /* a1 b1 c1 d1 */
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]); /* a2 b2 c2 d2 */
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]); /* a3 b3 c3 d3 */
    }
    /* u[4 i + j], 128-bit chunk c: dword 4 c + j of keys 4 i .. 4 i + 3 */
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44),
                      v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        out[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);      /* chunk 0 of each: dword j */
        out[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);  /* chunk 1: dword 4 + j */
        out[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);  /* chunk 2: dword 8 + j */
        out[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD); /* chunk 3: dword 12 + j */
    }
}

void k3_qli_scores_avx512(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8,
                          const float *ks, const int64_t *slots, int n, float *scores) {
    const int G = dI / 4, HP = (HI + 15) / 16 * 16;
    int32_t q32[QLI_MAX_HEADS * QLI_MAX_G], qoff[QLI_MAX_HEADS];
    float wq[QLI_MAX_HEADS];
    for (int h = 0; h < HP; h++) {
        int32_t sum = 0;
        if (h < HI) {
            memcpy(q32 + h * G, q8 + h * dI, (size_t)dI);
            for (int j = 0; j < dI; j++) sum += q8[h * dI + j];
        } else {
            memset(q32 + h * G, 0, sizeof(int32_t) * (size_t)G);
        }
        qoff[h] = 128 * sum;
        wq[h] = h < HI ? w[h] * qs[h] : 0.0f;
    }
    const __m512i bias = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512i kt[QLI_MAX_G], r[16];
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int m = n - i0 < 16 ? n - i0 : 16;
        for (int c = 0; c < G / 16; c++) {
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) r[i] = i < m ? _mm512_loadu_si512(k8 + slots[i0 + i] * dI + 64 * c) : zero;
            transpose16(r, kt + 16 * c);
        }
        for (int g = 0; g < G; g++) kt[g] = _mm512_xor_si512(kt[g], bias);
        __m512 s = _mm512_setzero_ps();
        for (int h0 = 0; h0 < HP; h0 += 16) {
            __m512i acc[16];
#pragma GCC unroll 16
            for (int h = 0; h < 16; h++) acc[h] = zero;
            for (int g = 0; g < G; g++)
#pragma GCC unroll 16
                for (int h = 0; h < 16; h++)
                    acc[h] = _mm512_dpbusd_epi32(acc[h], kt[g], _mm512_set1_epi32(q32[(h0 + h) * G + g]));
#pragma GCC unroll 16
            for (int h = 0; h < 16; h++) {
                const __m512i d = _mm512_max_epi32(_mm512_sub_epi32(acc[h], _mm512_set1_epi32(qoff[h0 + h])), zero);
                s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_set1_ps(wq[h0 + h]), _mm512_cvtepi32_ps(d)));
            }
        }
        float out[16];
        _mm512_storeu_ps(out, s);
        for (int i = 0; i < m; i++) scores[i0 + i] = out[i] * ks[slots[i0 + i]];
    }
}

/* ---- QSFA ------------------------------------------------------------------ */

/* r[l] = the sum of the 16 lanes of a[l] */
static inline __attribute__((always_inline)) __m512 sum16x16(const __m512 a[16]) {
    __m512 t[8], u[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* u[k], 128-bit chunk c: partial sums of a[4k .. 4k+3] over chunk c */
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

enum { QSFA_B = 8 }; /* slots per block */
_Static_assert(QSFA_B == 8, "a block's weights are stored with an 8-lane mask");

bool k3_qsfa_avx512_fits(const k3_c8_cache *c) {
    return c->kv_lora % 16 == 0 && c->rope % 16 == 0 && c->rope <= c->kv_lora;
}

/* Blocks of 8 slots: the block dequantized once; its scores for 4 heads x 4
 * slots at a time (16 accumulators, reduced together); per head one max, one
 * vector exp and one rescale per block (online softmax by blocks); then
 * o_h = α o_h + Σ p c over the block, 16 columns at a time for 4 heads. */
void k3_qsfa_avx512(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                    float scale, float *out, float *lse, float *work) {
    const int kvl = c->kv_lora, rope = c->rope, HP = (H + 3) / 4 * 4;
    float *cf = work, *zero = cf + QSFA_B * kvl, *z = zero + kvl + rope, *m = z + HP * QSFA_B, *l = m + HP,
          *al = l + HP;
    memset(zero, 0, sizeof(float) * (size_t)(kvl + rope));
    for (int h = 0; h < HP; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)H * kvl);
    const float *kp[QSFA_B];
    for (int i0 = 0; i0 < n; i0 += QSFA_B) {
        const int nb = n - i0 < QSFA_B ? n - i0 : QSFA_B;
        for (int b = 0; b < QSFA_B; b++) {
            float *row = cf + b * kvl;
            if (b >= nb) {
                memset(row, 0, sizeof(float) * (size_t)kvl);
                kp[b] = zero;
                continue;
            }
            const int64_t s = slots[i0 + b];
            const int8_t *c8 = c->c8 + s * kvl;
            const float *cs = c->cs + s * c->n_tiles;
            for (int j = 0; j < kvl; j += 16)
                _mm512_storeu_ps(row + j,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(
                                                   _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c8 + j)))),
                                               _mm512_set1_ps(cs[j / K3_C8_TILE])));
            kp[b] = c->kpe + s * rope;
        }
        /* scores z[h][b] */
        for (int h0 = 0; h0 < HP; h0 += 4) {
            const float *qr[4], *qp[4];
            for (int i = 0; i < 4; i++) {
                qr[i] = h0 + i < H ? qa + (int64_t)(h0 + i) * kvl : zero;
                qp[i] = h0 + i < H ? qpe + (int64_t)(h0 + i) * rope : zero;
            }
            for (int b0 = 0; b0 < QSFA_B; b0 += 4) {
                __m512 acc[16];
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int j = 0; j < kvl; j += 16) {
                    __m512 qv[4], cv[4];
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        qv[i] = _mm512_loadu_ps(qr[i] + j);
                        cv[i] = _mm512_loadu_ps(cf + (b0 + i) * kvl + j);
                    }
#pragma GCC unroll 4
                    for (int a = 0; a < 4; a++)
#pragma GCC unroll 4
                        for (int b = 0; b < 4; b++) acc[4 * a + b] = _mm512_fmadd_ps(qv[a], cv[b], acc[4 * a + b]);
                }
                for (int j = 0; j < rope; j += 16) {
                    __m512 qv[4], kv[4];
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        qv[i] = _mm512_loadu_ps(qp[i] + j);
                        kv[i] = _mm512_loadu_ps(kp[b0 + i] + j);
                    }
#pragma GCC unroll 4
                    for (int a = 0; a < 4; a++)
#pragma GCC unroll 4
                        for (int b = 0; b < 4; b++) acc[4 * a + b] = _mm512_fmadd_ps(qv[a], kv[b], acc[4 * a + b]);
                }
                /* lane 4a + b: head h0 + a, slot b0 + b */
                const __m512 r = _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale));
                _mm_storeu_ps(z + (h0 + 0) * QSFA_B + b0, _mm512_extractf32x4_ps(r, 0));
                _mm_storeu_ps(z + (h0 + 1) * QSFA_B + b0, _mm512_extractf32x4_ps(r, 1));
                _mm_storeu_ps(z + (h0 + 2) * QSFA_B + b0, _mm512_extractf32x4_ps(r, 2));
                _mm_storeu_ps(z + (h0 + 3) * QSFA_B + b0, _mm512_extractf32x4_ps(r, 3));
            }
        }
        /* online softmax by blocks: z becomes p, al the rescale of o and l */
        const __mmask16 valid = (__mmask16)((1u << nb) - 1);
        for (int h = 0; h < H; h++) {
            const __m512 zv = _mm512_maskz_loadu_ps(valid, z + h * QSFA_B);
            const float mx = _mm512_mask_reduce_max_ps(valid, zv);
            const float mn = mx > m[h] ? mx : m[h];
            if (mn == -INFINITY) { /* nothing but -inf so far: no weight yet */
                al[h] = 1.0f;
                _mm512_mask_storeu_ps(z + h * QSFA_B, 0xff, _mm512_setzero_ps());
                continue;
            }
            al[h] = expf(m[h] - mn); /* 0 on the first block */
            /* the block's padding slots get weight 0 */
            const __m512 p = _mm512_maskz_mov_ps(valid, k3_exp16(_mm512_sub_ps(zv, _mm512_set1_ps(mn))));
            _mm512_mask_storeu_ps(z + h * QSFA_B, 0xff, p);
            l[h] = l[h] * al[h] + _mm512_reduce_add_ps(p);
            m[h] = mn;
        }
        /* o_h = al_h o_h + Σ_b p_hb c_b */
        for (int j = 0; j < kvl; j += 16) {
            __m512 cv[QSFA_B];
#pragma GCC unroll 8
            for (int b = 0; b < QSFA_B; b++) cv[b] = _mm512_loadu_ps(cf + b * kvl + j);
            for (int h = 0; h < H; h++) {
                float *oh = out + (int64_t)h * kvl + j;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(oh), _mm512_set1_ps(al[h]));
#pragma GCC unroll 8
                for (int b = 0; b < QSFA_B; b++) acc = _mm512_fmadd_ps(_mm512_set1_ps(z[h * QSFA_B + b]), cv[b], acc);
                _mm512_storeu_ps(oh, acc);
            }
        }
    }
    for (int h = 0; h < H; h++) {
        if (n == 0 || l[h] == 0.0f) {
            lse[h] = -INFINITY;
            continue;
        }
        const __m512 inv = _mm512_set1_ps(1.0f / l[h]);
        for (int j = 0; j < kvl; j += 16)
            _mm512_storeu_ps(out + (int64_t)h * kvl + j,
                             _mm512_mul_ps(_mm512_loadu_ps(out + (int64_t)h * kvl + j), inv));
        lse[h] = m[h] + logf(l[h]);
    }
}
