/*
 * matmul.c -- k3_matmul: takes the current table's kernel for the weight type
 * (k3_kernel_ops.mm with fp32 activations, .bf with BF16 ones, .q with 8-bit
 * ones, by the weight-type table's acts, k3_mat.bf16 and k3_mat.act8), makes
 * the activations the kernel
 * reads once per call, and splits the rows over the thread pool; a kernel
 * with a call entry (AMX) does both itself.
 *
 * Threading: work is cut into row ranges, up to 4 per thread, that the pool
 * hands to whichever thread is free (each slice of the weights is streamed
 * exactly once, which is what decode is bound by); small row counts with many
 * activation rows are split over n as well. The kernels are batch invariant
 * (kernels_isa.h), so the split never changes a result. Tiny products run on
 * the calling thread: a pool round trip costs about as much as 32 KB of
 * weights.
 */
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"
#include "common/error.h"
#include "common/mem.h"
#include "common/pool.h"

#include <string.h>

/* ---- fp32 activations ------------------------------------------------------------ */

typedef struct mm_job {
    k3_mm_rows_fn *rows;
    const k3_mat *w;
    const float *x;
    float *y;
    int64_t n;
    int64_t n_rc, n_nc; /* row chunks x n chunks */
    int64_t ldx;        /* floats from one x row to the next (as prep_x made them) */
} mm_job;

enum { PREP_ROWS = 256 }; /* x rows prepared at a time (prep_x) */

/* Items t = nc * n_rc + rc: row chunk rc (16 rows, the last one takes the
 * rest) of activation chunk nc. A claimed range [lo, hi) is one kernel call
 * per activation chunk it touches, over all its rows at once. */
static void mm_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const mm_job *j = ctx;
    const int64_t rows = j->w->rows;
    for (int64_t t = lo; t < hi;) {
        const int64_t nc = t / j->n_rc, rc0 = t % j->n_rc;
        const int64_t te = hi < (nc + 1) * j->n_rc ? hi : (nc + 1) * j->n_rc;
        const int64_t rc1 = te - nc * j->n_rc; /* exclusive */
        const int64_t r0 = rc0 * 16, r1 = rc1 == j->n_rc ? rows : rc1 * 16;
        const int64_t i0 = j->n * nc / j->n_nc, i1 = j->n * (nc + 1) / j->n_nc;
        if (r0 < r1 && i0 < i1) j->rows(j->w, j->x + i0 * j->ldx, i1 - i0, j->y + i0 * rows, rows, r0, r1);
        t = te;
    }
}

