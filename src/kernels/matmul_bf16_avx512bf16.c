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

/* Strip s of a strip type against NTK <= NT tokens (x: token 0's dwords,
 * tokens ldx apart): every block in address order with C in registers, an
 * MXFP4 block decoded in registers; y as tile's. */
INLINE void stream_strip(const k3_mat *w, int64_t s, const uint32_t *x, int64_t ldx, float *y, int64_t ldy, __mmask16 m,
                         const int NTK, const int MX) {
    const int64_t nb = w->cols / 32;
    const __m512i tbl = k3b_e2m1_table();
    __m512 C[NT];
    UNROLL for (int t = 0; t < NTK; t++) C[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = s * nb + b;
        const uint8_t *p = (const uint8_t *)w->data + blk * (MX ? 256 : 1024);
        k3b_sc sc = {0};
        if (MX) {
            if (b % 4 == 0) _mm_prefetch((const char *)w->scale + blk * 16 + PF / 8, _MM_HINT_T1);
            sc = k3b_scales16(w->scale + blk * 16);
        }
        __m512 E[NT], O[NT];
        UNROLL for (int t = 0; t < NTK; t++) E[t] = O[t] = _mm512_setzero_ps();
        UNROLL for (int g = 0; g < 4; g++) {
            /* a prefetch before each line's load, not a burst per block:
             * 34 GB/s against 28 on two cores of the Xeon */
            __m512i v[4];
            if (MX) {
                _mm_prefetch((const char *)p + 64 * g + PF / 2, _MM_HINT_T1);
                k3b_mx4_quad_eo(p + 64 * g, tbl, sc, v);
            } else {
                UNROLL for (int i = 0; i < 4; i++) {
                    _mm_prefetch((const char *)p + 256 * g + 64 * i + PF, _MM_HINT_T1);
                    v[i] = _mm512_loadu_si512((const void *)(p + 256 * g + 64 * i));
                }
            }
            UNROLL for (int h = 0; h < 2; h++) {
                const int j = 2 * g + h;
                UNROLL for (int t = 0; t < NTK; t++) {
                    const uint32_t *xt = x + t * ldx + b * 16 + 2 * j;
                    E[t] = _mm512_dpbf16_ps(E[t], (__m512bh)v[2 * h], (__m512bh)_mm512_set1_epi32((int)xt[0]));
                    O[t] = _mm512_dpbf16_ps(O[t], (__m512bh)v[2 * h + 1], (__m512bh)_mm512_set1_epi32((int)xt[1]));
                }
            }
        }
        UNROLL for (int t = 0; t < NTK; t++) C[t] = _mm512_add_ps(C[t], _mm512_add_ps(E[t], O[t]));
    }
    UNROLL for (int t = 0; t < NTK; t++) _mm512_mask_storeu_ps(y + t * ldy, m, C[t]);
}

static void stream_any(int nt, bool mx, const k3_mat *w, int64_t s, const uint32_t *x, int64_t ldx, float *y,
                       int64_t ldy, __mmask16 m) {
#define C(NTK, MX) \
    case (NTK)*2 + (MX): stream_strip(w, s, x, ldx, y, ldy, m, NTK, MX); break;
    /* clang-format off */
    switch (nt * 2 + mx) {
    C(1, 0) C(1, 1) C(2, 0) C(2, 1) C(3, 0) C(3, 1) C(4, 0) C(4, 1)
    default: K3_ASSERT(!"bf16 stream: bad shape");
    }
    /* clang-format on */
#undef C
}

/* ---- the kernel of the table ------------------------------------------------- */

void k3_bf16_rows_avx512(const k3_mat *w, const float *xp, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    K3_ASSERT(r0 % 16 == 0);
    const int64_t nb = (w->cols + 31) / 32, s0 = r0 / 16, s1 = (r1 + 15) / 16;
    const uint32_t *x = (const uint32_t *)xp;
    const bool strip_type = w->type == K3_W_BF16_S16 || w->type == K3_W_MXFP4_S16;
    if (strip_type && n <= NT) {
        for (int64_t s = s0; s < s1; s++) {
            const int64_t left = r1 - 16 * s;
            const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            stream_any((int)n, w->type == K3_W_MXFP4_S16, w, s, x, nb * 16, y + 16 * s, ldy, m);
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
                tile_any(ms, nt, ws, x + (t * nb + k0) * 16, nb * 16, nblk, y + t * ldy + 16 * s, ldy, m, k0 > 0);
            }
        }
    }
}
