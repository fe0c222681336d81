/*
 * attn_ops_avx2.c -- AVX2 paths of QLI and QSFA (see attn_ops.h), the "avx2"
 * tables' (and the "avx512" one's where its own do not take a shape).
 * Compiled with -mavx2 -mfma; run only where the CPU has them.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/kernels_isa.h"
#include "vexp_avx2.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline float dot8(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* its q16[64 * 256] */
bool k3_qli_avx2_fits(int HI, int dI) { return dI % 16 == 0 && dI <= 256 && HI <= 64; }

void k3_qli_scores_avx2(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8,
                        const float *ks, const int64_t *slots, int n, float *scores) {
    /* queries widened to int16 once per token; keys widened per slot */
    static _Thread_local int16_t q16[64 * 256];
    float wq[64];
    const int nc = dI / 16;
    for (int h = 0; h < HI; h++) {
        wq[h] = w[h] * qs[h];
        for (int j = 0; j < dI; j++) q16[h * dI + j] = q8[h * dI + j];
    }
    __m256i kv[16];
    for (int i = 0; i < n; i++) {
        const int8_t *k = k8 + slots[i] * dI;
        float s = 0.0f;
        if (nc <= 16) {
            for (int c = 0; c < nc; c++) kv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k + 16 * c)));
            for (int h = 0; h < HI; h++) {
                const int16_t *q = q16 + h * dI;
                __m256i acc = _mm256_setzero_si256();
                for (int c = 0; c < nc; c++)
                    acc = _mm256_add_epi32(acc,
                                           _mm256_madd_epi16(kv[c], _mm256_loadu_si256((const __m256i *)(q + 16 * c))));
                const int32_t d = hsum8i(acc);
                if (d > 0) s += wq[h] * (float)d;
            }
        } else {
            for (int h = 0; h < HI; h++) {
                const int16_t *q = q16 + h * dI;
                __m256i acc = _mm256_setzero_si256();
                for (int c = 0; c < nc; c++) {
                    const __m256i kk = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k + 16 * c)));
                    acc =
                        _mm256_add_epi32(acc, _mm256_madd_epi16(kk, _mm256_loadu_si256((const __m256i *)(q + 16 * c))));
                }
                const int32_t d = hsum8i(acc);
                if (d > 0) s += wq[h] * (float)d;
            }
        }
        scores[i] = s * ks[slots[i]];
    }
}

/* Slot by slot (kv_lora % 8 == 0; any rope). */
static void qsfa_slots(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                       float scale, float *out, float *lse, float *work) {
    const int kvl = c->kv_lora, rope = c->rope;
    float *cf = work;                  /* dequantized row [kvl] */
    float *m = work + kvl, *l = m + H; /* running max and sum per head */
    for (int h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)H * kvl);
    for (int i = 0; i < n; i++) {
        const int64_t s = slots[i];
        const int8_t *c8 = c->c8 + s * kvl;
        const float *cs = c->cs + s * c->n_tiles;
        for (int j = 0; j < kvl; j += 8) {
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c8 + j))));
            _mm256_storeu_ps(cf + j, _mm256_mul_ps(v, _mm256_set1_ps(cs[j / K3_C8_TILE])));
        }
        const float *kpe = c->kpe + s * rope;
        for (int h = 0; h < H; h++) {
            float z = dot8(qa + (int64_t)h * kvl, cf, kvl);
            if (rope) z += dot8(qpe + (int64_t)h * rope, kpe, rope);
            z *= scale;
            float *oh = out + (int64_t)h * kvl;
            if (z > m[h]) {
                const float f = expf(m[h] - z); /* 0 on the first slot */
                l[h] *= f;
                const __m256 vf = _mm256_set1_ps(f);
                for (int j = 0; j < kvl; j += 8) _mm256_storeu_ps(oh + j, _mm256_mul_ps(_mm256_loadu_ps(oh + j), vf));
                m[h] = z;
            }
            const float p = expf(z - m[h]);
            l[h] += p;
            const __m256 vp = _mm256_set1_ps(p);
            for (int j = 0; j < kvl; j += 8)
                _mm256_storeu_ps(oh + j, _mm256_fmadd_ps(vp, _mm256_loadu_ps(cf + j), _mm256_loadu_ps(oh + j)));
        }
    }
    for (int h = 0; h < H; h++) {
        float *oh = out + (int64_t)h * kvl;
        if (n == 0) {
            lse[h] = -INFINITY;
            continue;
        }
        const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
        for (int j = 0; j < kvl; j += 8) _mm256_storeu_ps(oh + j, _mm256_mul_ps(_mm256_loadu_ps(oh + j), inv));
        lse[h] = m[h] + logf(l[h]);
    }
}

