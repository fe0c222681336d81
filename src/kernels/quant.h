/*
 * quant.h -- 8-bit weights and activations (docs/serving-reference.md §5).
 *
 * Weights are converted once, at load: K3_W_Q8 (int8 per output channel,
 * symmetric, s = max|w_row| / 127) or K3_W_MXFP8 (E4M3 with an E8M0 scale
 * per 32 columns, X = 2^(floor(log2 amax) - 8)). Routed experts stay MXFP4.
 * With k3_mat.act8 set, k3_matmul quantizes each activation row (token) at
 * run time -- int8 with one scale per token for Q8 and MXFP4 (W4A8, whose
 * doubled E2M1 values are the integers {0,1,2,3,4,6,8,12}: exact integer dot
 * products per 32-block), MXFP8 per 32-block for MXFP8 -- and runs integer
 * (or FP8-emulated) dot products. Each path equals its dequantize-then-fp32
 * reference (k3_matmul_q_ref) to rounding.
 */
#ifndef K3_KERNELS_QUANT_H
#define K3_KERNELS_QUANT_H

#include "kernels/kernels.h"

/* Converts src (F32/F16/BF16) to Q8: q [rows, cols], scales [rows], and the
 * sum of each row's int8 values [rows] (k3_mat.row_sum, which the VNNI kernel
 * needs). */
void k3_quant_q8_mat(const k3_mat *src, int8_t *q, float *scales, int32_t *sums);
/* Converts src (cols % 32 == 0) to MXFP8: q [rows, cols] E4M3, e [rows, cols/32] E8M0. */
void k3_quant_mxfp8_mat(const k3_mat *src, uint8_t *q, uint8_t *e);
/* One activation row: int8 with one scale (returned), q = round(x·127/amax).
 * The SIMD form equals the scalar reference (_ref) bit for bit. */
float k3_quant_act_i8(const float *x, int64_t n, int8_t *q);
float k3_quant_act_i8_ref(const float *x, int64_t n, int8_t *q);
/* The order the AVX-512 W4A8 kernel reads one quantized token in: per group
 * of up to four 32-blocks (128 columns), the even columns of each block, then
 * the odd ones, so the low and the high nibbles of the packed weights line up
 * with them; corr [ceil(cols/128) * 16] gets -12 x (the sum of the 8
 * activations each int32 lane of the kernel covers), which removes the +12
 * the kernel adds to every weight to make it unsigned. */