/* The fp32-activation kernels (bf false) or the BF16 dot products (bf). */
static void matmul_f32(k3_pool *pool, const k3_kernel_ops *o, const k3_mat *w, const float *x, int64_t n, float *y,
                       bool bf) {
#define KERN(o) (bf ? &(o)->bf[w->type] : &(o)->mm[w->type])
    while (KERN(o)->fits && !KERN(o)->fits(w, n)) o = o->base;
    const k3_mm_kernel *k = KERN(o);
#undef KERN
    if (k->call) {
        k->call(pool, w, x, n, y);
        return;
    }
    K3_ASSERT(k->rows); /* k3_wtype_traits.acts said fp32 or BF16 */
    const int64_t nprep = k->prep_x ? k->prep_x(w, x, n, NULL) : 0;
    if (nprep > 0 && n > PREP_ROWS && !bf) {
        /* blocks of x rows, so the scratch stays small (batch invariance
         * makes the split invisible) */
        for (int64_t i = 0; i < n; i += PREP_ROWS)
            k3_matmul(pool, w, x + i * w->cols, n - i < PREP_ROWS ? n - i : PREP_ROWS, y + i * w->rows);
        return;
    }
    mm_job j = {k->rows, w, x, y, n, 1, 1, nprep > 0 ? nprep / n : w->cols};
    if (nprep > 0) {
        float *xp = k3_scratch(K3_SCRATCH_MATMUL, sizeof(float) * (size_t)nprep);
        k->prep_x(w, x, n, xp);
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

/* ---- 8-bit activations ------------------------------------------------------------- */

typedef struct q_task {
    const k3_qjob *job;
    k3_q_rows_fn *rows;
    int64_t unit; /* rows per pool item: a whole tile */
} q_task;

static void q_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const q_task *t = p;
    t->rows(t->job, lo * t->unit, hi * t->unit);
}

/* The activations of an 8-bit product, tokens [16 lo, 16 hi): the token
 * scales and int8 values, and the form the kernel reads (k3_qform); W8A8
 * with panels makes only the panels. */
typedef struct q_prep {
    const k3_kernel_ops *o;
    const k3_q_kernel *k;
    const float *x;
    int64_t n, cols, ldc;
    float *xs;
    int8_t *xq, *xp;
    int32_t *corr;
    uint8_t *xpan;
} q_prep;

static void q_prep_tokens(void *ctx, int64_t lo, int64_t hi, int ith) {
    const q_prep *p = ctx;
    const int64_t cols = p->cols, t0 = 16 * lo, t1 = 16 * hi < p->n ? 16 * hi : p->n;
    for (int64_t i = t0; i < t1; i++) {
        p->xs[i] = p->o->quant_act_i8(p->x + i * cols, cols, p->xq + i * cols);
        if (p->k->form == K3_QX_U8 && !p->xpan) {
            for (int64_t c = i * cols; c < (i + 1) * cols; c++)
                p->xp[c] = (int8_t)((uint8_t)p->xq[c] ^ 0x80); /* x + 128 */
        } else if (p->k->form == K3_QX_MX4) {
            p->o->mx4_prep(p->xq + i * cols, cols, p->xp + i * cols, p->corr + i * p->ldc);
        } else if (p->k->form == K3_QX_MX4_R4) {
            p->o->mx4_r4_prep(p->xq + i * cols, cols, p->xp + i * cols, p->corr + i * p->ldc);
        }
    }
    if (p->xpan) /* panels lo..hi-1: out = panel lo's first byte */
        p->k->panels(p->xq + t0 * cols, t1 - t0, cols, p->xpan + t0 * cols);
}

static void matmul_q(k3_pool *pool, const k3_kernel_ops *o, const k3_mat *w, const float *x, int64_t n, float *y) {
    while (o->q[w->type].fits && !o->q[w->type].fits(w, n)) o = o->base;
    const k3_q_kernel *k = &o->q[w->type];
    if (k->call) {
        k->call(pool, w, x, n, y);
        return;
    }
    K3_ASSERT(k->rows); /* "k3_matmul: weight type without an 8-bit path" */
    const int64_t cols = w->cols, ldc = (cols + 127) / 128 * 16;
    /* scratch: xs [n] | xf or corr [n, cols or ldc] | xq [n, cols] | prepared [n, cols] */
    const size_t fsz =
        k->form == K3_QX_MXFP8 ? (size_t)(n * cols) * sizeof(float) : (size_t)(n * ldc) * sizeof(int32_t);
    /* and the token panels of W8A8 prefill [ceil(n / 16) * 16, cols] */
    const bool pan = k->form == K3_QX_U8 && k->panels && n >= K3_Q8_PANEL_MIN && cols % 4 == 0;
    const size_t psz = pan ? (size_t)((n + 15) / 16 * 16 * cols) + 64 : 0;
    char *buf = k3_scratch(K3_SCRATCH_QUANT, (size_t)n * sizeof(float) + fsz + 2 * (size_t)(n * cols) + 64 + psz);
    float *xs = (float *)buf;
    float *xf = (float *)(buf + (size_t)n * sizeof(float));
    int32_t *corr = (int32_t *)xf;
    int8_t *xq = (int8_t *)(buf + (size_t)n * sizeof(float) + fsz), *xp = xq + n * cols;
    const int8_t *xk = xq;
    uint8_t *xpan = NULL;
    if (k->form == K3_QX_MXFP8) {
        memcpy(xf, x, (size_t)(n * cols) * sizeof(float));
        for (int64_t i = 0; i < n; i++) k3_quant_act_mxfp8(xf + i * cols, cols);
    } else {
        if (pan) xpan = (uint8_t *)(((uintptr_t)(xp + n * cols) + 63) & ~(uintptr_t)63);
        /* quantized and prepared 16 tokens at a time on every thread (each
         * token alone, so the bits do not depend on the split) */
        q_prep p = {o, k, x, n, cols, ldc, xs, xq, xp, corr, xpan};
        const int64_t units = (n + 15) / 16;
        k3_pool_for(n * cols >= 65536 ? pool : NULL, units, 1, q_prep_tokens, &p);
        if (k->form != K3_QX_I8) xk = xp;
    }
    const k3_qjob j =
        {.ops = o, .w = w, .n = n, .xq = xk, .corr = corr, .ldc = ldc, .xs = xs, .xf = xf, .y = y, .xpan = xpan};
    const int64_t unit = k3_wtype_info(w->type)->tile_rows;
    q_task t = {&j, k->rows, unit};
    k3_pool_for(pool, w->rows / unit, 16 / unit, q_rows, &t);
}

/* ---- k3_matmul ---------------------------------------------------------------------- */

void k3_matmul(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y) {
    const k3_wtype_traits *ti = k3_wtype_info(w->type);
    K3_ASSERT(!ti->block || w->cols % ti->block == 0);
    if (n <= 0 || w->rows <= 0) return;
    if (w->cols == 0) { /* empty sums; the kernels assume at least one column */
        memset(y, 0, sizeof(float) * (size_t)(n * w->rows));
        return;
    }
    if (w->act8 || !(ti->acts & (K3_ACTS_F32 | K3_ACTS_BF16))) matmul_q(pool, k3_ops(), w, x, n, y);
    else matmul_f32(pool, k3_ops(), w, x, n, y, w->bf16 || !(ti->acts & K3_ACTS_F32));
}
