/*
 * quantize.c -- what is converted once, at load (quant.h): float matrices into
 * the 8-bit formats of --quant (k3_quantize_mat, for the model and the vision
 * tower alike), and MXFP4 matrices into the W4A8 tiles (K3_W_MXFP4_R4).
 */
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- k3_quantize_mat ---------------------------------------------------------- */

static void to_q8(const k3_mat *src, k3_mat *dst) {
    k3_quant_q8_mat(src, (int8_t *)dst->data, (float *)dst->row_scale, (int32_t *)dst->row_sum);
}

static void to_mxfp8(const k3_mat *src, k3_mat *dst) {
    k3_quant_mxfp8_mat(src, (uint8_t *)dst->data, (uint8_t *)dst->scale);
}

/* The --quant modes for float matrices: their names, the type they make
 * (its geometry is the weight-type table's) and the converter that fills
 * its arrays. */
static const struct {
    const char *name, *alias;
    k3_wtype type;
    void (*convert)(const k3_mat *src, k3_mat *dst);
} modes[] = {
    [K3_WQ_NONE] = {"none"},
    [K3_WQ_INT8] = {"w8a8", "w8a8-int8", K3_W_Q8, to_q8},
    [K3_WQ_MXFP8] = {"w8a8-mxfp8", "mxfp8", K3_W_MXFP8, to_mxfp8},
};
enum { N_MODES = sizeof modes / sizeof modes[0] };

const char *k3_quant_mode_name(k3_wquant q) {
    return (int)q >= 0 && (int)q < N_MODES && modes[q].name ? modes[q].name : "unknown";
}

bool k3_quant_mode_of(const char *name, k3_wquant *q) {
    for (int i = 1; i < N_MODES; i++)
        if (modes[i].name && (!strcmp(name, modes[i].name) || (modes[i].alias && !strcmp(name, modes[i].alias)))) {
            *q = (k3_wquant)i;
            return true;
        }
    return false;
}

void k3_quant_mode_list(char *buf, size_t size) {
    size_t at = 0;
    buf[0] = 0;
    for (int i = 1; i < N_MODES && at < size; i++)
        if (modes[i].name) at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? ", " : "", modes[i].name);
}

k3_status k3_quantize_mat(k3_mat *w, k3_wquant q, k3_quant_alloc_fn alloc, void *ctx, k3_error *err) {
    if ((int)q <= K3_WQ_NONE || (int)q >= N_MODES || !modes[q].convert) return K3_OK;
    if (!w->data || !k3_wtype_info(w->type)->is_float) return K3_OK;
    k3_mat d = {.type = modes[q].type, .rows = w->rows, .cols = w->cols};
    const k3_wtype_traits *ti = k3_wtype_info(d.type);
    if (ti->block && w->cols % ti->block) return K3_OK; /* stays as stored */
    void *data = alloc(ctx, k3_mat_data_bytes(&d)), *rs = NULL, *sum = NULL, *sc = NULL;
    if (data && ti->row_scale) rs = alloc(ctx, sizeof(float) * (size_t)d.rows);
    if (rs) sum = alloc(ctx, sizeof(int32_t) * (size_t)d.rows);
    if (data && ti->block) sc = alloc(ctx, k3_mat_scale_bytes(&d));
    if (!data || (ti->row_scale && !sum) || (ti->block && !sc))
        return k3_err(err, K3_ERR_NOMEM, "quant: out of memory for a %lld x %lld %s matrix", (long long)w->rows,
                      (long long)w->cols, ti->name);
    d.data = data;
    d.row_scale = rs;
    d.row_sum = sum;
    d.scale = sc;
    modes[q].convert(w, &d);
    *w = d;
    return K3_OK;
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

/* ---- the strips of the BF16 dot products ---------------------------------------- */

bool k3_bf16_mat_ok(const k3_mat *w) {
    if (!w->data || w->rows < 1 || w->cols < 1) return false;
    if (w->type == K3_W_BF16) return true;
    if (w->type != K3_W_MXFP4 || w->cols % 32) return false;
    const int64_t nb = w->cols / 32;
    const uint8_t *p = w->data;
    for (int64_t r = 0; r < w->rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t e = w->scale[r * nb + b];
            if (e == 255) return false;
            if (e >= 2 && e <= 252) continue;
            const uint8_t *q = p + r * (w->cols / 2) + 16 * b;
            for (int i = 0; i < 16; i++)
                if (q[i] & 0x77) return false; /* a code other than +-0 */
        }
    return true;
}

bool k3_s16_ok(const k3_mat *w) {
    return w->data && (w->type == K3_W_BF16 || w->type == K3_W_MXFP4) && w->rows > 0 && w->rows % 16 == 0 &&
        w->cols > 0 && w->cols % 32 == 0;
}

void k3_s16_pack(const k3_mat *w, uint8_t *data, uint8_t *scale) {
    K3_ASSERT(k3_s16_ok(w));
    const int64_t cols = w->cols, nb = cols / 32;
    if (w->type == K3_W_BF16) {
        const uint16_t *src = w->data;
        uint16_t *dst = (uint16_t *)data;
        for (int64_t r = 0; r < w->rows; r++)
            for (int64_t c = 0; c < cols; c++) dst[k3_s16_bf16_at(cols, r, c)] = src[r * cols + c];
        return;
    }
    /* quad g of a row's block holds its bytes 4g + 1, 4g + 3, 4g, 4g + 2 */
    const uint8_t *src = w->data;
    for (int64_t r = 0; r < w->rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = src + r * (cols / 2) + 16 * b;
            bool zero = true;
            for (int g = 0; g < 4; g++) {
                uint8_t *at = data + k3_s16_mx4_nib(cols, r, 32 * b + 8 * g + 2) / 2; /* nibbles 0, 1 */
                at[0] = q[4 * g + 1];
                at[1] = q[4 * g + 3];
                at[2] = q[4 * g];
                at[3] = q[4 * g + 2];
                zero = zero && !((q[4 * g] | q[4 * g + 1] | q[4 * g + 2] | q[4 * g + 3]) & 0x77);
            }
            scale[k3_s16_mx4_scale(cols, r, 32 * b)] = zero ? 127 : w->scale[r * nb + b];
        }
}
