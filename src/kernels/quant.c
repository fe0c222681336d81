/*
 * quant.c -- 8-bit weight conversion, activation quantization, and the
 * matmul driver for 8-bit activations (see quant.h). The inner loops have a
 * scalar form here and an AVX2 form in quant_avx2.c.
 */
#include "quant.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/pool.h"

/* ---- FP8 E4M3 ------------------------------------------------------------ */

float k3_e4m3_to_f32(uint8_t c) {
    const int e = (c >> 3) & 15, f = c & 7;
    if (e == 15 && f == 7) return NAN;
    const float v = e ? ldexpf((float)(8 + f), e - 10) : ldexpf((float)f, -9);
    return c & 0x80 ? -v : v;
}

uint8_t k3_f32_to_e4m3(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (isnan(a)) return 0x7F;
    if (a >= 448.0f) return sign | 0x7E;
    if (a == 0.0f) return sign;
    int e2;
    frexpf(a, &e2);             /* a = m 2^e2, m in [0.5, 1) */
    int E = e2 - 1 + 7;         /* biased exponent of a normal E4M3 */
    unsigned code;
    if (E < 1) {
        /* subnormal: units of 2^-9; 8 units roll over into E = 1, f = 0 */
        code = (unsigned)nearbyintf(a * 512.0f);
    } else {
        const float f = nearbyintf((ldexpf(a, 7 - E) - 1.0f) * 8.0f); /* 0..8 */
        code = ((unsigned)E << 3) + (unsigned)f; /* f = 8 carries into E */
    }
    if (code > 0x7E) code = 0x7E;
    return (uint8_t)(sign | code);
}

/* ---- weight conversion ---------------------------------------------------- */

void k3_quant_q8_mat(const k3_mat *src, int8_t *q, float *scales) {
    float *row = malloc(sizeof(float) * (size_t)src->cols);
    K3_ASSERT(row);
    for (int64_t r = 0; r < src->rows; r++) {
        k3_mat_get_row(src, r, row);
        scales[r] = k3_quant_act_i8(row, src->cols, q + r * src->cols);
    }
    free(row);
}

/* E8M0 exponent for a block with max |x| = amax and element max emax_exp
 * (E4M3: 8): X = 2^(floor(log2 amax) - emax_exp), byte = that + 127. */
static uint8_t mx_scale_byte(float amax, int emax_exp) {
    if (!(amax > 0.0f)) return 127 - 20; /* all zero: any scale works */
    int e2;
    frexpf(amax, &e2);
    int b = (e2 - 1) - emax_exp + 127;
    return (uint8_t)(b < 0 ? 0 : b > 254 ? 254 : b);
}

static void mxfp8_block(const float *x, uint8_t *q, uint8_t *e) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    *e = mx_scale_byte(amax, 8);
    const float inv = 1.0f / k3_e8m0_to_f32(*e);
    for (int i = 0; i < 32; i++) q[i] = k3_f32_to_e4m3(x[i] * inv);
}

void k3_quant_mxfp8_mat(const k3_mat *src, uint8_t *q, uint8_t *e) {
    K3_ASSERT(src->cols % 32 == 0);
    float *row = malloc(sizeof(float) * (size_t)src->cols);
    K3_ASSERT(row);
    const int64_t nb = src->cols / 32;
    for (int64_t r = 0; r < src->rows; r++) {
        k3_mat_get_row(src, r, row);
        for (int64_t b = 0; b < nb; b++) mxfp8_block(row + 32 * b, q + r * src->cols + 32 * b, e + r * nb + b);
    }
    free(row);
}

/* ---- activations ------------------------------------------------------------ */

float k3_quant_act_i8(const float *x, int64_t n, int8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (amax == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    const float inv = 127.0f / amax;
    for (int64_t i = 0; i < n; i++) {
        float v = nearbyintf(x[i] * inv);
        q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : v);
    }
    return amax / 127.0f;
}

