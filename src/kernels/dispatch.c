/*
 * dispatch.c -- picks the kernel table for this CPU once, and splits k3_matmul
 * over the thread pool.
 *
 * ISA choice: AVX-512 (F+BW+VL) > AVX2+FMA+F16C > scalar, by
 * __builtin_cpu_supports (which also checks that the OS saves the wider
 * registers). k3_kernels_force is for tests and benchmarks; k3_set_isa (k3.h,
 * `--isa`) is the public form, by name, which also says whether the AVX2
 * integer kernels may use AVX-VNNI (detected here too).
 *
 * Threading: work is cut into row ranges, up to 4 per thread, that the
 * pool hands to whichever thread is free (each slice of the weights is
 * streamed exactly once, which is what decode is bound by); small row counts
 * with many activation rows are split over n as well. The kernels are batch
 * invariant (kernels_isa.h), so the split never changes a result. Tiny
 * products run on the calling thread: a pool round trip costs about as much
 * as 32 KB of weights.
 */
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"
#include "common/error.h"
#include "common/mem.h"
#include "common/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const k3_kernel_ops *g_best;
static bool g_have[3];
static bool g_have_avxvnni;         /* AVX-VNNI (vpdpbusd on ymm) */
static _Atomic bool g_use_avxvnni;  /* the AVX2 integer kernels may use it */
static const k3_kernel_ops *_Atomic g_ops;

static const k3_kernel_ops *const g_table[3] = {&k3_ops_ref, &k3_ops_avx2, &k3_ops_avx512};

static void detect(void) {
    g_have[K3_ISA_REF] = true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    g_have[K3_ISA_AVX2] = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
    g_have[K3_ISA_AVX512] = g_have[K3_ISA_AVX2] && __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl");
    g_have_avxvnni = g_have[K3_ISA_AVX2] && __builtin_cpu_supports("avxvnni");
#endif
    atomic_store(&g_use_avxvnni, g_have_avxvnni);
    g_best = &k3_ops_ref;
    if (g_have[K3_ISA_AVX2]) g_best = &k3_ops_avx2;
    if (g_have[K3_ISA_AVX512]) g_best = &k3_ops_avx512;
    atomic_store(&g_ops, g_best);
}

void k3_kernels_init(void) { pthread_once(&g_once, detect); }

static inline const k3_kernel_ops *ops(void) {
    const k3_kernel_ops *o = atomic_load_explicit(&g_ops, memory_order_acquire);
    if (!o) {
        k3_kernels_init();
        o = atomic_load(&g_ops);
    }
    return o;
}

k3_isa k3_kernels_isa(void) { return ops()->isa; }

