/*
 * quantize.c -- what is converted once, at load (quant.h): float matrices into
 * the 8-bit formats of --quant, and MXFP4 matrices into the W4A8 tiles
 * (K3_W_MXFP4_R4).
 */
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"

#include <stdlib.h>

#include "common/error.h"

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

/* ---- the W4A8 tiles ----------------------------------------------------------- */

bool k3_mx4_r4_wanted(const k3_mat *src) {
    const k3_wtype_traits *t = k3_wtype_info(K3_W_MXFP4_R4);
    return src->type == K3_W_MXFP4 && src->act8 && src->rows % t->tile_rows == 0 && src->cols % t->tile_cols == 0 &&
           k3_ops()->w4a8_tiles;
}

void k3_mx4_r4_pack(const k3_mat *src, uint8_t *data, uint8_t *scale) {
    const int64_t cols = src->cols;
    const uint8_t *p = src->data;
    for (int64_t r = 0; r < src->rows; r++) {
        for (int64_t c = 0; c < cols; c += 2) data[k3_r4_byte(cols, r, c)] = p[r * (cols / 2) + c / 2];
        for (int64_t c = 0; c < cols; c += 32) scale[k3_r4_scale(cols, r, c)] = src->scale[r * (cols / 32) + c / 32];
    }
}
