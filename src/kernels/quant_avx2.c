/*
 * quant_avx2.c -- AVX2 kernels of the 8-bit matmuls (see quant.h and
 * kernels_isa.h), in two forms where the integer dot products are concerned:
 * plain AVX2 (the "avx2" table), and AVX-VNNI (vpdpbusd on 256 bits,
 * `target("avxvnni")`, the "avx2-vnni" table, only where the CPU has it).
 *
 * Plain AVX2 int8 x int8 uses the sign trick: maddubs(|a|, b·sign(a)) never
 * saturates because both sides are clamped to [-127, 127] (2·127·127 < 32768).
 * AVX-VNNI W8A8 takes the activations as x + 128 (unsigned) and 128 Σw (the
 * row sums made at load) off, like the AVX-512 kernel. Integer sums, exact in
 * any order: every path gives y = (float)dot · xs · row_scale, the same bits.
 *
 * W4A8 on K3_W_MXFP4_R4 tiles (kernels.h), the layout the AVX-512 VNNI
 * kernel reads: a 32-byte load of stretch j is two rows (one per 128-bit
 * lane) x four blocks (one per 4-byte lane); vpshufb turns the nibbles into
 * unsigned codes 2·E2M1 + 12, maddubs (or vpdpbusd) multiplies them by the
 * activations in k3_mx4_r4_prep order (16 bytes broadcast to both lanes), and
 * -12 Σx per block (prep's corr) takes the +12 off. The four stretches of a
 * group finish each lane's block; maddubs' int16 sums of four stretches stay
 * below 4·2·24·127 = 24384 < 32768, so they are added in int16 before one
 * vpmaddwd. Each block's integer dot then takes its scale 2^(e-128) in one
 * FMA per group, and a row's four lanes are added (0 + 1) + (2 + 3): the
 * operations and order of the AVX-512 tile kernel, so the bits are its bits,
 * whatever the token count.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common/error.h"
#include "kernels/kernels_isa.h"
#include "quant_simd.h"

#define INLINE static inline __attribute__((always_inline))
#define VNNI __attribute__((target("avxvnni")))

/* One token: how far ahead (bytes) a row's weights are prefetched into L2
 * (_MM_HINT_T1), as matmul_avx2.c does for BF16 and MXFP4 (4 KB ahead took a
 * core's BF16 stream from DRAM from 13-15 to 16-19 GB/s). Prefetches do not
 * fault: running past a matrix's end is harmless. */
enum { PF_AHEAD = 4096 };
#define PF(p) _mm_prefetch((const char *)(p) + PF_AHEAD, _MM_HINT_T1)

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

INLINE __m256i dot32(__m256i a, __m256i b) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* Σ_blocks 2^(e_b-128) · <x8 block, 2·e2m1 block> for one row of the stored
 * MXFP4 layout (k3_mx4_dot_ref's blocks, each an exact integer dot) */
float k3_mx4_dot_avx2(const uint8_t *packed, const uint8_t *scale, const int8_t *x, int64_t cols) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < cols / 32; b++) {
        const __m256i w = k3_mxfp4_block_i8(packed + 16 * b);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * b));
        const __m256 d = _mm256_cvtepi32_ps(dot32(xv, w));
        acc = _mm256_fmadd_ps(d, _mm256_set1_ps(k3_mxfp4_half_scale(scale[b])), acc);
    }
    return k3_hsum256_ps(acc);
}

/* ---- per-token activation quantization ------------------------------------ */

/* = k3_quant_act_i8_ref bit for bit: the same amax (max is order free, and
 * max_ps(|x|, m) keeps m where x is NaN, as the scalar compare does), the same
 * fp32 products, vcvtps2dq rounds to nearest even like nearbyintf, and
 * |x·127/amax| never rounds past 127, so the saturating packs never clip. */
float k3_quant_act_i8_avx2(const float *x, int64_t n, int8_t *q) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), absm), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float amax = _mm_cvtss_f32(h);
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (amax == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    const float inv = 127.0f / amax;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (i = 0; i + 32 <= n; i += 32) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vinv));
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vinv));
        const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vinv));
        /* per 128-bit lane: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7 */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, order));
    }
    for (; i < n; i++) {
        const float v = nearbyintf(x[i] * inv);
        q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : v);
    }
    return amax / 127.0f;
}