void k3_quant_act_mxfp8(float *x, int64_t n) {
    for (int64_t b = 0; b + 32 <= n; b += 32) {
        uint8_t q[32], e;
        mxfp8_block(x + b, q, &e);
        const float s = k3_e8m0_to_f32(e);
        for (int i = 0; i < 32; i++) x[b + i] = k3_e4m3_to_f32(q[i]) * s;
    }
}

/* ---- inner loops ------------------------------------------------------------- */

/* int8 dot, n any */
static int32_t dot_i8_ref(const int8_t *a, const int8_t *b, int64_t n) {
    int32_t s = 0;
    for (int64_t i = 0; i < n; i++) s += (int32_t)a[i] * b[i];
    return s;
}

/* Σ_blocks 2^(e_b-128) · <x8 block, 2·e2m1 block> for one MXFP4 row:
 * the doubled E2M1 values are integers, so each block dot is exact. */
static float dot_mxfp4_i8_ref(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols) {
    static const int8_t lut[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    float acc = 0.0f;
    for (int64_t b = 0; b < cols / 32; b++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) {
            const uint8_t byte = packed[16 * b + j];
            s += lut[byte & 15] * x[32 * b + 2 * j] + lut[byte >> 4] * x[32 * b + 2 * j + 1];
        }
        acc += (float)s * k3_e8m0_to_f32(scale[b]) * 0.5f;
    }
    return acc;
}

typedef int32_t (*dot_i8_fn)(const int8_t *, const int8_t *, int64_t);
typedef float (*dot_mx_fn)(const uint8_t *, const uint8_t *, const int8_t *, int64_t);
int32_t k3_dot_i8_avx2(const int8_t *a, const int8_t *b, int64_t n);
float k3_dot_mxfp4_i8_avx2(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols);
int32_t k3_dot_i8_avx512(const int8_t *a, const int8_t *b, int64_t n);
float k3_dot_mxfp4_i8_avx512(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols);

/* ---- the driver ------------------------------------------------------------- */

/* Per-thread scratch for the quantized activations, grown on first use (no
 * allocation in steady state) and freed when its thread exits. */
typedef struct {
    int8_t *xq;
    float *xf;
    size_t cap;
} qscratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    qscratch *q = p;
    free(q->xq);
    free(q->xf);
    free(q);
}

static void scratch_make_key(void) { K3_ASSERT(pthread_key_create(&scratch_key, scratch_free) == 0); }

static qscratch *scratch_get(size_t need, int64_t n) {
    pthread_once(&scratch_once, scratch_make_key);
    qscratch *q = pthread_getspecific(scratch_key);
    if (!q) {
        q = calloc(1, sizeof *q);
        K3_ASSERT(q && pthread_setspecific(scratch_key, q) == 0);
    }
    if (need > q->cap) {
        int8_t *xq = realloc(q->xq, need);
        K3_ASSERT(xq);
        q->xq = xq;
        float *xf = realloc(q->xf, need * sizeof(float) + (size_t)n * sizeof(float));
        K3_ASSERT(xf);
        q->xf = xf;
        q->cap = need;
    }
    return q;
}

typedef struct {
    const k3_mat *w;
    const int8_t *xq;   /* [n, cols] */
    const float *xs;    /* [n] */
    const float *xf;    /* [n, cols] MXFP8 path */
    int64_t n;
    float *y;
    dot_i8_fn dot;
    dot_mx_fn dotmx;
} qjob;

