/*
 * kernels.h -- the numeric kernels the forward pass is built from.
 *
 * Weights are k3_mat views into the mapped checkpoint in their stored format;
 * activations are fp32. Every kernel has a scalar reference (suffix _ref) that
 * tests hold the fast paths to; k3_kernels_init picks the kernel table of the
 * fastest path the CPU supports once, at start-up (dispatch.c), and every entry
 * point below runs the kernel that table names.
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
    K3_W_MXFP4,     /* compressed-tensors: packed [rows, cols/2] (low nibble = even
                      column) + E8M0 scales [rows, cols/32] */
    K3_W_Q8,        /* int8 [rows, cols] + fp32 scale per row (row_scale); made at load */
    K3_W_MXFP8,     /* OCP MXFP8: E4M3 [rows, cols] + E8M0 scales [rows, cols/32]; made at load */
    K3_W_MXFP4_R4,  /* MXFP4 bytes and scales rearranged in tiles of 4 rows (k3_r4_byte,
                      k3_r4_scale) for the W4A8 tile kernels (AVX-512 VNNI, AVX2); made
                      at load (quant.h) */
    K3_W_BF16_S16,  /* BF16 in strips of 16 rows, pair-interleaved for the BF16 dot
                      products (k3_s16_bf16_at); made at load from BF16 */
    K3_W_MXFP4_S16, /* MXFP4 codes and scales in the same strips (k3_s16_mx4_nib,
                       k3_s16_mx4_scale); made at load from MXFP4 */
    K3_W_COUNT
} k3_wtype;

/* A weight matrix in its stored format; borrowed (points into the mapping or
 * into memory the model owns). A row range of a matrix is a view with data
 * (and scale) advanced by whole rows. */
