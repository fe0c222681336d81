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

/* Order: a before b when a's score is higher, or equal with a lower index.
 * NaN scores sort last. */
static int before(const float *s, int32_t a, int32_t b) {
    const float x = s[a], y = s[b];
    if (x > y) return 1;
    if (x < y) return 0;
    if (x == y) return a < b;
    if (isnan(x) && !isnan(y)) return 0;
    if (!isnan(x) && isnan(y)) return 1;
    return a < b;
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int k3_topk(const float *scores, int n, int k, int32_t *sel, int32_t *work) {
    if (k >= n) {
        for (int i = 0; i < n; i++) sel[i] = i;
        return n;
    }
    if (k <= 0) return 0;
    /* Quickselect on indices with the total order `before`, so the first k
     * positions end up holding exactly the k best. */
    int32_t *a = work;
    for (int i = 0; i < n; i++) a[i] = i;
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        /* middle pivot: inputs start in index order, which with the
         * index tie-break keeps runs of equal scores well split */
        const int32_t p = a[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (before(scores, a[i], p)) i++;
            while (before(scores, p, a[j])) j--;
            if (i <= j) {
                const int32_t t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    memcpy(sel, a, sizeof(int32_t) * (size_t)k);
    qsort(sel, (size_t)k, sizeof(int32_t), cmp_i32);
    return k;
}
