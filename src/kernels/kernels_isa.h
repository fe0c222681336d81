/*
 * kernels_isa.h -- private to src/kernels: the kernel table, and every kernel
 * it can hold.
 *
 * One k3_kernel_ops per CPU level ("ref", "avx2", "avx2-vnni", "avx512"),
 * built once by dispatch.c from the kernels declared below, and one of them
 * current (k3_kernels_init picks the best the CPU has; k3_set_isa, --isa and
 * k3_kernels_force pick another). Every entry point of src/kernels runs the
 * current table's kernel: a caller never asks which CPU it is on.
 *
 * A table starts as a copy of the one below it and replaces the entries it
 * has kernels for, so an entry is never empty where the reference has one. An
 * entry with a fits() predicate takes only the calls it says yes to; the
 * others run the entry of `base` (the next table down), e.g. the AVX-512 QLI
 * kernel takes up to 64 heads and dI % 64 == 0, AVX2's dI % 16 == 0, the
 * reference every shape. Whatever table runs a call, its result is the one the
 * batch-invariance contract below allows, so a fits() that depends on n must
 * pick kernels that give the same bits as the base's.
 *
 * Files: a kernel is defined in a file that the tables point at and that
 * calls no entry point (so no file both feeds the table and reads it): the
 * references in ref.c, quant.c, attn_ops.c, attnres.c, kda.c, softmax.c, the
 * SIMD forms in *_avx2.c and *_avx512.c. The entry points are in dispatch.c,
 * k3_matmul in matmul.c; what is built on entry points (quantize.c,
 * kda_conv.c, mla.c) sits above them.
 *
 * Each kernel family's signature is a function type (k3_*_fn), which the
 * table's entries point at and the declarations below declare kernels with.
 */
#ifndef K3_KERNELS_KERNELS_ISA_H
#define K3_KERNELS_KERNELS_ISA_H

#include "kernels/attn_ops.h"
#include "kernels/attnres.h"
#include "kernels/kda.h"
#include "kernels/kernels.h"

typedef struct k3_kernel_ops k3_kernel_ops;

/* ---- matrix products with fp32 activations ------------------------------- */

/* Rows [r0, r1) of y = x Wᵀ: y[i*ldy + r] for i < n, r0 <= r < r1.
 * x: [n, w->cols] (row stride w->cols). One thread; the kernel picks its own
 * blocking (streaming for small n, tiled for large n), but each y[i][r] must
 * come out bit for bit the same whatever n, r0, r1 and the position of row i
 * (batch invariance: k3_matmul splits freely, and the engine's batch == alone
 * and causality tests compare with memcmp). Stack: up to ~100 KB (the
 * AVX-512 tiled path's weight block). x is as prep_x left it where that
 * returns > 0 for w. */
typedef void k3_mm_rows_fn(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1);
/* Optional (NULL: x is always taken as it is): x [n, w->cols] in the order
 * rows wants for w, written to xp once per k3_matmul call rather than by every
 * row chunk. Returns the floats it writes (0: w takes x as it is); with
 * xp == NULL only returns that count. */
typedef int64_t k3_mm_prep_fn(const k3_mat *w, const float *x, int64_t n, float *xp);
/* Whether a kernel takes a product of n activation rows with w (NULL: every
 * one). k3_matmul asks once per call, with the call's n; the pool may then
 * hand the kernel any share of those rows. */
typedef bool k3_mm_fits_fn(const k3_mat *w, int64_t n);
/* A kernel that makes the whole product itself (its own activation form and
 * its own split over the pool): the AMX kernels, whose activation tiles are
 * made once per call for every weight panel. Set instead of rows' split (an
 * entry with call still has rows NULL or not; k3_matmul takes call first). */
typedef void k3_mm_call_fn(k3_pool *pool, const k3_mat *w, const float *x, int64_t n, float *y);

typedef struct k3_mm_kernel {
    k3_mm_fits_fn *fits;
    k3_mm_rows_fn *rows;
    k3_mm_prep_fn *prep_x;
    k3_mm_call_fn *call;
} k3_mm_kernel;

