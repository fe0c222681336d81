/*
 * matmul_avx2.c -- AVX2 + FMA + F16C kernels of the "avx2" tables (dispatch.c).
 * Mirrors ref.c: k3_matmul_rows_ref, k3_dot_ref, k3_axpy_ref.
 *
 * Canonical order. Every path computes y[i][r] with the same operations in
 * the same order, whatever n, the position of row i or r in a tile, or the
 * thread split: columns are cut into KC-column blocks; within a block one
 * 8-lane accumulator runs over the columns in order (scalar tail last, after
 * the horizontal sum) -- for MXFP4, two accumulators taking alternate
 * 8-column groups, added before the sum (one chain is too slow to decode
 * into); the horizontal sum uses one fixed tree; block sums are added to y in
 * block order. So a batch gives bit for bit the logits of its sequences run
 * alone, and thread counts do not change results (kernels_matmul_batch_
 * invariant and the engine's causality tests hold this).
 *
 * Three regimes, by the number of activation rows n:
 *
 *   stream (n <= 4, decode): memory bound. Weight rows are converted to fp32
 *   in registers and applied to all n activation rows; several rows are in
 *   flight at once (up to 8) to keep enough DRAM streams and FMA chains busy.
 *
 *   multi-pass stream (dense types, 4 < n <= 64): the same over groups of
 *   STREAM_ROWS weight rows, 4 activation rows per pass; later passes find
 *   the group in L2.
 *
 *   tiled (n > 64, or MXFP4 with n > 4): compute bound. Each RB x KC weight
 *   block is converted once into an fp32 buffer (48 KB on the stack), then a
 *   4x3 register tile (4 activation rows x 3 weight rows, 12 accumulators;
 *   3x2 with two accumulators each for MXFP4) runs over it: 7 loads per 12
 *   FMAs. F32 weights are used in place.
 *
 * MXFP4: 32 packed bytes hold 64 columns, two 32-column blocks (low nibble =
 * even column). Each code is looked up twice with pshufb, in tables of the
 * high and the low bytes of the BF16 encodings of ±{0,.5,1,1.5,2,3,4,6}; the
 * two bytes, unpacked into 16-bit words, are the code's BF16 value, and a
 * shift or a mask makes it fp32 (exact), times the block scale 2^(e-127),
 * which is exact too. So every product x*w is the one the reference forms;
 * only the summation order differs. A pair of blocks decodes with one block
 * per 128-bit lane, so its eight vectors each hold 4 columns of both blocks
 * (the quad order, mx_dec64q; x is put in that order by prep_x); a last lone
 * block takes the paired order of BF16 (mx_dec32p).
 */
#include "kernels/kernels_isa.h"
#include "common/error.h"

#include <immintrin.h>
#include <math.h>

#define UNROLL _Pragma("GCC unroll 16")
#define INLINE static inline __attribute__((always_inline))

enum {
    KC = 1024,                  /* columns per block of the canonical order */
    RB = 12,                    /* tiled: weight rows per block (48 KB of fp32) */
    ROWS_OUTER_BYTES = 1 << 20, /* tiled: x up to this size -> row blocks outermost */
    STREAM_MAX_N = 64,          /* dense types stream up to this many x rows */
    STREAM_ROWS = 24,           /* weight rows per group in multi-pass streaming */
    STREAM_PAIRED_N = 16,       /* paired BF16 streams up to this many x rows */
    PAIRED_NR1 = 1,             /* BF16 rows per pass at n = 1 (K > 256) */
    PF_AHEAD = 4096,            /* n = 1: bytes ahead a row's weights are prefetched into L2 */

};

/* ---- loaders ---------------------------------------------------------- */