/* ---- W8A8 ---------------------------------------------------------------------- */

/* Σ_c w[r][c] x[t][c] for NR rows x NT tokens (NR·NT <= 12): the weights of
 * a step in registers, each token's activations loaded once per step. Plain
 * AVX2: x int8, sign trick; VNNI: x + 128, the caller takes 128 row_sum off
 * (the scalar tail sums the same x + 128). */
INLINE void q8_tile(const int8_t *w, int64_t ldw, const int8_t *x, int64_t ldx, int64_t cols, const int NR,
                    const int NT, int32_t out[4][4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_si256();
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m256i wv[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) wv[r] = _mm256_loadu_si256((const __m256i *)(w + r * ldw + c));
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + t * ldx + c));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++)
                acc[r][t] =
                    _mm256_add_epi32(acc[r][t],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[r], xv)), ones));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            int32_t s = hsum_epi32(acc[r][t]);
            for (int64_t k = c; k < cols; k++) s += (int32_t)w[r * ldw + k] * x[t * ldx + k];
            out[r][t] = s;
        }
}

INLINE VNNI void q8_tile_vnni(const int8_t *w, int64_t ldw, const int8_t *x, int64_t ldx, int64_t cols, const int NR,
                              const int NT, int32_t out[4][4]) {
    const uint8_t *xu = (const uint8_t *)x;
    __m256i acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_si256();
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m256i xv[4];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_si256((const __m256i *)(xu + t * ldx + c));
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * ldw + c));
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) acc[r][t] = _mm256_dpbusd_avx_epi32(acc[r][t], xv[t], wv);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            int32_t s = hsum_epi32(acc[r][t]);
            for (int64_t k = c; k < cols; k++) s += (int32_t)w[r * ldw + k] * xu[t * ldx + k];
            out[r][t] = s;
        }
}

/* One token, two rows ldw apart per pass (adjacent: one stream; ldw 0 is an
 * odd last row taken twice), two chains each: with the x loads shared this
 * read 7% more of the bandwidth than one row at a time (kbench, two threads,
 * from DRAM). Plain AVX2 takes |x| made once per call (ax), one vpsignb
 * fewer per 32 bytes. */
static inline void q8_dot2(const int8_t *w, int64_t ldw, int64_t cols, const int8_t *x, const int8_t *ax,
                           int32_t out[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    const int8_t *w1 = w + ldw;
    int64_t c = 0;
    for (; c + 64 <= cols; c += 64) {
        PF(w + c);
        PF(w1 + c);
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + c + 32 * k));
            const __m256i av = _mm256_loadu_si256((const __m256i *)(ax + c + 32 * k));
            const __m256i w0v = _mm256_loadu_si256((const __m256i *)(w + c + 32 * k));
            const __m256i w1v = _mm256_loadu_si256((const __m256i *)(w1 + c + 32 * k));
            a[k] = _mm256_add_epi32(a[k], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(w0v, xv)), ones));
            a[2 + k] = _mm256_add_epi32(a[2 + k],
                                        _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(w1v, xv)), ones));
        }
    }
    for (; c + 32 <= cols; c += 32) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + c));
        const __m256i av = _mm256_loadu_si256((const __m256i *)(ax + c));
        const __m256i w0v = _mm256_loadu_si256((const __m256i *)(w + c));
        const __m256i w1v = _mm256_loadu_si256((const __m256i *)(w1 + c));
        a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(w0v, xv)), ones));
        a[2] = _mm256_add_epi32(a[2], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(w1v, xv)), ones));
    }
    int32_t s0 = hsum_epi32(_mm256_add_epi32(a[0], a[1])), s1 = hsum_epi32(_mm256_add_epi32(a[2], a[3]));
    for (; c < cols; c++) {
        s0 += (int32_t)w[c] * x[c];
        s1 += (int32_t)w1[c] * x[c];
    }
    out[0] = s0;
    out[1] = s1;
}

