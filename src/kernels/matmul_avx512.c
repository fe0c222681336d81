/*
 * matmul_avx512.c -- AVX-512 (F, BW, VL) kernels of the "avx512" table (dispatch.c).
 * Mirrors ref.c (k3_matmul_rows_ref, k3_dot_ref, k3_axpy_ref). Same structure as
 * matmul_avx2.c; read that file's header first. Differences:
 *
 *   - 16-lane vectors, KC = 1024, a 4x6 register tile, RB = 24 (a 96 KB
 *     stack buffer: 12 rows measured 10-15% slower); column tails use masked
 *     loads.
 *   - MXFP4 decodes through vpermps with a 16-entry fp32 table (the E2M1
 *     codes, sign included) times the block scale. Each entry is an exact
 *     product, so decoded weights equal the reference's bit for bit.
 *     vpermps reads only the low 4 index bits: the zero-extended bytes give
 *     the even columns of a 32-column block, the same bytes shifted right by
 *     4 the odd ones. Rather than reorder the weights, x is "deinterleaved"
 *     (each 32-block as its 16 even then 16 odd columns), which is ~1.4x
 *     faster. So MXFP4's canonical order: per KC block, one accumulator for
 *     the even and one for the odd columns, added, then reduced.
 *   - BF16 with K % 32 == 0 takes the same "paired" order: each 32-bit word
 *     of a row holds an even column (low half) and an odd one (high half),
 *     so a shift and a mask turn 64 bytes into 32 fp32 weights with no
 *     shuffle. At n = 1 it streams one row at a time, in address order: the
 *     dense path's 8 rows in flight (8 streams a page apart) read 2048^2
 *     matrices at 14 GB/s on one thread, one row at a time 22-25.
 *   - Paired matrices take x already deinterleaved (prep_x, once per
 *     k3_matmul call), whichever path runs.
 *
 * On Zen 4, 512-bit ops run as two 256-bit halves, so the FMA peak equals
 * AVX2's; the gains are the 32 registers, the MXFP4 decode and the tails.
 */
#include "kernels/kernels_isa.h"
#include "kernels/hsum_avx512.h"
#include "common/error.h"

#include <immintrin.h>
#include <math.h>

#define UNROLL _Pragma("GCC unroll 16")
#define INLINE static inline __attribute__((always_inline))

enum {
    KC = 1024,                  /* columns per block of the canonical order */
    RB = 24,                    /* tiled: weight rows per block (96 KB of fp32) */
    TN = 6,                     /* tiled: weight rows per register tile (4 x 6) */
    TN_MX = 2,                  /* the same for MXFP4 (two accumulators each) */
    ROWS_OUTER_BYTES = 1 << 20, /* tiled: x up to this size -> row blocks outermost */
    STREAM_MAX_N = 64,          /* dense types stream up to this many x rows */
    STREAM_PAIRED_N = 16,       /* paired BF16 the same */
    PF_AHEAD = 4096,            /* n = 1: bytes ahead a row's weights are prefetched into L2 */
    STREAM_ROWS = 24,           /* weight rows per group in multi-pass streaming */
};

/* ---- loaders ---------------------------------------------------------- */

/* 16 weights of a row from column k, lanes outside m zero; wt a constant. */
INLINE __m512 ld16m(int wt, const void *row, int64_t k, __mmask16 m) {
    switch (wt) {
    case K3_W_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k));
    case K3_W_BF16: {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
    default: return _mm512_maskz_loadu_ps(m, (const float *)row + k);
    }
}

INLINE __m512 ld16(int wt, const void *row, int64_t k) {
    switch (wt) {
    case K3_W_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k)));
    case K3_W_BF16: {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
    default: return _mm512_loadu_ps((const float *)row + k);
    }
}

INLINE __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

INLINE size_t elem_size(int wt) { return wt == K3_W_F32 ? 4 : 2; }

/* 16 E8M0 bytes -> 2^(e-127) as fp32 (0 -> 2^-127, 255 -> NaN), as k3_mx_scale. */
INLINE __m512 mx_scales16(const uint8_t *sc) {
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc));
    __m512i b = _mm512_slli_epi32(e, 23);
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(b);
}