void k3_mx4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
/* The scalar form, and the AVX-512 VBMI one (check the CPU), bit for bit the same. */
void k3_mx4_prep_ref(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
void k3_mx4_prep_avx512_vbmi(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
/* K3_W_MXFP4_R4 (kernels.h): whether src (an MXFP4 matrix with act8) can
 * be tiled and this CPU has the kernel that reads tiles (AVX-512 VNNI);
 * then the tiles of src into data [rows * cols / 2] and scale [rows * cols / 32]. */
bool k3_mx4_r4_wanted(const k3_mat *src);
void k3_mx4_r4_pack(const k3_mat *src, uint8_t *data, uint8_t *scale);
/* The order the tile kernel reads one quantized token in (cols % 128 == 0):
 * per group of 128 columns, for j = 0..3, the columns 8j, 8j+2, 8j+4, 8j+6
 * of each of the four blocks (16 bytes: the low nibbles of stretch j), then
 * 8j+1, 8j+3, ... (the high ones); corr [cols / 32] gets -12 x each block's
 * sum. The scalar form, the AVX-512 VBMI one and the AVX2 one (below), bit
 * for bit the same. */
void k3_mx4_r4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
void k3_mx4_r4_prep_ref(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
void k3_mx4_r4_prep_avx512_vbmi(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
/* The same on AVX2 (check k3_kernels_isa), what the AVX2 path takes. */
void k3_mx4_r4_prep_avx2(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
/* One activation row fake-quantized to MXFP8 (E4M3 per 32, E8M0 scale), in place. */
void k3_quant_act_mxfp8(float *x, int64_t n);

/* AVX-512 only (check k3_kernels_isa): len (% 32 == 0) E4M3 codes with
 * their E8M0 block scales -> fp32, equal to k3_e4m3_to_f32 x scale for every
 * code but the NaNs (0x7F, 0xFF), which the quantizer never writes. */
void k3_mxfp8_dequant_avx512(const uint8_t *q, const uint8_t *e, int64_t len, float *out);
/* The same on AVX2 + F16C (check k3_kernels_isa). */
void k3_mxfp8_dequant_avx2(const uint8_t *q, const uint8_t *e, int64_t len, float *out);
/* AVX-512 VNNI only (VBMI too for the second): rows [r0, r1) x n tokens of
 * an MXFP4 matrix against activations prepared by k3_mx4_prep (corr rows
 * ldc apart), y[t*ldy + r] = dot · xs[t]. The two decode nibbles differently
 * and give the same bits. */
void k3_mx4_rows_avx512(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp,
                        const int32_t *corr, int64_t ldc, const float *xs, int64_t n, int64_t r0, int64_t r1,
                        float *y, int64_t ldy);
void k3_mx4_rows_avx512_vbmi(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp,
                             const int32_t *corr, int64_t ldc, const float *xs, int64_t n, int64_t r0, int64_t r1,
                             float *y, int64_t ldy);

/* The same for K3_W_MXFP4_R4 tiles (r0, r1 multiples of 4),
 * against activations prepared by k3_mx4_r4_prep. Every token's sums are
 * made in the same order whatever n: batch invariant. */
void k3_mx4_r4_rows_avx512(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp,
                           const int32_t *corr, int64_t ldc, const float *xs, int64_t n, int64_t r0, int64_t r1,
                           float *y, int64_t ldy);
void k3_mx4_r4_rows_avx512_vbmi(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp,
                                const int32_t *corr, int64_t ldc, const float *xs, int64_t n, int64_t r0,
                                int64_t r1, float *y, int64_t ldy);

/* quant_avx2.c: W8A8 rows (int8 weights with row sums, as k3_q8_rows of the
 * AVX-512 path) and W4A8 on K3_W_MXFP4_R4 tiles, each in a plain AVX2 form
 * (vpmaddubsw/vpmaddwd) and an AVX-VNNI form (vpdpbusd) that give the same
 * bits; the same arguments as the AVX-512 kernels above. */
void k3_q8_rows_avx2(const int8_t *w, const float *row_scale, const int32_t *row_sum, int64_t cols, const int8_t *x,
                     const float *xs, int64_t n, int64_t r0, int64_t r1, float *y, int64_t ldy);
void k3_q8_rows_avxvnni(const int8_t *w, const float *row_scale, const int32_t *row_sum, int64_t cols,
                        const int8_t *x, const float *xs, int64_t n, int64_t r0, int64_t r1, float *y, int64_t ldy);
void k3_mx4_r4_rows_avx2(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp,
                         const int32_t *corr, int64_t ldc, const float *xs, int64_t n, int64_t r0, int64_t r1,
                         float *y, int64_t ldy);
void k3_mx4_r4_rows_avxvnni(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp,
                            const int32_t *corr, int64_t ldc, const float *xs, int64_t n, int64_t r0, int64_t r1,
                            float *y, int64_t ldy);

/* y[n, rows] = x[n, cols] · Wᵀ with 8-bit activations, for Q8, MXFP8,
 * MXFP4 and MXFP4_R4 weights. Threaded over rows. */
void k3_matmul_q(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y);
/* The reference: quantize x the same way, dequantize both, fp64 dots. */
void k3_matmul_q_ref(const k3_mat *w, const float *x, int64_t n, float *y);

#endif /* K3_KERNELS_QUANT_H */
