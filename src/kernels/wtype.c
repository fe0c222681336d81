/*
 * wtype.c -- the weight-type table (kernels.h: k3_wtype_traits): one row per
 * k3_wtype with its geometry, which activations its kernels take, and its row
 * dequantizer, which is the scalar decode of the type (k3_matmul_ref and
 * k3_matmul_q_ref are built on it, and every SIMD decode is tested against
 * it). k3_mat's helpers below read only the table.
 */
#include "kernels/kernels.h"
#include "common/error.h"

#include <string.h>

/* ---- row dequantizers: columns [c0, c0 + len) of row r ------------------- */

static void row_f32(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    memcpy(out, (const float *)w->data + r * w->cols + c0, (size_t)len * sizeof *out);
}

static void row_f16(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const uint16_t *p = (const uint16_t *)w->data + r * w->cols + c0;
    for (int64_t c = 0; c < len; c++) out[c] = k3_f16_to_f32(p[c]);
}

static void row_bf16(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const uint16_t *p = (const uint16_t *)w->data + r * w->cols + c0;
    for (int64_t c = 0; c < len; c++) out[c] = k3_bf16_to_f32(p[c]);
}

static void row_mxfp4(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const int64_t cols = w->cols;
    const uint8_t *p = (const uint8_t *)w->data + r * (cols / 2);
    const uint8_t *s = w->scale + r * (cols / 32);
    for (int64_t c = c0; c < c0 + len; c++) {
        uint8_t b = p[c / 2];
        uint8_t code = (c & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 15);
        out[c - c0] = k3_e2m1_to_f32(code) * k3_e8m0_to_f32(s[c / 32]);
    }
}

static void row_q8(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const int8_t *p = (const int8_t *)w->data + r * w->cols + c0;
    for (int64_t c = 0; c < len; c++) out[c] = p[c] * w->row_scale[r];
}

static void row_mxfp8(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const int64_t cols = w->cols;
    const uint8_t *p = (const uint8_t *)w->data + r * cols;
    const uint8_t *s = w->scale + r * (cols / 32);
    for (int64_t c = c0; c < c0 + len; c++) out[c - c0] = k3_e4m3_to_f32(p[c]) * k3_e8m0_to_f32(s[c / 32]);
}

static void row_mxfp4_r4(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const int64_t cols = w->cols;
    const uint8_t *p = w->data;
    for (int64_t c = c0; c < c0 + len; c++) {
        uint8_t b = p[k3_r4_byte(cols, r, c & ~(int64_t)1)];
        uint8_t code = (c & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 15);
        out[c - c0] = k3_e2m1_to_f32(code) * k3_e8m0_to_f32(w->scale[k3_r4_scale(cols, r, c)]);
    }
}

static void row_bf16_s16(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const uint16_t *p = w->data;
    for (int64_t c = c0; c < c0 + len; c++) out[c - c0] = k3_bf16_to_f32(p[k3_s16_bf16_at(w->cols, r, c)]);
}

/* A code of 0 (either sign) is zero whatever its block's scale: the decoders
 * of the strips add the scale's exponent to the nonzero codes only. */
static void row_mxfp4_s16(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const uint8_t *p = w->data;
    for (int64_t c = c0; c < c0 + len; c++) {
        const int64_t at = k3_s16_mx4_nib(w->cols, r, c);
        const uint8_t code = (uint8_t)(p[at / 2] >> (at % 2 * 4) & 15);
        const float v = k3_e2m1_to_f32(code);
        out[c - c0] = v == 0.0f ? v : v * k3_e8m0_to_f32(w->scale[k3_s16_mx4_scale(w->cols, r, c)]);
    }
}

/* ---- the table ---------------------------------------------------------------- */

static const k3_wtype_traits table[] = {
    [K3_W_F32] = {.name = "f32",
                  .bits = 32,
                  .is_float = true,
                  .tile_rows = 1,
                  .tile_cols = 1,
                  .acts = K3_ACTS_F32,
                  .get_row = row_f32},
    [K3_W_F16] = {.name = "f16",
                  .bits = 16,
                  .is_float = true,
                  .tile_rows = 1,
                  .tile_cols = 1,
                  .acts = K3_ACTS_F32,
                  .get_row = row_f16},
    /* fp32 activations, or BF16 ones where k3_mat.bf16 asks */
    [K3_W_BF16] = {.name = "bf16",
                   .bits = 16,
                   .is_float = true,
                   .tile_rows = 1,
                   .tile_cols = 1,
                   .acts = K3_ACTS_F32 | K3_ACTS_BF16,
                   .get_row = row_bf16},
    /* fp32 activations, or 8-bit ones (W4A8) where k3_mat.act8 asks, or BF16
     * ones where k3_mat.bf16 does */
    [K3_W_MXFP4] = {.name = "mxfp4",
                    .bits = 4,
                    .block = 32,
                    .tile_rows = 1,
                    .tile_cols = 1,
                    .acts = K3_ACTS_F32 | K3_ACTS_8BIT | K3_ACTS_BF16,
                    .get_row = row_mxfp4},
    [K3_W_Q8] = {.name = "q8",
                 .bits = 8,
                 .row_scale = true,
                 .tile_rows = 1,
                 .tile_cols = 1,
                 .acts = K3_ACTS_8BIT,
                 .get_row = row_q8},
    [K3_W_MXFP8] = {.name = "mxfp8",
                    .bits = 8,
                    .block = 32,
                    .tile_rows = 1,
                    .tile_cols = 1,
                    .acts = K3_ACTS_8BIT,
                    .act_mxfp8 = true,
                    .get_row = row_mxfp8},
    /* a tile's bytes and scales are its rows' (k3_r4_byte): 4 rows x 128 columns */
    [K3_W_MXFP4_R4] = {.name = "mxfp4-r4",
                       .bits = 4,
                       .block = 32,
                       .tile_rows = 4,
                       .tile_cols = 128,
                       .acts = K3_ACTS_8BIT,
                       .get_row = row_mxfp4_r4},
    /* the strips of the BF16 dot products (kernels.h): 16 rows x 32 columns */
    [K3_W_BF16_S16] = {.name = "bf16-s16",
                       .bits = 16,
                       .tile_rows = 16,
                       .tile_cols = 32,
                       .acts = K3_ACTS_BF16,
                       .get_row = row_bf16_s16},
    [K3_W_MXFP4_S16] = {.name = "mxfp4-s16",
                        .bits = 4,
                        .block = 32,
                        .tile_rows = 16,
                        .tile_cols = 32,
                        .acts = K3_ACTS_BF16,
                        .get_row = row_mxfp4_s16},
};
_Static_assert(sizeof table / sizeof table[0] == K3_W_COUNT, "a row per k3_wtype");

