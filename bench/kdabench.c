/*
 * kdabench.c -- KDA's forms alone, one head on one thread: the recurrent
 * form against the BF16 chunked form (kda.h) over a prompt cut into pieces
 * on the block grid, as the layer runs them. Reports the median time of each
 * per prompt, the ratio, and the chunked form's products as work GFLOP/s. A
 * developer tool (`make kdabench`), not part of k3.
 *
 *   build/kdabench [tokens (512)] [piece (64)] [dk = dv (128)] [reps (21)]
 *   KB_ISA=amx|avx512|...: the kernel table (k3_set_isa; default the best)
 *   KB_VDP=1: the BF16 form's vdpbf16ps kernel (no table holds it by default)
 *   KB_G=x: the strongest log-decay per token (default -5, K3's bound; a third
 *   of the channels reach it, the rest decay 20 times less)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3.h"
#include "kernels/kda.h"
#include "kernels/kernels.h"
#include "kernels/kernels_isa.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 40) / 8388608.0) - 1.0f;
}

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One prompt of n tokens in pieces of p; bf: the BF16 chunked form. */
static void run(int n, int p, int dk, const float *q, const float *k, const float *g, const float *v, const float *b,
                float *o, float *S, float *work, int bf) {
    memset(S, 0, sizeof(float) * (size_t)dk * dk);
    for (int a = 0; a < n; a += p) {
        const int m = n - a < p ? n - a : p;
        k3_kda_head h = {m, dk, dk, q + (int64_t)a * dk, k + (int64_t)a * dk, g + (int64_t)a * dk, dk,
                         v + (int64_t)a * dk, dk, b + a, 1, o + (int64_t)a * dk, dk};
        if (bf == 2) k3_kda_chunked_bf_avx512(&h, S, K3_KDA_CHUNK_BF, work);
        else if (!bf || !k3_kda_chunked_bf(&h, S, K3_KDA_CHUNK_BF, work)) k3_kda_recurrent(&h, S);
    }
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 512, p = argc > 2 ? atoi(argv[2]) : 64;
    const int dk = argc > 3 ? atoi(argv[3]) : 128, reps = argc > 4 ? atoi(argv[4]) : 21;
    if (n < 1 || p < 1 || dk < 32 || dk % 32 || reps < 1) {
        fprintf(stderr, "usage: kdabench [tokens] [piece] [dk, a multiple of 32] [reps]\n");
        return 2;
    }
    k3_error err = {0};
    if (getenv("KB_ISA") && k3_set_isa(getenv("KB_ISA"), &err)) {
        fprintf(stderr, "kdabench: %s\n", err.msg);
        return 1;
    }
    const float gf = getenv("KB_G") ? (float)atof(getenv("KB_G")) : -5.0f;
    const size_t nd = (size_t)n * dk;
    float *q = malloc(sizeof(float) * nd), *k = malloc(sizeof(float) * nd), *g = malloc(sizeof(float) * nd);
    float *v = malloc(sizeof(float) * nd), *o = malloc(sizeof(float) * nd), *b = malloc(sizeof(float) * n);
    float *S = malloc(sizeof(float) * (size_t)dk * dk);
    float *work = malloc(sizeof(float) * (size_t)k3_kda_chunk_work_bf(K3_KDA_CHUNK_BF, dk, dk));
    for (int t = 0; t < n; t++) {
        double sq = 0, sk = 0;
        for (int d = 0; d < dk; d++) {
            q[t * dk + d] = frand(), k[t * dk + d] = frand(), v[t * dk + d] = frand();
            g[t * dk + d] = gf * (0.5f + 0.5f * frand()) * (d % 3 == 0 ? 1.0f : 0.05f);
            sq += q[t * dk + d] * q[t * dk + d], sk += k[t * dk + d] * k[t * dk + d];
        }
        for (int d = 0; d < dk; d++) q[t * dk + d] /= (float)sqrt(sq * dk), k[t * dk + d] /= (float)sqrt(sk);
        b[t] = 0.5f + 0.49f * frand();
    }
    k3_kda_head probe = {1, dk, dk, q, k, g, dk, v, dk, b, 1, o, dk};
    const int vdp = getenv("KB_VDP") && k3_kernels_bf16();
    const int have_bf = (vdp || k3_kda_bf_available()) && k3_kda_bf_fits(&probe);
    double *tr = malloc(sizeof(double) * reps), *tb = malloc(sizeof(double) * reps);
    for (int r = 0; r < reps; r++) { /* alternated: recurrent, chunked */
        double t0 = now_s();
        run(n, p, dk, q, k, g, v, b, o, S, work, 0);
        tr[r] = now_s() - t0;
        t0 = now_s();
        run(n, p, dk, q, k, g, v, b, o, S, work, vdp ? 2 : 1);
        tb[r] = now_s() - t0;
    }
    qsort(tr, (size_t)reps, sizeof(double), cmpd);
    qsort(tb, (size_t)reps, sizeof(double), cmpd);
    const double mr = tr[reps / 2], mb = tb[reps / 2];
    /* the chunked form's products per chunk of C (padded to 32): [Ke; Qe] S,
     * Aqk Vn, Kdᵀ Vn, and the sub-blocks' [Ks; Qs] Kbᵀ */
    double fl = 0;
    for (int a = 0; a < n; a += p) {
        const int m = n - a < p ? n - a : p;
        for (int c = 0; c < m; c += K3_KDA_CHUNK_BF) {
            const int C = m - c < K3_KDA_CHUNK_BF ? m - c : K3_KDA_CHUNK_BF, Cp = (C + 31) / 32 * 32;
            fl += 2.0 * (2.0 * Cp * dk * dk + (double)Cp * Cp * dk + (double)dk * Cp * dk);
            for (int r0 = 0; r0 < C; r0 += 16) fl += 2.0 * 32 * ((r0 + 16 + 15) / 16 * 16) * dk;
        }
    }
    printf("kdabench: table %s, %d tokens in pieces of %d, dk = dv = %d, median of %d (one thread)\n",
           k3_isa_current(), n, p, dk, reps);
    printf("  recurrent      %8.1f us  (%.2f us/token)\n", mr * 1e6, mr * 1e6 / n);
    if (have_bf)
        printf("  bf16 chunked%s %8.1f us  (%.2f us/token)  %.2fx the recurrent; products %.1f work GFLOP/s\n",
               vdp ? " (vdpbf16ps)" : "", mb * 1e6, mb * 1e6 / n, mr / mb, fl / mb * 1e-9);
    else printf("  bf16 chunked   (not in this table)\n");
    free(q), free(k), free(g), free(v), free(o), free(b), free(S), free(work), free(tr), free(tb);
    return 0;
}
