/*
 * xcore.c -- what it costs two cores to hand data to each other, next to
 * what each reads from memory. A developer tool (`make xcore`), not part of
 * k3: it tells which of this machine's two states a measurement met (the
 * two vCPUs sharing one ~34 GB/s, or each reading its own ~30) and what
 * every pool job pays at its start and end in that state.
 *
 *   build/xcore [rounds] [iterations]
 *
 * One thread waits for a flag, writes N bytes and raises a second flag; the
 * other thread, which raised the first, waits for the second and then reads
 * the N bytes (lines the other core holds modified). Each round prints the
 * 1 GB read of k3_membw_read_gbps with one thread and with two, the median
 * round trip and the median time of that read over `iterations` for N = 0,
 * 4 KB and 16 KB (a 1024- and a 4096-float activation vector), then the
 * two-thread read again: the state can change within seconds, and a round
 * whose two 2-thread reads agree saw one state throughout.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3.h"
#include "common/pool.h"
#include "kernels/membw.h"

enum { MAX_BYTES = 16384 };

static volatile uint64_t sink; /* keeps the reads */

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    _Alignas(64) _Atomic int64_t flag; /* 2i + 1: go, 2i + 2: written */
    _Alignas(64) uint64_t buf[MAX_BYTES / 8];
    size_t bytes;
    int iters;
} xfer;

static void *writer(void *arg) {
    xfer *x = arg;
    for (int64_t i = 0; i < x->iters; i++) {
        while (atomic_load_explicit(&x->flag, memory_order_acquire) != 2 * i + 1) {
        }
        for (size_t k = 0; k < x->bytes / 8; k++) x->buf[k] = (uint64_t)i + k;
        atomic_store_explicit(&x->flag, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

static int measure(size_t bytes, int iters, double *rt_us, double *rd_us) {
    xfer *x = aligned_alloc(64, sizeof *x);
    double *rt = malloc(sizeof *rt * (size_t)iters), *rd = malloc(sizeof *rd * (size_t)iters);
    if (!x || !rt || !rd) {
        free(x), free(rt), free(rd);
        return -1;
    }
    memset(x, 0, sizeof *x);
    x->bytes = bytes;
    x->iters = iters;
    pthread_t t;
    if (pthread_create(&t, NULL, writer, x)) {
        free(x), free(rt), free(rd);
        return -1;
    }
    uint64_t sum = 0;
    for (int64_t i = 0; i < iters; i++) {
        const double t0 = k3_now();
        atomic_store_explicit(&x->flag, 2 * i + 1, memory_order_release);
        while (atomic_load_explicit(&x->flag, memory_order_acquire) != 2 * i + 2) {
        }
        const double t1 = k3_now();
        for (size_t k = 0; k < bytes / 8; k++) sum += x->buf[k];
        const double t2 = k3_now();
        rt[i] = (t1 - t0) * 1e6;
        rd[i] = (t2 - t1) * 1e6;
    }
    pthread_join(t, NULL);
    qsort(rt, (size_t)iters, sizeof *rt, cmpd);
    qsort(rd, (size_t)iters, sizeof *rd, cmpd);
    *rt_us = rt[iters / 2];
    *rd_us = rd[iters / 2];
    sink += sum;
    free(x), free(rt), free(rd);
    return 0;
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 5, iters = argc > 2 ? atoi(argv[2]) : 2000;
    if (rounds < 1 || iters < 1) {
        fprintf(stderr, "usage: xcore [rounds >= 1] [iterations >= 1]\n");
        return 2;
    }
    /* the two sides spin on each other: on one CPU they would take turns
     * by time slices, which is a hang for this purpose */
    cpu_set_t cpus;
    if (sched_getaffinity(0, sizeof cpus, &cpus) == 0 && CPU_COUNT(&cpus) < 2) {
        fprintf(stderr, "xcore: needs two CPUs to run on, has %d\n", CPU_COUNT(&cpus));
        return 1;
    }
    k3_pool *one = NULL, *two = NULL;
    k3_error err;
    if (k3_pool_init(&one, 1, &err) || k3_pool_init(&two, 2, &err)) {
        fprintf(stderr, "xcore: %s\n", err.msg);
        k3_pool_free(one);
        return 1;
    }
    const size_t sizes[] = {0, 4096, MAX_BYTES};
    printf("%-8s %-8s | round trip / reading the other core's lines, us, after it wrote: %s | %-8s\n",
           "1 thread", "2 threads", "0 B, 4 KB, 16 KB", "2 threads");
    for (int r = 0; r < rounds; r++) {
        const double b1 = k3_membw_read_gbps(one, (size_t)1 << 30, 1);
        const double b2 = k3_membw_read_gbps(two, (size_t)1 << 30, 1);
        printf("%5.1f GB/s %5.1f GB/s |", b1, b2);
        for (int s = 0; s < 3; s++) {
            double rt, rd;
            if (measure(sizes[s], iters, &rt, &rd) < 0) {
                fprintf(stderr, "xcore: out of memory or no thread\n");
                k3_pool_free(one);
                k3_pool_free(two);
                return 1;
            }
            printf(" %5.2f / %5.2f", rt, rd);
        }
        printf(" | %5.1f GB/s\n", k3_membw_read_gbps(two, (size_t)1 << 30, 1));
    }
    k3_pool_free(one);
    k3_pool_free(two);
    return 0;
}