const char *k3_isa_name(k3_isa isa) {
    switch (isa) {
    case K3_ISA_REF: return "ref";
    case K3_ISA_AVX2: return "avx2";
    case K3_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

void k3_kernels_force(k3_isa isa) {
    k3_kernels_init();
    const k3_kernel_ops *o = g_best;
    if ((int)isa >= 0 && (int)isa < 3 && g_have[isa]) o = g_table[isa];
    atomic_store(&g_ops, o);
    atomic_store(&g_use_avxvnni, g_have_avxvnni);
}

bool k3_kernels_have(k3_isa isa) {
    k3_kernels_init();
    return (int)isa >= 0 && (int)isa < 3 && g_have[isa];
}

bool k3_kernels_avxvnni(void) {
    return ops()->isa == K3_ISA_AVX2 && atomic_load_explicit(&g_use_avxvnni, memory_order_relaxed);
}

void k3_kernels_force_avxvnni(bool on) {
    k3_kernels_init();
    atomic_store(&g_use_avxvnni, on && g_have_avxvnni);
}

k3_status k3_set_isa(const char *name, k3_error *err) {
    k3_kernels_init();
    if (!name || !strcmp(name, "best") || !*name) {
        k3_kernels_force(g_best->isa);
        return K3_OK;
    }
    static const struct { const char *name; k3_isa isa; int vnni; } names[] = {
        {"ref", K3_ISA_REF, 0},      {"avx2", K3_ISA_AVX2, 1}, {"avx2-vnni", K3_ISA_AVX2, 2},
        {"avx2-novnni", K3_ISA_AVX2, 0}, {"avx512", K3_ISA_AVX512, 0},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(name, names[i].name)) continue;
        if (!g_have[names[i].isa])
            return k3_err(err, K3_ERR_UNSUPPORTED, "this CPU lacks the instructions of kernel ISA '%s'", name);
        if (names[i].vnni == 2 && !g_have_avxvnni)
            return k3_err(err, K3_ERR_UNSUPPORTED, "this CPU lacks AVX-VNNI (kernel ISA '%s')", name);
        k3_kernels_force(names[i].isa);
        atomic_store(&g_use_avxvnni, names[i].vnni && g_have_avxvnni);
        return K3_OK;
    }
    return k3_err(err, K3_ERR_ARG, "unknown kernel ISA '%s' (ref, avx2, avx2-novnni, avx512 or best)", name);
}

const char *k3_isa_current(void) {
    const k3_isa isa = ops()->isa;
    if (isa == K3_ISA_AVX2) return k3_kernels_avxvnni() ? "avx2-vnni" : "avx2";
    return k3_isa_name(isa);
}

float k3_dot(const float *a, const float *b, int64_t n) { return ops()->dot(a, b, n); }

void k3_axpy(float *y, float a, const float *x, int64_t n) { ops()->axpy(y, a, x, n); }

void k3_glu(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2) {
    ops()->glu(f1, f2, n, kind, b1, b2);
}

/* ---- threaded matmul -------------------------------------------------- */

typedef struct mm_job {
    const k3_kernel_ops *ops;
    const k3_mat *w;
    const float *x;
    float *y;
    int64_t n;
    int64_t n_rc, n_nc; /* row chunks x n chunks */
} mm_job;

enum { PREP_ROWS = 256 }; /* x rows prepared at a time (ops->prep_x) */

/* Items t = nc * n_rc + rc: row chunk rc (16 rows, the last one takes the
 * rest) of activation chunk nc. A claimed range [lo, hi) is one kernel call
 * per activation chunk it touches, over all its rows at once. */
static void mm_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const mm_job *j = ctx;
    const int64_t rows = j->w->rows, cols = j->w->cols;
    for (int64_t t = lo; t < hi;) {
        const int64_t nc = t / j->n_rc, rc0 = t % j->n_rc;
        const int64_t te = hi < (nc + 1) * j->n_rc ? hi : (nc + 1) * j->n_rc;
        const int64_t rc1 = te - nc * j->n_rc; /* exclusive */
        const int64_t r0 = rc0 * 16, r1 = rc1 == j->n_rc ? rows : rc1 * 16;
        const int64_t i0 = j->n * nc / j->n_nc, i1 = j->n * (nc + 1) / j->n_nc;
        if (r0 < r1 && i0 < i1)
            j->ops->matmul(j->w, j->x + i0 * cols, i1 - i0, j->y + i0 * rows, rows, r0, r1);
        t = te;
    }
}

void k3_matmul(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y) {
    K3_ASSERT(w->type >= K3_W_F32 && w->type < K3_W_COUNT);
    K3_ASSERT(w->type != K3_W_MXFP4 || w->cols % 32 == 0);
    K3_ASSERT(w->type != K3_W_MXFP4_R4 || w->act8); /* only the W4A8 kernel reads tiles */
    if (n <= 0 || w->rows <= 0) return;
    if (w->cols == 0) { /* empty sums; the kernels assume at least one column */
        memset(y, 0, sizeof(float) * (size_t)(n * w->rows));
        return;
    }
    if (w->act8 || w->type == K3_W_Q8 || w->type == K3_W_MXFP8) {
        k3_matmul_q(pool, w, x, n, y); /* 8-bit activations: quant.c */
        return;
    }
    mm_job j = {ops(), w, x, y, n, 1, 1};
    const int64_t nprep = j.ops->prep_x ? j.ops->prep_x(w, x, n, NULL) : 0;
    if (nprep > 0 && n > PREP_ROWS) {
        /* blocks of x rows, so the scratch stays small (batch invariance
         * makes the split invisible) */
        for (int64_t i = 0; i < n; i += PREP_ROWS)
            k3_matmul(pool, w, x + i * w->cols, n - i < PREP_ROWS ? n - i : PREP_ROWS, y + i * w->rows);
        return;
    }
    if (nprep > 0) {
        float *xp = k3_scratch(K3_SCRATCH_MATMUL, sizeof(float) * (size_t)nprep);
        j.ops->prep_x(w, x, n, xp);
        j.x = xp;
    }
    const int64_t rows = w->rows;
    const int T = k3_pool_size(pool);
    const double bytes = (double)rows * (double)k3_mat_row_bytes(w);
    const double macs = (double)rows * (double)w->cols * (double)n;
    if (T > 1 && (bytes >= 32768 || macs >= 131072)) {
        /* 16-row items, a contiguous share per thread, stolen from as
         * the threads come free (pool.c); few rows and many tokens also
         * split the tokens */
        j.n_rc = rows / 16 > 0 ? rows / 16 : 1;
        int64_t nn = T / j.n_rc, nmax = n / 4 > 0 ? n / 4 : 1;
        j.n_nc = nn < nmax ? nn : nmax;
        if (j.n_nc < 1) j.n_nc = 1;
    }
    k3_pool_for(pool, j.n_rc * j.n_nc, 1, mm_task, &j);
}
