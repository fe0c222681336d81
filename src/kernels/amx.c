/*
 * amx.c -- the AMX unit's detection and permission, the weight views and
 * tiles, and the threading of the AMX kernels (amx.h). Plain C: the kernels
 * themselves are gemm_amx.c (on the unit) and gemm_emu_amx.c (emulated).
 *
 * Linux keeps the tile data state (8 KB per thread) off until a process
 * asks for it: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once,
 * for every thread of the process. Without it the first tile instruction
 * faults, so nothing runs on the unit before k3_amx_init has succeeded.
 */
#include "kernels/amx.h"
#include "kernels/kernels_isa.h"
#include "common/error.h"
#include "common/mem.h"
#include "common/pool.h"

#include <errno.h>
#include <stdio.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* ---- the unit ----------------------------------------------------------- */

static bool cpu_has(void) {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = (uint64_t)hi << 32 | lo;
    /* SSE, AVX, opmask, ZMM halves and ZMM16-31, tile config and data */
    const uint64_t need = 0x6 | 0xe0 | (3ull << 17);
    if ((xcr0 & need) != need) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool avx512 = (b >> 16 & 1) && (b >> 17 & 1) && (b >> 30 & 1) && (b >> 31 & 1) && (c >> 11 & 1);
    const bool amx = (d >> 22 & 1) && (d >> 24 & 1) && (d >> 25 & 1); /* BF16, TILE, INT8 */
    if (!avx512 || !amx) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return a >> 5 & 1; /* AVX512_BF16 */
#else
    return false;
#endif
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static bool g_cpu, g_ready;
static char g_why[160];

static void init_once(void) {
    g_cpu = cpu_has();
    if (!g_cpu) {
        snprintf(g_why, sizeof g_why, "this CPU has no AMX tile unit (AMX-TILE, AMX-BF16, AMX-INT8 with AVX-512 BF16)");
        return;
    }
#if defined(__linux__) && defined(SYS_arch_prctl)
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        snprintf(g_why, sizeof g_why, "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: %s)",
                 strerror(errno));
        return;
    }
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm) != 0 || !(perm & (1ul << XFEATURE_XTILEDATA))) {
        snprintf(g_why, sizeof g_why, "the kernel did not grant the AMX tile state (arch_prctl ARCH_GET_XCOMP_PERM)");
        return;
    }
    g_ready = true;
#else
    snprintf(g_why, sizeof g_why, "AMX needs Linux's arch_prctl to enable the tile state");
#endif
}

bool k3_amx_cpu_has(void) {
    pthread_once(&g_once, init_once);
    return g_cpu;
}

k3_status k3_amx_init(k3_error *err) {
    pthread_once(&g_once, init_once);
    return g_ready ? K3_OK : k3_err(err, K3_ERR_UNSUPPORTED, "%s", g_why);
}

bool k3_amx_ready(void) {
    pthread_once(&g_once, init_once);
    return g_ready;
}