static inline VNNI void q8_dot2_vnni(const int8_t *w, int64_t ldw, int64_t cols, const int8_t *x, int32_t out[2]) {
    const uint8_t *xu = (const uint8_t *)x;
    __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    const int8_t *w1 = w + ldw;
    int64_t c = 0;
    for (; c + 64 <= cols; c += 64) {
        PF(w + c);
        PF(w1 + c);
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xu + c + 32 * k));
            a[k] = _mm256_dpbusd_avx_epi32(a[k], xv, _mm256_loadu_si256((const __m256i *)(w + c + 32 * k)));
            a[2 + k] = _mm256_dpbusd_avx_epi32(a[2 + k], xv, _mm256_loadu_si256((const __m256i *)(w1 + c + 32 * k)));
        }
    }
    for (; c + 32 <= cols; c += 32) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xu + c));
        a[0] = _mm256_dpbusd_avx_epi32(a[0], xv, _mm256_loadu_si256((const __m256i *)(w + c)));
        a[2] = _mm256_dpbusd_avx_epi32(a[2], xv, _mm256_loadu_si256((const __m256i *)(w1 + c)));
    }
    int32_t s0 = hsum_epi32(_mm256_add_epi32(a[0], a[1])), s1 = hsum_epi32(_mm256_add_epi32(a[2], a[3]));
    for (; c < cols; c++) {
        s0 += (int32_t)w[c] * xu[c];
        s1 += (int32_t)w1[c] * xu[c];
    }
    out[0] = s0;
    out[1] = s1;
}

/* |x| of len (<= AX_MAX) int8 */
enum { AX_MAX = 8192 };
static inline void abs_i8(const int8_t *x, int64_t len, int8_t *ax) {
    int64_t c = 0;
    for (; c + 32 <= len; c += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x + c));
        _mm256_storeu_si256((__m256i *)(ax + c), _mm256_sign_epi8(v, v));
    }
    for (; c < len; c++) ax[c] = (int8_t)(x[c] < 0 ? -x[c] : x[c]);
}

/* Rows [r0, r1) of a Q8 matrix against one token (decode), two rows a pass
 * (an odd last row as a pair of itself: ldw 0); rows longer than AX_MAX in
 * column chunks (|x| made again per chunk; integer sums, exact in any order). */
static void q8_one_avx2(const int8_t *w, const float *row_scale, int64_t cols, const int8_t *x, float xs, int64_t r0,
                        int64_t r1, float *y) {
    int8_t ax[AX_MAX];
    if (cols <= AX_MAX) abs_i8(x, cols, ax);
    for (int64_t r = r0; r < r1; r += 2) {
        const int64_t ldw = r + 1 < r1 ? cols : 0;
        int32_t d[2] = {0, 0};
        for (int64_t c0 = 0; c0 < cols; c0 += AX_MAX) {
            const int64_t len = cols - c0 < AX_MAX ? cols - c0 : AX_MAX;
            if (cols > AX_MAX) abs_i8(x + c0, len, ax);
            int32_t o[2];
            q8_dot2(w + r * cols + c0, ldw, len, x + c0, ax, o);
            d[0] += o[0];
            d[1] += o[1];
        }
        y[r] = (float)d[0] * xs * row_scale[r];
        if (ldw) y[r + 1] = (float)d[1] * xs * row_scale[r + 1];
    }
}

static VNNI void q8_one_vnni(const int8_t *w, const float *row_scale, const int32_t *row_sum, int64_t cols,
                             const int8_t *x, float xs, int64_t r0, int64_t r1, float *y) {
    for (int64_t r = r0; r < r1; r += 2) {
        const int64_t ldw = r + 1 < r1 ? cols : 0;
        int32_t o[2];
        q8_dot2_vnni(w + r * cols, ldw, cols, x, o);
        y[r] = (float)(o[0] - 128 * row_sum[r]) * xs * row_scale[r];
        if (ldw) y[r + 1] = (float)(o[1] - 128 * row_sum[r + 1]) * xs * row_scale[r + 1];
    }
}

/* Rows [r0, r1) x tokens [0, n) of a Q8 matrix, y[t*ldy + r] =
 * (Σ w x - off·row_sum[r]) · xs[t] · row_scale[r] (off: 128 for VNNI's x + 128,
 * else 0). One token: two rows a pass, the weights in address order. More: tiles
 * (VNNI 4 rows x 3 tokens, plain 3 x 3), over 48-row slices that stay in L2
 * while the token groups pass. */
