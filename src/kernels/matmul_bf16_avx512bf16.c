/*
 * matmul_bf16_avx512bf16.c -- the BF16 dot products (kernels_isa.h, "BF16
 * dot products") on AVX-512 BF16 (vdpbf16ps): the "avx512-bf16" table's
 * kernels for k3_mat.bf16 matrices, and the AMX table's below its row
 * threshold, where they give the unit's bits.
 *
 * One lane per weight row: a vector is 16 rows' pair of weights (the strips,
 * kernels.h), multiplied by one token's pair of activations broadcast. So a
 * lane adds, per 32-column block, the block's even columns in order into E
 * and its odd ones into O (the strips pair columns 4j with 4j + 2 and 4j + 1
 * with 4j + 3, and vdpbf16ps adds a lane's high product before its low one),
 * then C += E + O: what TDPBF16PS does. Nothing depends on the number of
 * tokens or rows of a call.
 *
 * The weights: K3_W_BF16_S16 is read in place; K3_W_MXFP4_S16 decodes a
 * group of 16 bits a lane into two vectors (vpermw through the E2M1 table,
 * the scale's exponent added); stored BF16 and MXFP4 rows (a matrix left in
 * the mapping, or one whose shape the strips do not take) are converted
 * strip by strip into a buffer (a 16 x 16 transpose a block). The
 * activations are made once per k3_matmul call (prep_x): each token's blocks
 * rounded to BF16 in the E/O order, 16 dwords a block.
 *
 * Loops: per pair of strips (32 rows), chunks of KC blocks (the chunk's
 * weights, 2 x 8 KB, stay in L1 while every token passes), tokens in groups
 * of NT: a register tile of 2 strips x 4 tokens (C, E and O: 24 registers).
 * C goes through y between chunks. At one token the strips stream in
 * address order, each one contiguous.
 */
#include "kernels/kernels_isa.h"
#include "kernels/bf16_avx512.h"
#include "common/error.h"

#include <immintrin.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

#ifndef STREAM_MS
#define STREAM_MS 2 /* strips a pass of the vdpbf16ps stream */
#endif

/* MXFP4 strips on FMAs (fma_strip_mx): calls of fewer than MX_MS1 tokens
 * take one strip a pass (two strips are two more streams for a core that
 * is busy decoding: `build/kbench 1 1 384 1024` and `1024 384`, shuffled
 * from DRAM, 9.6-10.0 and 7.7-8.7 GB/s with two, 10.2-10.6 and 10.0-10.4
 * with one); each pass prefetches the next pass's strips and scales into L2
 * (MX_PFS passes ahead; 0: none), a call the first MX_HEAD bytes of its
 * first strips. */
#ifndef MX_MS1
#define MX_MS1 2
#endif
#ifndef MX_PFS
#define MX_PFS 1
#endif
#ifndef MX_HEAD
#define MX_HEAD 1024
#endif
enum {
    KC = 8,   /* blocks per chunk: 8 KB of a strip */
    NT = 4,   /* tokens per register tile */
    PF = 2048 /* one to four tokens: bytes ahead a strip is prefetched into L2 */
};

/* ---- activations ------------------------------------------------------- */

int64_t k3_bf16_prep_x_avx512(const k3_mat *w, const float *x, int64_t n, float *xp) {
    const int64_t cols = w->cols, nb = (cols + 31) / 32;
    if (xp) {
        const __m512i idx = k3b_idx_eo();
        for (int64_t i = 0; i < n; i++)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = 32 * b;
                _mm512_storeu_si512(xp + (i * nb + b) * 16,
                                    k3b_block(x + i * cols + c0, (int)(cols - c0 < 32 ? cols - c0 : 32), idx));
            }
    }
    return n * nb * 16;
}

/* ---- weights: blocks of a strip in the E/O order ------------------------- */

/* Blocks [b0, b0 + nblk) of strip s as E/O blocks (1 KB each, contiguous):
 * in place for K3_W_BF16_S16, else decoded or converted into buf. */