/* 32 MXFP4 weights (16 bytes at p, block scale s): even and odd columns. */
INLINE void mx_dec32(const uint8_t *p, float s, __m512 *we, __m512 *wo) {
    const __m512 tbl = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                      -3.0f, -4.0f, -6.0f);
    __m512 ts = _mm512_mul_ps(tbl, _mm512_set1_ps(s));
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *we = _mm512_permutexvar_ps(v, ts);
    *wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts);
}

/* 32 BF16 weights (64 bytes at p): even and odd columns. */
INLINE void bf_dec32(const uint8_t *p, __m512 *we, __m512 *wo) {
    __m512i v = _mm512_loadu_si512((const void *)p);
    *we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *wo = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Whether w sums in the paired order (XP = 1 below): MXFP4, and BF16 whose
 * rows are whole 32-column blocks. */
INLINE bool paired(const k3_mat *w) { return w->type == K3_W_MXFP4 || (w->type == K3_W_BF16 && w->cols % 32 == 0); }

/* Bytes of one row's columns [0, k) of a paired matrix. */
INLINE size_t paired_bytes(int wt, int64_t k) { return wt == K3_W_MXFP4 ? (size_t)k / 2 : (size_t)k * 2; }

/* Columns [k, k+32) of x as its even and odd columns. */
INLINE void x_split32(const float *x, __m512 *xe, __m512 *xo) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    *xe = _mm512_permutex2var_ps(a, ev, b);
    *xo = _mm512_permutex2var_ps(a, od, b);
}

/* ---- reductions: one fixed tree, so every path rounds alike ----------- */

INLINE void hsum_all(const __m512 *v, int cnt, float *s) {
    int q = 0;
    UNROLL for (; q + 4 <= cnt; q += 4) _mm_storeu_ps(s + q, k3_hsum4(v[q], v[q + 1], v[q + 2], v[q + 3]));
    UNROLL for (; q < cnt; q++) s[q] = k3_hsum(v[q]);
}

/* Keeps v in a register: otherwise GCC folds the load into every FMA that
 * uses it (one load per FMA) and the register tile becomes load-bound. */
INLINE __m512 in_reg(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

/* ---- the register tile ------------------------------------------------ */

/* MR activation rows x NR weight rows over one column block of K <= KC.
 * w: first weight row, rows ldw elements apart, type wt.
 * y[i*ldy + j] = (accum ? y : 0) + block sum, the canonical order:
 *   XP = 0 (dense): one accumulator, 16 columns a step, masked tail;
 *   XP = 1 (MXFP4, K % 32 == 0): w and x both deinterleaved (each 32-block
 *          as 16 even then 16 odd columns), even and odd accumulators. */
INLINE void tile(int wt, const void *w, int64_t ldw, const float *x, int64_t ldx, int64_t K, float *y, int64_t ldy,
                 bool accum, const int MR, const int NR, const int XP) {
    const char *wr[8];
    UNROLL for (int j = 0; j < NR; j++) wr[j] = (const char *)w + (size_t)j * ldw * elem_size(wt);
    __m512 acc[4][8][2];
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) acc[i][j][0] = acc[i][j][1] =
        _mm512_setzero_ps();
    if (XP) {
        for (int64_t k = 0; k < K; k += 32) {
            __m512 we[8], wo[8];
            UNROLL for (int j = 0; j < NR; j++) {
                we[j] = ld16(K3_W_F32, wr[j], k);
                wo[j] = ld16(K3_W_F32, wr[j], k + 16);
            }
            UNROLL for (int i = 0; i < MR; i++) {
                __m512 xe = in_reg(_mm512_loadu_ps(x + i * ldx + k));
                __m512 xo = in_reg(_mm512_loadu_ps(x + i * ldx + k + 16));
                UNROLL for (int j = 0; j < NR; j++) {
                    acc[i][j][0] = _mm512_fmadd_ps(we[j], xe, acc[i][j][0]);
                    acc[i][j][1] = _mm512_fmadd_ps(wo[j], xo, acc[i][j][1]);
                }
            }
        }
    } else {
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            __m512 wv[8];
            UNROLL for (int j = 0; j < NR; j++) wv[j] = ld16(wt, wr[j], k);
            UNROLL for (int i = 0; i < MR; i++) {
                __m512 xv = in_reg(_mm512_loadu_ps(x + i * ldx + k));
                UNROLL for (int j = 0; j < NR; j++) acc[i][j][0] = _mm512_fmadd_ps(wv[j], xv, acc[i][j][0]);
            }
        }
        if (k < K) {
            const __mmask16 m = tail_mask(K - k);
            __m512 wv[8];
            UNROLL for (int j = 0; j < NR; j++) wv[j] = ld16m(wt, wr[j], k, m);
            UNROLL for (int i = 0; i < MR; i++) {
                __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
                UNROLL for (int j = 0; j < NR; j++) acc[i][j][0] = _mm512_fmadd_ps(wv[j], xv, acc[i][j][0]);
            }
        }
    }
    __m512 v[32];
    float s[32];
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) v[i * NR + j] =
        XP ? _mm512_add_ps(acc[i][j][0], acc[i][j][1]) : acc[i][j][0];
    hsum_all(v, MR * NR, s);
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) {
        float *d = y + i * ldy + j;
        *d = accum ? *d + s[i * NR + j] : s[i * NR + j];
    }
}