bool k3_amx_emu_possible(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

static _Atomic bool g_emulate;

void k3_amx_emulate(bool on) { atomic_store(&g_emulate, on); }

static const k3_amx_ops *kern(void) {
    if (atomic_load_explicit(&g_emulate, memory_order_relaxed)) return k3_amx_emu_possible() ? &k3_amx_ops_emu : NULL;
    return k3_amx_ready() ? &k3_amx_ops_hw : NULL;
}

const char *k3_amx_backend(void) {
    const k3_amx_ops *k = kern();
    return k ? k->name : "none";
}

double k3_amx_peak_loop(bool int8, int64_t iters) {
    const k3_amx_ops *k = kern();
    K3_ASSERT(k);
    return k->peak(int8, iters);
}

/* ---- weights ------------------------------------------------------------ */

k3_status k3_amx_view(const k3_mat *w, k3_amx_mat *out, k3_error *err) {
    memset(out, 0, sizeof *out);
    if (w->type != K3_W_BF16 && w->type != K3_W_MXFP4 && w->type != K3_W_Q8)
        return k3_err(err, K3_ERR_UNSUPPORTED, "the AMX kernels read BF16, MXFP4 and Q8 weights, not type %d",
                      (int)w->type);
    if (w->type == K3_W_MXFP4 && w->cols % 32)
        return k3_err(err, K3_ERR_SHAPE, "an MXFP4 matrix has whole 32-column blocks (cols %lld)", (long long)w->cols);
    if (w->rows < 1 || w->cols < 1) return k3_err(err, K3_ERR_SHAPE, "an AMX matrix is not empty");
    out->type = w->type;
    out->act8 = w->type == K3_W_Q8 || (w->type == K3_W_MXFP4 && w->act8);
    out->rows = w->rows;
    out->cols = w->cols;
    out->data = w->data;
    out->scale = w->scale;
    out->row_scale = w->row_scale;
    return K3_OK;
}

size_t k3_amx_pack_bytes(const k3_mat *w) {
    K3_ASSERT(w->type == K3_W_BF16);
    return (size_t)((w->rows + 15) / 16) * (size_t)((w->cols + 31) / 32) * 1024;
}

void k3_amx_pack(const k3_mat *w, void *buf, k3_amx_mat *out) {
    K3_ASSERT(w->type == K3_W_BF16 && w->rows > 0 && w->cols > 0);
    const int64_t ns = (w->rows + 15) / 16, kt = (w->cols + 31) / 32;
    const uint16_t *src = w->data;
    uint16_t *dst = buf;
    memset(buf, 0, k3_amx_pack_bytes(w));
    for (int64_t s = 0; s < ns; s++)
        for (int64_t k = 0; k < kt; k++) {
            uint16_t *t = dst + (s * kt + k) * 512;
            for (int64_t r = 0; r < 16 && s * 16 + r < w->rows; r++) {
                const int64_t c0 = 32 * k, len = w->cols - c0 < 32 ? w->cols - c0 : 32;
                memcpy(t + r * 32, src + (s * 16 + r) * w->cols + c0, (size_t)len * 2);
            }
        }
    memset(out, 0, sizeof *out);
    out->type = K3_W_BF16;
    out->tiled = true;
    out->rows = w->rows;
    out->cols = w->cols;
    out->data = buf;
}

int64_t k3_amx_btiles(const k3_amx_mat *w) { return w->act8 ? (w->cols + 63) / 64 : (w->cols + 31) / 32; }

/* ---- threads ------------------------------------------------------------ */

typedef struct prep_job {
    const k3_amx_ops *k;
    const k3_amx_mat *w;
    const float *x;
    int64_t n, ktn;
    uint8_t *xb;
    float *xs;
} prep_job;

static void prep_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const prep_job *j = ctx;
    for (int64_t t = lo; t < hi; t++) {
        const int64_t nt = j->n - 16 * t < 16 ? j->n - 16 * t : 16;
        j->k->prep(j->w, j->x + 16 * t * j->w->cols, j->w->cols, nt, j->xb + t * j->ktn * 1024,
                   j->xs ? j->xs + 16 * t : NULL);
    }
}

typedef struct rows_job {
    const k3_amx_ops *k;
    const k3_amx_mat *w;
    const uint8_t *xb;
    const float *xs;
    int64_t n;
    float *y;
} rows_job;

static void rows_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const rows_job *j = ctx;
    j->k->rows(j->w, j->xb, j->xs, j->n, j->y, j->w->rows, lo, hi);
}

void k3_amx_matmul(k3_pool *pool, const k3_amx_mat *w, const float *x, int64_t n, float *y) {
    const k3_amx_ops *k = kern();
    K3_ASSERT(k); /* k3_amx_init succeeded, or the emulation is on */
    if (n <= 0) return;
    const int64_t ntt = (n + 15) / 16, ktn = k3_amx_btiles(w);
    const size_t xbytes = (size_t)(ntt * ktn) * 1024;
    uint8_t *xb = k3_scratch(K3_SCRATCH_AMX_X, xbytes + sizeof(float) * (size_t)ntt * 16);
    float *xs = w->act8 ? (float *)(xb + xbytes) : NULL;
    prep_job pj = {k, w, x, n, ktn, xb, xs};
    k3_pool_for(pool, ntt, 1, prep_task, &pj);
    rows_job rj = {k, w, xb, xs, n, y};
    k3_pool_for(pool, (w->rows + 31) / 32, 1, rows_task, &rj);
}

/* ---- the routed experts --------------------------------------------------- */

typedef struct moe_job {
    const k3_amx_ops *k;
    const k3_amx_expert *e;
    int64_t ne;
    const int64_t *row0;
    const float *x;
    float *y;
    uint8_t *xb, *hb;
    const int64_t *tile0; /* [ne + 1]: each expert's first token tile */
    int64_t *item0;       /* [ne + 1]: each expert's first item of the phase */
    int64_t hidden, ktx, kth;
    k3_glu_kind kind;
    float b1, b2;
    int phase; /* 0: activations, 1: gate/up, 2: down */
} moe_job;