static const uint8_t *strip_blocks(const k3_mat *w, int64_t s, int64_t b0, int nblk, uint8_t *buf) {
    const int64_t nb = (w->cols + 31) / 32;
    if (w->type == K3_W_BF16_S16) return (const uint8_t *)w->data + (s * nb + b0) * 1024;
    if (w->type == K3_W_MXFP4_S16) {
        const __m512i tbl = k3b_e2m1_table();
        for (int k = 0; k < nblk; k++) {
            const int64_t blk = s * nb + b0 + k;
            const uint8_t *p = (const uint8_t *)w->data + blk * 256;
            const k3b_sc sc = k3b_scales16(w->scale + blk * 16);
            for (int g = 0; g < 4; g++) {
                __m512i v[4];
                k3b_mx4_quad_eo(p + 64 * g, tbl, sc, v);
                for (int i = 0; i < 4; i++) _mm512_store_si512(buf + k * 1024 + 256 * g + 64 * i, v[i]);
            }
        }
        return buf;
    }
    /* stored BF16 or MXFP4 rows */
    K3_ASSERT(w->type == K3_W_BF16 || w->type == K3_W_MXFP4);
    const uint8_t *sc = w->type == K3_W_MXFP4 ? w->scale : NULL;
    for (int k = 0; k < nblk; k++) {
        __m512i r[16];
        k3b_stored_b(w->data, sc, w->rows, w->cols, 16 * s, b0 + k, r);
        for (int j = 0; j < 8; j++) {
            __m512i e, o;
            k3b_eo_from_b(r[2 * j], r[2 * j + 1], &e, &o);
            _mm512_store_si512(buf + k * 1024 + (2 * j) * 64, e);
            _mm512_store_si512(buf + k * 1024 + (2 * j + 1) * 64, o);
        }
    }
    return buf;
}

/* ---- the register tile ---------------------------------------------------- */

/* MS strips (blocks at ws[s], 1 KB apart) x NTK tokens (x: token 0's dwords
 * of the first block, tokens ldx dwords apart) over nblk blocks; C from and
 * to y (token t, strip s at y + t*ldy + 16s, lanes m[s]), or from zero. */
INLINE void tile(const uint8_t *const *ws, const uint32_t *x, int64_t ldx, int nblk, float *y, int64_t ldy,
                 const __mmask16 *m, bool accum, const int MS, const int NTK) {
    __m512 C[2][NT];
    UNROLL for (int s = 0; s < MS; s++) UNROLL for (int t = 0; t < NTK; t++) C[s][t] =
        accum ? _mm512_maskz_loadu_ps(m[s], y + t * ldy + 16 * s) : _mm512_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        __m512 E[2][NT], O[2][NT];
        UNROLL for (int s = 0; s < MS; s++) UNROLL for (int t = 0; t < NTK; t++) E[s][t] = O[s][t] =
            _mm512_setzero_ps();
        UNROLL for (int j = 0; j < 8; j++) {
            __m512bh we[2], wo[2];
            UNROLL for (int s = 0; s < MS; s++) {
                we[s] = (__m512bh)_mm512_loadu_si512(ws[s] + b * 1024 + (2 * j) * 64);
                wo[s] = (__m512bh)_mm512_loadu_si512(ws[s] + b * 1024 + (2 * j + 1) * 64);
            }
            UNROLL for (int t = 0; t < NTK; t++) {
                const uint32_t *xt = x + t * ldx + b * 16 + 2 * j;
                const __m512bh xe = (__m512bh)_mm512_set1_epi32((int)xt[0]);
                const __m512bh xo = (__m512bh)_mm512_set1_epi32((int)xt[1]);
                UNROLL for (int s = 0; s < MS; s++) {
                    E[s][t] = _mm512_dpbf16_ps(E[s][t], we[s], xe);
                    O[s][t] = _mm512_dpbf16_ps(O[s][t], wo[s], xo);
                }
            }
        }
        UNROLL for (int s = 0; s < MS; s++) UNROLL for (int t = 0; t < NTK; t++) C[s][t] =
            _mm512_add_ps(C[s][t], _mm512_add_ps(E[s][t], O[s][t]));
    }
    UNROLL for (int s = 0; s < MS; s++) UNROLL for (int t = 0; t < NTK; t++)
        _mm512_mask_storeu_ps(y + t * ldy + 16 * s, m[s], C[s][t]);
}

