/*
 * attn_ops_avx512.c -- QLI scores with AVX-512 VNNI (see attn_ops.h).
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
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "attn_ops.h"

enum { QLI_MAX_G = 64, QLI_MAX_HEADS = 64 };

int k3_qli_avx512_ok(int HI, int dI) { return HI <= QLI_MAX_HEADS && dI % 64 == 0 && dI / 4 <= QLI_MAX_G; }

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
            for (int i = 0; i < 16; i++)
                r[i] = i < m ? _mm512_loadu_si512(k8 + slots[i0 + i] * dI + 64 * c) : zero;
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