static void moe_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const moe_job *j = ctx;
    int64_t e = 0;
    while (e < j->ne && j->item0[e + 1] <= lo) e++;
    for (; e < j->ne && j->item0[e] < hi; e++) {
        const int64_t a = lo > j->item0[e] ? lo - j->item0[e] : 0;
        const int64_t b = (hi < j->item0[e + 1] ? hi : j->item0[e + 1]) - j->item0[e];
        if (a >= b) continue;
        const int64_t m = j->row0[e + 1] - j->row0[e];
        const uint8_t *xe = j->xb + j->tile0[e] * j->ktx * 1024;
        uint8_t *he = j->hb + j->tile0[e] * j->kth * 1024;
        if (j->phase == 0) {
            for (int64_t t = a; t < b; t++) {
                const int64_t nt = m - 16 * t < 16 ? m - 16 * t : 16;
                j->k->prep(&j->e[e].gate, j->x + (j->row0[e] + 16 * t) * j->hidden, j->hidden, nt,
                           j->xb + (j->tile0[e] + t) * j->ktx * 1024, NULL);
            }
        } else if (j->phase == 1) {
            j->k->up(&j->e[e], xe, m, he, a, b, j->kind, j->b1, j->b2);
        } else {
            j->k->rows(&j->e[e].down, he, NULL, m, j->y + j->row0[e] * j->hidden, j->hidden, a, b);
        }
    }
}

void k3_amx_moe(k3_pool *pool, const k3_amx_expert *experts, int64_t n_experts, const int64_t *row0, const float *x,
                float *y, k3_glu_kind kind, float b1, float b2) {
    const k3_amx_ops *k = kern();
    K3_ASSERT(k);
    if (n_experts <= 0) return;
    const int64_t hidden = experts[0].gate.cols, inter = experts[0].gate.rows;
    for (int64_t e = 0; e < n_experts; e++) {
        const k3_amx_expert *x_ = &experts[e];
        K3_ASSERT(x_->gate.cols == hidden && x_->up.cols == hidden && x_->gate.rows == inter && x_->up.rows == inter);
        K3_ASSERT(x_->down.rows == hidden && x_->down.cols == inter && !x_->down.act8 && !x_->gate.act8);
        K3_ASSERT(row0[e + 1] >= row0[e]);
    }
    int64_t ntt = 0;
    for (int64_t e = 0; e < n_experts; e++) ntt += (row0[e + 1] - row0[e] + 15) / 16;
    if (ntt == 0) return;
    const int64_t ktx = (hidden + 31) / 32, kth = (inter + 31) / 32;
    const size_t xbytes = (size_t)(ntt * ktx) * 1024, hbytes = (size_t)(ntt * kth) * 1024;
    uint8_t *xb = k3_scratch(K3_SCRATCH_AMX_X, xbytes);
    uint8_t *hb = k3_scratch(K3_SCRATCH_AMX_H, hbytes + sizeof(int64_t) * (size_t)(2 * n_experts + 2));
    int64_t *tile0 = (int64_t *)(hb + hbytes), *item0 = tile0 + n_experts + 1;
    tile0[0] = 0;
    for (int64_t e = 0; e < n_experts; e++) tile0[e + 1] = tile0[e] + (row0[e + 1] - row0[e] + 15) / 16;
    if (inter % 32) memset(hb, 0, hbytes); /* the last column tile's rows no strip writes */
    moe_job j = {k, experts, n_experts, row0, x, y, xb, hb, tile0, item0, hidden, ktx, kth, kind, b1, b2, 0};
    for (j.phase = 0; j.phase < 3; j.phase++) {
        item0[0] = 0;
        for (int64_t e = 0; e < n_experts; e++) {
            const int64_t nt = tile0[e + 1] - tile0[e];
            const int64_t items = j.phase == 0 ? nt : !nt ? 0 : j.phase == 1 ? (inter + 15) / 16 : (hidden + 31) / 32;
            item0[e + 1] = item0[e] + items;
        }
        k3_pool_for(pool, item0[n_experts], 1, moe_task, &j);
    }
}

/* ---- the DSA indexer ------------------------------------------------------- */

bool k3_amx_qli_ok(int HI, int dI) { return HI > 0 && HI % 16 == 0 && dI > 0 && dI % 64 == 0 && dI <= 1024; }