static void tile_any(int ms, int nt, const uint8_t *const *ws, const uint32_t *x, int64_t ldx, int nblk, float *y,
                     int64_t ldy, const __mmask16 *m, bool accum) {
#define C(MS, NTK) \
    case (MS)*8 + (NTK): tile(ws, x, ldx, nblk, y, ldy, m, accum, MS, NTK); break;
    /* clang-format off */
    switch (ms * 8 + nt) {
    C(1, 1) C(1, 2) C(1, 3) C(1, 4) C(2, 1) C(2, 2) C(2, 3) C(2, 4)
    default: K3_ASSERT(!"bf16 tile: bad shape");
    }
    /* clang-format on */
#undef C
}

/* ---- one to NT tokens: the strips stream ------------------------------------- */

/* The weights of quad g of block blk of a strip type as 4 E/O vectors
 * (v[2h], v[2h + 1]: pair 2g + h), prefetched pf bytes ahead (a prefetch
 * before each line's load, not a burst per block: 34 GB/s against 28 on two
 * cores of the Xeon); an MXFP4 quad decoded in registers. */
INLINE void quad_of(const k3_mat *w, int64_t blk, int g, __m512i tbl, k3b_sc sc, __m512i v[4], const int MX,
                    const int pf) {
    const uint8_t *p = (const uint8_t *)w->data + blk * (MX ? 256 : 1024);
    if (MX) {
        _mm_prefetch((const char *)p + 64 * g + pf / 2, _MM_HINT_T1);
        k3b_mx4_quad_eo(p + 64 * g, tbl, sc, v);
    } else {
        UNROLL for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char *)p + 256 * g + 64 * i + pf, _MM_HINT_T1);
            v[i] = _mm512_loadu_si512((const void *)(p + 256 * g + 64 * i));
        }
    }
}

/* An MXFP4 strip block's scales (the scale array prefetched pf / 8 ahead
 * every 4 blocks). */
INLINE k3b_sc scales_of(const k3_mat *w, int64_t blk, int64_t b, const int pf) {
    if (b % 4 == 0) _mm_prefetch((const char *)w->scale + blk * 16 + pf / 8, _MM_HINT_T1);
    return k3b_scales16(w->scale + blk * 16);
}

/* MS strips from s of a strip type against NTK <= NT tokens (x: token 0's
 * dwords, tokens ldx apart): every block in address order with C in
 * registers; y as tile's (strip i at y + 16i, lanes m[i]). Two strips a
 * pass give each block twice the independent sums: one strip's E and O
 * are each a chain of 8 vdpbf16ps a block, which at one token held an
 * MXFP4 block (256 bytes) to the chain's latency. */
INLINE void stream_strip(const k3_mat *w, int64_t s, const uint32_t *x, int64_t ldx, float *y, int64_t ldy,
                         const __mmask16 *m, const int MS, const int NTK, const int MX) {
    const int64_t nb = w->cols / 32;
    const __m512i tbl = k3b_e2m1_table();
    __m512 C[2][NT];
    UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++) C[i][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        k3b_sc sc[2];
        sc[0] = sc[1] = (k3b_sc){0};
        if (MX) UNROLL for (int i = 0; i < MS; i++) sc[i] = scales_of(w, (s + i) * nb + b, b, PF);
        __m512 E[2][NT], O[2][NT];
        UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++) E[i][t] = O[i][t] =
            _mm512_setzero_ps();
        UNROLL for (int g = 0; g < 4; g++) {
            __m512i v[2][4];
            UNROLL for (int i = 0; i < MS; i++) quad_of(w, (s + i) * nb + b, g, tbl, sc[i], v[i], MX, PF);
            UNROLL for (int h = 0; h < 2; h++) {
                const int j = 2 * g + h;
                UNROLL for (int t = 0; t < NTK; t++) {
                    const uint32_t *xt = x + t * ldx + b * 16 + 2 * j;
                    const __m512bh xe = (__m512bh)_mm512_set1_epi32((int)xt[0]);
                    const __m512bh xo = (__m512bh)_mm512_set1_epi32((int)xt[1]);
                    UNROLL for (int i = 0; i < MS; i++) {
                        E[i][t] = _mm512_dpbf16_ps(E[i][t], (__m512bh)v[i][2 * h], xe);
                        O[i][t] = _mm512_dpbf16_ps(O[i][t], (__m512bh)v[i][2 * h + 1], xo);
                    }
                }
            }
        }
        UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++) C[i][t] =
            _mm512_add_ps(C[i][t], _mm512_add_ps(E[i][t], O[i][t]));
    }
    UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++)
        _mm512_mask_storeu_ps(y + t * ldy + 16 * i, m[i], C[i][t]);
}

