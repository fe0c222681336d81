/*
 * quant.c -- the scalar forms of the 8-bit kernels (quant.h): the
 * activation quantizer and the W4A8 orders, which the SIMD forms equal bit
 * for bit; the "ref" table's W8A8 and W4A8 rows (exact integer dots per row);
 * the row-at-a-time W4A8 and MXFP8 rows that run on the table's own dot and
 * decode; and k3_matmul_q_ref, the dequantize-then-fp32 reference all of them
 * are held to.
 */
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

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

void k3_quant_act_mxfp8(float *x, int64_t n) {
    for (int64_t b = 0; b + 32 <= n; b += 32) {
        uint8_t q[32], e;
        k3_mxfp8_block(x + b, q, &e);
        const float s = k3_e8m0_to_f32(e);
        for (int i = 0; i < 32; i++) x[b + i] = k3_e4m3_to_f32(q[i]) * s;
    }
}

/* ---- the "ref" table's rows --------------------------------------------------- */

/* int8 dot, n any */
static int32_t dot_i8(const int8_t *a, const int8_t *b, int64_t n) {
    int32_t s = 0;
    for (int64_t i = 0; i < n; i++) s += (int32_t)a[i] * b[i];
    return s;
}

static const int8_t e2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Σ_blocks 2^(e_b-128) · <x8 block, 2·e2m1 block> for one MXFP4 row:
 * the doubled E2M1 values are integers, so each block dot is exact. */
float k3_mx4_dot_ref(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols) {
    float acc = 0.0f;
    for (int64_t b = 0; b < cols / 32; b++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) {
            const uint8_t byte = packed[16 * b + j];
            s += e2m1x2[byte & 15] * x[32 * b + 2 * j] + e2m1x2[byte >> 4] * x[32 * b + 2 * j + 1];
        }
        acc += (float)s * k3_e8m0_to_f32(scale[b]) * 0.5f;
    }
    return acc;
}

/* The same for row r of a K3_W_MXFP4_R4 matrix (its bytes found through
 * k3_r4_byte): the path for tiles when the kernel that reads them is not the
 * one running (a lower ISA forced after load). */
static float dot_mxfp4_r4_i8(const k3_mat *w, int64_t r, const int8_t *x) {
    const uint8_t *p = w->data;
    float acc = 0.0f;
    for (int64_t c0 = 0; c0 < w->cols; c0 += 32) {
        int32_t s = 0;
        for (int64_t c = c0; c < c0 + 32; c += 2) {
            const uint8_t byte = p[k3_r4_byte(w->cols, r, c)];
            s += e2m1x2[byte & 15] * x[c] + e2m1x2[byte >> 4] * x[c + 1];
        }
        acc += (float)s * k3_e8m0_to_f32(w->scale[k3_r4_scale(w->cols, r, c0)]) * 0.5f;
    }
    return acc;
}

void k3_q8_rows_ref(const k3_qjob *j, int64_t r0, int64_t r1) {
    const k3_mat *w = j->w;
    const int64_t cols = w->cols, rows = w->rows;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = (const int8_t *)w->data + r * cols;
        for (int64_t i = 0; i < j->n; i++)
            j->y[i * rows + r] = (float)dot_i8(j->xq + i * cols, wr, cols) * j->xs[i] * w->row_scale[r];
    }
}

/* W4A8 on the stored MXFP4 layout a row at a time (K3_QX_I8), with the
 * table's row dot: the "ref" and AVX2 tables', for matrices that are not
 * tiled (rows % 4, cols % 128, or a lower ISA forced after load). */
void k3_mx4_rows(const k3_qjob *j, int64_t r0, int64_t r1) {
    const k3_mat *w = j->w;
    const int64_t cols = w->cols, rows = w->rows;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *pr = (const uint8_t *)w->data + r * (cols / 2), *sr = w->scale + r * (cols / 32);
        for (int64_t i = 0; i < j->n; i++)
            j->y[i * rows + r] = j->ops->mx4_dot(pr, sr, j->xq + i * cols, cols) * j->xs[i];
    }
}

void k3_mx4_r4_rows_ref(const k3_qjob *j, int64_t r0, int64_t r1) {
    const k3_mat *w = j->w;
    const int64_t cols = w->cols, rows = w->rows;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < j->n; i++) j->y[i * rows + r] = dot_mxfp4_r4_i8(w, r, j->xq + i * cols) * j->xs[i];
}

/* ---- MXFP8 ---------------------------------------------------------------------- */

static pthread_once_t lut_once = PTHREAD_ONCE_INIT;
static float e4m3_lut[256];

static void lut_init(void) {
    for (int c = 0; c < 256; c++) e4m3_lut[c] = k3_e4m3_to_f32((uint8_t)c);
}

void k3_mxfp8_dequant_ref(const uint8_t *q, const uint8_t *e, int64_t len, float *out) {
    pthread_once(&lut_once, lut_init);
    for (int64_t b = 0; b < len; b += 32) { /* len % 32 == 0 */
        const float sc = k3_e8m0_to_f32(e[b / 32]);
        for (int c = 0; c < 32; c++) out[b + c] = e4m3_lut[q[b + c]] * sc;
    }
}

/* Each row dequantized in chunks of up to 8192 columns by the table's decode,
 * every chunk applied to every token with the table's dot (the activations
 * fake-quantized per block: K3_QX_MXFP8). */
void k3_mxfp8_rows(const k3_qjob *j, int64_t r0, int64_t r1) {
    const k3_mat *w = j->w;
    const int64_t cols = w->cols, rows = w->rows;
    float wrow[8192];
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c0 = 0; c0 < cols; c0 += 8192) {
            const int64_t len = cols - c0 < 8192 ? cols - c0 : 8192;
            const k3_mat one = k3_mat_rows(w, r, 1);
            j->ops->mxfp8_dequant((const uint8_t *)one.data + c0, one.scale + c0 / 32, len, wrow);
            for (int64_t i = 0; i < j->n; i++) {
                const float d = j->ops->dot(j->xf + i * cols + c0, wrow, len);
                j->y[i * rows + r] = c0 ? j->y[i * rows + r] + d : d;
            }
        }
}

/* ---- the reference -------------------------------------------------------------- */

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
            const float s = k3_quant_act_i8_ref(xd, cols, xq);
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
