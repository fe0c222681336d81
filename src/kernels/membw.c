/*
 * membw.c -- k3_membw_read_gbps (membw.h).
 *
 * Each thread sums its contiguous share of the buffer with four independent
 * 128-bit integer accumulators (SSE2 is enough to saturate memory: a core can
 * issue two loads per cycle, far above its share of DRAM bandwidth). The fill
 * runs on the same threads so pages are first touched where they are read.
 */
#include "kernels/membw.h"
#include "common/mem.h"
#include "common/pool.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

enum { LINE = 64, MAX_SINKS = 512 };

typedef struct bw_job {
    uint8_t *buf;
    size_t n_lines;
    bool fill;
    uint64_t sink[MAX_SINKS]; /* per-thread results, so the reads are not dead */
} bw_job;

static void bw_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    bw_job *j = ctx;
    uint8_t *p = j->buf + (size_t)lo * LINE, *end = j->buf + (size_t)hi * LINE;
    if (j->fill) {
        memset(p, 0x5a ^ ith, (size_t)(end - p));
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (; p < end; p += LINE) {
        a0 = _mm_add_epi64(a0, _mm_load_si128((const __m128i *)p));
        a1 = _mm_add_epi64(a1, _mm_load_si128((const __m128i *)(p + 16)));
        a2 = _mm_add_epi64(a2, _mm_load_si128((const __m128i *)(p + 32)));
        a3 = _mm_add_epi64(a3, _mm_load_si128((const __m128i *)(p + 48)));
    }
    __m128i s = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
    uint64_t out[2];
    _mm_storeu_si128((__m128i *)out, s);
    j->sink[ith % MAX_SINKS] += out[0] + out[1];
#else
    uint64_t a[8] = {0};
    for (; p < end; p += LINE)
        for (int k = 0; k < 8; k++) {
            uint64_t v;
            memcpy(&v, p + 8 * k, 8);
            a[k] += v;
        }
    j->sink[ith % MAX_SINKS] += a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
#endif
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double k3_membw_read_gbps(k3_pool *pool, size_t bytes, int reps) {
    if (reps < 1) reps = 1;
    size_t n_lines = bytes / LINE;
    if (n_lines < 64) n_lines = 64;
    bw_job *j = calloc(1, sizeof *j);
    double *rate = malloc(sizeof *rate * (size_t)reps);
    /* in huge pages where the kernel allows, like the weights made at load:
     * the TLB should not be what is measured */
    uint8_t *buf = k3_alloc_big(n_lines * LINE);
    double med = 0;
    if (j && rate && buf) {
        j->buf = buf;
        j->n_lines = n_lines;
        const int64_t grain = 4096; /* 256 KB per thread at least */
        j->fill = true;
        k3_pool_for(pool, (int64_t)n_lines, grain, bw_task, j);
        j->fill = false;
        for (int r = 0; r < reps; r++) {
            double t0 = k3_now();
            k3_pool_for(pool, (int64_t)n_lines, grain, bw_task, j);
            double dt = k3_now() - t0;
            rate[r] = (double)(n_lines * LINE) / (dt > 1e-9 ? dt : 1e-9) * 1e-9;
        }
        qsort(rate, (size_t)reps, sizeof *rate, cmp_double);
        med = reps % 2 ? rate[reps / 2] : 0.5 * (rate[reps / 2 - 1] + rate[reps / 2]);
    }
    free(buf);
    free(rate);
    free(j);
    return med;
}