/* ---- matrix products with BF16 activations: the BF16 dot products --------- *
 *
 * For k3_mat.bf16 matrices (BF16, MXFP4) and the K3_W_*_S16 strips made from
 * them, in the "bf" entries (k3_mm_kernel as above). The numbers of one
 * output y[t][r], whatever kernel, table, n, row range or thread split:
 *
 *   x rounded to BF16 (to nearest even, k3_f32_to_bf16); the weights' exact
 *   BF16 values (BF16 as stored; MXFP4 codes times scales 2 <= e <= 252, the
 *   only ones k3_bf16_mat_ok lets through); per block of 32 columns (zeros
 *   past cols), in column order, E = the block's 16 even-column products
 *   added from +0 one rounding at a time, O the same for its odd columns;
 *   C = +0, then C = C + (E + O) block after block. Inputs below 2^-126 read
 *   as zero and results below it are flushed (DAZ, FTZ).
 *
 * That is what a chain of AMX TDPBF16PS over 32-column tiles computes
 * (measured on the unit: bit for bit, tests/test_amx.c), and what vdpbf16ps
 * computes on the strips' pairing (it adds a lane's high product, then its
 * low one); k3_bf16_rows_ref is it in scalar code. So the AMX kernels above
 * their row threshold and the AVX-512 ones below it give the same bits, and
 * a token's result never depends on what it was batched with. (A CPU whose
 * vdpbf16ps rounds a pair differently gives its own bits, the same for
 * every n: tests hold it to the reference within the rounding bound.) The
 * prepared x is the kernel's own (bf16 dwords, not floats). */

/* ---- matrix products with 8-bit activations -------------------------------- */

/* The form a kernel reads the activations in, which k3_matmul makes once per
 * call from x (quant.h has the quantizers and the orders). */
typedef enum k3_qform {
    K3_QX_I8 = 0, /* int8 per token, one scale each (k3_quant_act_i8) */
    K3_QX_U8,     /* the same plus 128, as unsigned bytes (vpdpbusd's unsigned side) */
    K3_QX_MX4,    /* int8 in k3_mx4_prep order, with its corr */
    K3_QX_MX4_R4, /* int8 in k3_mx4_r4_prep order, with its corr */
    K3_QX_MXFP8,  /* fp32 fake-quantized per 32-block (k3_quant_act_mxfp8) */
} k3_qform;

/* One 8-bit-activation product y[n, w->rows] = x Wᵀ as its kernel reads it. */
typedef struct k3_qjob {
    const k3_kernel_ops *ops; /* the table the kernel came from (its dots, decoders) */
    const k3_mat *w;
    int64_t n;           /* tokens */
    const int8_t *xq;    /* [n, cols]: int8, or + 128, or a W4A8 order (k3_qform) */
    const int32_t *corr; /* [n, ldc]: W4A8 orders, -12 x block sums */
    int64_t ldc;
    const float *xs; /* [n]: token scales */
    const float *xf; /* [n, cols]: K3_QX_MXFP8 */
    float *y;        /* [n, w->rows]: y[t * w->rows + r] */
    /* K3_QX_U8 with k3_q_kernel.panels, n >= K3_Q8_PANEL_MIN and cols % 4
     * == 0: the same bytes in token panels (k3_q8_panels_fn), else NULL */
    const uint8_t *xpan;
} k3_qjob;

/* Rows [r0, r1) (whole tiles of w's type) x every token of j, into j->y;
 * batch invariant as k3_mm_rows_fn. */
typedef void k3_q_rows_fn(const k3_qjob *j, int64_t r0, int64_t r1);

/* W8A8 prefill (K3_QX_U8): the quantized tokens (int8, [n, cols], cols % 4
 * == 0) as x + 128 in panels of 16 tokens, the order vpdpbusd wants when a
 * weight's 4 bytes are broadcast against 16 tokens: panel p, column group g
 * (columns 4g..4g+3) at out[(p * cols / 4 + g) * 64 + 4 t + c % 4] for token
 * 16p + t; a last panel's missing tokens are 128 (zero). out holds
 * ceil(n / 16) * 16 * cols bytes. */
typedef void k3_q8_panels_fn(const int8_t *xq, int64_t n, int64_t cols, uint8_t *out);
enum { K3_Q8_PANEL_MIN = 16 }; /* the fewest tokens a call gets panels for */

typedef struct k3_q_kernel {
    k3_qform form;
    k3_mm_fits_fn *fits;
    k3_q_rows_fn *rows;
    k3_mm_call_fn *call;     /* the whole product from fp32 x (its own quantizer), as k3_mm_kernel.call */
    k3_q8_panels_fn *panels; /* K3_QX_U8: the kernel also reads k3_qjob.xpan */
} k3_q_kernel;