static void stream_any(int ms, int nt, bool mx, const k3_mat *w, int64_t s, const uint32_t *x, int64_t ldx, float *y,
                       int64_t ldy, const __mmask16 *m) {
#define C(MS, NTK, MX) \
    case ((MS)*8 + (NTK)) * 2 + (MX): stream_strip(w, s, x, ldx, y, ldy, m, MS, NTK, MX); break;
    /* clang-format off */
    switch ((ms * 8 + nt) * 2 + mx) {
    C(1, 1, 0) C(1, 1, 1) C(1, 2, 0) C(1, 2, 1) C(1, 3, 0) C(1, 3, 1) C(1, 4, 0) C(1, 4, 1)
    C(2, 1, 0) C(2, 1, 1) C(2, 2, 0) C(2, 2, 1) C(2, 3, 0) C(2, 3, 1) C(2, 4, 0) C(2, 4, 1)
    default: K3_ASSERT(!"bf16 stream: bad shape");
    }
    /* clang-format on */
#undef C
}

/* The lanes of strips [s, s + ms) that rows [.., r1) keep. */
static void strip_masks(int64_t s, int ms, int64_t r1, __mmask16 *m) {
    for (int i = 0; i < ms; i++) {
        const int64_t left = r1 - 16 * (s + i);
        m[i] = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    }
}

/* ---- fp32 FMAs on the widened pairs ------------------------------------------
 *
 * A lane's vdpbf16ps step is C + hi_w * hi_x, then + lo_w * lo_x, each a
 * rounding of an exact product added (two BF16 make at most 16 significant
 * bits), inputs below 2^-126 read as zero and results below it flushed. An
 * fp32 FMA on the two halves widened (a BF16 is the top half of its fp32)
 * rounds the same exact sum once: the same bits, under MXCSR FTZ | DAZ,
 * wherever no product is below 2^-126 (vdpbf16ps flushes such a product
 * before it adds it; the FMA does not) or above the fp32 range. So the FMA
 * path takes a call only where every weight of the matrix (k3_mat.wrange:
 * 2^-64 <= |w| < 2^64, or zero) and every activation of its tokens (the
 * prepared flag: 2^-60 <= |x| < 2^60, or zero) keep each product within
 * [2^-124, 2^124); any other call runs vdpbf16ps. Where vdpbf16ps issues at
 * half the FMA's rate a pair (two products of 16 lanes: one instruction
 * every 2 cycles) costs 1 cycle, and the widening (an and and a shift a
 * vector of weights) is shared by the tokens of the pass: on the Xeon with
 * AMX the small-row products become bound by the bandwidth, not by the dot
 * unit (dispatch.c picks this table per CPU, by the two loops' rates).
 *
 * The prepared activations of this path: per token the E/O dwords (nb x 16,
 * as k3_bf16_prep_x_avx512), then the same values widened to fp32 (nb x 32:
 * float 2k the high half of dword k, 2k + 1 its low half), then 16 dwords,
 * the first 1 where the token's activations are in range. */

enum { NF = 8 }; /* tokens per FMA pass: 2 x 8 accumulators and the widened weights */

/* the E/O dwords, the widened floats, the flag: one token's prepared floats */
static inline int64_t fma_ld(int64_t nb) { return nb * 48 + 16; }

