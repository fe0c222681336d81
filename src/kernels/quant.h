/*
 * quant.h -- 8-bit weights and activations (docs/serving-reference.md §5).
 *
 * Weights are converted once, at load (k3_quantize_mat): K3_W_Q8 (int8 per
 * output channel, symmetric, s = max|w_row| / 127) or K3_W_MXFP8 (E4M3 with an
 * E8M0 scale per 32 columns, X = 2^(floor(log2 amax) - 8)). Routed experts
 * stay MXFP4. With k3_mat.act8 set (and always for Q8, MXFP8 and the MXFP4_R4
 * tiles), k3_matmul quantizes each activation row (token) at run time -- int8
 * with one scale per token for Q8 and MXFP4 (W4A8, whose doubled E2M1 values
 * are the integers {0,1,2,3,4,6,8,12}: exact integer dot products per
 * 32-block), MXFP8 per 32-block for MXFP8 -- and runs integer (or
 * FP8-emulated) dot products, the kernels of the current table
 * (kernels_isa.h). Each path equals its dequantize-then-fp32 reference
 * (k3_matmul_q_ref) to rounding.
 */
#ifndef K3_KERNELS_QUANT_H
#define K3_KERNELS_QUANT_H

#include "kernels/kernels.h"

/* ---- load-time conversion (quantize.c) ---------------------------------- */

/* Memory for a converted matrix's arrays: n bytes that stay as long as the
 * matrix is used; NULL when there is none. */
typedef void *(*k3_quant_alloc_fn)(void *ctx, size_t n);

/* Converts *w (F32, F16 or BF16) to the format of q -- K3_WQ_INT8: K3_W_Q8
 * with its row scales and row sums, K3_WQ_MXFP8: K3_W_MXFP8 -- in arrays from
 * alloc (data, then the row scales and sums, then the block scales), and
 * points *w at them. Leaves *w as it is, returning K3_OK, where q does not
 * apply: K3_WQ_NONE, no data, a matrix that is not plain floats, or columns
 * the format's blocks do not divide (MXFP8 with cols % 32 != 0). */
k3_status k3_quantize_mat(k3_mat *w, k3_wquant q, k3_quant_alloc_fn alloc, void *ctx, k3_error *err);

/* The --quant name of q ("none", "w8a8", "w8a8-mxfp8"); the mode a name (or
 * its alias: "w8a8-int8", "mxfp8") stands for, false for none; and the names
 * of the modes that convert, ", "-joined, into buf. */
const char *k3_quant_mode_name(k3_wquant q);
bool k3_quant_mode_of(const char *name, k3_wquant *q);
void k3_quant_mode_list(char *buf, size_t size);

/* The converters themselves: src (F32/F16/BF16) to Q8: q [rows, cols],
 * scales [rows], and the sum of each row's int8 values [rows] (k3_mat.row_sum,
 * which the VNNI kernels need); to MXFP8 (cols % 32 == 0): q [rows, cols]
 * E4M3, e [rows, cols/32] E8M0. */
void k3_quant_q8_mat(const k3_mat *src, int8_t *q, float *scales, int32_t *sums);
void k3_quant_mxfp8_mat(const k3_mat *src, uint8_t *q, uint8_t *e);

/* K3_W_MXFP4_R4 (kernels.h): whether src (an MXFP4 matrix with act8) can be
 * tiled and the current table has the kernel that reads tiles
 * (k3_kernel_ops.w4a8_tiles: AVX-512 VNNI, AVX2); then the tiles of src into
 * data [rows * cols / 2] and scale [rows * cols / 32]. */
bool k3_mx4_r4_wanted(const k3_mat *src);
void k3_mx4_r4_pack(const k3_mat *src, uint8_t *data, uint8_t *scale);

/* The BF16 dot products (kernels_isa.h). k3_bf16_mat_ok: whether w may take
 * them (k3_mat.bf16): BF16, or MXFP4 whose every block's scale is finite
 * (e != 255) and, where a code is not zero, 2 <= e <= 252, so that every
 * weight is a normal BF16 value (the decoders add the scale's exponent).
 * k3_s16_ok: whether w (k3_mat.bf16) can be strips (rows % 16 == 0, cols %
 * 32 == 0); k3_s16_pack: the strips of w into data (k3_mat_data_bytes) and,
 * for MXFP4, scale (k3_mat_scale_bytes; an all-zero block's scale set to 127). */
bool k3_bf16_mat_ok(const k3_mat *w);
bool k3_s16_ok(const k3_mat *w);
void k3_s16_pack(const k3_mat *w, uint8_t *data, uint8_t *scale);

/* ---- activations: the current table's, and the scalar forms (quant.c) ---- */

/* One activation row: int8 with one scale (returned), q = round(x·127/amax).
 * The SIMD forms equal the scalar reference (_ref) bit for bit. */
float k3_quant_act_i8(const float *x, int64_t n, int8_t *q);
float k3_quant_act_i8_ref(const float *x, int64_t n, int8_t *q);
/* The order the AVX-512 W4A8 kernel reads one quantized token in: per group
 * of up to four 32-blocks (128 columns), the even columns of each block, then
 * the odd ones, so the low and the high nibbles of the packed weights line up
 * with them; corr [ceil(cols/128) * 16] gets -12 x (the sum of the 8
 * activations each int32 lane of the kernel covers), which removes the +12
 * the kernel adds to every weight to make it unsigned. */
void k3_mx4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
void k3_mx4_prep_ref(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
/* The order the tile kernels read one quantized token in (cols % 128 == 0):
 * per group of 128 columns, for j = 0..3, the columns 8j, 8j+2, 8j+4, 8j+6
 * of each of the four blocks (16 bytes: the low nibbles of stretch j), then
 * 8j+1, 8j+3, ... (the high ones); corr [cols / 32] gets -12 x each block's
 * sum. */
void k3_mx4_r4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
void k3_mx4_r4_prep_ref(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
/* One activation row fake-quantized to MXFP8 (E4M3 per 32, E8M0 scale), in place. */
void k3_quant_act_mxfp8(float *x, int64_t n);

/* The reference of k3_matmul with 8-bit activations, for Q8, MXFP8, MXFP4
 * and MXFP4_R4 weights: quantize x the same way, dequantize both, fp64 dots. */
void k3_matmul_q_ref(const k3_mat *w, const float *x, int64_t n, float *y);

#endif /* K3_KERNELS_QUANT_H */