const k3_wtype_traits *k3_wtype_info(k3_wtype t) {
    K3_ASSERT((int)t >= 0 && t < K3_W_COUNT && table[t].name);
    return &table[t];
}

/* ---- k3_mat ------------------------------------------------------------------ */

size_t k3_mat_row_bytes(const k3_mat *w) {
    const k3_wtype_traits *ti = k3_wtype_info(w->type);
    const size_t c = (size_t)w->cols;
    return c * (size_t)ti->bits / 8 + (ti->block ? c / (size_t)ti->block : 0) + (ti->row_scale ? sizeof(float) : 0);
}

size_t k3_mat_data_bytes(const k3_mat *w) {
    return (size_t)w->rows * ((size_t)w->cols * (size_t)k3_wtype_info(w->type)->bits / 8);
}

size_t k3_mat_scale_bytes(const k3_mat *w) {
    const int block = k3_wtype_info(w->type)->block;
    return block ? (size_t)w->rows * ((size_t)w->cols / (size_t)block) : 0;
}

k3_mat k3_mat_rows(const k3_mat *w, int64_t r0, int64_t n) {
    const k3_wtype_traits *ti = k3_wtype_info(w->type);
    K3_ASSERT(r0 >= 0 && n >= 0 && r0 + n <= w->rows);
    K3_ASSERT(r0 % ti->tile_rows == 0 && n % ti->tile_rows == 0); /* whole tiles */
    k3_mat v = *w;
    v.rows = n;
    v.data = (const uint8_t *)w->data + (size_t)r0 * ((size_t)w->cols * (size_t)ti->bits / 8);
    if (ti->block) v.scale = w->scale + r0 * (w->cols / ti->block);
    if (ti->row_scale) {
        v.row_scale = w->row_scale + r0;
        if (w->row_sum) v.row_sum = w->row_sum + r0;
    }
    return v;
}

bool k3_mat_wrange(const k3_mat *w) {
    bool ok = true;
    if (w->type == K3_W_BF16 || w->type == K3_W_BF16_S16) {
        /* |w| in [2^(e-127), 2^(e-126)): exponents 63..190 */
        const uint16_t *p = w->data;
        const size_t n = (size_t)w->rows * (size_t)w->cols;
        for (size_t i = 0; i < n; i++) {
            const unsigned e = p[i] >> 7 & 0xff;
            ok &= e == 0 || (e >= 63 && e <= 190);
        }
        return ok;
    }
    if (w->type == K3_W_MXFP4 || w->type == K3_W_MXFP4_S16) {
        /* codes 0.5..6 times 2^(e-127): |w| in [2^(e-128), 2^(e-124)); the
         * FMA kernels take the scale at a block's end, so they need the
         * scaled sums normal too: scales 69..187 wherever a row's block has
         * a nonzero code (a block of zeros may carry any finite scale).
         * A stored block's 16 bytes follow its scale's index; a strip
         * block's row r has 4 bytes in each of its 4 quads of 64
         * (kernels.h). */
        const uint8_t *d = w->data;
        const size_t n = k3_mat_scale_bytes(w);
        const bool s16 = w->type == K3_W_MXFP4_S16;
        for (size_t i = 0; i < n; i++) {
            if (w->scale[i] >= 69 && w->scale[i] <= 187) continue;
            ok &= w->scale[i] != 255;
            unsigned nz = 0;
            for (int k = 0; k < 16; k++) {
                const uint8_t b =
                    s16 ? d[i / 16 * 256 + (size_t)k / 4 * 64 + i % 16 * 4 + (size_t)k % 4] : d[16 * i + k];
                nz |= (b & 0x77u);
            }
            ok &= nz == 0;
        }
        return ok;
    }
    return false;
}

void k3_mat_get_row(const k3_mat *w, int64_t r, float *out) {
    K3_ASSERT(r >= 0 && r < w->rows);
    k3_wtype_info(w->type)->get_row(w, r, 0, w->cols, out);
}