#define Q8_ROWS(NAME, TILE, ONE_TOKEN, OFF, ATTR, TR, TT) \
    ATTR void NAME(const k3_qjob *job, int64_t r0, int64_t r1) { \
        const int8_t *w = job->w->data, *x = job->xq; \
        const float *row_scale = job->w->row_scale, *xs = job->xs; \
        const int32_t *row_sum = job->w->row_sum; \
        const int64_t cols = job->w->cols, n = job->n, ldy = job->w->rows; \
        float *y = job->y; \
        K3_ASSERT(row_sum); /* made by k3_quant_q8_mat */ \
        if (n == 1) { \
            ONE_TOKEN; \
            return; \
        } \
        int32_t o[4][4]; \
        for (int64_t rb = r0; rb < r1; rb += 48) { \
            const int64_t re = rb + 48 < r1 ? rb + 48 : r1; \
            for (int64_t t0 = 0; t0 < n; t0 += TT) { \
                const int nt = n - t0 >= TT ? TT : (int)(n - t0); \
                const int8_t *xt = x + t0 * cols; \
                for (int64_t r = rb; r < re;) { \
                    const int nr = re - r >= TR ? TR : 1; \
                    const int8_t *wr = w + r * cols; \
                    if (nr == TR) { \
                        if (nt == TT) TILE(wr, cols, xt, cols, cols, TR, TT, o); \
                        else if (nt == 2) TILE(wr, cols, xt, cols, cols, TR, 2, o); \
                        else TILE(wr, cols, xt, cols, cols, TR, 1, o); \
                    } else { \
                        if (nt == TT) TILE(wr, cols, xt, cols, cols, 1, TT, o); \
                        else if (nt == 2) TILE(wr, cols, xt, cols, cols, 1, 2, o); \
                        else TILE(wr, cols, xt, cols, cols, 1, 1, o); \
                    } \
                    for (int i = 0; i < nr; i++) \
                        for (int t = 0; t < nt; t++) \
                            y[(t0 + t) * ldy + r + i] = \
                                (float)(o[i][t] - OFF * row_sum[r + i]) * xs[t0 + t] * row_scale[r + i]; \
                    r += nr; \
                } \
            } \
        } \
    }

#define ONE_AVX2 q8_one_avx2(w, row_scale, cols, x, xs[0], r0, r1, y)
#define ONE_VNNI q8_one_vnni(w, row_scale, row_sum, cols, x, xs[0], r0, r1, y)
Q8_ROWS(k3_q8_rows_avx2, q8_tile, ONE_AVX2, 0, , 3, 3)
Q8_ROWS(k3_q8_rows_avxvnni, q8_tile_vnni, ONE_VNNI, 128, VNNI, 4, 3)

/* ---- W4A8 on MXFP4_R4 tiles ------------------------------------------------------- */

/* 8 E8M0 bytes -> 2^(e-128) (the scale halved, for the doubled codes):
 * e << 23 read as a float is 2^(e-127) for e >= 1, raised to 2^-127
 * (0x00400000) for e = 0, then halved, exactly (e = 1, 0 give the
 * subnormals 2^-127, 2^-128, like vscalefps). */
INLINE __m256 half_scales8(const uint8_t *e8) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));
    const __m256i b = _mm256_max_epi32(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000));
    return _mm256_mul_ps(_mm256_castsi256_ps(b), _mm256_set1_ps(0.5f));
}

/* One row pair (rows 2p, 2p+1 of a tile) against NT prepared tokens:
 * acc[t] lanes 4i + b += block b of row i's integer dot (b, b + 4, ... over
 * the groups) times its scale. */
#define MX4_PAIR(NAME, ATTR, DOTS) \
    INLINE ATTR void NAME(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *xp, \
                          const int32_t *corr, int64_t ldc, const int NT, __m256 acc[8]) { \
        const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, \
                                             15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0); \
        const __m256i m4 = _mm256_set1_epi8(0x0f); \
        const __m256i ones = _mm256_set1_epi16(1); \
        (void)ones; \
        for (int64_t g = 0; g < cols; g += 128, packed += 256, scale += 16) { \
            __m256i lo[4], hi[4]; \
            if (NT == 1) /* the tile's 256 bytes of this group, 4 KB ahead */ \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) PF(packed + 64 * j); \
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) { \
                const __m256i pk = _mm256_loadu_si256((const __m256i *)(packed + 64 * j)); \
                lo[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(pk, m4)); \
                hi[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(pk, 4), m4)); \
            } \
            const __m256 s = half_scales8(scale); \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) { \
                const int8_t *x = xp + t * cols + g; \
                const __m256i c4 = \
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(corr + t * ldc + g / 32))); \
                __m256i d; \
                DOTS; \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[t]); \
            } \
        } \
    }