/* ---- QSFA by blocks of slots ---------------------------------------------------- */

/* r lane k = the sum of the 8 lanes of a[k] */
static inline __attribute__((always_inline)) __m256 sum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: a0..a3 partial (low half), a0..a3 (high half); u1 the same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

enum { QB = 8 }; /* slots per block */
_Static_assert(QB == 8, "the block of k3_qsfa_block_work");

/* The AVX-512 kernel's plan on 8 lanes: blocks of 8 slots dequantized once;
 * scores for 4 heads x 2 slots at a time (8 accumulators, reduced together);
 * per head one max, one vector exp and one rescale per block (online softmax
 * by blocks); then o_h = α o_h + Σ p c over the block, 8 columns at a time.
 * kv_lora % 8 == 0, rope % 8 == 0. */
static void qsfa_blocks(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                        float scale, float *out, float *lse, float *work) {
    const int kvl = c->kv_lora, rope = c->rope, HP = (H + 3) / 4 * 4;
    float *cf = work, *zero = cf + QB * kvl, *z = zero + kvl + rope, *m = z + HP * QB, *l = m + HP, *al = l + HP;
    memset(zero, 0, sizeof(float) * (size_t)(kvl + rope));
    for (int h = 0; h < HP; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)H * kvl);
    const float *kp[QB];
    for (int i0 = 0; i0 < n; i0 += QB) {
        const int nb = n - i0 < QB ? n - i0 : QB;
        for (int b = 0; b < QB; b++) {
            float *row = cf + b * kvl;
            if (b >= nb) {
                memset(row, 0, sizeof(float) * (size_t)kvl);
                kp[b] = zero;
                continue;
            }
            const int64_t s = slots[i0 + b];
            const int8_t *c8 = c->c8 + s * kvl;
            const float *cs = c->cs + s * c->n_tiles;
            for (int j = 0; j < kvl; j += 8) {
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c8 + j))));
                _mm256_storeu_ps(row + j, _mm256_mul_ps(v, _mm256_set1_ps(cs[j / K3_C8_TILE])));
            }
            kp[b] = c->kpe + s * rope;
        }
        /* scores z[h][b] */
        for (int h0 = 0; h0 < HP; h0 += 4) {
            const float *qr[4], *qp[4];
            for (int i = 0; i < 4; i++) {
                qr[i] = h0 + i < H ? qa + (int64_t)(h0 + i) * kvl : zero;
                qp[i] = h0 + i < H ? qpe + (int64_t)(h0 + i) * rope : zero;
            }
            __m256 red[8];
            for (int b0 = 0; b0 < QB; b0 += 2) {
                __m256 acc[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                const float *c0 = cf + b0 * kvl, *c1 = c0 + kvl;
                for (int j = 0; j < kvl; j += 8) {
                    const __m256 x0 = _mm256_loadu_ps(c0 + j), x1 = _mm256_loadu_ps(c1 + j);
#pragma GCC unroll 4
                    for (int a = 0; a < 4; a++) {
                        const __m256 q = _mm256_loadu_ps(qr[a] + j);
                        acc[2 * a] = _mm256_fmadd_ps(q, x0, acc[2 * a]);
                        acc[2 * a + 1] = _mm256_fmadd_ps(q, x1, acc[2 * a + 1]);
                    }
                }
                for (int j = 0; j < rope; j += 8) {
                    const __m256 x0 = _mm256_loadu_ps(kp[b0] + j), x1 = _mm256_loadu_ps(kp[b0 + 1] + j);
#pragma GCC unroll 4
                    for (int a = 0; a < 4; a++) {
                        const __m256 q = _mm256_loadu_ps(qp[a] + j);
                        acc[2 * a] = _mm256_fmadd_ps(q, x0, acc[2 * a]);
                        acc[2 * a + 1] = _mm256_fmadd_ps(q, x1, acc[2 * a + 1]);
                    }
                }
                /* lane 2a + b: head h0 + a, slot b0 + b */
                const __m256 r = _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale));
                red[b0 / 2] = r;
            }
            /* red[k] lane 2a + b -> z[(h0 + a) * QB + 2k + b] */
            for (int k = 0; k < QB / 2; k++) {
                float t[8];
                _mm256_storeu_ps(t, red[k]);
                for (int a = 0; a < 4; a++) {
                    z[(h0 + a) * QB + 2 * k] = t[2 * a];
                    z[(h0 + a) * QB + 2 * k + 1] = t[2 * a + 1];
                }
            }
        }
        /* online softmax by blocks: z becomes p, al the rescale of o and l */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb), lane));
        for (int h = 0; h < H; h++) {
            const __m256 zv = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(z + h * QB), valid);
            __m128 mm = _mm_max_ps(_mm256_castps256_ps128(zv), _mm256_extractf128_ps(zv, 1));
            mm = _mm_max_ps(mm, _mm_movehl_ps(mm, mm));
            mm = _mm_max_ss(mm, _mm_shuffle_ps(mm, mm, 1));
            const float mx = _mm_cvtss_f32(mm);
            const float mn = mx > m[h] ? mx : m[h];
            if (mn == -INFINITY) { /* nothing but -inf so far: no weight yet */
                al[h] = 1.0f;
                _mm256_storeu_ps(z + h * QB, _mm256_setzero_ps());
                continue;
            }
            al[h] = expf(m[h] - mn); /* 0 on the first block */
            /* the block's padding slots get weight 0 */
            const __m256 p = _mm256_and_ps(valid, k3_exp8(_mm256_sub_ps(zv, _mm256_set1_ps(mn))));
            _mm256_storeu_ps(z + h * QB, p);
            l[h] = l[h] * al[h] + hsum8(p);
            m[h] = mn;
        }
        /* o_h = al_h o_h + Σ_b p_hb c_b */
        for (int j = 0; j < kvl; j += 8) {
            __m256 cv[QB];
#pragma GCC unroll 8
            for (int b = 0; b < QB; b++) cv[b] = _mm256_loadu_ps(cf + b * kvl + j);
            for (int h = 0; h < H; h++) {
                float *oh = out + (int64_t)h * kvl + j;
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(oh), _mm256_set1_ps(al[h]));
#pragma GCC unroll 8
                for (int b = 0; b < QB; b++) acc = _mm256_fmadd_ps(_mm256_set1_ps(z[h * QB + b]), cv[b], acc);
                _mm256_storeu_ps(oh, acc);
            }
        }
    }
    for (int h = 0; h < H; h++) {
        if (n == 0 || l[h] == 0.0f) {
            lse[h] = -INFINITY;
            continue;
        }
        const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
        for (int j = 0; j < kvl; j += 8)
            _mm256_storeu_ps(out + (int64_t)h * kvl + j,
                             _mm256_mul_ps(_mm256_loadu_ps(out + (int64_t)h * kvl + j), inv));
        lse[h] = m[h] + logf(l[h]);
    }
}

bool k3_qsfa_avx2_fits(const k3_c8_cache *c) { return c->kv_lora % 8 == 0; }

void k3_qsfa_avx2(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                  float scale, float *out, float *lse, float *work) {
    if (c->rope % 8 == 0 && c->rope <= c->kv_lora) qsfa_blocks(qa, qpe, H, c, slots, n, scale, out, lse, work);
    else qsfa_slots(qa, qpe, H, c, slots, n, scale, out, lse, work);
}