int64_t k3_bf16_prep_x_avx512_fma(const k3_mat *w, const float *x, int64_t n, float *xp) {
    const int64_t cols = w->cols, nb = (cols + 31) / 32, ld = fma_ld(nb);
    if (xp) {
        const __m512i idx = k3b_idx_eo(), hi = _mm512_set1_epi32((int)0xffff0000);
        const __m512i lo16 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi16 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        const __m512i ff = _mm512_set1_epi16(0xff), e0 = _mm512_set1_epi16(127 - 60), span = _mm512_set1_epi16(119);
        for (int64_t i = 0; i < n; i++) {
            float *xi = xp + i * ld;
            __mmask32 bad = 0;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = 32 * b;
                const __m512i d = k3b_block(x + i * cols + c0, (int)(cols - c0 < 32 ? cols - c0 : 32), idx);
                _mm512_storeu_si512(xi + b * 16, d);
                const __m512i h = _mm512_and_si512(d, hi), l = _mm512_slli_epi32(d, 16);
                _mm512_storeu_si512(xi + nb * 16 + b * 32, _mm512_permutex2var_epi32(h, lo16, l));
                _mm512_storeu_si512(xi + nb * 16 + b * 32 + 16, _mm512_permutex2var_epi32(h, hi16, l));
                /* a word's exponent: 0 (zero, or read as zero) or 67..186 */
                const __m512i e = _mm512_and_si512(_mm512_srli_epi16(d, 7), ff);
                bad |= _mm512_test_epi16_mask(e, e) & _mm512_cmpgt_epu16_mask(_mm512_sub_epi16(e, e0), span);
            }
            _mm512_storeu_si512(xi + nb * 48, _mm512_setzero_si512());
            ((uint32_t *)xi)[nb * 48] = bad == 0;
        }
    }
    return n * ld;
}

/* Strip s against NTK <= NF tokens (xf: token 0's widened floats, tokens
 * ldx floats apart) on FMAs, every block in address order (prefetched as
 * stream_strip's), the block sums through cb; y as tile's. */
/* MS strips from s against NTK <= NF tokens (xf: token 0's widened floats,
 * tokens ldx floats apart) on FMAs, every block in address order (loaded
 * as stream_strip's), the block sums through cb; y as stream_strip's. An
 * E or O sum is a chain of 16 FMAs a block: two strips a pass where the
 * tokens are few. */
INLINE void fma_strip(const k3_mat *w, int64_t s, const float *xf, int64_t ldx, float *y, int64_t ldy,
                      const __mmask16 *m, const int MS, const int NTK, const int MX) {
    const int64_t nb = w->cols / 32;
    const __m512i tbl = k3b_e2m1_table(), hi = _mm512_set1_epi32((int)0xffff0000);
    _Alignas(64) float cb[2][NF][16];
    UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++)
        _mm512_store_ps(cb[i][t], _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        k3b_sc sc[2];
        sc[0] = sc[1] = (k3b_sc){0};
        if (MX) UNROLL for (int i = 0; i < MS; i++) sc[i] = scales_of(w, (s + i) * nb + b, b, PF);
        __m512 E[2][NF], O[2][NF];
        UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++) E[i][t] = O[i][t] =
            _mm512_setzero_ps();
        UNROLL for (int g = 0; g < 4; g++) {
            __m512i v[2][4];
            UNROLL for (int i = 0; i < MS; i++) quad_of(w, (s + i) * nb + b, g, tbl, sc[i], v[i], MX, PF);
            UNROLL for (int h = 0; h < 2; h++) {
                const int j = 2 * g + h;
                UNROLL for (int i = 0; i < MS; i++) {
                    const __m512 eh = _mm512_castsi512_ps(_mm512_and_si512(v[i][2 * h], hi));
                    const __m512 el = _mm512_castsi512_ps(_mm512_slli_epi32(v[i][2 * h], 16));
                    const __m512 oh = _mm512_castsi512_ps(_mm512_and_si512(v[i][2 * h + 1], hi));
                    const __m512 ol = _mm512_castsi512_ps(_mm512_slli_epi32(v[i][2 * h + 1], 16));
                    UNROLL for (int t = 0; t < NTK; t++) {
                        const float *xt = xf + t * ldx + b * 32 + 4 * j;
                        E[i][t] = _mm512_fmadd_ps(eh, _mm512_set1_ps(xt[0]), E[i][t]);
                        O[i][t] = _mm512_fmadd_ps(oh, _mm512_set1_ps(xt[2]), O[i][t]);
                        E[i][t] = _mm512_fmadd_ps(el, _mm512_set1_ps(xt[1]), E[i][t]);
                        O[i][t] = _mm512_fmadd_ps(ol, _mm512_set1_ps(xt[3]), O[i][t]);
                    }
                }
            }
        }
        UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++)
            _mm512_store_ps(cb[i][t], _mm512_add_ps(_mm512_load_ps(cb[i][t]), _mm512_add_ps(E[i][t], O[i][t])));
    }
    UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++)
        _mm512_mask_storeu_ps(y + t * ldy + 16 * i, m[i], _mm512_load_ps(cb[i][t]));
}

