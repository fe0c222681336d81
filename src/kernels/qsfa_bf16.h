/*
 * qsfa_bf16.h -- the pieces of QSFA's BF16 form (attn_ops.h, "QSFA on the
 * dot products") that its AVX-512 BF16 kernel (qsfa_avx512bf16.c) and its
 * AMX one (qsfa_amx.c) share, so that everything but the products is the
 * same code: the query and the slots' keys as BF16 rows, the scores'
 * epilogue, the softmax, P rounded to BF16 and the output. The products
 * themselves are E/O sums of 32 BF16 pairs (bf16_avx512.h), taken by
 * vdpbf16ps in the E/O word order and by TDPBF16PS in the natural one.
 * Include only from files compiled with AVX-512 F/BW/VL/BF16.
 *
 * One call is one token and at most 16 heads (k3_qsfa_bf runs a larger head
 * count in groups of 16): heads are the 16 lanes of a score vector and the
 * rows of the AMX tiles, slots go by blocks of 32 (QB_S), zero-padded.
 */
#ifndef K3_KERNELS_QSFA_BF16_H
#define K3_KERNELS_QSFA_BF16_H

#include <math.h>
#include <string.h>

#include "kernels/attn_ops.h"
#include "kernels/bf16_avx512.h"
#include "kernels/kernels_isa.h"
#include "kernels/vexp_avx512.h"

enum { QB_H = 16, QB_S = 32 };

/* The work of one call (k3_qsfa_bf_work floats), carved. */
typedef struct qsfa_bf_ws {
    int kvl, rope, nt, kq, n, npad;
    float *z;     /* [npad][16] scores, then p */
    float *pt;    /* [16][npad] p transposed */
    float *cst;   /* [nt][npad] the slots' block scales */
    float *cbuf;  /* [32][16] a block of products */
    float *qrow;  /* [16][kq] the query rows as fp32: qa | qpe | qpe */
    float *ml;    /* m [16], l [16], 1/l [16] */
    float *vb;    /* 1024: the AMX values' B tiles */
    uint16_t *pb; /* [nt][16][npad] P times the block scales, BF16 */
    uint16_t *qb; /* [kq / 32][16 rows][32 words] the query's blocks */
    uint16_t *cb; /* [32][kq] a block of slots' keys, BF16 */
} qsfa_bf_ws;

#define QB_INLINE static inline __attribute__((always_inline))

QB_INLINE void qsfa_bf_ws_init(qsfa_bf_ws *w, const k3_c8_cache *c, int n, float *work) {
    w->kvl = c->kv_lora;
    w->rope = c->rope;
    w->nt = (c->kv_lora + K3_C8_TILE - 1) / K3_C8_TILE;
    w->kq = c->kv_lora + 2 * c->rope;
    w->n = n;
    w->npad = (n + QB_S - 1) / QB_S * QB_S;
    float *p = work;
    w->z = p, p += (int64_t)w->npad * 16;
    w->pt = p, p += (int64_t)w->npad * 16;
    w->cst = p, p += (int64_t)w->npad * w->nt;
    w->cbuf = p, p += 512;
    w->qrow = p, p += (int64_t)16 * w->kq;
    w->ml = p, p += 48;
    w->vb = p, p += 1024;
    w->pb = (uint16_t *)p, p += (int64_t)w->nt * 8 * w->npad;
    w->qb = (uint16_t *)p, p += (int64_t)w->kq * 8;
    w->cb = (uint16_t *)p;
}

/* 32 fp32 values whose BF16 is exact (their low 16 bits zero or ignored) as
 * 32 words in the order idx gives (k3b_idx_natural, k3b_idx_eo). */
QB_INLINE __m512i qsfa_bf_words(__m512i a, __m512i b, __m512i idx) { return _mm512_permutex2var_epi16(a, idx, b); }

/* 16 int8 codes as fp32 bits (exact in BF16: the top 16 bits) */
QB_INLINE __m512i qsfa_bf_codes16(const int8_t *p) {
    return _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
}

