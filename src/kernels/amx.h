/*
 * amx.h -- matrix products on the AMX tile unit (Intel Sapphire Rapids and
 * later; docs/amx.md): BF16 weights, MXFP4 experts (decoded to BF16 tiles,
 * or the INT8 route) and W8A8 INT8, fp32 activations in and fp32 out.
 *
 * Roles: the weights are the A operand (16 output rows x 32 BF16 or 64 INT8
 * columns per tile, as they are stored: a row of a tile is a stretch of one
 * weight row), the activations the B operand (pairs or quads of columns x 16
 * tokens, converted once per call), the accumulators C hold 16 output rows x
 * 16 tokens. So the weights are read in place (BF16 rows, MXFP4 packed bytes
 * with their scales, Q8 rows), or from tiles made once at load (k3_amx_pack).
 *
 * Numerics: each token's sums are made in one order over the columns that
 * does not depend on the other tokens of the call (batch invariant); BF16
 * paths round the activations to BF16 (to nearest even, as k3_f32_to_bf16)
 * and add in fp32; INT8 paths make exact integer sums (Q8: the same integers,
 * and then the same float operations, as the AVX-512 VNNI kernel).
 *
 * The kernels exist twice: on the unit (k3_amx_init first) and with every
 * tile instruction emulated in C on AVX-512 (k3_amx_emulate, for tests on
 * CPUs without AMX); the code around the tile instructions is the same.
 */
#ifndef K3_KERNELS_AMX_H
#define K3_KERNELS_AMX_H

#include "kernels/kernels.h"

/* ---- the unit ----------------------------------------------------------- */

/* Whether the CPU has AMX-TILE, AMX-BF16, AMX-INT8 and the AVX-512 parts the
 * kernels use (F, BW, VL, DQ, VNNI, BF16), and the OS saves the tile state. */
bool k3_amx_cpu_has(void);
/* Asks the kernel once per process for the tile data state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); later calls return the first
 * answer. K3_ERR_UNSUPPORTED with a sentence when the CPU lacks AMX or the
 * kernel refuses; then the AVX-512 kernels are the ones to use. */
k3_status k3_amx_init(k3_error *err);
/* k3_amx_init has succeeded: the kernels below may run on the unit. */
bool k3_amx_ready(void);
/* Whether the emulated kernels can run here (the AVX-512 parts above). */
bool k3_amx_emu_possible(void);
/* Tests: run the kernels below with the tile instructions emulated (on) or
 * on the unit (off, the default). The emulation is slow: not for serving. */
void k3_amx_emulate(bool on);
/* "amx", "amx-emulated" or "none": what the kernels below would run on. */
const char *k3_amx_backend(void);

/* ---- weights ------------------------------------------------------------ */

/* A weight matrix as the AMX kernels read it; borrowed, like k3_mat. */
typedef struct k3_amx_mat {
    k3_wtype type; /* K3_W_BF16, K3_W_MXFP4 or K3_W_Q8 */
    bool act8;     /* activations to int8 per token (k3_quant_act_i8):
                               MXFP4 then takes the INT8 route (W4A8's numbers);
                               always set for Q8 */
    bool tiled;    /* BF16: tiles made by k3_amx_pack, else stored rows */
    int64_t rows, cols;
    const uint8_t *data;    /* stored rows, or (tiled) 16-row strips of 1 KB
                               tiles: strip s, column tile k at
                               (s * ceil(cols/32) + k) * 1024, each 16 rows of
                               32 BF16, zero padded */
    const uint8_t *scale;   /* MXFP4: E8M0 [rows, cols/32] as stored */
    const float *row_scale; /* Q8: one per row */
} k3_amx_mat;

/* The stored matrix w read in place: K3_W_BF16, K3_W_MXFP4 (cols % 32 == 0;
 * w->act8 picks the INT8 route) or K3_W_Q8. K3_ERR_UNSUPPORTED otherwise. */
k3_status k3_amx_view(const k3_mat *w, k3_amx_mat *out, k3_error *err);
/* BF16 tiles of w (K3_W_BF16): the bytes they take, and the tiles made into
 * buf (64-byte aligned; the model's resident copy), described by *out. */
size_t k3_amx_pack_bytes(const k3_mat *w);
void k3_amx_pack(const k3_mat *w, void *buf, k3_amx_mat *out);

/* ---- products ----------------------------------------------------------- */

/* y[n, rows] = x[n, cols] · Wᵀ, split over 32-row panels of W by the pool.
 * Reference: k3_matmul_ref (fp32 activations), k3_matmul_q_ref (act8). */
void k3_amx_matmul(k3_pool *pool, const k3_amx_mat *w, const float *x, int64_t n, float *y);

/* One routed expert: gate and up [inter, hidden], down [hidden, inter], all
 * BF16 or all MXFP4 (the BF16-decode route; act8 is not taken here). */
typedef struct k3_amx_expert {
    k3_amx_mat gate, up, down;
} k3_amx_expert;