/* MXFP4 strips on FMAs: the codes decoded straight to fp32 (vpermps reads a
 * nibble's 4 bits as its index: nibble k of a quad's dword, k = 4, 0, 5, 1
 * are pair 2g's E high, E low, O high, O low; 6, 2, 7, 3 pair 2g + 1's),
 * unscaled, and a block's E and O multiplied by its scales at its end.
 * (c s) x = s (c x) exactly and the sums round alike where every partial
 * sum is normal both ways: with |x| in [2^-60, 2^60) a nonzero unscaled
 * sum is a multiple of 2^-68 below 2^67, so scales 69..187 (k3_mat_wrange)
 * keep both sides normal. */
INLINE void fma_strip_mx(const k3_mat *w, int64_t s, const float *xf, int64_t ldx, float *y, int64_t ldy,
                         const __mmask16 *m, const int MS, const int NTK) {
    const int64_t nb = w->cols / 32;
    const uint8_t *pf = (const uint8_t *)w->data + (s + MX_PFS * MS) * nb * 256,
                  *pfs = w->scale + (s + MX_PFS * MS) * nb * 16;
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                      -3.0f, -4.0f, -6.0f);
    _Alignas(64) float cb[2][NF][16];
    UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++)
        _mm512_store_ps(cb[i][t], _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        __m512 E[2][NF], O[2][NF];
        UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++) E[i][t] = O[i][t] =
            _mm512_setzero_ps();
        /* the next pass's strips (the MS after these, contiguous), MS x 256
         * bytes and MS x 16 bytes of scales a block: one pass ahead */
        if (MX_PFS > 0) {
            UNROLL for (int k = 0; k < 4 * MS; k++)
                _mm_prefetch((const char *)pf + (MS * b) * 256 + 64 * k, _MM_HINT_T1);
            _mm_prefetch((const char *)pfs + (MS * b) * 16, _MM_HINT_T1);
        }
        UNROLL for (int g = 0; g < 4; g++) {
            __m512i d[2];
            UNROLL for (int i = 0; i < MS; i++) {
                const uint8_t *p = (const uint8_t *)w->data + ((s + i) * nb + b) * 256 + 64 * g;
                d[i] = _mm512_loadu_si512((const void *)p);
            }
            UNROLL for (int h = 0; h < 2; h++) {
                const int j = 2 * g + h;
                UNROLL for (int i = 0; i < MS; i++) {
                    const __m512 eh = _mm512_permutexvar_ps(_mm512_srli_epi32(d[i], 16 + 8 * h), lut);
                    const __m512 el = _mm512_permutexvar_ps(h ? _mm512_srli_epi32(d[i], 8) : d[i], lut);
                    const __m512 oh = _mm512_permutexvar_ps(_mm512_srli_epi32(d[i], 20 + 8 * h), lut);
                    const __m512 ol = _mm512_permutexvar_ps(_mm512_srli_epi32(d[i], 4 + 8 * h), lut);
                    UNROLL for (int t = 0; t < NTK; t++) {
                        const float *xt = xf + t * ldx + b * 32 + 4 * j;
                        E[i][t] = _mm512_fmadd_ps(eh, _mm512_set1_ps(xt[0]), E[i][t]);
                        O[i][t] = _mm512_fmadd_ps(oh, _mm512_set1_ps(xt[2]), O[i][t]);
                        E[i][t] = _mm512_fmadd_ps(el, _mm512_set1_ps(xt[1]), E[i][t]);
                        O[i][t] = _mm512_fmadd_ps(ol, _mm512_set1_ps(xt[3]), O[i][t]);
                    }
                }
            }
        }
        UNROLL for (int i = 0; i < MS; i++) {
            const int64_t blk = (s + i) * nb + b;
            /* 2^(e-127) from the byte e (a block of zeros may carry 0: 0 x 0) */
            const __m512 sv = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->scale + blk * 16))), 23));
            UNROLL for (int t = 0; t < NTK; t++)
                _mm512_store_ps(cb[i][t],
                                _mm512_add_ps(_mm512_load_ps(cb[i][t]),
                                              _mm512_add_ps(_mm512_mul_ps(E[i][t], sv), _mm512_mul_ps(O[i][t], sv))));
        }
    }
    UNROLL for (int i = 0; i < MS; i++) UNROLL for (int t = 0; t < NTK; t++)
        _mm512_mask_storeu_ps(y + t * ldy + 16 * i, m[i], _mm512_load_ps(cb[i][t]));
}