#define XB(k) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + 16 * (k))))
/* int16 sums of four stretches (< 24384 each), one vpmaddwd per nibble half */
#define DOTS_AVX2 \
    do { \
        __m256i sl = _mm256_maddubs_epi16(lo[0], XB(0)), sh = _mm256_maddubs_epi16(hi[0], XB(1)); \
        _Pragma("GCC unroll 4") for (int j = 1; j < 4; j++) { \
            sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(lo[j], XB(2 * j))); \
            sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(hi[j], XB(2 * j + 1))); \
        } \
        d = _mm256_add_epi32(c4, _mm256_add_epi32(_mm256_madd_epi16(sl, ones), _mm256_madd_epi16(sh, ones))); \
    } while (0)
/* the AVX-512 kernel's two chains: corr + the low halves, then the high ones */
#define DOTS_VNNI \
    do { \
        __m256i e = _mm256_setzero_si256(); \
        d = c4; \
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) { \
            d = _mm256_dpbusd_avx_epi32(d, lo[j], XB(2 * j)); \
            e = _mm256_dpbusd_avx_epi32(e, hi[j], XB(2 * j + 1)); \
        } \
        d = _mm256_add_epi32(d, e); \
    } while (0)

MX4_PAIR(mx4_pair_avx2, , DOTS_AVX2)
MX4_PAIR(mx4_pair_vnni, VNNI, DOTS_VNNI)

/* One token, a whole tile (both row pairs) per pass: each 64-byte stretch
 * read once, the token's 8 x 16 bytes loaded once per group for both pairs,
 * two independent chains. The same integer dots and the same FMA per lane as
 * MX4_PAIR, so the same bits. */
#define MX4_TILE1(NAME, ATTR, DOTS2) \
    INLINE ATTR void NAME(const uint8_t *packed, const uint8_t *scale, int64_t cols, const int8_t *x, \
                          const int32_t *corr, __m256 *acc0, __m256 *acc1) { \
        const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, \
                                             15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0); \
        const __m256i m4 = _mm256_set1_epi8(0x0f); \
        const __m256i ones = _mm256_set1_epi16(1); \
        (void)ones; \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(); \
        for (int64_t g = 0; g < cols; g += 128, packed += 256, scale += 16, x += 128) { \
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) PF(packed + 64 * j); \
            const __m256i c4 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(corr + g / 32))); \
            __m256i d0, d1; \
            DOTS2; \
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), half_scales8(scale), a0); \
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), half_scales8(scale + 8), a1); \
        } \
        *acc0 = a0; \
        *acc1 = a1; \
    }

#define DEC(P, LO, HI) \
    do { \
        const __m256i pk_ = _mm256_loadu_si256((const __m256i *)(P)); \
        LO = _mm256_shuffle_epi8(lut, _mm256_and_si256(pk_, m4)); \
        HI = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(pk_, 4), m4)); \
    } while (0)
#define XB1(k) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + 16 * (k))))
#define DOTS2_AVX2 \
    do { \
        __m256i sl0 = _mm256_setzero_si256(), sh0 = sl0, sl1 = sl0, sh1 = sl0; \
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) { \
            __m256i l0, h0, l1, h1; \
            DEC(packed + 64 * j, l0, h0); \
            DEC(packed + 64 * j + 32, l1, h1); \
            const __m256i xl = XB1(2 * j), xh = XB1(2 * j + 1); \
            sl0 = _mm256_add_epi16(sl0, _mm256_maddubs_epi16(l0, xl)); \
            sh0 = _mm256_add_epi16(sh0, _mm256_maddubs_epi16(h0, xh)); \
            sl1 = _mm256_add_epi16(sl1, _mm256_maddubs_epi16(l1, xl)); \
            sh1 = _mm256_add_epi16(sh1, _mm256_maddubs_epi16(h1, xh)); \
        } \
        d0 = _mm256_add_epi32(c4, _mm256_add_epi32(_mm256_madd_epi16(sl0, ones), _mm256_madd_epi16(sh0, ones))); \
        d1 = _mm256_add_epi32(c4, _mm256_add_epi32(_mm256_madd_epi16(sl1, ones), _mm256_madd_epi16(sh1, ones))); \
    } while (0)