/* The query of heads [0, H) (H <= 16; the rest zero) rounded to BF16 as
 * the products' blocks: for each 32 dims k of qa | qpe | qpe, the 16 heads'
 * dwords transposed, row r lane h = head h's dword r of the block in idx's
 * order. */
QB_INLINE void qsfa_bf_query(qsfa_bf_ws *w, const float *qa, const float *qpe, int H, __m512i idx) {
    const int kvl = w->kvl, rope = w->rope, kq = w->kq;
    for (int h = 0; h < H; h++) {
        float *r = w->qrow + (int64_t)h * kq;
        memcpy(r, qa + (int64_t)h * kvl, sizeof(float) * (size_t)kvl);
        memcpy(r + kvl, qpe + (int64_t)h * rope, sizeof(float) * (size_t)rope);
        memcpy(r + kvl + rope, qpe + (int64_t)h * rope, sizeof(float) * (size_t)rope);
    }
    for (int k = 0; k < kq / 32; k++) {
        __m512i v[16];
        for (int h = 0; h < 16; h++)
            v[h] = h < H ? k3b_block(w->qrow + (int64_t)h * kq + 32 * k, 32, idx) : _mm512_setzero_si512();
        k3b_tr16(v);
        for (int r = 0; r < 16; r++) _mm512_storeu_si512((void *)(w->qb + (int64_t)k * 512 + r * 32), v[r]);
    }
}

/* The keys of slots [s0, s0 + 32) (those past n zero) as BF16 rows of kq
 * words into cb: the latent codes (exact), then the rope key's BF16 (hi) and
 * the BF16 of what hi leaves (lo), so hi + lo holds it to ~2^-17. */
QB_INLINE void qsfa_bf_keys(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, int s0, __m512i idx) {
    const int kvl = w->kvl, rope = w->rope, kq = w->kq;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    float tmp[2 * 1024];
    for (int i = 0; i < QB_S; i++) {
        uint16_t *dst = w->cb + (int64_t)i * kq;
        if (s0 + i >= w->n) {
            memset(dst, 0, sizeof(uint16_t) * (size_t)kq);
            continue;
        }
        const int64_t s = slots[s0 + i];
        const int8_t *c8 = c->c8 + s * kvl;
        for (int d = 0; d < kvl; d += 32)
            _mm512_storeu_si512((void *)(dst + d),
                                qsfa_bf_words(qsfa_bf_codes16(c8 + d), qsfa_bf_codes16(c8 + d + 16), idx));
        const float *kp = c->kpe + s * rope;
        for (int j = 0; j < rope; j += 16) {
            const __m512i u = _mm512_and_si512(k3b_round_hi(_mm512_castps_si512(_mm512_loadu_ps(kp + j))), hi);
            const __m512 rest = _mm512_sub_ps(_mm512_loadu_ps(kp + j), _mm512_castsi512_ps(u));
            _mm512_storeu_si512((void *)(tmp + j), u);
            _mm512_storeu_si512((void *)(tmp + rope + j), k3b_round_hi(_mm512_castps_si512(rest)));
        }
        for (int d = 0; d < 2 * rope; d += 32)
            _mm512_storeu_si512((void *)(dst + kvl + d),
                                qsfa_bf_words(_mm512_loadu_si512((const void *)(tmp + d)),
                                              _mm512_loadu_si512((const void *)(tmp + d + 16)), idx));
    }
}

/* Block b of the scores of slots [s0, s0 + 32) from their products C
 * (cbuf, [32][16]): a latent block (b < nt) adds C times the slot's scale of
 * that block, the rope block (b == nt) adds C. */
QB_INLINE void qsfa_bf_zblock(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, int s0, int b) {
    for (int i = 0; i < QB_S; i++) {
        float *z = w->z + (int64_t)(s0 + i) * 16;
        const __m512 C = _mm512_loadu_ps(w->cbuf + i * 16), zv = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(z);
        if (b < w->nt) {
            const float sc = s0 + i < w->n ? c->cs[slots[s0 + i] * c->n_tiles + b] : 0.0f;
            _mm512_storeu_ps(z, _mm512_fmadd_ps(C, _mm512_set1_ps(sc), zv));
        } else _mm512_storeu_ps(z, _mm512_add_ps(zv, C));
    }
}

