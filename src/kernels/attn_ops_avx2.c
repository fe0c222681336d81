/*
 * attn_ops_avx2.c -- AVX2 paths of QLI and QSFA (see attn_ops.h). Compiled
 * with -mavx2 -mfma; called only when the CPU has them.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn_ops.h"

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

void k3_qli_scores_avx2(const int8_t *q8, const float *qs, const float *w, int HI, int dI,
                        const int8_t *k8, const float *ks, const int64_t *slots, int n, float *scores) {
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
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(kv[c], _mm256_loadu_si256((const __m256i *)(q + 16 * c))));
                const int32_t d = hsum8i(acc);
                if (d > 0) s += wq[h] * (float)d;
            }
        } else {
            for (int h = 0; h < HI; h++) {
                const int16_t *q = q16 + h * dI;
                __m256i acc = _mm256_setzero_si256();
                for (int c = 0; c < nc; c++) {
                    const __m256i kk = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k + 16 * c)));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(kk, _mm256_loadu_si256((const __m256i *)(q + 16 * c))));
                }
                const int32_t d = hsum8i(acc);
                if (d > 0) s += wq[h] * (float)d;
            }
        }
        scores[i] = s * ks[slots[i]];
    }
}

void k3_qsfa_avx2(const float *qa, const float *qpe, int H, const k3_c8_cache *c,
                  const int64_t *slots, int n, float scale, float *out, float *lse, float *work) {
    const int kvl = c->kv_lora, rope = c->rope;
    float *cf = work;                 /* dequantized row [kvl] */
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