/* 8 weights of a row starting at column k, as fp32; wt is a constant. */
INLINE __m256 ld8(int wt, const void *row, int64_t k) {
    switch (wt) {
    case K3_W_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
    case K3_W_BF16: {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    default: return _mm256_loadu_ps((const float *)row + k);
    }
}

INLINE float ld1(int wt, const void *row, int64_t k) {
    switch (wt) {
    case K3_W_F16: return _cvtsh_ss(((const uint16_t *)row)[k]);
    case K3_W_BF16: return k3_bf16_to_f32(((const uint16_t *)row)[k]);
    default: return ((const float *)row)[k];
    }
}

INLINE size_t elem_size(int wt) { return wt == K3_W_F32 ? 4 : 2; }

/* High bytes of the fp16 encodings of the 16 E2M1 codes. */
#define MX_F16_HI 0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46, 0x80, 0xb8, 0xbc, 0xbe, 0xc0, 0xc2, 0xc4, 0xc6

/* High and low bytes of the BF16 encodings of the 16 E2M1 codes. */
#define MX_BF_HI 0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x80, 0xbf, 0xbf, 0xbf, 0xc0, 0xc0, 0xc0, 0xc0
#define MX_BF_LO 0x00, 0x00, 0x80, 0xc0, 0x00, 0x40, 0x80, 0xc0, 0x00, 0x00, 0x80, 0xc0, 0x00, 0x40, 0x80, 0xc0

/* ---- the paired order (MXFP4, and BF16 with K % 32 == 0) -------------- */

/* Whether w sums in the paired order: each 32-column block taken as its 16
 * even, then its 16 odd columns (x deinterleaved so by prep_x), four 8-column
 * groups [even 0-14, even 16-30, odd 1-15, odd 17-31] that alternate between
 * two accumulators (tile() with U = 2 over the deinterleaved columns). */
INLINE bool paired(const k3_mat *w) { return w->type == K3_W_MXFP4 || (w->type == K3_W_BF16 && w->cols % 32 == 0); }

/* 8-float halves: [a0 a2 a4 a6 b0 b2 b4 b6] (imm 0x88) or the odd ones (0xdd). */
#define PAIR_SEL(a, b, imm) \
    _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, imm)), 0xd8))

/* x [n, K] (K % 32 == 0) into the paired order. */
static void x_deinterleave(const float *x, int64_t K, int64_t n, float *xd) {
    for (int64_t i = 0; i < n * K; i += 32) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        _mm256_storeu_ps(xd + i, PAIR_SEL(a, b, 0x88));
        _mm256_storeu_ps(xd + i + 8, PAIR_SEL(c, d, 0x88));
        _mm256_storeu_ps(xd + i + 16, PAIR_SEL(a, b, 0xdd));
        _mm256_storeu_ps(xd + i + 24, PAIR_SEL(c, d, 0xdd));
    }
}

/* 32 BF16 weights (64 bytes at p) -> out[4] in the paired order: each 32-bit
 * word is an even column (low half) and an odd one (high half), so a shift
 * and a mask decode them, no shuffle. */
INLINE void bf_dec32p(const uint8_t *p, __m256 out[4]) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)p), v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    out[1] = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    out[2] = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
    out[3] = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
}

/* The quad order of a pair of MXFP4 blocks (64 columns): vector q, lane l
 * holds column QUAD_COL[q] + 4 (l mod 4) of the first block (l < 4) or of
 * the second (l >= 4), QUAD_COL = {0, 2, 16, 18, 1, 3, 17, 19}. */

/* 64 MXFP4 weights (32 bytes, blocks with scales s = [s0 x4, s1 x4]) ->
 * out[8] in the quad order. Per 64 weights: 3 ops to split the nibbles, 4
 * lookups, 4 unpacks, 8 shifts or masks, 8 scalings (F16C's vcvtph2ps is two
 * ops for 8 weights, and needed the block split out of the lanes). */
