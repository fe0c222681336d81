/*
 * quant.c -- 8-bit weight conversion, activation quantization, and the
 * matmul driver for 8-bit activations (see quant.h). The inner loops have a
 * scalar form here and SIMD forms in quant_avx2.c and quant_avx512.c; the
 * number formats are codec.c's.
 */
#include "quant.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/mem.h"
#include "common/pool.h"

/* ---- weight conversion ---------------------------------------------------- */

void k3_quant_q8_mat(const k3_mat *src, int8_t *q, float *scales, int32_t *sums) {
    float *row = malloc(sizeof(float) * (size_t)src->cols);
    K3_ASSERT(row);
    for (int64_t r = 0; r < src->rows; r++) {
        k3_mat_get_row(src, r, row);
        int8_t *qr = q + r * src->cols;
        scales[r] = k3_quant_act_i8(row, src->cols, qr);
        int32_t t = 0;
        for (int64_t c = 0; c < src->cols; c++) t += qr[c];
        sums[r] = t;
    }
    free(row);
}

void k3_quant_mxfp8_mat(const k3_mat *src, uint8_t *q, uint8_t *e) {
    K3_ASSERT(src->cols % 32 == 0);
    float *row = malloc(sizeof(float) * (size_t)src->cols);
    K3_ASSERT(row);
    const int64_t nb = src->cols / 32;
    for (int64_t r = 0; r < src->rows; r++) {
        k3_mat_get_row(src, r, row);
        for (int64_t b = 0; b < nb; b++) k3_mxfp8_block(row + 32 * b, q + r * src->cols + 32 * b, e + r * nb + b);
    }
    free(row);
}

/* ---- activations ------------------------------------------------------------ */

float k3_quant_act_i8_ref(const float *x, int64_t n, int8_t *q) {
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

float k3_quant_act_i8_avx512(const float *x, int64_t n, int8_t *q);
float k3_quant_act_i8_avx2(const float *x, int64_t n, int8_t *q);

static bool have_vnni(void) {
    return k3_kernels_isa() >= K3_ISA_AVX512 && __builtin_cpu_supports("avx512vnni");
}

float k3_quant_act_i8(const float *x, int64_t n, int8_t *q) {
    const k3_isa isa = k3_kernels_isa();
    return isa >= K3_ISA_AVX512 ? k3_quant_act_i8_avx512(x, n, q)
           : isa == K3_ISA_AVX2 ? k3_quant_act_i8_avx2(x, n, q)
                                : k3_quant_act_i8_ref(x, n, q);
}

void k3_mx4_prep_ref(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr) {
    for (int64_t base = 0, g = 0; base < cols; base += 128, g++) {
        const int nb = cols - base >= 128 ? 4 : (int)((cols - base) / 32);
        const int64_t half = 16 * nb;
        for (int i = 0; i < nb; i++)
            for (int j = 0; j < 16; j++) {
                xp[base + 16 * i + j] = xq[base + 32 * i + 2 * j];
                xp[base + half + 16 * i + j] = xq[base + 32 * i + 2 * j + 1];
            }
        for (int l = 0; l < 16; l++) {
            int32_t sum = 0;
            if (l < 4 * nb)
                for (int k = 0; k < 4; k++) sum += xp[base + 4 * l + k] + xp[base + half + 4 * l + k];
            corr[g * 16 + l] = -12 * sum;
        }
    }
}

void k3_mx4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr) {
    if (have_vnni() && __builtin_cpu_supports("avx512vbmi")) k3_mx4_prep_avx512_vbmi(xq, cols, xp, corr);
    else k3_mx4_prep_ref(xq, cols, xp, corr);
}

bool k3_mx4_r4_wanted(const k3_mat *src) {
    /* the AVX-512 VNNI and the AVX2 (plain or AVX-VNNI) kernels read tiles */
    return src->type == K3_W_MXFP4 && src->act8 && src->rows % 4 == 0 && src->cols % 128 == 0 &&
           (have_vnni() || k3_kernels_isa() == K3_ISA_AVX2);
}