/* The activation quantizer and the W4A8 orders (quant.h); the dot of one
 * stored-layout MXFP4 row with one int8 token, Σ_blocks 2^(e-128) · <x, 2
 * e2m1> (each block an exact integer dot); len (% 32 == 0) E4M3 codes with
 * their E8M0 block scales -> fp32. */
typedef float k3_act_i8_fn(const float *x, int64_t n, int8_t *q);
typedef void k3_mx4_order_fn(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
typedef float k3_mx4_dot_fn(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols);
typedef void k3_mxfp8_dequant_fn(const uint8_t *q, const uint8_t *e, int64_t len, float *out);

/* The routed experts of a MoE layer, every active expert in one grouped
 * product a phase (k3_moe_experts, kernels.h): whether the kernel takes the
 * layer (its matrices, the rows of all its experts) and the kernel. */
typedef bool k3_moe_fits_fn(const k3_mat *gate, const k3_mat *up, const k3_mat *down, const int32_t *eact, int32_t na,
                            int64_t rows);
typedef void k3_moe_fn(k3_pool *pool, const k3_mat *gate, const k3_mat *up, const k3_mat *down, const int32_t *eact,
                       int32_t na, const int32_t *row0, const int32_t *rows, int32_t K, const float *z, int64_t ldz,
                       float *y, int64_t ldy, k3_glu_kind kind, float b1, float b2);

/* ---- the rest (each as its entry point: kernels.h, attn_ops.h, attnres.h, kda.h) -- */

typedef float k3_dot_fn(const float *a, const float *b, int64_t n);
typedef void k3_axpy_fn(float *y, float a, const float *x, int64_t n);
typedef void k3_glu_fn(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);
typedef void k3_softmax_fn(float *s, int64_t n, float scale);
typedef bool k3_qli_fits_fn(int HI, int dI);
typedef void k3_qli_fn(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8,
                       const float *ks, const int64_t *slots, int n, float *scores);
typedef void k3_qli_chunk_fn(k3_pool *pool, const int8_t *q8, const float *qs, const float *w, int64_t T, int HI,
                             int dI, const int8_t *k8, const float *ks, const int64_t *slots, int64_t n, float *scores,
                             int64_t lds);
typedef bool k3_qsfa_fits_fn(const k3_c8_cache *c);
typedef void k3_qsfa_fn(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                        float scale, float *out, float *lse, float *work);
typedef void k3_lse_merge_fn(const float *const *o, const float *const *lse, int P, int H, int d, float *out,
                             float *lse_out);
typedef void k3_attnres_fn(const float *const *V, int n, const float *w, int64_t D, float eps, float *out);
typedef bool k3_kda_fits_fn(const k3_kda_head *h);
typedef void k3_kda_recurrent_fn(const k3_kda_head *h, float *S);
typedef void k3_kda_chunked_fn(const k3_kda_head *h, float *S, int chunk, float *work);

/* ---- the table --------------------------------------------------------------- */

struct k3_kernel_ops {
    const char *name; /* k3_isa_current(): "ref", "avx2", "avx2-vnni", "avx512", "amx" */
    k3_isa isa;
    const k3_kernel_ops *base; /* runs the calls an entry's fits() turns down; NULL for "ref" */

    /* matrix products, by weight type (k3_wtype_traits.acts says which
     * family takes a type); rows NULL: no kernel */
    k3_mm_kernel mm[K3_W_COUNT];
    k3_mm_kernel bf[K3_W_COUNT]; /* BF16 activations: k3_mat.bf16 and the _S16 types */
    k3_q_kernel q[K3_W_COUNT];
    /* the model marks its BF16 and MXFP4 matrices k3_mat.bf16 at load and
     * makes them resident as strips (k3_kernels_bf16): this table's bf
     * kernels are its own, not the scalar reference */
    bool bf16;
    /* MXFP4 matrices with 8-bit activations are copied as K3_W_MXFP4_R4
     * tiles at load (k3_mx4_r4_wanted): this table has a faster tile kernel */
    bool w4a8_tiles;

    /* what the 8-bit products are made of */
    k3_act_i8_fn *quant_act_i8;
    k3_mx4_order_fn *mx4_prep, *mx4_r4_prep;
    k3_mx4_dot_fn *mx4_dot;
    k3_mxfp8_dequant_fn *mxfp8_dequant;

    /* the routed experts grouped (NULL: one expert at a time through k3_matmul) */
    k3_moe_fits_fn *moe_fits;
    k3_moe_fn *moe;

    /* fp32 vectors */
    k3_dot_fn *dot;
    k3_axpy_fn *axpy;
    k3_glu_fn *glu;
    k3_softmax_fn *softmax;

    /* attention on 8-bit caches, the LSE merge and the AttnRes mix */
    k3_qli_fits_fn *qli_fits;
    k3_qli_fn *qli_scores;
    k3_qli_fits_fn *qli_chunk_fits; /* QLI of a chunk's tokens over shared slots, qli_scores' bits */
    k3_qli_chunk_fn *qli_chunk;     /* (NULL: token by token) */
    k3_qsfa_fits_fn *qsfa_fits;
    k3_qsfa_fn *qsfa;
    k3_qsfa_fn *qsfa_bf; /* QSFA's BF16 form (k3_c8_cache.bf16; NULL: the fp32 one) */
    k3_lse_merge_fn *lse_merge;
    k3_attnres_fn *attnres_mix;

    /* KDA */
    k3_kda_fits_fn *kda_recurrent_fits, *kda_chunked_fits;
    k3_kda_recurrent_fn *kda_recurrent;
    k3_kda_chunked_fn *kda_chunked;
    k3_kda_chunked_fn *kda_chunked_bf; /* the BF16 chunked form (k3_kda_bf_fits; NULL: none) */
    int32_t kda_bf_min;                /* pieces this long take it by default (0: none) */
    bool kda_recurrent_prefill;        /* the recurrent form beats the chunked one at every length */
};

/* The current table (k3_kernels_init on first use). */
const k3_kernel_ops *k3_ops(void);

/* ---- the kernels (the references' prototypes are in the public headers) ---- */

/* fp32 activations: ref.c, matmul_avx2.c, matmul_avx512.c, act_*.c, softmax*.c */
k3_mm_rows_fn k3_matmul_rows_ref, k3_matmul_rows_avx2, k3_matmul_rows_avx512;
/* The BF16 dot products: the scalar reference (ref.c) and AVX-512 BF16
 * (matmul_bf16_avx512bf16.c: every bf type, rows in whole 16-row strips but
 * the last; the _fma pair takes few-token calls on fp32 FMAs with the same
 * bits, for the CPUs whose FMAs outrun vdpbf16ps, and prepares x its way). */
k3_mm_rows_fn k3_bf16_rows_ref, k3_bf16_rows_avx512, k3_bf16_rows_avx512_fma;
k3_mm_prep_fn k3_bf16_prep_x_avx512, k3_bf16_prep_x_avx512_fma;
k3_mm_prep_fn k3_matmul_prep_x_avx2, k3_matmul_prep_x_avx512;
k3_dot_fn k3_dot_avx2, k3_dot_avx512;
k3_axpy_fn k3_axpy_avx2, k3_axpy_avx512;
k3_glu_fn k3_glu_avx2, k3_glu_avx512;
k3_softmax_fn k3_softmax_avx2, k3_softmax_avx512;

/* 8-bit activations. quant.c, the scalar forms: the "ref" table's W8A8 and
 * tile W4A8 rows; W4A8 on the stored layout a row at a time with the table's
 * mx4_dot, and MXFP8 decoded (mxfp8_dequant) and dotted (dot) by the table,
 * for every table whose own kernels do not replace them. */
k3_q_rows_fn k3_q8_rows_ref, k3_mx4_r4_rows_ref, k3_mx4_rows, k3_mxfp8_rows;
k3_mx4_dot_fn k3_mx4_dot_ref;
k3_mxfp8_dequant_fn k3_mxfp8_dequant_ref;

/* quant_avx2.c: W8A8 in a plain form (vpmaddubsw/vpmaddwd, K3_QX_I8) and an
 * AVX-VNNI one (vpdpbusd, K3_QX_U8), W4A8 on K3_W_MXFP4_R4 tiles
 * (K3_QX_MX4_R4) in both forms, all giving the same bits; the stored-layout
 * MXFP4 dot; the quantizer, the tiles' order and the MXFP8 decode (F16C), bit
 * for bit the scalar ones. */
k3_q_rows_fn k3_q8_rows_avx2, k3_q8_rows_avxvnni, k3_mx4_r4_rows_avx2, k3_mx4_r4_rows_avxvnni;
k3_mx4_dot_fn k3_mx4_dot_avx2;
k3_act_i8_fn k3_quant_act_i8_avx2;
k3_mx4_order_fn k3_mx4_r4_prep_avx2;
k3_mxfp8_dequant_fn k3_mxfp8_dequant_avx2;

/* quant_avx512.c, AVX-512 VNNI for the W8A8 (K3_QX_U8) and W4A8 kernels
 * (K3_QX_MX4 on the stored layout, K3_QX_MX4_R4 on tiles), each W4A8 kernel
 * also in a VBMI form (vpermb decodes the nibbles) with the same bits; the
 * quantizer, the W4A8 orders (VBMI) and the MXFP8 decode, bit for bit the
 * scalar ones (the decode for every code but the NaNs 0x7F, 0xFF, which the
 * quantizer never writes). */
k3_q_rows_fn k3_q8_rows_avx512, k3_mx4_rows_avx512, k3_mx4_rows_avx512_vbmi, k3_mx4_r4_rows_avx512,
    k3_mx4_r4_rows_avx512_vbmi;
k3_act_i8_fn k3_quant_act_i8_avx512;
k3_q8_panels_fn k3_q8_panels_avx512;
k3_mx4_order_fn k3_mx4_prep_avx512_vbmi, k3_mx4_r4_prep_avx512_vbmi;
k3_mxfp8_dequant_fn k3_mxfp8_dequant_avx512;

/* amx.c: the "amx" table's products on the tile unit (amx.h), each taking
 * the calls with at least the rows where the tiles pay off (fits) and leaving
 * the rest to "avx512": BF16 weights and MXFP4 ones (the BF16-decode route)
 * with fp32 activations, Q8 (W8A8) with int8 ones, bit for bit the AVX-512
 * VNNI kernel's. */
k3_mm_fits_fn k3_amx_q8_fits, k3_amx_bf_fits;
k3_mm_call_fn k3_amx_mm_call, k3_amx_bf_call;
k3_moe_fits_fn k3_amx_moe_bf_fits;
k3_moe_fn k3_amx_moe_bf;

/* QLI and QSFA (attn_ops_avx2.c, attn_ops_avx512.c). AVX2 QSFA goes by
 * blocks of 8 slots where rope % 8 == 0 and rope <= kv_lora, else slot by
 * slot. */
k3_qli_fits_fn k3_qli_avx2_fits, k3_qli_avx512_fits;
k3_qli_fn k3_qli_scores_avx2, k3_qli_scores_avx512;
k3_qsfa_fits_fn k3_qsfa_avx2_fits, k3_qsfa_avx512_fits;
k3_qsfa_fn k3_qsfa_avx2, k3_qsfa_avx512;
/* Floats of work the QSFA kernels by blocks of 8 slots (AVX2, AVX-512) use:
 * a block of rows, a zero row, the block's scores, three values per head (the
 * heads padded to 4). */
static inline int64_t k3_qsfa_block_work(int H, int kv_lora, int rope) {
    const int HP = (H + 3) / 4 * 4;
    return 8 * (int64_t)kv_lora + kv_lora + rope + (int64_t)HP * 8 + 3 * HP;
}

/* QSFA's BF16 form (attn_ops.h, k3_qsfa_bf16_ref's bits) where
 * k3_qsfa_bf16_fits: vdpbf16ps (qsfa_avx512bf16.c, "avx512-bf16") and the AMX
 * tiles (qsfa_amx.c, "amx" where the unit is granted). Floats of work: */
k3_qsfa_fn k3_qsfa_bf_avx512, k3_qsfa_bf_amx;
static inline int64_t k3_qsfa_bf_work(int kv_lora, int rope, int n) {
    const int64_t npad = (n + 31) / 32 * 32, nt = (kv_lora + 127) / 128, kq = kv_lora + 2 * (int64_t)rope;
    return npad * (32 + 9 * nt) + 25 * kq + 2048 + 64;
}

/* The AttnRes mix (attnres_avx2.c). */
k3_attnres_fn k3_attnres_mix_avx2;

/* KDA (kda_avx2.c, kda_avx512.c): dk, dv multiples of 8, dk <= 8192
 * (k3_kda_simd_fits). */
k3_kda_fits_fn k3_kda_simd_fits;
k3_kda_recurrent_fn k3_kda_recurrent_avx2, k3_kda_recurrent_avx512;
k3_kda_chunked_fn k3_kda_chunked_avx2;
/* KDA's BF16 chunked form (kda.h, k3_kda_chunked_bf_ref's bits) where
 * k3_kda_bf_fits: vdpbf16ps (kda_avx512bf16.c) and the AMX tiles (kda_amx.c,
 * on the unit only). */
k3_kda_chunked_fn k3_kda_chunked_bf_avx512, k3_kda_chunked_bf_amx;

#endif /* K3_KERNELS_KERNELS_ISA_H */