INLINE void mx_dec64q(const uint8_t *p, __m256 s, __m256 out[8]) {
    const __m256i th = _mm256_setr_epi8(MX_BF_HI, MX_BF_HI), tl = _mm256_setr_epi8(MX_BF_LO, MX_BF_LO);
    const __m256i m = _mm256_set1_epi8(0x0f), hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    const __m256i ce = _mm256_and_si256(b, m), co = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    const __m256i le = _mm256_shuffle_epi8(tl, ce), he = _mm256_shuffle_epi8(th, ce);
    const __m256i lo = _mm256_shuffle_epi8(tl, co), ho = _mm256_shuffle_epi8(th, co);
    /* BF16 words, per lane: even columns 0-14, 16-30, odd 1-15, 17-31 */
    const __m256i w[4] = {_mm256_unpacklo_epi8(le, he), _mm256_unpackhi_epi8(le, he), _mm256_unpacklo_epi8(lo, ho),
                          _mm256_unpackhi_epi8(lo, ho)};
    UNROLL for (int g = 0; g < 4; g++) {
        out[2 * g] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w[g], 16)), s);
        out[2 * g + 1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(w[g], hi)), s);
    }
}

/* [s[0] x4, s[1] x4]: the scales of a pair of blocks, for mx_dec64q. */
INLINE __m256 mx_pair_scale(const float *s) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(s)), _mm_broadcast_ss(s + 1), 1);
}

/* 8 E8M0 bytes -> 2^(e-127) as fp32 (0 -> 2^-127, 255 -> NaN), as k3_mx_scale. */
INLINE __m256 mx_scales8(const uint8_t *sc) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc));
    __m256i b = _mm256_slli_epi32(e, 23);
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(b);
}

/* 32 MXFP4 weights (16 bytes, one block) -> out[4] in the paired order. */
INLINE void mx_dec32p(const uint8_t *p, __m256 s, __m256 out[4]) {
    const __m128i tbl = _mm_setr_epi8(MX_F16_HI);
    const __m128i m = _mm_set1_epi8(0x0f), z = _mm_setzero_si128();
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m128i hl = _mm_shuffle_epi8(tbl, _mm_and_si128(b, m));
    const __m128i hh = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(b, 4), m));
    out[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_unpacklo_epi8(z, hl)), s);
    out[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_unpackhi_epi8(z, hl)), s);
    out[2] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_unpacklo_epi8(z, hh)), s);
    out[3] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_unpackhi_epi8(z, hh)), s);
}

/* ---- reductions: one fixed tree, so every path rounds alike ----------- */

