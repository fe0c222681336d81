/*
 * qsfa_avx512bf16.c -- QSFA's BF16 form (attn_ops.h) with vdpbf16ps, the
 * "avx512-bf16" table's kernel: the bits of the AMX one (qsfa_amx.c) and of
 * k3_qsfa_bf16_ref.
 *
 * vdpbf16ps adds a lane's high product, then its low one; a dword of the E/O
 * order (bf16_avx512.h) holds dims 4j (high) and 4j + 2 (low), or 4j + 1 and
 * 4j + 3, so a chain over j walks the even dims of a block of 32 in order
 * (E) and another the odd ones (O), and C = C + (E + O) is TDPBF16PS's sum.
 * Scores: lanes are the 16 heads, the slot's key dword broadcast. Values:
 * lanes are 16 output dims, the slots' codes paired by the E/O order of the
 * slots and P's dword broadcast.
 */
#include "kernels/qsfa_bf16.h"

#define DP(acc, a, b) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(b))

/* Scores of slots [s0, s0 + 32): each block's sums of 4 slots at a time into
 * cbuf, then the block's epilogue. */
static void scores(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, int s0) {
    const int kq = w->kq, kvl = w->kvl;
    for (int b = 0; b <= w->nt; b++) {
        const int k0 = b < w->nt ? b * 4 : kvl / 32,
                  k1 = b < w->nt ? (kvl / 32 < (b + 1) * 4 ? kvl / 32 : (b + 1) * 4) : kq / 32;
        for (int g = 0; g < QB_S; g += 4) {
            const uint32_t *kr[4];
            for (int i = 0; i < 4; i++) kr[i] = (const uint32_t *)(w->cb + (int64_t)(g + i) * kq);
            __m512 C[4];
            for (int i = 0; i < 4; i++) C[i] = _mm512_setzero_ps();
            for (int k = k0; k < k1; k++) {
                const uint16_t *q = w->qb + (int64_t)k * 512;
                __m512 E[4], O[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) E[i] = O[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                    const __m512i qe = _mm512_loadu_si512((const void *)(q + (2 * j) * 32)),
                                  qo = _mm512_loadu_si512((const void *)(q + (2 * j + 1) * 32));
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        E[i] = DP(E[i], qe, _mm512_set1_epi32((int)kr[i][k * 16 + 2 * j]));
                        O[i] = DP(O[i], qo, _mm512_set1_epi32((int)kr[i][k * 16 + 2 * j + 1]));
                    }
                }
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) C[i] = _mm512_add_ps(C[i], _mm512_add_ps(E[i], O[i]));
            }
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(w->cbuf + (g + i) * 16, C[i]);
        }
        qsfa_bf_zblock(w, c, slots, s0, b);
    }
}

/* Output dims [d0, d0 + 16) of heads [0, H) over every slot. */
static void values(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, int H, int d0, float *out) {
    const int kvl = w->kvl, npad = w->npad, b = d0 / K3_C8_TILE;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    float *C = w->cbuf;
    memset(C, 0, sizeof(float) * 16 * 16);
    for (int s0 = 0; s0 < npad; s0 += QB_S) {
        __m512i f[QB_S], V[16];
        for (int i = 0; i < QB_S; i++)
            f[i] = s0 + i < w->n ? qsfa_bf_codes16(c->c8 + slots[s0 + i] * kvl + d0) : _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            V[2 * j] = _mm512_ternarylogic_epi32(hi, f[4 * j], _mm512_srli_epi32(f[4 * j + 2], 16), 0xCA);
            V[2 * j + 1] = _mm512_ternarylogic_epi32(hi, f[4 * j + 1], _mm512_srli_epi32(f[4 * j + 3], 16), 0xCA);
        }
        for (int h = 0; h < H; h++) {
            const uint32_t *p = (const uint32_t *)(w->pb + ((int64_t)b * 16 + h) * npad + s0);
            __m512 E = _mm512_setzero_ps(), O = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                E = DP(E, V[2 * j], _mm512_set1_epi32((int)p[2 * j]));
                O = DP(O, V[2 * j + 1], _mm512_set1_epi32((int)p[2 * j + 1]));
            }
            _mm512_storeu_ps(C + h * 16, _mm512_add_ps(_mm512_loadu_ps(C + h * 16), _mm512_add_ps(E, O)));
        }
    }
    qsfa_bf_out(w, C, 16, H, d0, out);
}

static void qsfa16(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                   float scale, float *out, float *lse, float *work) {
    if (n == 0) {
        qsfa_bf_empty(H, c->kv_lora, out, lse);
        return;
    }
    qsfa_bf_ws w;
    qsfa_bf_ws_init(&w, c, n, work);
    const __m512i idx = k3b_idx_eo();
    qsfa_bf_query(&w, qa, qpe, H, idx);
    for (int s0 = 0; s0 < w.npad; s0 += QB_S) {
        qsfa_bf_keys(&w, c, slots, s0, idx);
        scores(&w, c, slots, s0);
    }
    qsfa_bf_softmax(&w, c, slots, scale, idx);
    for (int d0 = 0; d0 < w.kvl; d0 += 16) values(&w, c, slots, H, d0, out);
    qsfa_bf_lse(&w, H, lse);
}

void k3_qsfa_bf_avx512(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                       float scale, float *out, float *lse, float *work) {
    for (int h0 = 0; h0 < H; h0 += QB_H) {
        const int nh = H - h0 < QB_H ? H - h0 : QB_H;
        qsfa16(qa + (int64_t)h0 * c->kv_lora, qpe + (int64_t)h0 * c->rope, nh, c, slots, n, scale,
               out + (int64_t)h0 * c->kv_lora, lse + h0, work);
    }
}