typedef struct qli_job {
    const k3_amx_ops *k;
    const int8_t *q8, *k8;
    const float *qs, *w, *ks;
    const int64_t *slots;
    int64_t T, n, lds;
    int HI, dI;
    float *scores;
} qli_job;

static void qli_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const qli_job *j = ctx;
    j->k->qli(j->q8, j->qs, j->w, j->T, j->HI, j->dI, j->k8, j->ks, j->slots, j->n, j->scores, j->lds, lo, hi);
}

void k3_amx_qli_scores(k3_pool *pool, const int8_t *q8, const float *qs, const float *w, int64_t T, int HI, int dI,
                       const int8_t *k8, const float *ks, const int64_t *slots, int64_t n, float *scores, int64_t lds) {
    const k3_amx_ops *k = kern();
    K3_ASSERT(k && k3_amx_qli_ok(HI, dI));
    if (T <= 0 || n <= 0) return;
    qli_job j = {k, q8, k8, qs, w, ks, slots, T, n, lds, HI, dI, scores};
    k3_pool_for(pool, (n + 31) / 32, 1, qli_task, &j);
}

/* The kernel table's chunk entry (kernels_isa.h qli_chunk): shapes off the
 * tiles' (HI % 16, dI % 64) run zero-padded, the queries to [T, HI16, dI64]
 * and the n keys, gathered, to [n, dI64] (slots 0..n-1). Exact: a zero column
 * adds 0 to every dot product, a zero head has d = 0 and adds nothing, and
 * the real heads keep their order. The copies are O((T HI16 + n) dI64) bytes
 * against the T HI16 n dI64 multiply-adds. */
static int64_t up_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

bool k3_amx_qli_chunk_fits(int HI, int dI) {
    return kern() && HI > 0 && dI > 0 && k3_amx_qli_ok((int)up_to(HI, 16), (int)up_to(dI, 64));
}

void k3_amx_qli_chunk(k3_pool *pool, const int8_t *q8, const float *qs, const float *w, int64_t T, int HI, int dI,
                      const int8_t *k8, const float *ks, const int64_t *slots, int64_t n, float *scores, int64_t lds) {
    if (k3_amx_qli_ok(HI, dI)) {
        k3_amx_qli_scores(pool, q8, qs, w, T, HI, dI, k8, ks, slots, n, scores, lds);
        return;
    }
    if (T <= 0 || n <= 0) return;
    const int64_t hp = up_to(HI, 16), dp = up_to(dI, 64);
    const size_t qb = (size_t)(T * hp * dp), kb = (size_t)(n * dp), fb = sizeof(float) * (size_t)(2 * T * hp + n);
    uint8_t *buf = k3_scratch(K3_SCRATCH_AMX_X, qb + kb + fb + sizeof(int64_t) * (size_t)n + 64);
    int8_t *qp = (int8_t *)buf, *kp = qp + qb;
    float *qsp = (float *)(buf + up_to((int64_t)(qb + kb), 64)), *wp = qsp + T * hp, *ksp = wp + T * hp;
    int64_t *sl = (int64_t *)(ksp + n);
    memset(qp, 0, qb);
    memset(kp, 0, kb);
    memset(qsp, 0, sizeof(float) * (size_t)(2 * T * hp));
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < HI; h++) {
            memcpy(qp + (t * hp + h) * dp, q8 + (t * HI + h) * dI, (size_t)dI);
            qsp[t * hp + h] = qs[t * HI + h];
            wp[t * hp + h] = w[t * HI + h];
        }
    for (int64_t i = 0; i < n; i++) {
        memcpy(kp + i * dp, k8 + slots[i] * dI, (size_t)dI);
        ksp[i] = ks[slots[i]];
        sl[i] = i;
    }
    k3_amx_qli_scores(pool, qp, qsp, wp, T, (int)hp, (int)dp, kp, ksp, sl, n, scores, lds);
}

/* ---- the "amx" kernel table's entries (kernels_isa.h) ---------------------- */

/* The rows from which a W8A8 call runs on the tiles (docs/amx.md,
 * "Thresholds"): below them the AVX-512 streams read the weights at the
 * bandwidth and the tiles would sit mostly empty. */
enum { AMX_MIN_ROWS = 8 };

bool k3_amx_q8_fits(const k3_mat *w, int64_t n) { return kern() && w->type == K3_W_Q8 && n >= AMX_MIN_ROWS; }

