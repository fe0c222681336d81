/*
 * kernels.h -- the numeric kernels the forward pass is built from.
 *
 * Weights are k3_mat views into the mapped checkpoint in their stored format;
 * activations are fp32. Every kernel has a scalar reference (suffix _ref,
 * src/kernels/ref.c) that tests hold the fast paths to; k3_kernels_init picks
 * the fastest path the CPU supports once, at start-up.
 *
 * Shapes are row-major: x [n, cols], W [rows, cols], y [n, rows], y = x Wᵀ.
 */
#ifndef K3_KERNELS_KERNELS_H
#define K3_KERNELS_KERNELS_H

#include "k3.h"

typedef enum k3_wtype {
    K3_W_F32 = 0,
    K3_W_F16,
    K3_W_BF16,
    K3_W_MXFP4,    /* compressed-tensors: packed [rows, cols/2] (low nibble = even
                      column) + E8M0 scales [rows, cols/32] */
    K3_W_Q8,       /* int8 [rows, cols] + fp32 scale per row (row_scale); made at load */
    K3_W_MXFP8,    /* OCP MXFP8: E4M3 [rows, cols] + E8M0 scales [rows, cols/32]; made at load */
    K3_W_MXFP4_R4, /* MXFP4 bytes and scales rearranged in tiles of 4 rows (k3_r4_byte,
                      k3_r4_scale) for the AVX-512 W4A8 kernel; made at load (quant.h) */
    K3_W_COUNT
} k3_wtype;

/* A weight matrix in its stored format; borrowed (points into the mapping or
 * into memory the model owns). A row range of a matrix is a view with data
 * (and scale) advanced by whole rows. */
typedef struct k3_mat {
    k3_wtype type;
    int64_t rows, cols;    /* logical shape, y = W x */
    const void *data;
    const uint8_t *scale;  /* MXFP4, MXFP8: E8M0 per 32 columns */
    const float *row_scale;/* Q8: one scale per row */
    const int32_t *row_sum;/* Q8: Σ of each row's int8 values (k3_quant_q8_mat) */
    bool act8;             /* quantize the activations to 8 bits per token (W4A8/W8A8):
                              k3_matmul then runs the integer kernels of quant.h */
} k3_mat;

/* K3_W_MXFP4_R4 (rows % 4 == 0, cols % 128 == 0): where the packed byte of
 * columns c, c+1 (c even) of row r lies, and the scale of column c. Per tile
 * of 4 rows, per group of 128 columns (four 32-blocks): 256 bytes, four
 * stretches of 64 in which row i's block b has bytes 4j..4j+3 (of its 16) in
 * stretch j at 16i + 4b; then 16 scales, row i's block b at 4i + b. So one
 * 64-byte load puts a different block in each 4-byte lane, and the kernel's
 * lane sums finish a whole block before they take its scale. */
static inline int64_t k3_r4_byte(int64_t cols, int64_t r, int64_t c) {
    const int64_t q = c % 32 / 2; /* the byte within its block */
    return r / 4 * 2 * cols + c / 128 * 256 + q / 4 * 64 + r % 4 * 16 + c % 128 / 32 * 4 + q % 4;
}
static inline int64_t k3_r4_scale(int64_t cols, int64_t r, int64_t c) {
    return r / 4 * (cols / 8) + c / 128 * 16 + r % 4 * 4 + c % 128 / 32;
}

/* Bytes one row occupies (data + scales). */
size_t k3_mat_row_bytes(const k3_mat *w);
/* View of rows [r0, r0+n). */
k3_mat k3_mat_rows(const k3_mat *w, int64_t r0, int64_t n);
/* Dequantizes row r into out[cols]. */
void k3_mat_get_row(const k3_mat *w, int64_t r, float *out);

/* ---- scalar conversions ---- */
float k3_bf16_to_f32(uint16_t h);
uint16_t k3_f32_to_bf16(float f);   /* round to nearest even */
float k3_f16_to_f32(uint16_t h);
/* E2M1 code (4 bits) -> value; E8M0 byte -> 2^(e-127) (255 -> NaN). */
float k3_e2m1_to_f32(uint8_t code);
float k3_e8m0_to_f32(uint8_t e);
/* E4M3 (OCP FP8: bias 7, max 448, 0x7F/0xFF = NaN, no infinities). */
float k3_e4m3_to_f32(uint8_t code);
/* Round to the nearest E4M3 (ties to even), saturating at +-448. */
uint8_t k3_f32_to_e4m3(float x);

/* ---- matrix products ---- */

/* y[n, rows] = x[n, cols] · Wᵀ, threaded over rows (and n). */
void k3_matmul(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y);
/* The scalar reference: same contract, one thread, no SIMD. */
void k3_matmul_ref(const k3_mat *w, const float *x, int64_t n, float *y);

/* ---- vector helpers (fp32) ---- */
float k3_dot(const float *a, const float *b, int64_t n);
float k3_dot_ref(const float *a, const float *b, int64_t n);
/* y += a * x */
void k3_axpy(float *y, float a, const float *x, int64_t n);
void k3_axpy_ref(float *y, float a, const float *x, int64_t n);

/* ---- gated activations (docs/model.md §3.5) ---- */

/* f1[i] = act(f1[i], f2[i]) over n values. SwiGLU: silu(g)·u. SiTU:
 * b1 tanh(g/b1) sigmoid(g) · b2 tanh(u/b2) (b2 <= 0: plain u). SiLU: silu(g)
 * (f2 unused, may be NULL). Gate: g · sigmoid(b1 u) (output gates, KDA's
 * bounded decay). The SIMD paths use their own exp and tanh, within a few
 * ulp of libm's. */
typedef enum k3_glu_kind { K3_GLU_SWIGLU = 0, K3_GLU_SITU, K3_GLU_SILU, K3_GLU_GATE } k3_glu_kind;
void k3_glu(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);
void k3_glu_ref(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);

/* Which path k3_matmul and friends use: "ref", "avx2", ... */
typedef enum k3_isa { K3_ISA_REF = 0, K3_ISA_AVX2, K3_ISA_AVX512 } k3_isa;
/* Detects the CPU once; safe to call many times. */
void k3_kernels_init(void);
k3_isa k3_kernels_isa(void);
const char *k3_isa_name(k3_isa isa);
/* Forces a path (tests); a path the CPU lacks falls back to the best one it has. */
void k3_kernels_force(k3_isa isa);
/* Whether the CPU has the instructions of isa. */
bool k3_kernels_have(k3_isa isa);
/* Whether the AVX2 integer kernels use AVX-VNNI (vpdpbusd on 256 bits): the
 * AVX2 path is running, the CPU has it, and it is not switched off (by
 * k3_set_isa("avx2-novnni"), or k3_kernels_force_avxvnni(false) in tests;
 * k3_kernels_force turns it back on where the CPU has it). */
bool k3_kernels_avxvnni(void);
void k3_kernels_force_avxvnni(bool on);

#endif /* K3_KERNELS_KERNELS_H */
