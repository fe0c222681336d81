/*
 * qbench.c -- the 8-bit prefill products alone (W8A8 and W4A8) at the bench
 * checkpoint's shapes, against the INT8 dot-product peak: GOP/s of
 * k3_matmul on weights from cache, and how much of it is the per-token
 * activation quantization (the part before the kernel). A developer tool
 * (`make qbench`), not part of k3.
 *
 *   build/qbench [threads] [tokens]
 *   QB_ISA=name: the kernel table (k3_set_isa; default the best the CPU has)
 *   QB_ONLY=name: only the shapes whose name starts so
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3.h"
#include "kernels/kernels.h"
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* nm matrices of one shape: Q8 from random fp32, or MXFP4 (tiled where the
 * table wants the tiles), as the loader makes them */
static k3_mat *make(k3_wtype t, int64_t rows, int64_t cols, int nm) {
    k3_mat *ms = calloc((size_t)nm, sizeof *ms);
    float *f = malloc(sizeof(float) * (size_t)(rows * cols));
    for (int m = 0; m < nm; m++) {
        if (t == K3_W_Q8) {
            for (int64_t i = 0; i < rows * cols; i++) f[i] = (float)((int)(rnd() % 2001) - 1000) / 1e5f;
            const k3_mat src = {.type = K3_W_F32, .rows = rows, .cols = cols, .data = f};
            int8_t *q = aligned_alloc(64, (size_t)(rows * cols));
            float *rs = malloc(sizeof(float) * (size_t)rows);
            int32_t *sum = malloc(sizeof(int32_t) * (size_t)rows);
            k3_quant_q8_mat(&src, q, rs, sum);
            ms[m] = (k3_mat){.type = K3_W_Q8, .rows = rows, .cols = cols, .act8 = true, .data = q, .row_scale = rs,
                             .row_sum = sum};
        } else {
            k3_mat w = {.type = K3_W_MXFP4, .rows = rows, .cols = cols, .act8 = true};
            uint8_t *d = aligned_alloc(64, (size_t)(rows * cols / 2)), *s = malloc((size_t)(rows * cols / 32));
            for (int64_t i = 0; i < rows * cols / 2; i++) d[i] = (uint8_t)rnd();
            for (int64_t i = 0; i < rows * cols / 32; i++) s[i] = (uint8_t)(118 + rnd() % 8);
            w.data = d;
            w.scale = s;
            if (k3_mx4_r4_wanted(&w)) {
                uint8_t *d4 = aligned_alloc(64, (size_t)(rows * cols / 2)), *s4 = malloc((size_t)(rows * cols / 32));
                k3_mx4_r4_pack(&w, d4, s4);
                free(d);
                free(s);
                w.type = K3_W_MXFP4_R4;
                w.data = d4;
                w.scale = s4;
            }
            ms[m] = w;
        }
    }
    free(f);
    return ms;
}

int main(int argc, char **argv) {
    const int nth = argc > 1 ? atoi(argv[1]) : 2;
    const int64_t ntok = argc > 2 ? atoll(argv[2]) : 512;
    k3_pool *pool = NULL;
    k3_error err;
    if (nth > 1 && k3_pool_init(&pool, nth, &err) != K3_OK) return 1;
    k3_kernels_init();
    if (getenv("QB_ISA") && k3_set_isa(getenv("QB_ISA"), &err) != K3_OK) {
        fprintf(stderr, "qbench: %s\n", err.msg);
        return 2;
    }
    const double peak = k3_peak_gflops(pool, K3_PEAK_INT8DOT, 0.3);
    printf("isa %s, threads %d, INT8 dot peak %.0f GOP/s\n", k3_isa_current(), nth, peak);
    /* the trunk's projections (hidden 2048: KDA's, MLA's, the shared
     * experts'), the dense FFN (5632), and one layer's routed experts: 64
     * of them, 8 a token, so ~tokens/8 each, latent 1024 -> 384 -> 1024 */
    const struct {
        const char *name;
        k3_wtype t;
        int64_t rows, cols, n;
        int nm;
    } sh[] = {
        {"q8 2048x2048", K3_W_Q8, 2048, 2048, ntok, 4},
        {"q8 5632x2048", K3_W_Q8, 5632, 2048, ntok, 2},
        {"q8 2048x5632", K3_W_Q8, 2048, 5632, ntok, 2},
        {"q8 768x2048", K3_W_Q8, 768, 2048, ntok, 4},
        {"w4 384x1024", K3_W_MXFP4, 384, 1024, ntok / 8 > 0 ? ntok / 8 : 1, 64},
        {"w4 1024x384", K3_W_MXFP4, 1024, 384, ntok / 8 > 0 ? ntok / 8 : 1, 64},
    };
    for (size_t s = 0; s < sizeof sh / sizeof sh[0]; s++) {
        const char *only = getenv("QB_ONLY");
        if (only && strncmp(sh[s].name, only, strlen(only))) continue;
        const int64_t rows = sh[s].rows, cols = sh[s].cols, n = sh[s].n;
        k3_mat *ms = make(sh[s].t, rows, cols, sh[s].nm);
        float *x = malloc(sizeof(float) * (size_t)(n * cols)), *y = malloc(sizeof(float) * (size_t)(n * rows));
        int8_t *xq = malloc((size_t)(n * cols));
        for (int64_t i = 0; i < n * cols; i++) x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
        const double ops = 2.0 * (double)rows * (double)cols * (double)n * sh[s].nm;
        double t[7], tq[7];
        for (int r = 0; r < 7; r++) {
            double t0 = k3_now();
            for (int m = 0; m < sh[s].nm; m++) k3_matmul(pool, &ms[m], x, n, y);
            t[r] = k3_now() - t0;
            t0 = k3_now();
            for (int m = 0; m < sh[s].nm; m++)
                for (int64_t i = 0; i < n; i++) k3_quant_act_i8(x + i * cols, cols, xq + i * cols);
            tq[r] = k3_now() - t0;
        }
        qsort(t, 7, sizeof t[0], cmpd);
        qsort(tq, 7, sizeof tq[0], cmpd);
        printf("%-14s %-9s x%-3d n %4lld: %8.3f ms %7.1f GOP/s %5.1f%% of peak; act quant alone %.3f ms (%4.1f%%)\n",
               sh[s].name, k3_wtype_info(ms[0].type)->name, sh[s].nm, (long long)n, t[3] * 1e3, ops / t[3] / 1e9,
               100.0 * ops / t[3] / 1e9 / peak, tq[3] * 1e3, 100.0 * tq[3] / t[3]);
        free(x);
        free(y);
        free(xq);
    }
    return 0;
}
