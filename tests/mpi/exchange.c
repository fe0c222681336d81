/*
 * exchange.c -- build/k3-mpi-exchange, run under mpirun -np D: the DSA
 * top-k exchange alone (k3_comm_topk_exchange). Every rank draws the same
 * random scores with many ties (a few distinct values, some NaN) for a few
 * rows and lengths, keeps the positions it owns under the DCP layout
 * (several interleaves), takes its local top-k with k3_topk, exchanges
 * (all-gather and butterfly), and checks that every rank's result equals a
 * plain sort of all scores by (score desc, NaN last, position asc) cut at
 * k. Prints "exchange: N passed, N failed" on rank 0; exit 1 on a failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/mla.h"
#include "common/error.h"
#include "comm/comm.h"
#include "ctx/ctx.h"

static const float *g_sc;
static int plain_cmp(const void *pa, const void *pb) {
    const int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    const float x = g_sc[a], y = g_sc[b];
    const int nx = isnan(x), ny = isnan(y);
    if (nx != ny) return nx ? 1 : -1;
    if (!nx && x != y) return x > y ? -1 : 1;
    return (a > b) - (a < b);
}

int main(void) {
    int pass = 0, fail = 0;
    /* the anchor owns MPI (initializes and finalizes it); the dists made
     * per case find it initialized and leave it alone */
    k3_dist *anchor;
    k3_error err = {0};
    k3_dist_options ao = {.dcp = 1, .ep = 1, .timeout_s = 60};
    if (k3_dist_init(&anchor, &ao, &err)) {
        fprintf(stderr, "exchange: %s\n", err.msg);
        return 1;
    }
    const int D = k3_dist_size(anchor);
    for (int mode = 0; mode < 2; mode++)
        for (int il = 1; il <= 4; il *= 2) {
            /* the whole world is one DCP group */
            k3_dist_options o = {.dcp = D, .ep = 1, .dcp_interleave = il, .exchange = (k3_topk_exchange)mode,
                                 .timeout_s = 60};
            k3_dist *dd;
            if (k3_dist_init(&dd, &o, &err)) {
                if (mode == 1 && (D & (D - 1))) { /* butterfly needs a power of two: refused, as it should */
                    pass++;
                    k3_err_clear(&err);
                    continue;
                }
                fprintf(stderr, "exchange: %s\n", err.msg);
                return 1;
            }
            const int r = k3_dist_dcp_rank(dd);
            const int rows = 5, lens[5] = {1, 7, 40, 97, 300}, ks[5] = {8, 8, 16, 33, 64};
            for (int t = 0; t < rows; t++) {
                const int n = lens[t], k = ks[t];
                float *sc = malloc(sizeof(float) * (size_t)n);
                uint64_t s = 12345u + (uint64_t)t * 77u + (uint64_t)il;
                for (int i = 0; i < n; i++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    const int v = (int)((s >> 33) % 7);
                    sc[i] = v == 6 && i % 5 == 0 ? NAN : (float)v * 0.5f; /* many ties, a few NaN */
                }
                /* own scores, in local order */
                float *own = malloc(sizeof(float) * (size_t)n);
                int32_t *sel = malloc(sizeof(int32_t) * (size_t)n), *work = malloc(sizeof(int32_t) * (size_t)n);
                const int nl = (int)k3_dcp_count(n, r, D, il);
                for (int j = 0; j < nl; j++) own[j] = sc[k3_dcp_global(j, r, D, il)];
                const int kk = k3_topk(own, nl, k, sel, work);
                k3_cand *mine = malloc(sizeof(k3_cand) * (size_t)k), *out = malloc(sizeof(k3_cand) * (size_t)k);
                k3_cand *wk = malloc(sizeof(k3_cand) * (size_t)k * (size_t)(D > 2 ? D : 2));
                for (int i = 0; i < kk; i++)
                    mine[i] = (k3_cand){own[sel[i]], (int32_t)k3_dcp_global(sel[i], r, D, il)};
                k3_cand_sort(mine, kk);
                for (int i = kk; i < k; i++) mine[i] = (k3_cand){-INFINITY, -1};
                k3_status st = k3_comm_topk_exchange(dd, mine, 1, k, out, wk);
                /* the plain sort of everything */
                int32_t *all = malloc(sizeof(int32_t) * (size_t)n);
                for (int i = 0; i < n; i++) all[i] = i;
                g_sc = sc;
                qsort(all, (size_t)n, sizeof *all, plain_cmp);
                int bad = st != K3_OK;
                const int want = n < k ? n : k;
                for (int i = 0; i < k && !bad; i++) bad = out[i].pos != (i < want ? all[i] : -1);
                if (bad) {
                    fail++;
                    fprintf(stderr, "exchange: rank %d: %s, interleave %d, n %d, k %d: wrong global top-k\n", r,
                            mode ? "butterfly" : "allgather", il, n, k);
                } else {
                    pass++;
                }
                free(sc);
                free(own);
                free(sel);
                free(work);
                free(mine);
                free(out);
                free(wk);
                free(all);
            }
            k3_dist_free(dd);
        }
    double v[2] = {pass, fail};
    if (k3_dist_sum(anchor, v, 2, &err)) {
        fprintf(stderr, "exchange: %s\n", err.msg);
        return 1;
    }
    if (k3_dist_rank(anchor) == 0) printf("exchange: %.0f passed, %.0f failed on %d ranks\n", v[0], v[1], D);
    const int rc = v[1] > 0;
    k3_dist_free(anchor);
    return rc;
}