#define DOTS2_VNNI \
    do { \
        __m256i e0 = _mm256_setzero_si256(), e1 = e0; \
        d0 = c4; \
        d1 = c4; \
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) { \
            __m256i l0, h0, l1, h1; \
            DEC(packed + 64 * j, l0, h0); \
            DEC(packed + 64 * j + 32, l1, h1); \
            const __m256i xl = XB1(2 * j), xh = XB1(2 * j + 1); \
            d0 = _mm256_dpbusd_avx_epi32(d0, l0, xl); \
            e0 = _mm256_dpbusd_avx_epi32(e0, h0, xh); \
            d1 = _mm256_dpbusd_avx_epi32(d1, l1, xl); \
            e1 = _mm256_dpbusd_avx_epi32(e1, h1, xh); \
        } \
        d0 = _mm256_add_epi32(d0, e0); \
        d1 = _mm256_add_epi32(d1, e1); \
    } while (0)

MX4_TILE1(mx4_tile1_avx2, , DOTS2_AVX2)
MX4_TILE1(mx4_tile1_vnni, VNNI, DOTS2_VNNI)

/* A row's four lanes (0 + 1) + (2 + 3), both rows of the pair: y[0], y[1]. */
INLINE void pair_store(__m256 a, float xs, float *y) {
    __m256 v = _mm256_add_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    y[0] = _mm256_cvtss_f32(v) * xs;
    y[1] = _mm_cvtss_f32(_mm256_extractf128_ps(v, 1)) * xs;
}

/* Rows [r0, r1) (whole tiles) x tokens [0, n) of a K3_W_MXFP4_R4 matrix
 * against activations prepared by k3_mx4_r4_prep: 16-row slices, groups of
 * up to 8 tokens, each tile's row pairs in turn. */
#define MX4_R4_ROWS(NAME, PAIR, TILE1, ATTR) \
    ATTR void NAME(const k3_qjob *job, int64_t r0, int64_t r1) { \
        const uint8_t *packed = job->w->data, *scale = job->w->scale; \
        const int8_t *xp = job->xq; \
        const int32_t *corr = job->corr; \
        const float *xs = job->xs; \
        const int64_t cols = job->w->cols, ldc = job->ldc, n = job->n, ldy = job->w->rows; \
        float *y = job->y; \
        if (n == 1) { /* decode: whole tiles in address order */ \
            for (int64_t r = r0; r < r1; r += 4) { \
                __m256 a0, a1; \
                TILE1(packed + r / 4 * 2 * cols, scale + r / 4 * (cols / 8), cols, xp, corr, &a0, &a1); \
                pair_store(a0, xs[0], y + r); \
                pair_store(a1, xs[0], y + r + 2); \
            } \
            return; \
        } \
        for (int64_t rb = r0; rb < r1; rb += 16) { \
            const int64_t re = rb + 16 < r1 ? rb + 16 : r1; \
            for (int64_t t0 = 0; t0 < n; t0 += 8) { \
                const int nt = n - t0 >= 8 ? 8 : (int)(n - t0); \
                const int8_t *xt = xp + t0 * cols; \
                const int32_t *ct = corr + t0 * ldc; \
                for (int64_t r = rb; r < re; r += 2) { \
                    /* row pair r, r + 1: bytes 32 (r % 4 / 2) into each stretch, scales 8 (r % 4 / 2) */ \
                    const uint8_t *pr = packed + r / 4 * 2 * cols + r % 4 / 2 * 32; \
                    const uint8_t *sr = scale + r / 4 * (cols / 8) + r % 4 / 2 * 8; \
                    __m256 acc[8]; \
                    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps(); \
                    switch (nt) { \
                    case 1: PAIR(pr, sr, cols, xt, ct, ldc, 1, acc); break; \
                    case 2: PAIR(pr, sr, cols, xt, ct, ldc, 2, acc); break; \
                    case 3: PAIR(pr, sr, cols, xt, ct, ldc, 3, acc); break; \
                    case 4: PAIR(pr, sr, cols, xt, ct, ldc, 4, acc); break; \
                    case 5: PAIR(pr, sr, cols, xt, ct, ldc, 5, acc); break; \
                    case 6: PAIR(pr, sr, cols, xt, ct, ldc, 6, acc); break; \
                    case 7: PAIR(pr, sr, cols, xt, ct, ldc, 7, acc); break; \
                    default: PAIR(pr, sr, cols, xt, ct, ldc, 8, acc); break; \
                    } \
                    for (int t = 0; t < nt; t++) pair_store(acc[t], xs[t0 + t], y + (t0 + t) * ldy + r); \
                } \
            } \
        } \
    }