/* The softmax of the scores (z times scale; the slots past n -inf) into p,
 * its max and sum per head; p transposed (pt); P times each block's scales
 * rounded to BF16 in idx's order (pb). n > 0. */
QB_INLINE void qsfa_bf_softmax(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, float scale, __m512i idx) {
    const int n = w->n, npad = w->npad, nt = w->nt;
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    const __m512 sv = _mm512_set1_ps(scale);
    for (int s = 0; s < npad; s++) {
        float *z = w->z + (int64_t)s * 16;
        const __m512 v = s < n ? _mm512_mul_ps(_mm512_loadu_ps(z), sv) : _mm512_set1_ps(-INFINITY);
        _mm512_storeu_ps(z, v);
        if (s < n) m = _mm512_max_ps(m, v);
    }
    for (int s = 0; s < npad; s++) {
        float *z = w->z + (int64_t)s * 16;
        const __m512 p = s < n ? k3_exp16(_mm512_sub_ps(_mm512_loadu_ps(z), m)) : _mm512_setzero_ps();
        _mm512_storeu_ps(z, p);
        l = _mm512_add_ps(l, p);
    }
    _mm512_storeu_ps(w->ml, m);
    _mm512_storeu_ps(w->ml + 16, l);
    for (int h = 0; h < 16; h++) w->ml[32 + h] = 1.0f / w->ml[16 + h];
    for (int s0 = 0; s0 < npad; s0 += 16) {
        __m512i v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_si512((const void *)(w->z + (int64_t)(s0 + i) * 16));
        k3b_tr16(v);
        for (int h = 0; h < 16; h++) _mm512_storeu_si512((void *)(w->pt + (int64_t)h * npad + s0), v[h]);
    }
    for (int b = 0; b < nt; b++) {
        float *cs = w->cst + (int64_t)b * npad;
        for (int s = 0; s < npad; s++) cs[s] = s < n ? c->cs[slots[s] * c->n_tiles + b] : 0.0f;
    }
    for (int b = 0; b < nt; b++)
        for (int h = 0; h < 16; h++)
            for (int s0 = 0; s0 < npad; s0 += 32) {
                const float *p = w->pt + (int64_t)h * npad + s0, *cs = w->cst + (int64_t)b * npad + s0;
                const __m512i a =
                    k3b_round_hi(_mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(cs))));
                const __m512i d =
                    k3b_round_hi(_mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(cs + 16))));
                _mm512_storeu_si512((void *)(w->pb + ((int64_t)b * 16 + h) * npad + s0), qsfa_bf_words(a, d, idx));
            }
}

/* Output dims [d0, d0 + 16) of heads [0, H) from their sums C (rows of 16
 * floats, ldc apart): C / l. */
QB_INLINE void qsfa_bf_out(const qsfa_bf_ws *w, const float *C, int ldc, int H, int d0, float *out) {
    for (int h = 0; h < H; h++)
        _mm512_storeu_ps(out + (int64_t)h * w->kvl + d0,
                         _mm512_mul_ps(_mm512_loadu_ps(C + (int64_t)h * ldc), _mm512_set1_ps(w->ml[32 + h])));
}

QB_INLINE void qsfa_bf_lse(const qsfa_bf_ws *w, int H, float *lse) {
    for (int h = 0; h < H; h++) lse[h] = w->ml[h] + logf(w->ml[16 + h]);
}

/* n == 0: no weight */
QB_INLINE void qsfa_bf_empty(int H, int kvl, float *out, float *lse) {
    memset(out, 0, sizeof(float) * (size_t)H * (size_t)kvl);
    for (int h = 0; h < H; h++) lse[h] = -INFINITY;
}

#endif /* K3_KERNELS_QSFA_BF16_H */
