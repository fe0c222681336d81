/*
 * topk.c -- settling the DSA top-k across the DCP group (docs/serving-reference.md §2.5.3):
 * each rank brings its local top-k of (score, global position) candidates;
 * either every rank gathers all D lists (all-gather) or the ranks merge
 * pairwise over log2(D) rounds (butterfly, partner = rank XOR 2^i). Both end
 * with the same global top-k on every rank, in the order (score desc,
 * position asc) -- the order k3_topk uses in one process, so the winners are
 * the same tokens. Exactness: a global winner owned by rank r is among the k
 * best of r's own tokens, so the local cut loses nothing.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"

int k3_cand_before(const k3_cand *a, const k3_cand *b) {
    if ((a->pos < 0) != (b->pos < 0)) return b->pos < 0; /* padding last */
    const float x = a->score, y = b->score;
    if (x > y) return 1;
    if (x < y) return 0;
    if (x == y) return a->pos < b->pos;
    if (isnan(x) != isnan(y)) return !isnan(x);
    return a->pos < b->pos;
}

void k3_cand_merge(const k3_cand *a, const k3_cand *b, int k, k3_cand *out) {
    int i = 0, j = 0;
    for (int o = 0; o < k; o++) out[o] = k3_cand_before(&a[i], &b[j]) ? a[i++] : b[j++];
}

static int cmp_cand(const void *pa, const void *pb) {
    const k3_cand *a = pa, *b = pb;
    return k3_cand_before(a, b) ? -1 : k3_cand_before(b, a) ? 1 : 0;
}

void k3_cand_sort(k3_cand *c, int n) { qsort(c, (size_t)n, sizeof *c, cmp_cand); }

k3_status k3_comm_topk_exchange(k3_dist *d, const k3_cand *mine, int32_t rows, int32_t k, k3_cand *out, k3_cand *work) {
    const int32_t D = k3_comm_group_size(d, K3_GROUP_DCP), r = k3_comm_group_rank(d, K3_GROUP_DCP);
    const size_t row_bytes = sizeof(k3_cand) * (size_t)k, all = row_bytes * (size_t)rows;
    if (D == 1) {
        memcpy(out, mine, all);
        return K3_OK;
    }
    if (k3_dist_exchange(d) == K3_TOPK_ALLGATHER) {
        /* work: [D][rows][k]; merge the D sorted lists of each row pairwise */
        k3_status s = k3_comm_allgather(d, K3_GROUP_DCP, K3_COMM_TOPK, mine, all, work);
        if (s) return s;
        k3_cand *tmp = malloc(row_bytes * 2);
        if (!tmp) return K3_ERR_NOMEM;
        for (int32_t t = 0; t < rows; t++) {
            k3_cand *acc = tmp, *nxt = tmp + k;
            memcpy(acc, work + (size_t)t * k, row_bytes);
            for (int32_t q = 1; q < D; q++) {
                k3_cand_merge(acc, work + ((size_t)q * rows + t) * k, k, nxt);
                k3_cand *x = acc;
                acc = nxt;
                nxt = x;
            }
            memcpy(out + (size_t)t * k, acc, row_bytes);
        }
        free(tmp);
        return K3_OK;
    }
    /* butterfly: work [2][rows][k]: out holds the running lists */
    memcpy(out, mine, all);
    k3_cand *theirs = work, *merged = work + (size_t)rows * k;
    for (int32_t bit = 1; bit < D; bit <<= 1) {
        k3_status s = k3_comm_sendrecv(d, K3_GROUP_DCP, K3_COMM_TOPK, out, all, r ^ bit, theirs);
        if (s) return s;
        for (int32_t t = 0; t < rows; t++)
            k3_cand_merge(out + (size_t)t * k, theirs + (size_t)t * k, k, merged + (size_t)t * k);
        memcpy(out, merged, all);
    }
    return K3_OK;
}