/* The BF16 dot products: from this many rows on the tiles; below, the
 * AVX-512 BF16 kernels, with the same bits. */
enum { AMX_MIN_ROWS_BF = 16 };

bool k3_amx_bf_fits(const k3_mat *w, int64_t n) { return kern() && n >= AMX_MIN_ROWS_BF; }

typedef struct bf_job {
    const k3_amx_ops *k;
    const k3_mat *w;
    const float *x;
    int64_t n, nb;
    uint8_t *xa;
    float *y;
} bf_job;

static void bf_prep_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const bf_job *j = ctx;
    const int64_t cols = j->w->cols;
    for (int64_t t = lo; t < hi; t++) {
        const int64_t nt = j->n - 16 * t < 16 ? j->n - 16 * t : 16;
        const float *xr[16];
        for (int64_t i = 0; i < nt; i++) xr[i] = j->x + (16 * t + i) * cols;
        j->k->prep_bf(xr, nt, cols, j->xa + t * j->nb * 1024);
    }
}

static void bf_rows_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const bf_job *j = ctx;
    j->k->rows_bf(j->w, j->xa, j->n, j->y, j->w->rows, NULL, lo, hi);
}

void k3_amx_bf_call(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y) {
    const k3_amx_ops *k = kern();
    K3_ASSERT(k);
    const int64_t nb = (w->cols + 31) / 32, ntt = (n + 15) / 16;
    uint8_t *xa = k3_scratch(K3_SCRATCH_AMX_X, (size_t)(ntt * nb) * 1024);
    bf_job j = {k, w, x, n, nb, xa, y};
    k3_pool_for(pool, ntt, 1, bf_prep_task, &j);
    k3_pool_for(pool, ((w->rows + 15) / 16 + 1) / 2, 1, bf_rows_task, &j);
}

/* ---- the routed experts on the BF16 dot products ---------------------------------- */

typedef struct moe_bf_job {
    const k3_amx_ops *k;
    const k3_mat *gate, *up, *down;
    const int32_t *eact, *row0, *rows;
    int32_t na, K;
    const float *z;
    int64_t ldz;
    float **yr;
    uint8_t *xa, *ha;
    const int64_t *tile0; /* [na + 1]: each active expert's first token tile */
    int64_t *item0;       /* [na + 1]: each active expert's first item of the phase */
    int64_t nbx, nbh;
    k3_glu_kind kind;
    float b1, b2;
    int phase; /* 0: A tiles of x, 1: gate/up, 2: down */
} moe_bf_job;

static void moe_bf_task(void *ctx, int64_t lo, int64_t hi, int ith) {
    const moe_bf_job *j = ctx;
    int64_t a = 0;
    while (a < j->na && j->item0[a + 1] <= lo) a++;
    for (; a < j->na && j->item0[a] < hi; a++) {
        const int64_t i0 = lo > j->item0[a] ? lo - j->item0[a] : 0;
        const int64_t i1 = (hi < j->item0[a + 1] ? hi : j->item0[a + 1]) - j->item0[a];
        if (i0 >= i1) continue;
        const int e = j->eact[a];
        const int64_t r0 = j->row0[e], m = j->row0[e + 1] - r0;
        const uint8_t *xe = j->xa + j->tile0[a] * j->nbx * 1024;
        uint8_t *he = j->ha + j->tile0[a] * j->nbh * 1024;
        if (j->phase == 0) {
            for (int64_t t = i0; t < i1; t++) {
                const int64_t nt = m - 16 * t < 16 ? m - 16 * t : 16;
                const float *xr[16];
                for (int64_t i = 0; i < nt; i++) xr[i] = j->z + (int64_t)(j->rows[r0 + 16 * t + i] / j->K) * j->ldz;
                j->k->prep_bf(xr, nt, j->gate[e].cols, j->xa + (j->tile0[a] + t) * j->nbx * 1024);
            }
        } else if (j->phase == 1) {
            j->k->up_bf(&j->gate[e], &j->up[e], xe, m, he, i0, i1, j->kind, j->b1, j->b2);
        } else {
            j->k->rows_bf(&j->down[e], he, m, NULL, 0, j->yr + r0, i0, i1);
        }
    }
}

/* The grouped experts take the tiles from this many routed rows per active
 * expert on average: each expert's rows start a tile of 16, so a tile of one
 * or two tokens (a batched decode step, a verify chunk's few positions over
 * many experts) pays the weights' decode into B tiles for one TDPBF16PS,
 * where the AVX-512 BF16 kernels (the same bits) decode them in registers,
 * one expert a thread (docs/amx.md, "Thresholds"). */
