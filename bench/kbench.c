/*
 * kbench.c -- matrix-vector kernels alone, against the machine's read
 * bandwidth: for each weight format, y = W x at batch n over a set of
 * matrices larger than the last-level cache (cycled like a model's layers),
 * reporting weight GB/s. A developer tool (`make kbench`), not part of k3.
 *
 *   build/kbench [threads] [n] [rows] [cols]
 *   KB_HUGE=1: the matrices in 2 MB pages; KB_SHUFFLE=1: read in a random
 *   order (routed experts); KB_KB=N: N KB of matrices (small: from cache);
 *   KB_ISA=ref|avx2|avx2-novnni|avx512: the kernels (k3_set_isa; default the
 *   best the CPU has); KB_FMT=name: only the formats whose name starts so
 *   (=name: the one so named);
 *   KB_CPU=1: time by the process's CPU clock instead of the wall clock (with
 *   one thread, on a machine others load: their time slices then do not count)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

#include "k3.h"
#include "kernels/kernels.h"
#include "kernels/quant.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(getenv("KB_CPU") ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int nth = argc > 1 ? atoi(argv[1]) : 2;
    const int64_t n = argc > 2 ? atoll(argv[2]) : 1;
    const int64_t rows = argc > 3 ? atoll(argv[3]) : 2048, cols = argc > 4 ? atoll(argv[4]) : 2048;
    k3_pool *pool = NULL;
    k3_error err;
    if (nth > 1 && k3_pool_init(&pool, nth, &err) != K3_OK) return 1;
    k3_kernels_init();
    if (getenv("KB_ISA") && k3_set_isa(getenv("KB_ISA"), &err) != K3_OK) {
        fprintf(stderr, "kbench: %s\n", err.msg);
        return 2;
    }
    printf("isa %s, threads %d, n %lld, matrices %lld x %lld\n", k3_isa_current(), nth,
           (long long)n, (long long)rows, (long long)cols);
    const double bw = k3_membw_read_gbps(pool, (size_t)1 << 30, 5);
    printf("read bandwidth %.1f GB/s\n", bw);
    float *x = malloc(sizeof(float) * (size_t)(n * cols)), *y = malloc(sizeof(float) * (size_t)(n * rows));
    for (int64_t i = 0; i < n * cols; i++) x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
    struct { const char *name; k3_wtype t; bool act8, bf16; } fmts[] = {
        {"bf16", K3_W_BF16, false, false}, {"q8 (w8a8)", K3_W_Q8, true, false}, {"mxfp4 (w4a8)", K3_W_MXFP4, true, false},
        {"mxfp4 r4 (w4a8)", K3_W_MXFP4_R4, true, false},
        {"mxfp4 (fp32 act)", K3_W_MXFP4, false, false}, {"mxfp8 (w8a8)", K3_W_MXFP8, true, false},
        /* the BF16 dot products (AVX512_BF16, AMX): as stored and as strips */
        {"bf16 (bf16 act)", K3_W_BF16, false, true}, {"bf16 s16", K3_W_BF16_S16, false, true},
        {"mxfp4 (bf16 act)", K3_W_MXFP4, false, true}, {"mxfp4 s16", K3_W_MXFP4_S16, false, true},
    };
    for (size_t f = 0; f < sizeof fmts / sizeof fmts[0]; f++) {
        const char *want = getenv("KB_FMT");
        if (want && want[0] == '=' ? strcmp(fmts[f].name, want + 1) : want && strncmp(fmts[f].name, want, strlen(want)))
            continue;
        k3_mat w = {.type = fmts[f].t, .rows = rows, .cols = cols, .act8 = fmts[f].act8, .bf16 = fmts[f].bf16};
        const k3_wtype_traits *ti = k3_wtype_info(w.type);
        const size_t rb = k3_mat_row_bytes(&w);
        const size_t mb = rb * (size_t)rows;
        const int nm = (int)(((getenv("KB_KB") ? (size_t)atoll(getenv("KB_KB")) : 524288) << 10) / mb) + 1;
        k3_mat *ms = calloc((size_t)nm, sizeof *ms);
        const size_t db = k3_mat_data_bytes(&w);
        /* one after the other in one allocation, like the model's copies
         * (k3_model_load_resident); KB_HUGE: in 2 MB pages, as they are */
        const size_t al = (db * nm + (2u << 20) - 1) / (2u << 20) * (2u << 20);
        uint8_t *arena = aligned_alloc(2u << 20, al);
        madvise(arena, al, getenv("KB_HUGE") ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        for (int m = 0; m < nm; m++) {
            ms[m] = w;
            uint8_t *d = arena + db * m;
            for (size_t i = 0; i < db; i++) d[i] = (uint8_t)rnd();
            if (fmts[f].t == K3_W_BF16 || fmts[f].t == K3_W_BF16_S16)
                for (size_t i = 0; i < db / 2; i++) ((uint16_t *)d)[i] = k3_f32_to_bf16((float)((int)(rnd() % 2001) - 1000) / 1e5f);
            if (fmts[f].t == K3_W_MXFP8)
                for (size_t i = 0; i < db; i++) if ((d[i] & 0x7f) == 0x7f) d[i] = 0x10;
            ms[m].data = d;
            if (ti->block) {
                uint8_t *s = malloc(k3_mat_scale_bytes(&w));
                for (size_t i = 0; i < k3_mat_scale_bytes(&w); i++) s[i] = (uint8_t)(118 + rnd() % 8);
                ms[m].scale = s;
            }
            ms[m].wrange = k3_mat_wrange(&ms[m]); /* as the loader marks its strips */
            if (ti->row_scale) { /* as the loader makes them: scales and row sums */
                float *s = malloc(sizeof(float) * (size_t)rows);
                int32_t *sum = malloc(sizeof(int32_t) * (size_t)rows);
                for (int64_t i = 0; i < rows; i++) {
                    s[i] = 1e-3f;
                    sum[i] = 0;
                    for (int64_t c = 0; c < cols; c++) sum[i] += ((const int8_t *)d)[i * cols + c];
                }
                ms[m].row_scale = s;
                ms[m].row_sum = sum;
            }
        }
        /* KB_SHUFFLE: the matrices in a random order, as routed experts are read */
        int *order = malloc(sizeof(int) * (size_t)nm);
        for (int m = 0; m < nm; m++) order[m] = m;
        if (getenv("KB_SHUFFLE"))
            for (int m = nm - 1; m > 0; m--) {
                const int k = (int)(rnd() % (uint32_t)(m + 1)), tmp = order[m];
                order[m] = order[k];
                order[k] = tmp;
            }
        double t[7];
        const int reps = nm < 64 ? 2000 / nm : 1;
        for (int r = 0; r < 7; r++) {
            const double t0 = now_s();
            for (int k = 0; k < reps; k++)
                for (int m = 0; m < nm; m++) k3_matmul(pool, &ms[order[m]], x, n, y);
            t[r] = now_s() - t0;
        }
        qsort(t, 7, sizeof t[0], cmpd);
        const double gb = (double)mb * nm * reps / 1e9;
        printf("%-18s %6.2f MB/matrix x %3d: %7.2f GB/s weights (%5.1f%% of read bw), %8.1f GFLOP/s\n",
               fmts[f].name, mb / 1e6, nm, gb / t[3], 100.0 * gb / t[3] / bw,
               2.0 * rows * cols * n * nm * reps / t[3] / 1e9);
    }
    return 0;
}