#ifndef FMA_MX_MIN
#define FMA_MX_MIN 1 /* MXFP4 from one token on */
#endif
#ifndef FMA2
#define FMA2 3 /* up to FMA2 tokens a pass take two strips */
#endif

static void fma_any(int ms, int nt, bool mx, const k3_mat *w, int64_t s, const float *xf, int64_t ldx, float *y,
                    int64_t ldy, const __mmask16 *m) {
#define C(MS, NTK, MX) \
    case ((MS)*16 + (NTK)) * 2 + (MX): \
        if (MX) fma_strip_mx(w, s, xf, ldx, y, ldy, m, MS, NTK); \
        else fma_strip(w, s, xf, ldx, y, ldy, m, MS, NTK, 0); \
        break;
    /* clang-format off */
    switch ((ms * 16 + nt) * 2 + mx) {
    C(1, 1, 0) C(1, 1, 1) C(1, 2, 0) C(1, 2, 1) C(1, 3, 0) C(1, 3, 1) C(1, 4, 0) C(1, 4, 1)
    C(1, 5, 0) C(1, 5, 1) C(1, 6, 0) C(1, 6, 1) C(1, 7, 0) C(1, 7, 1) C(1, 8, 0) C(1, 8, 1)
    C(2, 1, 0) C(2, 1, 1) C(2, 2, 0) C(2, 2, 1) C(2, 3, 0) C(2, 3, 1)
    default: K3_ASSERT(!"bf16 fma: bad shape");
    }
    /* clang-format on */
#undef C
}

/* ---- the kernels of the table ------------------------------------------------- */

/* vdpbf16ps: tokens ldx dwords apart (x as prep made it) */
static void rows_dp(const k3_mat *w, const uint32_t *x, int64_t ldx, int64_t n, float *y, int64_t ldy, int64_t r0,
                    int64_t r1) {
    K3_ASSERT(r0 % 16 == 0);
    const int64_t nb = (w->cols + 31) / 32, s0 = r0 / 16, s1 = (r1 + 15) / 16;
    const bool strip_type = w->type == K3_W_BF16_S16 || w->type == K3_W_MXFP4_S16;
    if (strip_type && n <= NT) {
        for (int64_t s = s0; s < s1;) {
            const int ms = s + 1 < s1 ? STREAM_MS : 1;
            __mmask16 m[2];
            strip_masks(s, ms, r1, m);
            stream_any(ms, (int)n, w->type == K3_W_MXFP4_S16, w, s, x, ldx, y + 16 * s, ldy, m);
            s += ms;
        }
        return;
    }
    _Alignas(64) uint8_t buf[2][KC * 1024];
    for (int64_t s = s0; s < s1; s += 2) {
        const int ms = s + 1 < s1 ? 2 : 1;
        __mmask16 m[2];
        for (int i = 0; i < ms; i++) {
            const int64_t left = r1 - 16 * (s + i);
            m[i] = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        }
        for (int64_t k0 = 0; k0 < nb; k0 += KC) {
            const int nblk = (int)(nb - k0 < KC ? nb - k0 : KC);
            const uint8_t *ws[2];
            for (int i = 0; i < ms; i++) ws[i] = strip_blocks(w, s + i, k0, nblk, buf[i]);
            for (int64_t t = 0; t < n; t += NT) {
                const int nt = (int)(n - t < NT ? n - t : NT);
                tile_any(ms, nt, ws, x + t * ldx + k0 * 16, ldx, nblk, y + t * ldy + 16 * s, ldy, m, k0 > 0);
            }
        }
    }
}