MX4_R4_ROWS(k3_mx4_r4_rows_avx2, mx4_pair_avx2, mx4_tile1_avx2, )
MX4_R4_ROWS(k3_mx4_r4_rows_avxvnni, mx4_pair_vnni, mx4_tile1_vnni, VNNI)

/* = k3_mx4_r4_prep_ref (cols % 128 == 0), bit for bit: per group, each
 * block's 32 bytes split by vpshufb (per 128-bit lane: stretch 2h's even
 * columns, its odd ones, then stretch 2h + 1's) into dwords, which two
 * rounds of unpacks gather across the four blocks; corr from the exact
 * int32 block sums (maddubs by 1, madd by 1, two hadds). */
void k3_mx4_r4_prep_avx2(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr) {
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2, 4, 6, 1, 3, 5, 7,
                                           8, 10, 12, 14, 9, 11, 13, 15);
    const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < cols; g += 128) {
        __m256i a[4], v[4];
        for (int b = 0; b < 4; b++) {
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + g + 32 * b));
            a[b] = _mm256_shuffle_epi8(xb, split);
            v[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, xb), one16);
        }
        /* lane h of a[b] holds (as dwords) stretch 2h even, 2h odd, 2h+1 even, 2h+1 odd of block b */
        const __m256i l01 = _mm256_unpacklo_epi32(a[0], a[1]), l23 = _mm256_unpacklo_epi32(a[2], a[3]);
        const __m256i h01 = _mm256_unpackhi_epi32(a[0], a[1]), h23 = _mm256_unpackhi_epi32(a[2], a[3]);
        const __m256i e02 = _mm256_unpacklo_epi64(l01, l23), o02 = _mm256_unpackhi_epi64(l01, l23);
        const __m256i e13 = _mm256_unpacklo_epi64(h01, h23), o13 = _mm256_unpackhi_epi64(h01, h23);
        _mm256_storeu_si256((__m256i *)(xp + g), _mm256_permute2x128_si256(e02, o02, 0x20));
        _mm256_storeu_si256((__m256i *)(xp + g + 32), _mm256_permute2x128_si256(e13, o13, 0x20));
        _mm256_storeu_si256((__m256i *)(xp + g + 64), _mm256_permute2x128_si256(e02, o02, 0x31));
        _mm256_storeu_si256((__m256i *)(xp + g + 96), _mm256_permute2x128_si256(e13, o13, 0x31));
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        const __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)(corr + g / 32), _mm_mullo_epi32(sum, _mm_set1_epi32(-12)));
    }
}

/* ---- MXFP8 --------------------------------------------------------------------------- */

/* = k3_mxfp8_dequant_avx512 on 8 lanes: E4M3 bits moved into an fp16 (sign,
 * exponent and mantissa shifted left by 7), converted by F16C,
 * times 256 (the bias 15 - 7, exact), times the block scale (one rounding,
 * like the scalar e4m3 x scale). Every code but the NaNs. */
void k3_mxfp8_dequant_avx2(const uint8_t *q, const uint8_t *e, int64_t len, float *out) {
    const __m128i low7 = _mm_set1_epi16(0x7f), sign = _mm_set1_epi16(0x80);
    const __m256 x256 = _mm256_set1_ps(256.0f);
    for (int64_t b = 0; b < len; b += 32) {
        union {
            uint32_t u;
            float f;
        } sc;
        const uint8_t eb = e[b / 32];
        sc.u = eb == 255 ? 0x7fc00000u : eb ? (uint32_t)eb << 23 : 0x00400000u;
        const __m256 s = _mm256_set1_ps(sc.f);
        for (int h = 0; h < 32; h += 8) {
            const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(q + b + h)));
            const __m128i f16 =
                _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, sign), 8), _mm_slli_epi16(_mm_and_si128(c, low7), 7));
            _mm256_storeu_ps(out + b + h, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(f16), x256), s));
        }
    }
}