/* The four horizontal sums of a, b, c, d (tree: pairs, quads, then 8s). */
INLINE __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* hsum4's tree for one vector. */
INLINE float hsum(__m256 v) {
    __m256 p = _mm256_hadd_ps(v, v);
    __m256 t = _mm256_hadd_ps(p, p);
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* s[q] = hsum(v[q]) for q < cnt (cnt a constant). */
INLINE void hsum_all(const __m256 *v, int cnt, float *s) {
    int q = 0;
    UNROLL for (; q + 4 <= cnt; q += 4) _mm_storeu_ps(s + q, hsum4(v[q], v[q + 1], v[q + 2], v[q + 3]));
    UNROLL for (; q < cnt; q++) s[q] = hsum(v[q]);
}

/* Keeps v in a register: otherwise GCC folds the load into every FMA that
 * uses it (one load per FMA) and the register tile becomes load-bound. */
INLINE __m256 in_reg(__m256 v) {
    __asm__("" : "+v"(v));
    return v;
}

/* ---- the register tile ------------------------------------------------ */

/* MR activation rows x NR weight rows over one column block of K <= KC, in
 * the canonical order. w: first weight row, rows ldw elements apart, type wt
 * (F32/F16/BF16). y[i*ldy + j] = (accum ? y : 0) + block sum. U = 1 for the
 * dense types; U = 2 is MXFP4's order (8-column groups alternate between two
 * accumulators, added before the horizontal sum). */
INLINE void tile(int wt, const void *w, int64_t ldw, const float *x, int64_t ldx, int64_t K, float *y, int64_t ldy,
                 bool accum, const int MR, const int NR, const int U) {
    const char *wr[8];
    UNROLL for (int j = 0; j < NR; j++) wr[j] = (const char *)w + (size_t)j * ldw * elem_size(wt);
    __m256 acc[4][8][2];
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) acc[i][j][0] = acc[i][j][1] =
        _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * U <= K; k += 8 * U) {
        UNROLL for (int u = 0; u < U; u++) {
            __m256 wv[8];
            UNROLL for (int j = 0; j < NR; j++) wv[j] = ld8(wt, wr[j], k + 8 * u);
            UNROLL for (int i = 0; i < MR; i++) {
                __m256 xv = in_reg(_mm256_loadu_ps(x + i * ldx + k + 8 * u));
                UNROLL for (int j = 0; j < NR; j++) acc[i][j][u] = _mm256_fmadd_ps(wv[j], xv, acc[i][j][u]);
            }
        }
    }
    if (U > 1 && k + 8 <= K) { /* an odd 8-column group: accumulator 0 */
        __m256 wv[8];
        UNROLL for (int j = 0; j < NR; j++) wv[j] = ld8(wt, wr[j], k);
        UNROLL for (int i = 0; i < MR; i++) {
            __m256 xv = in_reg(_mm256_loadu_ps(x + i * ldx + k));
            UNROLL for (int j = 0; j < NR; j++) acc[i][j][0] = _mm256_fmadd_ps(wv[j], xv, acc[i][j][0]);
        }
        k += 8;
    }
    __m256 v[32];
    float s[32];
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) v[i * NR + j] =
        U > 1 ? _mm256_add_ps(acc[i][j][0], acc[i][j][1]) : acc[i][j][0];
    hsum_all(v, MR * NR, s);
    for (; k < K; k++)
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) s[i * NR + j] +=
            x[i * ldx + k] * ld1(wt, wr[j], k);
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) {
        float *d = y + i * ldy + j;
        *d = accum ? *d + s[i * NR + j] : s[i * NR + j];
    }
}

/* ---- stream: n <= 4 --------------------------------------------------- */

/* Rows [r0, r1) of a F32/F16/BF16 matrix against n <= 4 activation rows,
 * NR rows at a time (more rows in flight keep more DRAM streams busy; NR was
 * picked by measurement on Zen 4, where a few spills cost less than fewer
 * streams). */
INLINE void stream_dense(int wt, const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0,
                         int64_t r1) {
    const int64_t K = w->cols;
    const size_t rb = (size_t)K * elem_size(wt);
    const char *base = (const char *)w->data;
#define T(MR, NR) \
    for (int64_t k0 = 0; k0 < K; k0 += KC) \
    tile(wt, base + (size_t)r * rb + (size_t)k0 * elem_size(wt), K, x + k0, K, K - k0 < KC ? K - k0 : KC, y + r, ldy, \
         k0 > 0, MR, NR, 1)
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
        for (; r + 3 <= r1; r += 3) T(4, 3);
        for (; r < r1; r++) T(4, 1);
        break;
    }
#undef T
}

/* Paired rows [r, r+NR) (MXFP4 or BF16, type wt; p, sc their first row, ldp,
 * lds apart) x MR deinterleaved x rows (xd, ldx apart), KC blocks in the
 * canonical order: y[i*ldy + j] = the dot of x row i and weight row j. */
