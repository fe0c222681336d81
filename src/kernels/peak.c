/*
 * peak.c -- k3_peak_gflops (k3.h): the register loop of a kind on every
 * thread of the pool at once, its length set so the whole takes about the
 * time asked; the rate is the operations of all threads over the slowest
 * thread's time.
 */
#include "k3.h"
#include "kernels/peak_isa.h"
#include "kernels/amx.h"
#include "kernels/kernels_isa.h"
#include "common/clock.h"
#include "common/pool.h"

#include <stdlib.h>

const char *k3_peak_name(k3_peak_kind kind) {
    static const char *const names[K3_PEAK_COUNT] = {"fp32 FMA", "BF16 dot", "INT8 dot", "AMX BF16", "AMX INT8"};
    return (int)kind >= 0 && kind < K3_PEAK_COUNT ? names[kind] : "unknown";
}

typedef double loop_fn(int64_t iters);

static double amx_bf16(int64_t iters) { return k3_amx_peak_loop(false, iters); }
static double amx_int8(int64_t iters) { return k3_amx_peak_loop(true, iters); }

/* The loop of kind on this CPU, with iters per unit of work (a round of the
 * AMX loops is 16 tile products, of the others 12 vector ones); NULL where
 * there is none. */
static loop_fn *loop_of(k3_peak_kind kind) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx512 =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    switch (kind) {
    case K3_PEAK_FMA32:
        if (avx512) return k3_peak_fma32_avx512;
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? k3_peak_fma32_avx2 : NULL;
    case K3_PEAK_BF16DOT: return avx512 && __builtin_cpu_supports("avx512bf16") ? k3_peak_bf16_avx512 : NULL;
    case K3_PEAK_INT8DOT:
        if (avx512 && __builtin_cpu_supports("avx512vnni")) return k3_peak_int8_avx512;
        return __builtin_cpu_supports("avxvnni") ? k3_peak_int8_avxvnni : NULL;
    case K3_PEAK_AMX_BF16: return k3_amx_ready() ? amx_bf16 : NULL;
    case K3_PEAK_AMX_INT8: return k3_amx_ready() ? amx_int8 : NULL;
    case K3_PEAK_COUNT: break;
    }
#endif
    return NULL;
}

enum { MAX_THREADS = 512 };

typedef struct peak_job {
    loop_fn *fn;
    int64_t iters;
    double ops[MAX_THREADS], secs[MAX_THREADS];
} peak_job;

static void peak_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    peak_job *j = ctx;
    for (int64_t i = lo; i < hi; i++) {
        const double t0 = k3_now();
        const double ops = j->fn(j->iters);
        const int64_t slot = i < MAX_THREADS ? i : MAX_THREADS - 1;
        j->ops[slot] += ops;
        j->secs[slot] += k3_now() - t0;
    }
}

double k3_peak_gflops(k3_pool *pool, k3_peak_kind kind, double seconds) {
    loop_fn *fn = loop_of(kind);
    if (!fn || seconds <= 0) return 0.0;
    /* one thread, until a run takes 5 ms, to size the loop */
    int64_t iters = 1000;
    for (;;) {
        const double t0 = k3_now();
        fn(iters);
        const double dt = k3_now() - t0;
        if (dt >= 5e-3 || iters > ((int64_t)1 << 40)) {
            iters = (int64_t)((double)iters * seconds / (dt > 1e-9 ? dt : 1e-9));
            break;
        }
        iters *= 4;
    }
    if (iters < 1) iters = 1;
    const int T = pool ? k3_pool_size(pool) : 1;
    peak_job *j = calloc(1, sizeof *j);
    if (!j) return 0.0;
    j->fn = fn;
    j->iters = iters;
    k3_pool_for(pool, T < MAX_THREADS ? T : MAX_THREADS, 1, peak_task, j);
    double ops = 0, worst = 0;
    for (int i = 0; i < MAX_THREADS; i++) {
        ops += j->ops[i];
        worst = j->secs[i] > worst ? j->secs[i] : worst;
    }
    free(j);
    return worst > 0 ? ops / worst / 1e9 : 0.0;
}

k3_peak_kind k3_peak_of(const k3_quant_options *q) {
    const bool amx = k3_kernels_isa() == K3_ISA_AMX;
    if (q->linear != K3_WQ_NONE) return amx ? K3_PEAK_AMX_INT8 : K3_PEAK_INT8DOT;
    if (!q->f32 && k3_kernels_bf16()) return amx ? K3_PEAK_AMX_BF16 : K3_PEAK_BF16DOT;
    return K3_PEAK_FMA32;
}