enum { AMX_MOE_ROWS_PER_EXPERT = 8 };

bool k3_amx_moe_bf_fits(const k3_mat *gate, const k3_mat *up, const k3_mat *down, const int32_t *eact, int32_t na,
                        int64_t rows) {
    if (!kern() || rows < AMX_MIN_ROWS_BF || na <= 0 || rows < (int64_t)AMX_MOE_ROWS_PER_EXPERT * na) return false;
    const k3_mat *g0 = &gate[eact[0]];
    for (int32_t a = 0; a < na; a++) {
        const k3_mat *g = &gate[eact[a]], *u = &up[eact[a]], *d = &down[eact[a]];
        if (!g->bf16 || !u->bf16 || !d->bf16 || g->rows != g0->rows || g->cols != g0->cols || u->rows != g->rows ||
            u->cols != g->cols || d->cols != g->rows || d->rows != g->cols)
            return false;
    }
    return true;
}

void k3_amx_moe_bf(k3_pool *pool, const k3_mat *gate, const k3_mat *up, const k3_mat *down, const int32_t *eact,
                   int32_t na, const int32_t *row0, const int32_t *rows, int32_t K, const float *z, int64_t ldz,
                   float *y, int64_t ldy, k3_glu_kind kind, float b1, float b2) {
    const k3_amx_ops *k = kern();
    K3_ASSERT(k);
    if (na <= 0) return;
    const int64_t hidden = gate[eact[0]].cols, inter = gate[eact[0]].rows;
    int64_t ntt = 0, nrows = 0;
    for (int32_t a = 0; a < na; a++) {
        const int e = eact[a];
        K3_ASSERT(gate[e].cols == hidden && up[e].cols == hidden && gate[e].rows == inter && up[e].rows == inter);
        K3_ASSERT(down[e].rows == hidden && down[e].cols == inter);
        ntt += (row0[e + 1] - row0[e] + 15) / 16;
        nrows = row0[e + 1] > nrows ? row0[e + 1] : nrows;
    }
    const int64_t nbx = (hidden + 31) / 32, nbh = (inter + 31) / 32;
    const size_t xbytes = (size_t)(ntt * nbx) * 1024, hbytes = (size_t)(ntt * nbh) * 1024;
    uint8_t *xa = k3_scratch(K3_SCRATCH_AMX_X, xbytes);
    uint8_t *ha =
        k3_scratch(K3_SCRATCH_AMX_H, hbytes + sizeof(int64_t) * (size_t)(2 * na + 2) + sizeof(float *) * (size_t)nrows);
    int64_t *tile0 = (int64_t *)(ha + hbytes), *item0 = tile0 + na + 1;
    float **yr = (float **)(item0 + na + 1);
    tile0[0] = 0;
    for (int32_t a = 0; a < na; a++) {
        const int e = eact[a];
        tile0[a + 1] = tile0[a] + (row0[e + 1] - row0[e] + 15) / 16;
        for (int32_t r = row0[e]; r < row0[e + 1]; r++) yr[r] = y + (int64_t)rows[r] * ldy;
    }
    if (inter % 32) memset(ha, 0, hbytes); /* the last block's columns no strip writes */
    moe_bf_job j = {k,  gate, up, down,  eact,  row0, rows, na,   K,  z,  ldz,
                    yr, xa,   ha, tile0, item0, nbx,  nbh,  kind, b1, b2, 0};
    for (j.phase = 0; j.phase < 3; j.phase++) {
        item0[0] = 0;
        for (int32_t a = 0; a < na; a++) {
            const int64_t nt = tile0[a + 1] - tile0[a];
            const int64_t items = j.phase == 0 ? nt : !nt ? 0 : j.phase == 1 ? (inter + 15) / 16 : (hidden + 31) / 32;
            item0[a + 1] = item0[a] + items;
        }
        k3_pool_for(pool, item0[na], 1, moe_bf_task, &j);
    }
}

void k3_amx_mm_call(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y) {
    k3_amx_mat a;
    k3_error err = {0};
    const k3_status s = k3_amx_view(w, &a, &err);
    K3_ASSERT(s == K3_OK); /* the fits above took only the types and shapes k3_amx_view reads */
    k3_amx_matmul(pool, &a, x, n, y);
}