static void q_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const qjob *j = p;
    const k3_mat *w = j->w;
    const int64_t cols = w->cols, rows = w->rows;
    float wrow[8192];
    for (int64_t r = lo; r < hi; r++) {
        switch (w->type) {
        case K3_W_Q8: {
            const int8_t *wr = (const int8_t *)w->data + r * cols;
            for (int64_t i = 0; i < j->n; i++)
                j->y[i * rows + r] = (float)j->dot(j->xq + i * cols, wr, cols) * j->xs[i] * w->row_scale[r];
            break;
        }
        case K3_W_MXFP4: {
            const uint8_t *pr = (const uint8_t *)w->data + r * (cols / 2), *sr = w->scale + r * (cols / 32);
            for (int64_t i = 0; i < j->n; i++)
                j->y[i * rows + r] = j->dotmx(pr, sr, j->xq + i * cols, cols) * j->xs[i];
            break;
        }
        case K3_W_MXFP8: {
            for (int64_t c0 = 0; c0 < cols; c0 += 8192) {
                const int64_t len = cols - c0 < 8192 ? cols - c0 : 8192;
                const k3_mat one = k3_mat_rows(w, r, 1);
                /* dequantized row chunk, applied to every token */
                const uint8_t *q = (const uint8_t *)one.data + c0;
                for (int64_t c = 0; c < len; c++)
                    wrow[c] = k3_e4m3_to_f32(q[c]) * k3_e8m0_to_f32(one.scale[(c0 + c) / 32]);
                for (int64_t i = 0; i < j->n; i++) {
                    const float d = k3_dot(j->xf + i * cols + c0, wrow, len);
                    j->y[i * rows + r] = c0 ? j->y[i * rows + r] + d : d;
                }
            }
            break;
        }
        default:
            K3_ASSERT(!"k3_matmul_q: weight type without an 8-bit path");
        }
    }
}

void k3_matmul_q(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y) {
    const int64_t cols = w->cols;
    /* room for n rows, and n scales after them, whatever n was before */
    const size_t need = (size_t)(n * cols) + (size_t)n;
    qscratch *q = scratch_get(need, n);
    int8_t *tl_xq = q->xq;
    float *tl_xf = q->xf;
    float *xs = tl_xf + (size_t)(n * cols); /* after the MXFP8 rows */
    if (w->type == K3_W_MXFP8) {
        memcpy(tl_xf, x, (size_t)(n * cols) * sizeof(float));
        for (int64_t i = 0; i < n; i++) k3_quant_act_mxfp8(tl_xf + i * cols, cols);
    } else {
        for (int64_t i = 0; i < n; i++) xs[i] = k3_quant_act_i8(x + i * cols, cols, tl_xq + i * cols);
    }
    k3_isa isa = k3_kernels_isa();
    /* the AVX-512 path needs VNNI (vpdpbusd) on top of what k3_kernels_isa checks */
    if (isa >= K3_ISA_AVX512 && !__builtin_cpu_supports("avx512vnni")) isa = K3_ISA_AVX2;
    qjob j = {w, tl_xq, xs, tl_xf, n, y,
              isa >= K3_ISA_AVX512 ? k3_dot_i8_avx512 : isa >= K3_ISA_AVX2 ? k3_dot_i8_avx2 : dot_i8_ref,
              isa >= K3_ISA_AVX512 ? k3_dot_mxfp4_i8_avx512
              : isa >= K3_ISA_AVX2 ? k3_dot_mxfp4_i8_avx2 : dot_mxfp4_i8_ref};
    k3_pool_for(pool, w->rows, 16, q_rows, &j);
}

void k3_matmul_q_ref(const k3_mat *w, const float *x, int64_t n, float *y) {
    const int64_t cols = w->cols;
    float *xd = malloc(sizeof(float) * (size_t)cols), *wr = malloc(sizeof(float) * (size_t)cols);
    int8_t *xq = malloc((size_t)cols);
    K3_ASSERT(xd && wr && xq);
    for (int64_t i = 0; i < n; i++) {
        memcpy(xd, x + i * cols, sizeof(float) * (size_t)cols);
        if (w->type == K3_W_MXFP8) {
            k3_quant_act_mxfp8(xd, cols);
        } else {
            const float s = k3_quant_act_i8(xd, cols, xq);
            for (int64_t c = 0; c < cols; c++) xd[c] = xq[c] * s;
        }
        for (int64_t r = 0; r < w->rows; r++) {
            k3_mat_get_row(w, r, wr);
            double acc = 0.0;
            for (int64_t c = 0; c < cols; c++) acc += (double)xd[c] * wr[c];
            y[i * w->rows + r] = (float)acc;
        }
    }
    free(xd);
    free(wr);
    free(xq);
}