void k3_mx4_r4_pack(const k3_mat *src, uint8_t *data, uint8_t *scale) {
    const int64_t cols = src->cols;
    const uint8_t *p = src->data;
    for (int64_t r = 0; r < src->rows; r++) {
        for (int64_t c = 0; c < cols; c += 2) data[k3_r4_byte(cols, r, c)] = p[r * (cols / 2) + c / 2];
        for (int64_t c = 0; c < cols; c += 32) scale[k3_r4_scale(cols, r, c)] = src->scale[r * (cols / 32) + c / 32];
    }
}

void k3_mx4_r4_prep_ref(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr) {
    K3_ASSERT(cols % 128 == 0);
    for (int64_t g = 0; g < cols; g += 128) {
        for (int j = 0; j < 4; j++)
            for (int b = 0; b < 4; b++)
                for (int k = 0; k < 4; k++) {
                    xp[g + 32 * j + 4 * b + k] = xq[g + 32 * b + 8 * j + 2 * k];
                    xp[g + 32 * j + 16 + 4 * b + k] = xq[g + 32 * b + 8 * j + 2 * k + 1];
                }
        for (int b = 0; b < 4; b++) {
            int32_t sum = 0;
            for (int c = 0; c < 32; c++) sum += xq[g + 32 * b + c];
            corr[g / 32 + b] = -12 * sum;
        }
    }
}

void k3_mx4_r4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr) {
    if (have_vnni() && __builtin_cpu_supports("avx512vbmi")) k3_mx4_r4_prep_avx512_vbmi(xq, cols, xp, corr);
    else if (k3_kernels_isa() == K3_ISA_AVX2) k3_mx4_r4_prep_avx2(xq, cols, xp, corr);
    else k3_mx4_r4_prep_ref(xq, cols, xp, corr);
}