/* ---- stream: n <= 4 --------------------------------------------------- */

/* Rows [r0, r1) of a F32/F16/BF16 matrix against n <= 4 activation rows,
 * NR rows at a time (more rows in flight keep more DRAM streams busy). */
INLINE void stream_dense(int wt, const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0,
                         int64_t r1) {
    const int64_t K = w->cols;
    const size_t rb = (size_t)K * elem_size(wt);
    const char *base = (const char *)w->data;
#define T(MR, NR) \
    for (int64_t k0 = 0; k0 < K; k0 += KC) \
    tile(wt, base + (size_t)r * rb + (size_t)k0 * elem_size(wt), K, x + k0, K, K - k0 < KC ? K - k0 : KC, y + r, ldy, \
         k0 > 0, MR, NR, 0)
    int64_t r = r0;
    switch (n) {
    case 1:
        for (; r + 8 <= r1; r += 8) T(1, 8);
        for (; r < r1; r++) T(1, 1);
        break;
    case 2:
        for (; r + 8 <= r1; r += 8) T(2, 8);
        for (; r < r1; r++) T(2, 1);
        break;
    case 3:
        for (; r + 6 <= r1; r += 6) T(3, 6);
        for (; r < r1; r++) T(3, 1);
        break;
    default:
        for (; r + 6 <= r1; r += 6) T(4, 6);
        for (; r < r1; r++) T(4, 1);
        break;
    }
#undef T
}

/* x rows [n, K) -> xd [n, len]: columns [c0, c0+len), each 32-block split
 * into its even then odd columns. */
static void mx_deinterleave(const float *x, int64_t K, int64_t n, int64_t c0, int64_t len, float *xd) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < len; k += 32) {
            __m512 xe, xo;
            x_split32(x + i * K + c0 + k, &xe, &xo);
            _mm512_storeu_ps(xd + i * len + k, xe);
            _mm512_storeu_ps(xd + i * len + k + 16, xo);
        }
}

/* Paired rows [r, r+NR) (MXFP4 or BF16, type wt; p, sc their first row) x
 * MR deinterleaved x rows (xd, stride K), KC blocks in the canonical order:
 * y[i*ldy + j] = the dot of x row i and weight row j. sc unused for BF16. */