/* The routed experts of a MoE layer over their gathered token rows: expert e
 * takes rows [row0[e], row0[e+1]) of x [*, hidden] and writes the same rows
 * of y [*, hidden] = down(act(gate x, up x)), act = k3_glu(kind, b1, b2).
 * Split over (expert, 32-row panel) items; each expert's rows fill the
 * token columns of its tiles. h = act(...) is rounded to BF16 like x. */
void k3_amx_moe(k3_pool *pool, const k3_amx_expert *experts, int64_t n_experts, const int64_t *row0, const float *x,
                float *y, k3_glu_kind kind, float b1, float b2);

/* DSA indexer scores (QLI, attn_ops.h) of T query tokens over the same n key
 * slots: scores[t * lds + i] = k3_qli_scores_ref(q8 + t HI dI, qs + t HI,
 * w + t HI, ...)[i], bit for bit. q8 [T, HI, dI] int8, qs and w [T, HI]; k8
 * rows of dI int8 and ks per slot, as k3_qli_scores. Split over 32-slot
 * panels. Shapes: k3_amx_qli_ok. */
bool k3_amx_qli_ok(int HI, int dI);
void k3_amx_qli_scores(k3_pool *pool, const int8_t *q8, const float *qs, const float *w, int64_t T, int HI, int dI,
                       const int8_t *k8, const float *ks, const int64_t *slots, int64_t n, float *scores, int64_t lds);
/* The same for any HI, dI whose zero-padded shape k3_amx_qli_ok takes (the
 * kernel table's qli_chunk; the same bits). */
bool k3_amx_qli_chunk_fits(int HI, int dI);
void k3_amx_qli_chunk(k3_pool *pool, const int8_t *q8, const float *qs, const float *w, int64_t T, int HI, int dI,
                      const int8_t *k8, const float *ks, const int64_t *slots, int64_t n, float *scores, int64_t lds);

/* The unit's peak on this core: iters rounds of a loop of tile products
 * (2 x 2 accumulators over operands in tiles, no memory traffic); returns
 * the operations done (2 per multiply-add), to be divided by the time. */
double k3_amx_peak_loop(bool int8, int64_t iters);

/* ---- private to src/kernels: the two builds of the kernels ---------------
 * (gemm_amx.c on the unit, gemm_emu_amx.c emulated); amx.c splits the work
 * over threads. One thread each; xb: the activations' B tiles, 1 KB each,
 * k3_amx_btiles(w) per 16 tokens, 64-byte aligned. */
typedef struct k3_amx_ops {
    const char *name;
    /* B tiles of nt (1..16) tokens, rows ldx apart, for w; xs: their int8
     * scales (act8) */
    void (*prep)(const k3_amx_mat *w, const float *x, int64_t ldx, int64_t nt, uint8_t *xb, float *xs);
    /* 32-row panels [p0, p1) of y[t * ldy + r] = x Wᵀ over n tokens */
    void (*rows)(const k3_amx_mat *w, const uint8_t *xb, const float *xs, int64_t n, float *y, int64_t ldy, int64_t p0,
                 int64_t p1);
    /* an expert's gate and up, 16-row strips [s0, s1), act, BF16 h into hb
     * (the down projection's B tiles) */
    void (*up)(const k3_amx_expert *e, const uint8_t *xb, int64_t n, uint8_t *hb, int64_t s0, int64_t s1,
               k3_glu_kind kind, float b1, float b2);
    double (*peak)(bool int8, int64_t iters);
    /* k3_amx_qli_scores over 32-slot panels [p0, p1) */
    void (*qli)(const int8_t *q8, const float *qs, const float *w, int64_t T, int HI, int dI, const int8_t *k8,
                const float *ks, const int64_t *slots, int64_t n, float *scores, int64_t lds, int64_t p0, int64_t p1);
    /* the BF16 dot products (kernels_isa.h), weights as B: the A tiles of
     * nt (1..16) tokens, token t at xr[t] (ceil(cols/32) tiles); 32-row
     * panels [p0, p1) of x Wᵀ for a k3_mat.bf16 matrix or its strips, token
     * t's row r to yr[t] + r (yr NULL: y + t * ldy + r); and an expert's
     * gate and up strips [s0, s1), act, BF16 h into ha (the down
     * projection's A tiles) */
    void (*prep_bf)(const float *const *xr, int64_t nt, int64_t cols, uint8_t *xa);
    void (*rows_bf)(const k3_mat *w, const uint8_t *xa, int64_t n, float *y, int64_t ldy, float *const *yr, int64_t p0,
                    int64_t p1);
    void (*up_bf)(const k3_mat *gate, const k3_mat *up, const uint8_t *xa, int64_t n, uint8_t *ha, int64_t s0,
                  int64_t s1, k3_glu_kind kind, float b1, float b2);
} k3_amx_ops;
extern const k3_amx_ops k3_amx_ops_hw, k3_amx_ops_emu;
/* B tiles per 16 tokens for w: ceil(cols / 32) (BF16), ceil(cols / 64) (INT8). */
int64_t k3_amx_btiles(const k3_amx_mat *w);

#endif /* K3_KERNELS_AMX_H */