INLINE void stream_paired_rows(const int wt, const uint8_t *p, int64_t ldp, const uint8_t *sc, int64_t lds,
                               const float *xd, int64_t ldx, int64_t len, float *y, int64_t ldy, const int MR,
                               const int NR) {
    float t[16] = {0};
    _Alignas(32) float sv[4][8]; /* MXFP4: the scales of 8 blocks (256 columns) per row */
    for (int64_t kb = 0; kb < len; kb += KC) {
        const int64_t ke = len - kb < KC ? len : kb + KC;
        __m256 acc[4][4][2];
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) acc[i][j][0] = acc[i][j][1] =
            _mm256_setzero_ps();
        int64_t k = kb;
        if (wt == K3_W_MXFP4) {
            for (; k + 64 <= ke; k += 64) {
                if (k % 256 == 0) UNROLL for (int j = 0; j < NR; j++) {
                        if (len - k >= 256) _mm256_store_ps(sv[j], mx_scales8(sc + j * lds + k / 32));
                        else
                            for (int b = 0; b < (len - k) / 32; b++) sv[j][b] = k3_mx_scale(sc[j * lds + k / 32 + b]);
                    }
                UNROLL for (int j = 0; j < NR; j++) {
                    __m256 wv[8];
                    const float *s2 = &sv[j][k % 256 / 32];
                    if (MR == 1 && k % 128 == 0)
                        _mm_prefetch((const char *)p + j * ldp + k / 2 + PF_AHEAD, _MM_HINT_T1);
                    mx_dec64q(p + j * ldp + k / 2, mx_pair_scale(s2), wv);
                    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int q = 0; q < 8; q++) acc[i][j][q % 2] =
                        _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(xd + i * ldx + k + 8 * q), acc[i][j][q % 2]);
                }
            }
            if (k < ke) /* a last block of 32 */
                UNROLL for (int j = 0; j < NR; j++) {
                    __m256 wv[4];
                    mx_dec32p(p + j * ldp + k / 2, _mm256_set1_ps(k3_mx_scale(sc[j * lds + k / 32])), wv);
                    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int q = 0; q < 4; q++) acc[i][j][q % 2] =
                        _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(xd + i * ldx + k + 8 * q), acc[i][j][q % 2]);
                }
        } else {
            for (; k < ke; k += 32) UNROLL for (int j = 0; j < NR; j++) {
                    __m256 wv[4];
                    if (MR == 1) _mm_prefetch((const char *)p + j * ldp + k * 2 + PF_AHEAD, _MM_HINT_T1);
                    bf_dec32p(p + j * ldp + k * 2, wv);
                    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int q = 0; q < 4; q++) acc[i][j][q % 2] =
                        _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(xd + i * ldx + k + 8 * q), acc[i][j][q % 2]);
                }
        }
        __m256 v[16];
        float s[16];
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) v[i * NR + j] =
            _mm256_add_ps(acc[i][j][0], acc[i][j][1]);
        hsum_all(v, MR * NR, s);
        UNROLL for (int q = 0; q < MR * NR; q++) t[q] = kb ? t[q] + s[q] : s[q];
    }
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < NR; j++) y[i * ldy + j] = t[i * NR + j];
}

/* Rows [r0, r1) of a paired matrix x n rows of x prepared by prep_x, in
 * passes of up to 4 x rows over groups of STREAM_ROWS weight rows (later
 * passes find the group in L2). Weight rows per pass, by measurement: at
 * n = 1 one BF16 row at a time, in address order (what the prefetchers
 * follow best), four MXFP4 rows (adjacent, so still one stream: two
 * accumulator chains per row leave the FMAs waiting on their latency) and
 * four BF16 rows of at most 256 columns; two at n = 2. */