INLINE void stream_paired_rows(const int wt, const uint8_t *p, int64_t ldp, const uint8_t *sc, int64_t lds,
                               const float *xd, int64_t len, float *y, int64_t ldy, const int MR, const int NR) {
    float t[16] = {0};
    _Alignas(64) float sv[4][16];
    for (int64_t kb = 0; kb < len; kb += KC) {
        const int64_t K = len - kb < KC ? len - kb : KC;
        __m512 acc[4][4][2]; /* [x row][weight row][even, odd columns] */
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) acc[i][j][0] = acc[i][j][1] =
            _mm512_setzero_ps();
        for (int64_t k = kb; k < kb + K; k += 32) {
            if (wt == K3_W_MXFP4 && k % 512 == 0) {
                UNROLL for (int j = 0; j < NR; j++) {
                    if (len - k >= 512) {
                        _mm512_store_ps(sv[j], mx_scales16(sc + j * lds + k / 32));
                    } else {
                        for (int b = 0; b < (len - k) / 32; b++) sv[j][b] = k3_mx_scale(sc[j * lds + k / 32 + b]);
                    }
                }
            }
            __m512 we[4], wo[4];
            UNROLL for (int j = 0; j < NR; j++) {
                /* one token: the row streams alone; a prefetch 4 KB ahead
                 * into L2 keeps the line fill ahead of the decode */
                if (wt == K3_W_MXFP4) {
                    if (MR == 1 && k % 128 == 0)
                        _mm_prefetch((const char *)p + j * ldp + k / 2 + PF_AHEAD, _MM_HINT_T1);
                    mx_dec32(p + j * ldp + k / 2, sv[j][(k % 512) / 32], &we[j], &wo[j]);
                } else {
                    if (MR == 1) _mm_prefetch((const char *)p + j * ldp + k * 2 + PF_AHEAD, _MM_HINT_T1);
                    bf_dec32(p + j * ldp + k * 2, &we[j], &wo[j]);
                }
            }
            UNROLL for (int i = 0; i < MR; i++) {
                __m512 xe = in_reg(_mm512_loadu_ps(xd + i * len + k));
                __m512 xo = in_reg(_mm512_loadu_ps(xd + i * len + k + 16));
                UNROLL for (int j = 0; j < NR; j++) {
                    acc[i][j][0] = _mm512_fmadd_ps(we[j], xe, acc[i][j][0]);
                    acc[i][j][1] = _mm512_fmadd_ps(wo[j], xo, acc[i][j][1]);
                }
            }
        }
        __m512 v[16];
        float s[16];
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) v[i * NR + j] =
            _mm512_add_ps(acc[i][j][0], acc[i][j][1]);
        hsum_all(v, MR * NR, s);
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) {
            const int q = i * NR + j;
            t[q] = kb ? t[q] + s[q] : s[q];
        }
    }
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) y[i * ldy + j] = t[i * NR + j];
}

/* Rows [r0, r1) of a paired matrix x n <= STREAM_PAIRED_N rows of x
 * prepared by prep_x (deinterleaved). With n > 4, passes of 4 x rows go over
 * groups of STREAM_ROWS weight rows, the later passes finding the group in L2. */
static void stream_paired(const k3_mat *w, const float *xd, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t K = w->cols;
    const int wt = w->type;
    const size_t rowb = paired_bytes(wt, K);
    for (int64_t g = r0; g < r1; g += STREAM_ROWS) {
        const int64_t ge = r1 - g < STREAM_ROWS ? r1 : g + STREAM_ROWS;
        for (int64_t i = 0; i < n; i += 4) {
            const int mi = (int)(n - i < 4 ? n - i : 4);
            for (int64_t r = g; r < ge;) {
                /* Weight rows per pass: one streams the matrix in address
                 * order, which the prefetchers follow best (BF16 decode:
                 * 25 -> 32 GB/s against two rows); more share each x load,
                 * which matters once x outgrows L1 (MXFP4, n >= 3: two) or
                 * the loads would outnumber the FMAs (BF16, n >= 2: three;
                 * 2048^2 at n = 8: 125 GFLOP/s, two rows 110). Rows of at
                 * most 256 columns go four at a time at n = 1 (still one
                 * stream: they are adjacent), so the per-row sums and
                 * stores are shared. */
                int nr = wt == K3_W_MXFP4 ? (mi >= 3 ? 2 : 1) : (mi >= 2 ? 3 : K <= 256 ? 4 : 1);
                if (ge - r < nr) nr = 1;
                const uint8_t *pr = (const uint8_t *)w->data + r * rowb;
                const uint8_t *sr = wt == K3_W_MXFP4 ? w->scale + r * (K / 32) : NULL;
                const float *xi = xd + i * K;
                float *yi = y + i * ldy + r;
#define C(WT, MR, NR) stream_paired_rows(WT, pr, (int64_t)rowb, sr, K / 32, xi, K, yi, ldy, MR, NR)
/* clang-format off */
#define S(MR, NR)                                                                             \
    case (MR) * 4 + (NR) - 1:                                                                 \
        if (wt == K3_W_MXFP4) C(K3_W_MXFP4, MR, NR); else C(K3_W_BF16, MR, NR);               \
        break;
                switch (mi * 4 + nr - 1) {
                S(1, 1) S(1, 2) S(2, 1) S(2, 2) S(3, 1) S(3, 2) S(4, 1) S(4, 2) S(2, 3) S(3, 3) S(4, 3)
                S(1, 4)
                default: K3_ASSERT(!"stream_paired: bad shape");
                }
#undef S
#undef C
                /* clang-format on */
                r += nr;
            }
        }
    }
}

/* ---- tiled: n > 4 ----------------------------------------------------- */