void k3_quant_act_mxfp8(float *x, int64_t n) {
    for (int64_t b = 0; b + 32 <= n; b += 32) {
        uint8_t q[32], e;
        k3_mxfp8_block(x + b, q, &e);
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

/* The same for row r of a K3_W_MXFP4_R4 matrix (its bytes found through
 * k3_r4_byte): the path for tiles when the kernel that reads them is not
 * the one running (a lower ISA forced after load). */
static float dot_mxfp4_r4_i8_ref(const k3_mat *w, int64_t r, const int8_t *x) {
    static const int8_t lut[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const uint8_t *p = w->data;
    float acc = 0.0f;
    for (int64_t c0 = 0; c0 < w->cols; c0 += 32) {
        int32_t s = 0;
        for (int64_t c = c0; c < c0 + 32; c += 2) {
            const uint8_t byte = p[k3_r4_byte(w->cols, r, c)];
            s += lut[byte & 15] * x[c] + lut[byte >> 4] * x[c + 1];
        }
        acc += (float)s * k3_e8m0_to_f32(w->scale[k3_r4_scale(w->cols, r, c0)]) * 0.5f;
    }
    return acc;
}

typedef int32_t (*dot_i8_fn)(const int8_t *, const int8_t *, int64_t);
typedef float (*dot_mx_fn)(const uint8_t *, const uint8_t *, const int8_t *, int64_t);
int32_t k3_dot_i8_avx2(const int8_t *a, const int8_t *b, int64_t n);
float k3_dot_mxfp4_i8_avx2(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols);
void k3_q8_rows_avx512(const int8_t *w, const float *row_scale, const int32_t *row_sum, int64_t cols,
                       const uint8_t *xu, const float *xs, int64_t n, int64_t r0, int64_t r1, float *y,
                       int64_t ldy);
typedef void (*mx4_rows_fn)(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp,
                            const int32_t *corr, int64_t ldc, const float *xs, int64_t n, int64_t r0, int64_t r1,
                            float *y, int64_t ldy);
typedef void (*q8_rows_fn)(const int8_t *w, const float *row_scale, const int32_t *row_sum, int64_t cols,
                           const int8_t *x, const float *xs, int64_t n, int64_t r0, int64_t r1, float *y,
                           int64_t ldy);

/* ---- the driver ------------------------------------------------------------- */

static pthread_once_t lut_once = PTHREAD_ONCE_INIT;
static float e4m3_lut[256];

static void lut_init(void) {
    for (int c = 0; c < 256; c++) e4m3_lut[c] = k3_e4m3_to_f32((uint8_t)c);
}

typedef struct {
    const k3_mat *w;
    const int8_t *xq;   /* [n, cols]: int8 (ref, AVX2); +128 (Q8) or k3_mx4_prep order (MXFP4) on AVX-512 */
    const int32_t *corr;/* [n, ldc] MXFP4 on AVX-512 */
    int64_t ldc;
    const float *xs;    /* [n] */
    const float *xf;    /* [n, cols] MXFP8 path */
    int64_t n;
    float *y;
    bool vnni;          /* AVX-512 with VNNI: the W8A8/W4A8 kernels of quant_avx512.c */
    bool a2;            /* AVX2: the W8A8 and tile W4A8 kernels of quant_avx2.c */
    q8_rows_fn q8a2;    /* its W8A8 kernel (AVX-VNNI or plain) */
    mx4_rows_fn mx4a2;  /* its tile kernel */
    bool avx512;        /* AVX-512 (F16C conversion for MXFP8) */
    mx4_rows_fn mx4;    /* the W4A8 kernel (VNNI, with VBMI where present) */
    mx4_rows_fn mx4r4;  /* the same for MXFP4_R4 tiles */
    int64_t unit;       /* rows per pool item: 4 for MXFP4_R4 (whole tiles), else 1 */
    dot_i8_fn dot;
    dot_mx_fn dotmx;
} qjob;

static void q_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const qjob *j = p;
    const k3_mat *w = j->w;
    lo *= j->unit;
    hi *= j->unit;
    const int64_t cols = w->cols, rows = w->rows;
    if (j->vnni && w->type == K3_W_Q8) {
        K3_ASSERT(w->row_sum); /* made by k3_quant_q8_mat */
        k3_q8_rows_avx512(w->data, w->row_scale, w->row_sum, cols, (const uint8_t *)j->xq, j->xs, j->n, lo, hi,
                          j->y, rows);
        return;
    }
    if (j->vnni && w->type == K3_W_MXFP4) {
        j->mx4(w->data, w->scale, cols, j->xq, j->corr, j->ldc, j->xs, j->n, lo, hi, j->y, rows);
        return;
    }
    if (j->vnni && w->type == K3_W_MXFP4_R4) {
        j->mx4r4(w->data, w->scale, cols, j->xq, j->corr, j->ldc, j->xs, j->n, lo, hi, j->y, rows);
        return;
    }
    if (j->a2 && w->type == K3_W_Q8) {
        K3_ASSERT(w->row_sum);
        j->q8a2(w->data, w->row_scale, w->row_sum, cols, j->xq, j->xs, j->n, lo, hi, j->y, rows);
        return;
    }
    if (j->a2 && w->type == K3_W_MXFP4_R4) {
        j->mx4a2(w->data, w->scale, cols, j->xq, j->corr, j->ldc, j->xs, j->n, lo, hi, j->y, rows);
        return;
    }
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
        case K3_W_MXFP4_R4:
            for (int64_t i = 0; i < j->n; i++)
                j->y[i * rows + r] = dot_mxfp4_r4_i8_ref(w, r, j->xq + i * cols) * j->xs[i];
            break;
        case K3_W_MXFP8: {
            for (int64_t c0 = 0; c0 < cols; c0 += 8192) {
                const int64_t len = cols - c0 < 8192 ? cols - c0 : 8192;
                const k3_mat one = k3_mat_rows(w, r, 1);
                /* dequantized row chunk, applied to every token */
                const uint8_t *q = (const uint8_t *)one.data + c0;
                if (j->avx512) {
                    k3_mxfp8_dequant_avx512(q, one.scale + c0 / 32, len, wrow);
                } else if (j->a2) {
                    k3_mxfp8_dequant_avx2(q, one.scale + c0 / 32, len, wrow);
                } else {
                    for (int64_t b = 0; b < len; b += 32) { /* len % 32 == 0 */
                        const float sc = k3_e8m0_to_f32(one.scale[(c0 + b) / 32]);
                        for (int c = 0; c < 32; c++) wrow[b + c] = e4m3_lut[q[b + c]] * sc;
                    }
                }
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
    /* the AVX-512 path needs VNNI (vpdpbusd) on top of what k3_kernels_isa checks */
    const bool vnni = have_vnni();
    const k3_isa isa = vnni ? K3_ISA_AVX512 : k3_kernels_isa() >= K3_ISA_AVX2 ? K3_ISA_AVX2 : K3_ISA_REF;
    const bool a2 = isa == K3_ISA_AVX2, a2vnni = a2 && k3_kernels_avxvnni();
    const int64_t ldc = (cols + 127) / 128 * 16;
    /* scratch: xs [n] | xf or corr [n, cols or ldc] | xq [n, cols] | prepared [n, cols] */
    const size_t fsz = w->type == K3_W_MXFP8 ? (size_t)(n * cols) * sizeof(float) : (size_t)(n * ldc) * sizeof(int32_t);
    pthread_once(&lut_once, lut_init);
    char *buf = k3_scratch(K3_SCRATCH_QUANT, (size_t)n * sizeof(float) + fsz + 2 * (size_t)(n * cols) + 64);
    float *xs = (float *)buf;
    float *xf = (float *)(buf + (size_t)n * sizeof(float));
    int32_t *corr = (int32_t *)xf;
    int8_t *xq = (int8_t *)(buf + (size_t)n * sizeof(float) + fsz), *xp = xq + n * cols;
    const int8_t *xk = xq;
    if (w->type == K3_W_MXFP8) {
        memcpy(xf, x, (size_t)(n * cols) * sizeof(float));
        for (int64_t i = 0; i < n; i++) k3_quant_act_mxfp8(xf + i * cols, cols);
    } else {
        for (int64_t i = 0; i < n; i++) xs[i] = k3_quant_act_i8(x + i * cols, cols, xq + i * cols);
        if ((vnni || a2vnni) && w->type == K3_W_Q8) {
            for (int64_t i = 0; i < n * cols; i++) xp[i] = (int8_t)((uint8_t)xq[i] ^ 0x80); /* x + 128 */
            xk = xp;
        } else if (vnni && w->type == K3_W_MXFP4) {
            for (int64_t i = 0; i < n; i++) k3_mx4_prep(xq + i * cols, cols, xp + i * cols, corr + i * ldc);
            xk = xp;
        } else if ((vnni || a2) && w->type == K3_W_MXFP4_R4) {
            for (int64_t i = 0; i < n; i++) k3_mx4_r4_prep(xq + i * cols, cols, xp + i * cols, corr + i * ldc);
            xk = xp;
        }
    }
    const bool vbmi = __builtin_cpu_supports("avx512vbmi");
    qjob j = {w, xk, corr, ldc, xs, xf, n, y, vnni, a2,
              a2vnni ? k3_q8_rows_avxvnni : k3_q8_rows_avx2,
              a2vnni ? k3_mx4_r4_rows_avxvnni : k3_mx4_r4_rows_avx2,
              k3_kernels_isa() >= K3_ISA_AVX512,
              vbmi ? k3_mx4_rows_avx512_vbmi : k3_mx4_rows_avx512,
              vbmi ? k3_mx4_r4_rows_avx512_vbmi : k3_mx4_r4_rows_avx512,
              w->type == K3_W_MXFP4_R4 ? 4 : 1,
              isa >= K3_ISA_AVX2 ? k3_dot_i8_avx2 : dot_i8_ref,
              isa >= K3_ISA_AVX2 ? k3_dot_mxfp4_i8_avx2 : dot_mxfp4_i8_ref};
    k3_pool_for(pool, w->rows / j.unit, 16 / j.unit, q_rows, &j);
}

void k3_matmul_q_ref(const k3_mat *w, const float *x, int64_t n, float *y) {
    const int64_t cols = w->cols;
    float *xd = malloc(sizeof(float) * (size_t)cols), *wr = malloc(sizeof(float) * (size_t)cols);
    int8_t *xq = malloc((size_t)cols);
    K3_ASSERT(xd && wr && xq);
    for (int64_t i = 0; i < n; i++) {
        memcpy(xd, x + i * cols, sizeof(float) * (size_t)cols);
        if (k3_wtype_info(w->type)->act_mxfp8) {
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
