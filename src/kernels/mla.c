/*
 * mla.c -- absorbed MLA attention over a slot list, the DSA indexer scores,
 * and an exact deterministic top-k (see mla.h).
 */
#include "mla.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

float k3_mla_attend(const float *qa, const float *qpe, int kv_lora, int rope, const float *cache, int64_t ld,
                    const int64_t *slots, int n, float scale, float *scores, float *out) {
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
    for (int i = 0; i < n; i++) k3_axpy(out, scores[i] * inv, cache + slots[i] * ld, kv_lora);
    return mx + (float)log(sum);
}

void k3_indexer_scores(const float *q, const float *w, int HI, int dI, const float *kcache, const int64_t *slots, int n,
                       float *scores) {
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
 * -0 == +0 (x + 0 turns -0 into +0), NaN below everything. */
static inline uint32_t order_key(float x) {
    x += 0.0f;
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const uint32_t k = b & 0x80000000u ? ~b : b | 0x80000000u;
    return (b & 0x7fffffffu) > 0x7f800000u ? 0 : k;
}

/* Restores the min-heap h[0, n) below position i. */
static void sift_down(uint32_t *h, int n, int i) {
    const uint32_t v = h[i];
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

int k3_topk(const float *scores, int n, int k, int32_t *sel, int32_t *work) {
    if (k >= n) {
        for (int i = 0; i < n; i++) sel[i] = i;
        return n;
    }
    if (k <= 0) return 0;
    /* One pass in index order keeps the k best keys seen in a min-heap (a
     * later equal key loses to the earlier one, so only a strictly higher
     * key enters); its root is then the k-th best key t. A second pass takes,
     * in index order, every key above t and as many equal to it as the heap
     * held, the lowest indices first. */
    uint32_t *key = (uint32_t *)work, *h = (uint32_t *)sel;
    for (int i = 0; i < k; i++) h[i] = key[i] = order_key(scores[i]);
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(h, k, i);
    for (int i = k; i < n; i++) {
        const uint32_t q = key[i] = order_key(scores[i]);
        if (q > h[0]) {
            h[0] = q;
            sift_down(h, k, 0);
        }
    }
    const uint32_t t = h[0];
    int ties = 0;
    for (int i = 0; i < k; i++) ties += h[i] == t;
    int m = 0;
    for (int i = 0; i < n && m < k; i++) {
        const uint32_t q = key[i];
        if (q > t || (q == t && ties-- > 0)) sel[m++] = i;
    }
    return k;
}