/* Rows [r0, r0+nr) x columns [k0, k0+kl) to fp32 in buf (stride KC); paired
 * types in deinterleaved order (each 32-block: 16 even, then 16 odd columns). */
static void convert_block(const k3_mat *w, int64_t r0, int nr, int64_t k0, int kl, float *buf) {
    const int64_t K = w->cols;
    for (int j = 0; j < nr; j++) {
        float *d = buf + (size_t)j * KC;
        switch (w->type) {
        case K3_W_BF16:
            if (paired(w)) {
                const uint8_t *s = (const uint8_t *)w->data + ((r0 + j) * K + k0) * 2;
                for (int k = 0; k < kl; k += 32) {
                    __m512 we, wo;
                    bf_dec32(s + k * 2, &we, &wo);
                    _mm512_storeu_ps(d + k, we);
                    _mm512_storeu_ps(d + k + 16, wo);
                }
                break;
            }
            /* fall through */
        case K3_W_F16: {
            const uint16_t *s = (const uint16_t *)w->data + (r0 + j) * K + k0;
            for (int k = 0; k < kl; k += 16) {
                const __mmask16 m = tail_mask(kl - k);
                __m512 v = w->type == K3_W_F16 ? ld16m(K3_W_F16, s, k, m) : ld16m(K3_W_BF16, s, k, m);
                _mm512_mask_storeu_ps(d + k, m, v);
            }
            break;
        }
        case K3_W_MXFP4: {
            const uint8_t *s = (const uint8_t *)w->data + (r0 + j) * (K / 2) + k0 / 2;
            const uint8_t *sc = w->scale + (r0 + j) * (K / 32) + k0 / 32;
            for (int k = 0; k < kl; k += 32) {
                __m512 we, wo;
                mx_dec32(s + k / 2, k3_mx_scale(sc[k / 32]), &we, &wo);
                _mm512_storeu_ps(d + k, we);
                _mm512_storeu_ps(d + k + 16, wo);
            }
            break;
        }
        default: K3_ASSERT(!"convert_block: bad type");
        }
    }
}

/* fp32 weights (buffer or F32 matrix) x MR <= 4 activation rows x NR <= TN. */
static void tile_f32(int mr, int nr, const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t K, float *y,
                     int64_t ldy, bool accum) {
#define C(MR, NR) \
    case (MR)*8 + (NR): tile(K3_W_F32, w, ldw, x, ldx, K, y, ldy, accum, MR, NR, 0); break;
/* clang-format off */
#define R(MR) C(MR, 1) C(MR, 2) C(MR, 3) C(MR, 4) C(MR, 5) C(MR, 6)
    switch (mr * 8 + nr) {
    R(1) R(2) R(3) R(4)
    default: K3_ASSERT(!"tile_f32: bad shape");
    }
#undef R
#undef C
    /* clang-format on */
}

/* The same for deinterleaved (paired) weights and x, NR <= TN_MX. */
static void tile_mx(int mr, int nr, const float *w, int64_t ldw, const float *xd, int64_t ldx, int64_t K, float *y,
                    int64_t ldy, bool accum) {
/* clang-format off */
#define C(MR, NR)                                                                             \
    case (MR) * 8 + (NR): tile(K3_W_F32, w, ldw, xd, ldx, K, y, ldy, accum, MR, NR, 1); break;
    switch (mr * 8 + nr) {
    C(1, 1) C(1, 2) C(1, 3) C(2, 1) C(2, 2) C(2, 3) C(3, 1) C(3, 2) C(3, 3) C(4, 1) C(4, 2) C(4, 3)
    default: K3_ASSERT(!"tile_mx: bad shape");
    }
#undef C
    /* clang-format on */
}

/* One RB x KC block: convert (F32 is used in place) and run the register
 * tiles over all n activation rows. */
