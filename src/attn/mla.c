/*
 * mla.c -- absorbed MLA attention over a slot list, the DSA indexer scores,
 * and an exact deterministic top-k (see mla.h).
 */
#include "mla.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

float k3_mla_attend(const float *qa, const float *qpe, int kv_lora, int rope,
                    const float *cache, int64_t ld, const int64_t *slots, int n,
                    float scale, float *scores, float *out) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) {
        const float *row = cache + slots[i] * ld;
        float s = k3_dot(qa, row, kv_lora);
        if (rope) s += k3_dot(qpe, row + kv_lora, rope);
        s *= scale;
        scores[i] = s;
        if (s > mx) mx = s;
    }
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        scores[i] = expf(scores[i] - mx);
        sum += scores[i];
    }
    const float inv = (float)(1.0 / sum);
    memset(out, 0, sizeof(float) * (size_t)kv_lora);
    for (int i = 0; i < n; i++)
        k3_axpy(out, scores[i] * inv, cache + slots[i] * ld, kv_lora);
    return mx + (float)log(sum);
}

void k3_indexer_scores(const float *q, const float *w, int HI, int dI,
                       const float *kcache, const int64_t *slots, int n, float *scores) {
    for (int i = 0; i < n; i++) {
        const float *k = kcache + slots[i] * dI;
        float s = 0.0f;
        for (int h = 0; h < HI; h++) {
            const float d = k3_dot(q + (int64_t)h * dI, k, dI);
            if (d > 0.0f) s += w[h] * d;
        }
        scores[i] = s;
    }
}

/* A key whose unsigned order is the order of k3_topk: higher scores higher,
 * -0 == +0, NaN below everything. */
static inline uint32_t order_key(float x) {
    if (x != x) return 0;
    if (x == 0.0f) x = 0.0f;
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

/* The k-th largest (k >= 1) of v[0, n), reordering v (quickselect). */
static uint32_t kth_largest(uint32_t *v, int n, int k) {
    int lo = 0, hi = n - 1;
    const int want = k - 1;
    while (lo < hi) {
        /* v[lo..j] >= p >= v[i..hi] afterwards, v(j, i) == p */
        const uint32_t p = v[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] > p) i++;
            while (v[j] < p) j--;
            if (i <= j) {
                const uint32_t t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return p;
    }
    return v[want];
}

int k3_topk(const float *scores, int n, int k, int32_t *sel, int32_t *work) {
    if (k >= n) {
        for (int i = 0; i < n; i++) sel[i] = i;
        return n;
    }
    if (k <= 0) return 0;
    /* the k-th best key, then one pass in index order: every key above it,
     * and as many equal to it as are left, the lowest indices first */
    uint32_t *v = (uint32_t *)work;
    for (int i = 0; i < n; i++) v[i] = order_key(scores[i]);
    const uint32_t t = kth_largest(v, n, k);
    int above = 0;
    for (int i = 0; i < n; i++) above += order_key(scores[i]) > t;
    int ties = k - above, m = 0;
    for (int i = 0; i < n && m < k; i++) {
        const uint32_t q = order_key(scores[i]);
        if (q > t || (q == t && ties-- > 0)) sel[m++] = i;
    }
    return k;
}