static void stream_paired(const k3_mat *w, const float *xd, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t K = w->cols;
    const int wt = w->type;
    const size_t rowb = wt == K3_W_MXFP4 ? (size_t)K / 2 : (size_t)K * 2;
    for (int64_t g = r0; g < r1; g += STREAM_ROWS) {
        const int64_t ge = r1 - g < STREAM_ROWS ? r1 : g + STREAM_ROWS;
        for (int64_t i = 0; i < n; i += 4) {
            const int mi = (int)(n - i < 4 ? n - i : 4);
            for (int64_t r = g; r < ge;) {
                int nr = mi == 1 ? (wt == K3_W_MXFP4 || K <= 256 ? 4 : PAIRED_NR1) : mi == 2 ? 2 : 1;
                while (ge - r < nr) nr /= 2;
                const uint8_t *pr = (const uint8_t *)w->data + r * rowb;
                const uint8_t *sr = wt == K3_W_MXFP4 ? w->scale + r * (K / 32) : NULL;
                const float *xi = xd + i * K;
                float *yi = y + i * ldy + r;
#define C(WT, MR, NR) stream_paired_rows(WT, pr, (int64_t)rowb, sr, K / 32, xi, K, K, yi, ldy, MR, NR)
/* clang-format off */
#define S(MR, NR)                                                                             \
    case (MR) * 8 + (NR):                                                                     \
        if (wt == K3_W_MXFP4) C(K3_W_MXFP4, MR, NR); else C(K3_W_BF16, MR, NR);               \
        break;
                switch (mi * 8 + nr) {
                S(1, 1) S(1, 2) S(1, 4) S(2, 1) S(2, 2) S(3, 1) S(4, 1)
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

/* ---- tiled ------------------------------------------------------------ */

/* Converts rows [r0, r0+nr) x columns [k0, k0+kl) to fp32 in buf (stride KC). */
static void convert_block(const k3_mat *w, int64_t r0, int nr, int64_t k0, int kl, float *buf) {
    const int64_t K = w->cols;
    for (int j = 0; j < nr; j++) {
        float *d = buf + (size_t)j * KC;
        int k = 0;
        switch (w->type) {
        case K3_W_F16: {
            const uint16_t *s = (const uint16_t *)w->data + (r0 + j) * K + k0;
            for (; k + 8 <= kl; k += 8) _mm256_storeu_ps(d + k, ld8(K3_W_F16, s, k));
            for (; k < kl; k++) d[k] = ld1(K3_W_F16, s, k);
            break;
        }
        case K3_W_BF16: {
            const uint16_t *s = (const uint16_t *)w->data + (r0 + j) * K + k0;
            if (paired(w)) { /* in the paired order */
                __m256 v[4];
                for (; k < kl; k += 32) {
                    bf_dec32p((const uint8_t *)(s + k), v);
                    UNROLL for (int q = 0; q < 4; q++) _mm256_storeu_ps(d + k + 8 * q, v[q]);
                }
                break;
            }
            for (; k + 8 <= kl; k += 8) _mm256_storeu_ps(d + k, ld8(K3_W_BF16, s, k));
            for (; k < kl; k++) d[k] = ld1(K3_W_BF16, s, k);
            break;
        }
        case K3_W_MXFP4: { /* in the quad order (a lone last block paired) */
            const uint8_t *s = (const uint8_t *)w->data + (r0 + j) * (K / 2) + k0 / 2;
            const uint8_t *sc = w->scale + (r0 + j) * (K / 32) + k0 / 32;
            __m256 v[8];
            for (; k + 64 <= kl; k += 64) {
                const float s2[2] = {k3_mx_scale(sc[k / 32]), k3_mx_scale(sc[k / 32 + 1])};
                mx_dec64q(s + k / 2, mx_pair_scale(s2), v);
                UNROLL for (int q = 0; q < 8; q++) _mm256_storeu_ps(d + k + 8 * q, v[q]);
            }
            if (k < kl) {
                mx_dec32p(s + k / 2, _mm256_set1_ps(k3_mx_scale(sc[k / 32])), v);
                UNROLL for (int q = 0; q < 4; q++) _mm256_storeu_ps(d + k + 8 * q, v[q]);
            }
            break;
        }
        default: K3_ASSERT(!"convert_block: bad type");
        }
    }
}

/* fp32 weights (buffer or F32 matrix) x MR <= 4 activation rows x NR <= 3. */
static void tile_f32(int mr, int nr, const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t K, float *y,
                     int64_t ldy, bool accum) {
/* clang-format off */
#define C(MR, NR)                                                                             \
    case (MR) * 4 + (NR): tile(K3_W_F32, w, ldw, x, ldx, K, y, ldy, accum, MR, NR, 1); break;
    switch (mr * 4 + nr) {
    C(1, 1) C(1, 2) C(1, 3) C(2, 1) C(2, 2) C(2, 3)
    C(3, 1) C(3, 2) C(3, 3) C(4, 1) C(4, 2) C(4, 3)
    default: K3_ASSERT(!"tile_f32: bad shape");
    }
#undef C
    /* clang-format on */
}

/* The same in MXFP4's order (two accumulators each): MR <= 3, NR <= 2. */
static void tile_mx(int mr, int nr, const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t K, float *y,
                    int64_t ldy, bool accum) {
/* clang-format off */
#define C(MR, NR)                                                                             \
    case (MR) * 4 + (NR): tile(K3_W_F32, w, ldw, x, ldx, K, y, ldy, accum, MR, NR, 2); break;
    switch (mr * 4 + nr) {
    C(1, 1) C(1, 2) C(2, 1) C(2, 2) C(3, 1) C(3, 2)
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
        /* x deinterleaved like the weights (prep_x); 3 x 2 tiles: 12
         * accumulators (two per pair) + 2 weights + 1 x. */
        for (int64_t i = 0; i < n; i += 3) {
            const int mi = (int)(n - i < 3 ? n - i : 3);
            for (int j = 0; j < nr; j += 2)
                tile_mx(mi, nr - j < 2 ? nr - j : 2, wb + (size_t)j * ldw, ldw, x + i * K + k0, K, kl,
                        y + i * ldy + rb + j, ldy, k0 > 0);
        }
        return;
    }
    for (int64_t i = 0; i < n; i += 4) {
        const int mi = (int)(n - i < 4 ? n - i : 4);
        for (int j = 0; j < nr; j += 3)
            tile_f32(mi, nr - j < 3 ? nr - j : 3, wb + (size_t)j * ldw, ldw, x + i * K + k0, K, kl,
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

void k3_matmul_rows_avx2(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
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

/* x [n, K] (K % 32 == 0) for MXFP4: each pair of blocks in the quad order
 * (QUAD_COL above), a last lone block in the paired order. */
static void x_quad(const float *x, int64_t K, int64_t n, float *xq) {
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * K;
        float *d = xq + i * K;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            /* per 16 columns a 4 x 4 transpose (rows: 4 adjacent columns),
             * the first block in the low lanes, the second in the high */
            UNROLL for (int h = 0; h < 2; h++) {
                const float *a = xr + k + 16 * h, *b = a + 32;
                const __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
                const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
                const __m256 r0 = _mm256_permute2f128_ps(a0, b0, 0x20), r1 = _mm256_permute2f128_ps(a0, b0, 0x31);
                const __m256 r2 = _mm256_permute2f128_ps(a1, b1, 0x20), r3 = _mm256_permute2f128_ps(a1, b1, 0x31);
                const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
                const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
                /* columns 16h + 4p + c for c = 0, 1, 2, 3: the quad vectors 2h + 0, 4, 1, 5 */
                _mm256_storeu_ps(d + k + 8 * (2 * h), _mm256_shuffle_ps(t0, t2, 0x44));
                _mm256_storeu_ps(d + k + 8 * (2 * h + 4), _mm256_shuffle_ps(t0, t2, 0xee));
                _mm256_storeu_ps(d + k + 8 * (2 * h + 1), _mm256_shuffle_ps(t1, t3, 0x44));
                _mm256_storeu_ps(d + k + 8 * (2 * h + 5), _mm256_shuffle_ps(t1, t3, 0xee));
            }
        }
        if (k < K) x_deinterleave(xr + k, 32, 1, d + k);
    }
}

/* x for a paired matrix: MXFP4's quad order, or BF16's paired order. */
int64_t k3_matmul_prep_x_avx2(const k3_mat *w, const float *x, int64_t n, float *xp) {
    if (!paired(w)) return 0;
    if (xp && w->type == K3_W_MXFP4) x_quad(x, w->cols, n, xp);
    else if (xp) x_deinterleave(x, w->cols, n, xp);
    return n * w->cols;
}

float k3_dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void k3_axpy_avx2(float *y, float a, const float *x, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}