static void tiled_block(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t rb, int nr,
                        int64_t k0, int kl, float *buf) {
    const int64_t K = w->cols;
    const float *wb = buf;
    int64_t ldw = KC;
    if (w->type == K3_W_F32) {
        wb = (const float *)w->data + rb * K + k0;
        ldw = K;
    } else {
        convert_block(w, rb, nr, k0, kl, buf);
    }
    if (paired(w)) {
        /* x deinterleaved like the weights (prep_x); tiles of 4 x TN_MX
         * (even and odd accumulators: 2 x 4 x 2 = 16 registers). */
        for (int64_t i = 0; i < n; i += 4) {
            const int mi = (int)(n - i < 4 ? n - i : 4);
            for (int j = 0; j < nr; j += TN_MX)
                tile_mx(mi, nr - j < TN_MX ? nr - j : TN_MX, wb + (size_t)j * ldw, ldw, x + i * K + k0, K, kl,
                        y + i * ldy + rb + j, ldy, k0 > 0);
        }
        return;
    }
    for (int64_t i = 0; i < n; i += 4) {
        const int mi = (int)(n - i < 4 ? n - i : 4);
        for (int j = 0; j < nr; j += TN)
            tile_f32(mi, nr - j < TN ? nr - j : TN, wb + (size_t)j * ldw, ldw, x + i * K + k0, K, kl,
                     y + i * ldy + rb + j, ldy, k0 > 0);
    }
}

static void tiled(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    _Alignas(64) float buf[RB * KC];
    const int64_t K = w->cols;
    if (n * K * 4 <= ROWS_OUTER_BYTES) {
        /* x is L2-sized: finish each block of weight rows before the next,
         * so the weights stream row after row. */
        for (int64_t rb = r0; rb < r1; rb += RB) {
            const int nr = (int)(r1 - rb < RB ? r1 - rb : RB);
            for (int64_t k0 = 0; k0 < K; k0 += KC)
                tiled_block(w, x, n, y, ldy, rb, nr, k0, (int)(K - k0 < KC ? K - k0 : KC), buf);
        }
        return;
    }
    /* Large x: keep one KC-column panel of x hot while all rows pass over it. */
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int kl = (int)(K - k0 < KC ? K - k0 : KC);
        for (int64_t rb = r0; rb < r1; rb += RB)
            tiled_block(w, x, n, y, ldy, rb, (int)(r1 - rb < RB ? r1 - rb : RB), k0, kl, buf);
    }
}

/* ---- the kernels of the table ----------------------------------------- */

/* Any type, n <= 4 activation rows. */
static void stream_rows(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    switch (w->type) {
    case K3_W_F32: stream_dense(K3_W_F32, w, x, n, y, ldy, r0, r1); break;
    case K3_W_F16: stream_dense(K3_W_F16, w, x, n, y, ldy, r0, r1); break;
    case K3_W_BF16:
        if (paired(w)) stream_paired(w, x, n, y, ldy, r0, r1);
        else stream_dense(K3_W_BF16, w, x, n, y, ldy, r0, r1);
        break;
    case K3_W_MXFP4: stream_paired(w, x, n, y, ldy, r0, r1); break;
    default: K3_ASSERT(!"matmul: bad type");
    }
}

/* x for a paired matrix: each 32-column block as its 16 even, then its 16
 * odd columns (the order both the weights' decoders give). */
int64_t k3_matmul_prep_x_avx512(const k3_mat *w, const float *x, int64_t n, float *xp) {
    if (!paired(w)) return 0;
    if (xp) mx_deinterleave(x, w->cols, n, 0, w->cols, xp);
    return n * w->cols;
}

void k3_matmul_rows_avx512(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    if (n <= 4) {
        stream_rows(w, x, n, y, ldy, r0, r1);
    } else if (w->type == K3_W_BF16 && paired(w) && n <= STREAM_PAIRED_N) {
        stream_paired(w, x, n, y, ldy, r0, r1);
    } else if (!paired(w) && n <= STREAM_MAX_N) {
        /* Passes of 4 activation rows over groups of STREAM_ROWS weight rows:
         * the first pass brings the group from DRAM, the others find it in
         * L2, and converting on the fly beats a buffer round trip. (MXFP4
         * decoding is too costly to repeat: it goes to tiled.) */
        const int64_t K = w->cols;
        for (int64_t r = r0; r < r1; r += STREAM_ROWS) {
            const int64_t re = r1 - r < STREAM_ROWS ? r1 : r + STREAM_ROWS;
            for (int64_t i = 0; i < n; i += 4)
                stream_rows(w, x + i * K, n - i < 4 ? n - i : 4, y + i * ldy, ldy, r, re);
        }
    } else {
        tiled(w, x, n, y, ldy, r0, r1);
    }
}

float k3_dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    for (; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
    }
    return k3_hsum(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

void k3_axpy_avx512(float *y, float a, const float *x, int64_t n) {
    const __m512 av = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, v);
    }
}