typedef struct k3_mat {
    k3_wtype type;
    int64_t rows, cols; /* logical shape, y = W x */
    const void *data;
    const uint8_t *scale;   /* MXFP4, MXFP8: E8M0 per 32 columns */
    const float *row_scale; /* Q8: one scale per row */
    const int32_t *row_sum; /* Q8: Σ of each row's int8 values (k3_quant_q8_mat) */
    bool act8;              /* quantize the activations to 8 bits per token (W4A8/W8A8):
                              k3_matmul then runs the 8-bit kernels, quant.h */
    bool bf16;              /* BF16 dot-product numerics (BF16, MXFP4; always for the
                              _S16 types): the activations rounded to BF16 and each
                              32-column block's even and odd products summed apart, as
                              the AMX unit's TDPBF16PS does (kernels_isa.h); set at load
                              where the kernel table has these products (k3_kernels_bf16) */
    bool wrange;            /* the weights in the range of the FMA kernels (k3_mat_wrange, set
                              with the strips): then with activations within 2^+-60 every
                              product and partial sum is a normal float, and the BF16 dot
                              products may run on fp32 FMAs with vdpbf16ps's bits
                              (matmul_bf16_avx512bf16.c) */
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

/* The strips of the BF16 dot products (rows % 16 == 0, cols % 32 == 0), one
 * lane per row, so a vector of 16 dwords is 16 rows' pair of weights:
 *
 * K3_W_BF16_S16: per strip of 16 rows, per block of 32 columns, 1 KB = 16
 * vectors. Vector 2j holds, per row, columns 4j (high half) and 4j + 2 (low
 * half); vector 2j + 1 columns 4j + 1 and 4j + 3. vdpbf16ps adds a lane's
 * high product, then its low one, so the even vectors add a block's even
 * columns in order and the odd vectors its odd columns: the sums TDPBF16PS
 * makes (kernels_isa.h, "BF16 dot products"). k3_s16_bf16_at: the index of
 * the uint16 holding (r, c). */
static inline int64_t k3_s16_bf16_at(int64_t cols, int64_t r, int64_t c) {
    const int64_t q = c % 32;
    return ((r / 16 * (cols / 32) + c / 32) * 16 + q / 4 * 2 + q % 2) * 32 + r % 16 * 2 + (q % 4 < 2);
}
/* K3_W_MXFP4_S16: per strip and block, 256 bytes of codes: 4 quads of 16
 * lanes x 32 bits; quad g of row r holds, in its nibbles 0..7 from the low
 * end, the codes of columns 8g + 2, 8g + 3, 8g + 6, 8g + 7, 8g, 8g + 1,
 * 8g + 4, 8g + 5, so that the quad shifted right by 0, 4, 8, 12 bits a word
 * indexes vectors 4g..4g + 3 of the BF16 strip; and per strip and block 16
 * scales, one per row, in the scale array. k3_s16_mx4_nib: the nibble
 * holding (r, c) (byte nib / 2, the high nibble when odd); k3_s16_mx4_scale:
 * the index of its scale. */
static inline int64_t k3_s16_mx4_nib(int64_t cols, int64_t r, int64_t c) {
    const int64_t q = c % 32, m = q % 8;
    return (((r / 16 * (cols / 32) + c / 32) * 4 + q / 8) * 16 + r % 16) * 8 + m % 2 + m / 4 * 2 + (m / 2 % 2 ? 0 : 4);
}
static inline int64_t k3_s16_mx4_scale(int64_t cols, int64_t r, int64_t c) {
    return (r / 16 * (cols / 32) + c / 32) * 16 + r % 16;
}

/* ---- the weight-type table (wtype.c) ---------------------------------- */

/* Which activations k3_matmul's kernels for a type take (k3_wtype_traits.acts):
 * fp32, 8-bit, or BF16 (the BF16 dot products, k3_mat.bf16). */
enum { K3_ACTS_F32 = 1, K3_ACTS_8BIT = 2, K3_ACTS_BF16 = 4 };

/* One row per k3_wtype: what the code around the kernels asks of a type.
 * Adding a format is a row here, its kernels, and their entries in the
 * kernel tables (dispatch.c); docs/ARCHITECTURE.md lists the files. */
typedef struct k3_wtype_traits {
    const char *name;
    int bits;       /* bits of one weight in data: a row is cols * bits / 8 bytes */
    int block;      /* columns per E8M0 scale in scale (cols % block == 0); 0: no scales */
    bool row_scale; /* one fp32 scale per row (row_scale) and the sum of its integer values (row_sum) */
    bool is_float;  /* plain floats (F32, F16, BF16): what --quant converts */
    int tile_rows;  /* rows per tile: row views start and end on whole tiles (1: no tiles) */
    int tile_cols;  /* columns per tile group (cols % tile_cols == 0; 1: none) */
    unsigned acts;  /* K3_ACTS_*: K3_ACTS_8BIT alone runs with 8-bit activations whatever k3_mat.act8 says,
                       K3_ACTS_BF16 alone with BF16 ones whatever k3_mat.bf16 says */
    bool act_mxfp8; /* its 8-bit activations are MXFP8 per 32-block (else int8 per token) */
    /* Columns [c0, c0 + len) of row r, dequantized: the scalar decode every
     * kernel that reads the type is held to. */
    void (*get_row)(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out);
} k3_wtype_traits;

const k3_wtype_traits *k3_wtype_info(k3_wtype t);

/* Bytes one row occupies (data + scales + row scale). */
size_t k3_mat_row_bytes(const k3_mat *w);
/* Bytes of the data array and of the scale array (every row). */
size_t k3_mat_data_bytes(const k3_mat *w);
size_t k3_mat_scale_bytes(const k3_mat *w);
/* View of rows [r0, r0+n) (whole tiles where the type has them). */
k3_mat k3_mat_rows(const k3_mat *w, int64_t r0, int64_t n);
/* Dequantizes row r into out[cols]. */
void k3_mat_get_row(const k3_mat *w, int64_t r, float *out);
/* Whether a BF16 or MXFP4 matrix (stored or strips) is in the FMA kernels'
 * range: every nonzero BF16 weight within 2^-64 <= |w| < 2^64 (words with a
 * zero exponent read as zero); every MXFP4 block with a nonzero code scaled
 * by 2^(69-127)..2^(187-127), and none by NaN. False for other types. */
bool k3_mat_wrange(const k3_mat *w);

/* ---- scalar conversions (codec.c) -------------------------------------- */
float k3_bf16_to_f32(uint16_t h);
uint16_t k3_f32_to_bf16(float f); /* round to nearest even */
float k3_f16_to_f32(uint16_t h);
/* E2M1 code (4 bits) -> value; E8M0 byte -> 2^(e-127) (255 -> NaN). */
float k3_e2m1_to_f32(uint8_t code);
float k3_e8m0_to_f32(uint8_t e);
/* 2^(e-127) for an E8M0 byte, 255 -> NaN (= k3_e8m0_to_f32, inlined for the
 * MXFP4 inner loops). e = 0 gives the subnormal 2^-127; every e2m1 value times
 * it is still exact, so decoded weights equal the reference's bit for bit. */
static inline float k3_mx_scale(uint8_t e) {
    union {
        uint32_t u;
        float f;
    } v;
    if (e == 255) v.u = 0x7fc00000u;
    else if (e >= 1) v.u = (uint32_t)e << 23;
    else v.u = 0x00400000u;
    return v.f;
}
/* E4M3 (OCP FP8: bias 7, max 448, 0x7F/0xFF = NaN, no infinities). */
float k3_e4m3_to_f32(uint8_t code);
/* Round to the nearest E4M3 (ties to even), saturating at +-448. */
uint8_t k3_f32_to_e4m3(float x);
/* One MXFP8 block: 32 values as E4M3 codes q[32] and their E8M0 scale *e
 * (the OCP rule, raised by one where it would clip: quant.h). */
void k3_mxfp8_block(const float *x, uint8_t *q, uint8_t *e);

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
/* s[i] = softmax(scale · s)[i] over n values, in place (the vision tower's
 * attention rows); the SIMD paths use their own exp. */
void k3_softmax(float *s, int64_t n, float scale);
void k3_softmax_ref(float *s, int64_t n, float scale);

/* ---- gated activations (docs/model.md §3.5) ---- */

/* f1[i] = act(f1[i], f2[i]) over n values. SwiGLU: silu(g)·u. SiTU:
 * b1 tanh(g/b1) sigmoid(g) · b2 tanh(u/b2) (b2 <= 0: plain u). SiLU: silu(g)
 * (f2 unused, may be NULL). Gate: g · sigmoid(b1 u) (output gates, KDA's
 * bounded decay). The SIMD paths use their own exp and tanh, within a few
 * ulp of libm's. */
typedef enum k3_glu_kind { K3_GLU_SWIGLU = 0, K3_GLU_SITU, K3_GLU_SILU, K3_GLU_GATE } k3_glu_kind;
void k3_glu(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);
void k3_glu_ref(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);

/* The routed experts of a MoE layer in one grouped product a phase, where
 * the current table has such a kernel (AMX) and takes the layer: the
 * active experts eact[0..na) (gate, up, down indexed by expert), expert e
 * taking items [row0[e], row0[e + 1]) of rows, item i reading z row
 * rows[i] / K (stride ldz) and writing y row rows[i] (stride ldy) =
 * down(act(gate x, up x)), act = k3_glu(kind, b1, b2). The same bits as the
 * experts one at a time through k3_matmul and k3_glu. Returns false, having
 * done nothing, where the table has no such kernel or turns the layer down. */
bool k3_moe_experts(k3_pool *pool, const k3_mat *gate, const k3_mat *up, const k3_mat *down, const int32_t *eact,
                    int32_t na, const int32_t *row0, const int32_t *rows, int32_t K, const float *z, int64_t ldz,
                    float *y, int64_t ldy, k3_glu_kind kind, float b1, float b2);

/* ---- which kernels run (dispatch.c) ------------------------------------ */

/* The CPU levels k3_kernels_init picks a kernel table for: "ref", "avx2", ... */
typedef enum k3_isa { K3_ISA_REF = 0, K3_ISA_AVX2, K3_ISA_AVX512, K3_ISA_AMX, K3_ISA_COUNT } k3_isa;
/* Detects the CPU and builds the tables once; safe to call many times. */
void k3_kernels_init(void);
k3_isa k3_kernels_isa(void);
const char *k3_isa_name(k3_isa isa);
/* Forces a path (tests); a path the CPU lacks falls back to the best one it has. */
void k3_kernels_force(k3_isa isa);
/* Whether the CPU has the instructions of isa. */
bool k3_kernels_have(k3_isa isa);
/* Whether the AVX2 integer kernels use AVX-VNNI (vpdpbusd on 256 bits): the
 * "avx2-vnni" table is running, which k3_kernels_force(K3_ISA_AVX2) takes where
 * the CPU has it; k3_set_isa("avx2-novnni"), or k3_kernels_force_avxvnni(false)
 * in tests, takes the plain "avx2" one. */
bool k3_kernels_avxvnni(void);
void k3_kernels_force_avxvnni(bool on);
/* Whether the current table has the BF16 dot products (AVX512_BF16, AMX):
 * then the model marks its BF16 and MXFP4 matrices k3_mat.bf16 at load (the
 * default mode's numerics), and makes them resident as K3_W_*_S16 strips. */
bool k3_kernels_bf16(void);
/* Tests: makes the "amx" table current with the tile instructions emulated
 * (k3_amx_emulate) where the CPU runs the emulation, so its dispatch and
 * kernels run on a CPU without the unit; false (and nothing changed) where it
 * cannot. k3_kernels_force or k3_set_isa leaves it (and the emulation off). */
bool k3_kernels_force_amx_emulated(void);

#endif /* K3_KERNELS_KERNELS_H */