/* The adds between the products (E + O, C + ...) flushed as the products
 * are (kernels_isa.h: results below 2^-126 flushed), whatever the caller's
 * MXCSR: FTZ | DAZ for the duration of a call. */
static unsigned csr_ftz(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    return csr;
}

void k3_bf16_rows_avx512(const k3_mat *w, const float *xp, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const unsigned csr = csr_ftz();
    rows_dp(w, (const uint32_t *)xp, (w->cols + 31) / 32 * 16, n, y, ldy, r0, r1);
    _mm_setcsr(csr);
}

/* The table's kernel where the FMAs outrun vdpbf16ps: calls of 2 to
 * FMA_MAX tokens on the strips whose weights and activations are in range
 * on FMAs, NF tokens a pass (the strip's 16 to 64 KB stay in L2 for the
 * next pass); every other call on vdpbf16ps. Both give the same bits. */
enum { FMA_MAX = 16 };

void k3_bf16_rows_avx512_fma(const k3_mat *w, const float *xp, int64_t n, float *y, int64_t ldy, int64_t r0,
                             int64_t r1) {
    K3_ASSERT(r0 % 16 == 0);
    const int64_t nb = (w->cols + 31) / 32, ld = fma_ld(nb);
    const unsigned csr = csr_ftz();
    const bool mx = w->type == K3_W_MXFP4_S16;
    bool fma = w->wrange && (w->type == K3_W_BF16_S16 || mx) && n >= (mx ? FMA_MX_MIN : 2) && n <= FMA_MAX;
    for (int64_t i = 0; fma && i < n; i++) fma = ((const uint32_t *)xp)[i * ld + nb * 48] != 0;
    if (!fma) {
        rows_dp(w, (const uint32_t *)xp, ld, n, y, ldy, r0, r1);
        _mm_setcsr(csr);
        return;
    }
    const int64_t np = (n + NF - 1) / NF, s1 = (r1 + 15) / 16; /* passes of even size: 9 tokens as 5 + 4 */
    if (mx && MX_HEAD > 0) { /* the first pass's first blocks (each pass prefetches the next) */
        const int64_t s0 = r0 / 16, ms0 = s0 + 1 < s1 && n <= FMA2 && n >= MX_MS1 ? 2 : 1;
        for (int64_t i = 0; i < ms0; i++) {
            const char *p = (const char *)w->data + (s0 + i) * nb * 256;
            for (int64_t o = 0; o < MX_HEAD && o < nb * 256; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
        }
        for (int64_t o = 0; o < ms0 * nb * 16; o += 64)
            _mm_prefetch((const char *)w->scale + s0 * nb * 16 + o, _MM_HINT_T1);
    }
    for (int64_t s = r0 / 16; s < s1;) {
        const int ms = s + 1 < s1 && n <= FMA2 && (!mx || n >= MX_MS1) ? 2 : 1;
        __mmask16 m[2];
        strip_masks(s, ms, r1, m);
        for (int64_t q = 0, t = 0; q < np; q++) {
            const int nt = (int)(n * (q + 1) / np - t);
            fma_any(ms, nt, mx, w, s, xp + t * ld + nb * 16, ld, y + t * ldy + 16 * s, ldy, m);
            t += nt;
        }
        s += ms;
    }
    _mm_setcsr(csr);
}
