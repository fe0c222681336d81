/*
 * quant_avx512.c -- AVX-512 VNNI kernels of the 8-bit matmuls (see quant.h
 * and kernels_isa.h), the "avx512" table's where the CPU has VNNI. vpdpbusd multiplies unsigned by signed bytes: for W8A8 the
 * activations go in as x + 128 and 128 Σw comes off; for W4A8 the weights go
 * in as 2·E2M1 + 12 and 12 Σx comes off. Integer sums, so exact.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common/error.h"
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"
#include "hsum_avx512.h"

/* ---- per-token activation quantization ----------------------------------- */

/* = k3_quant_act_i8_ref bit for bit: the same amax (max is order free), the
 * same fp32 products, vcvtps2dq rounds to nearest even like nearbyintf, and
 * |x·127/amax| never rounds past 127. */
float k3_quant_act_i8_avx512(const float *x, int64_t n, int8_t *q) {
    __m512 m = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    float amax = _mm512_reduce_max_ps(m);
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (amax == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    const float inv = 127.0f / amax;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (i = 0; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(q + i),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv))));
    for (; i < n; i++) {
        const float v = nearbyintf(x[i] * inv);
        q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : v);
    }
    return amax / 127.0f;
}

/* ---- W8A8 int8 tiles ------------------------------------------------------- */

/* Σ_c w[r][c] xu[t][c] for NR rows x NT tokens, with xu = x + 128 (unsigned
 * bytes, for vpdpbusd); the caller takes 128 Σ_c w[r][c] (the row sums made
 * at load) off. Integer, so exact in any order. */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *w, int64_t ldw, const uint8_t *xu, int64_t ldx,
                                                          int64_t cols, int NR, int NT, int32_t out[4][4]) {
    __m512i acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_si512();
    int64_t c = 0;
    __m512i wv[4], xv[4];
#define Q8_STEP(LOAD) \
    do { \
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) wv[r] = LOAD(w + r * ldw + c); \
        _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) xv[t] = LOAD(xu + t * ldx + c); \
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) \
            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], xv[t], wv[r]); \
    } while (0)
#define LOAD_FULL(p) _mm512_loadu_si512(p)
#define LOAD_TAIL(p) _mm512_maskz_loadu_epi8(m, p)
    for (; c + 64 <= cols; c += 64) Q8_STEP(LOAD_FULL);
    if (c < cols) {
        const __mmask64 m = (1ull << (cols - c)) - 1;
        Q8_STEP(LOAD_TAIL);
    }
#undef Q8_STEP
#undef LOAD_FULL
#undef LOAD_TAIL
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) out[r][t] = _mm512_reduce_add_epi32(acc[r][t]);
}

/* q8_tile with nr (1 or 4) and nt (1..4) known only at run time */
static void q8_tiles(const int8_t *w, int64_t cols, const uint8_t *xu, int nr, int nt, int32_t out[4][4]) {
#define T(NR) \
    switch (nt) { \
    case 1: q8_tile(w, cols, xu, cols, cols, NR, 1, out); break; \
    case 2: q8_tile(w, cols, xu, cols, cols, NR, 2, out); break; \
    case 3: q8_tile(w, cols, xu, cols, cols, NR, 3, out); break; \
    default: q8_tile(w, cols, xu, cols, cols, NR, 4, out); break; \
    }
    if (nr == 4) T(4) else T(1)
#undef T
}

/* How far ahead (bytes) the W4A8 tile kernel prefetches its weights into L2
 * (_MM_HINT_T1) at one token, as the AVX2 one does (quant_avx2.c): without
 * it a core's stream of routed experts from DRAM fell behind the AVX2
 * kernel's. (W8A8's row stream does not gain from it: the hardware follows
 * one long row.) */
enum { ONE_AHEAD = 4096 };
#define PF1(p) _mm_prefetch((const char *)(p) + ONE_AHEAD, _MM_HINT_T1)

/* One row against one token: four accumulators so the vpdpbusd chain is not
 * what limits a decode step. Σ w xu, like q8_tile. */
static inline int32_t q8_dot1(const int8_t *w, const uint8_t *xu, int64_t cols) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t c = 0;
    for (; c + 256 <= cols; c += 256) {
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(xu + c), _mm512_loadu_si512(w + c));
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(xu + c + 64), _mm512_loadu_si512(w + c + 64));
        a2 = _mm512_dpbusd_epi32(a2, _mm512_loadu_si512(xu + c + 128), _mm512_loadu_si512(w + c + 128));
        a3 = _mm512_dpbusd_epi32(a3, _mm512_loadu_si512(xu + c + 192), _mm512_loadu_si512(w + c + 192));
    }
    for (; c < cols; c += 64) {
        const __mmask64 m = cols - c >= 64 ? ~0ull : ((1ull << (cols - c)) - 1);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_maskz_loadu_epi8(m, xu + c), _mm512_maskz_loadu_epi8(m, w + c));
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}

/* ---- W8A8 on token panels (prefill) ------------------------------------------ */

/* k3_q8_panels_fn: one gather of 16 tokens' 4 bytes per 64-byte vector. */
void k3_q8_panels_avx512(const int8_t *xq, int64_t n, int64_t cols, uint8_t *out) {
    const int64_t ng = cols / 4;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)cols));
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t t0 = 0; t0 < n; t0 += 16, out += 16 * cols) {
        const __mmask16 m = n - t0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t0)) - 1);
        const int8_t *x = xq + t0 * cols;
        for (int64_t g = 0; g < ng; g++)
            _mm512_storeu_si512(out + 64 * g,
                                _mm512_xor_si512(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, x + 4 * g,
                                                                             1),
                                                 flip));
    }
}

/* Panels of the W8A8 prefill kernel: Q8P_V panels (48 tokens) x up to 8
 * rows per register block, the weights' 4-byte groups broadcast against a
 * panel's 16 tokens (so no horizontal sums: a lane is one token's dot);
 * columns in Q8P_KC blocks, so the 48 tokens' block (24 KB) stays in L1
 * while the rows of a Q8P_RB-row slice (in L2) pass; between column blocks
 * the int32 sums wait in a small buffer. */
enum { Q8P_V = 3, Q8P_KC = 256, Q8P_RB = 64 };

/* NR rows (w, stride ldw) x NV panels (xp, stride ldp) over column groups
 * [g0, g1): the sums start at 0 (first) or from c, and go back to c, or,
 * at the last block, through the epilogue into y (tokens t0.., nt of them):
 * y[t*ldy + r] = (float)(Σ w xu - 128 row_sum[r]) · xs[t] · row_scale[r],
 * the operations of the scalar formula, so the bits of every other path. */
static inline __attribute__((always_inline)) void q8p_block(const int8_t *w, int64_t ldw, const uint8_t *xp,
                                                            int64_t ldp, int64_t g0, int64_t g1, const int NR,
                                                            const int NV, __m512i *c, bool first, bool last,
                                                            const int32_t *row_sum, const float *row_scale,
                                                            const float *xs, int64_t nt, float *y, int64_t ldy) {
    __m512i acc[8][Q8P_V];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) acc[r][v] = first ? _mm512_setzero_si512() : c[r * Q8P_V + v];
    for (int64_t g = g0; g < g1; g++) {
        __m512i a[Q8P_V];
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) a[v] = _mm512_loadu_si512(xp + v * ldp + 64 * g);
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            int32_t wq;
            memcpy(&wq, w + r * ldw + 4 * g, 4);
            const __m512i b = _mm512_set1_epi32(wq);
#pragma GCC unroll 3
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], a[v], b);
        }
    }
    if (!last) {
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 3
            for (int v = 0; v < NV; v++) c[r * Q8P_V + v] = acc[r][v];
        return;
    }
    /* through a 16 x 8 buffer to one store of the NR rows per token: 16
     * scattered stores a row at y's stride (8 KB for 2048 rows: one cache
     * set) thrashed L1 */
    const __m512i ti = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(8));
    float tr[16 * 8] __attribute__((aligned(64)));
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) {
        const int64_t left = nt - 16 * v;
        const int mt = left >= 16 ? 16 : (int)left;
        const __mmask16 m = (__mmask16)((1u << mt) - 1);
        const __m512 sx = _mm512_maskz_loadu_ps(m, xs + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const __m512 f =
                _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(
                                                _mm512_sub_epi32(acc[r][v], _mm512_set1_epi32(128 * row_sum[r]))),
                                            sx),
                              _mm512_set1_ps(row_scale[r]));
            _mm512_i32scatter_ps(tr + r, ti, f, 4);
        }
        float *yv = y + 16 * v * ldy;
        for (int t = 0; t < mt; t++) {
            if (NR == 8) _mm256_storeu_ps(yv + t * ldy, _mm256_load_ps(tr + 8 * t));
            else if (NR == 4) _mm_storeu_ps(yv + t * ldy, _mm_load_ps(tr + 8 * t));
            else yv[t * ldy] = tr[8 * t];
        }
    }
}

static void q8p_rows(const k3_qjob *j, int64_t r0, int64_t r1) {
    const int8_t *w = j->w->data;
    const int64_t cols = j->w->cols, n = j->n, ldy = j->w->rows, ng = cols / 4, ldp = 16 * cols;
    const int64_t np = (n + 15) / 16;
    __m512i c[Q8P_RB * Q8P_V]; /* a slice's int32 sums between column blocks */
    for (int64_t rb = r0; rb < r1; rb += Q8P_RB) {
        const int64_t re = rb + Q8P_RB < r1 ? rb + Q8P_RB : r1;
        for (int64_t p0 = 0; p0 < np; p0 += Q8P_V) {
            const int nv = np - p0 >= Q8P_V ? Q8P_V : (int)(np - p0);
            const uint8_t *xp = j->xpan + p0 * ldp;
            const int64_t t0 = 16 * p0, nt = n - t0;
            /* a column block of the tokens (24 KB) stays in L1 while every
             * row of the slice passes */
            for (int64_t g0 = 0; g0 < ng; g0 += Q8P_KC / 4) {
                const int64_t g1 = g0 + Q8P_KC / 4 < ng ? g0 + Q8P_KC / 4 : ng;
                const bool first = g0 == 0, last = g1 == ng;
                for (int64_t rg = rb; rg < re;) {
                    const int nr = re - rg >= 8 ? 8 : re - rg >= 4 ? 4 : 1;
                    const int8_t *wr = w + rg * cols;
                    __m512i *cr = c + (rg - rb) * Q8P_V;
#define Q8P(NR, NV) \
    q8p_block(wr, cols, xp, ldp, g0, g1, NR, NV, cr, first, last, j->w->row_sum + rg, j->w->row_scale + rg, \
              j->xs + t0, nt, j->y + t0 * ldy + rg, ldy)
#define Q8P_NV(NR) \
    do { \
        if (nv == 1) Q8P(NR, 1); \
        else if (nv == 2) Q8P(NR, 2); \
        else Q8P(NR, 3); \
    } while (0)
                    if (nr == 8) {
                        Q8P_NV(8);
                    } else if (nr == 4) {
                        Q8P_NV(4);
                    } else {
                        Q8P_NV(1);
                    }
#undef Q8P_NV
#undef Q8P
                    rg += nr;
                }
            }
        }
    }
}

/* Rows [r0, r1) x tokens [0, n) of a Q8 matrix:
 * y[t*ldy + r] = (Σ w xu - 128 row_sum[r]) · xs[t] · row_scale[r].
 * Few tokens (decode): one row at a time against all of them, so the weights
 * stream in address order, which is what the prefetchers follow best. Many:
 * 4x4 tiles, blocked so a 64-row slice of W stays in L2 while the tokens pass. */
void k3_q8_rows_avx512(const k3_qjob *j, int64_t r0, int64_t r1) {
    const int8_t *w = j->w->data;
    const uint8_t *xu = (const uint8_t *)j->xq;
    const float *row_scale = j->w->row_scale, *xs = j->xs;
    const int32_t *row_sum = j->w->row_sum;
    const int64_t cols = j->w->cols, n = j->n, ldy = j->w->rows;
    float *y = j->y;
    K3_ASSERT(row_sum); /* made by k3_quant_q8_mat */
    if (j->xpan) {
        q8p_rows(j, r0, r1);
        return;
    }
    if (n == 1) {
        for (int64_t r = r0; r < r1; r++)
            y[r] = (float)(q8_dot1(w + r * cols, xu, cols) - 128 * row_sum[r]) * xs[0] * row_scale[r];
        return;
    }
    int32_t o[4][4];
    for (int64_t rb = r0; rb < r1; rb += 64) {
        const int64_t re = rb + 64 < r1 ? rb + 64 : r1;
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
            const int nt = n - t0 >= 4 ? 4 : (int)(n - t0);
            const uint8_t *xt = xu + t0 * cols;
            for (int64_t r = rb; r < re;) {
                const int nr = n > 4 && re - r >= 4 ? 4 : 1;
                q8_tiles(w + r * cols, cols, xt, nr, nt, o);
                for (int i = 0; i < nr; i++)
                    for (int t = 0; t < nt; t++)
                        y[(t0 + t) * ldy + r + i] =
                            (float)(o[i][t] - 128 * row_sum[r + i]) * xs[t0 + t] * row_scale[r + i];
                r += nr;
            }
        }
    }
}

/* ---- W4A8 MXFP4 ------------------------------------------------------------ */

/* k3_mx4_prep for whole groups of four blocks: two byte permutations over
 * the group's 128 activations (the even columns of each block, then the odd
 * ones), and the lane sums of both halves with vpdpbusd against ones. A
 * last group of fewer blocks goes to the scalar form. */
__attribute__((target("avx512vbmi"))) void k3_mx4_prep_avx512_vbmi(const int8_t *xq, int64_t cols, int8_t *xp,
                                                                   int32_t *corr) {
    uint8_t ie[64], io[64];
    for (int p = 0; p < 64; p++) {
        ie[p] = (uint8_t)(32 * (p / 16) + 2 * (p % 16));
        io[p] = (uint8_t)(ie[p] + 1);
    }
    const __m512i even = _mm512_loadu_si512(ie), odd = _mm512_loadu_si512(io);
    const __m512i ones = _mm512_set1_epi8(1), m12 = _mm512_set1_epi32(-12);
    int64_t base = 0, g = 0;
    for (; base + 128 <= cols; base += 128, g++) {
        const __m512i a = _mm512_loadu_si512(xq + base), b = _mm512_loadu_si512(xq + base + 64);
        const __m512i lo = _mm512_permutex2var_epi8(a, even, b), hi = _mm512_permutex2var_epi8(a, odd, b);
        _mm512_storeu_si512(xp + base, lo);
        _mm512_storeu_si512(xp + base + 64, hi);
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lo), ones, hi);
        _mm512_storeu_si512(corr + g * 16, _mm512_mullo_epi32(sum, m12));
    }
    if (base < cols) k3_mx4_prep_ref(xq + base, cols - base, xp + base, corr + g * 16);
}

/* k3_mx4_r4_prep: each half of a group's output is one two-source byte
 * permutation of its 128 activations; the block sums are vpdpbusd lane sums
 * (8 lanes a block), folded pairwise, then within each 128-bit quarter. */
__attribute__((target("avx512vbmi"))) void k3_mx4_r4_prep_avx512_vbmi(const int8_t *xq, int64_t cols, int8_t *xp,
                                                                      int32_t *corr) {
    uint8_t ix[128];
    for (int o = 0; o < 128; o++) /* o = 32j + 16h + 4b + k <- column 32b + 8j + 2k + h */
        ix[o] = (uint8_t)(32 * (o % 16 / 4) + 8 * (o / 32) + 2 * (o % 4) + o % 32 / 16);
    const __m512i i0 = _mm512_loadu_si512(ix), i1 = _mm512_loadu_si512(ix + 64);
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    const __m512i q0 = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i ones = _mm512_set1_epi8(1), m12 = _mm512_set1_epi32(-12);
    for (int64_t g = 0; g + 128 <= cols; g += 128) {
        const __m512i a = _mm512_loadu_si512(xq + g), b = _mm512_loadu_si512(xq + g + 64);
        _mm512_storeu_si512(xp + g, _mm512_permutex2var_epi8(a, i0, b));
        _mm512_storeu_si512(xp + g + 64, _mm512_permutex2var_epi8(a, i1, b));
        const __m512i sa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, a);
        const __m512i sb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, b);
        /* lanes 4q..4q+3: block q's pair sums */
        __m512i v = _mm512_add_epi32(_mm512_permutex2var_epi32(sa, ev, sb), _mm512_permutex2var_epi32(sa, od, sb));
        v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));
        v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
        _mm_storeu_si128((__m128i *)(corr + g / 32),
                         _mm512_castsi512_si128(_mm512_mullo_epi32(_mm512_permutexvar_epi32(q0, v), m12)));
    }
}

/* How far ahead (in packed bytes) the kernel prefetches its weights and
 * scales, into L2 (_MM_HINT_T1). A core decodes W4A8 at ~30 GB/s from cache
 * and reads ~30 GB/s from DRAM, but not both at once: from DRAM it got 17-20
 * GB/s, 60% of a plain read (presumably the ~12 vector ops that wait on each
 * missing line fill the scheduler, so few lines are in flight). 8 KB ahead
 * into L2 brings it to 21-24 on one core (decode: -1% per token at ~35 GB/s,
 * -2 to -2.5% at ~60, measured token against token in one process). Into L1
 * (T0) the same prefetches cost 20-30% (they hold L1's few miss buffers),
 * and 1-2 KB ahead is too close to help. Prefetches do not fault, so running
 * past a matrix's end is harmless. */
enum { MX4_AHEAD = 8192 };

/* Nibbles to codes with vpshufb: each index byte needs its top bits cleared. */
#define MX4_ROW mx4_row_shufb
#define MX4_TILE mx4_tile_shufb
#define MX4_TILES k3_mx4_r4_rows_avx512
#define MX4_ROWS k3_mx4_rows_avx512
#define MX4_ATTR
#define MX4_LO(pk) _mm512_shuffle_epi8(lut, _mm512_and_si512(pk, m4))
#define MX4_HI(pk) _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(pk, 4), m4))
#include "mx4_avx512.inc"
#undef MX4_ROW
#undef MX4_TILE
#undef MX4_TILES
#undef MX4_ROWS
#undef MX4_ATTR
#undef MX4_LO
#undef MX4_HI

/* With AVX512-VBMI, vpermb reads only the low 6 bits of each index and the
 * 16-entry table is repeated 4 times in lut: no masking. */
#define MX4_ROW mx4_row_vbmi
#define MX4_TILE mx4_tile_vbmi
#define MX4_TILES k3_mx4_r4_rows_avx512_vbmi
#define MX4_ROWS k3_mx4_rows_avx512_vbmi
#define MX4_ATTR __attribute__((target("avx512vbmi")))
#define MX4_LO(pk) _mm512_permutexvar_epi8(pk, lut)
#define MX4_HI(pk) _mm512_permutexvar_epi8(_mm512_srli_epi16(pk, 4), lut)
#include "mx4_avx512.inc"
#undef MX4_ROW
#undef MX4_TILE
#undef MX4_TILES
#undef MX4_ROWS
#undef MX4_ATTR
#undef MX4_LO
#undef MX4_HI

/* ---- W8A8 MXFP8 -------------------------------------------------------------- */

/* len (% 32 == 0) E4M3 codes with their E8M0 block scales -> fp32, the same
 * values as the scalar decode (quant.c): sign and the 7 low bits placed as an IEEE
 * half (s eeee mmm -> s 0eeee mmm0000000) is the E4M3 value times 2^-8, for
 * normals and subnormals alike; the half converts exactly. The NaN codes
 * 0x7F/0xFF, which the quantizer never writes, are not kept NaN. */
void k3_mxfp8_dequant_avx512(const uint8_t *q, const uint8_t *e, int64_t len, float *out) {
    const __m256i low7 = _mm256_set1_epi16(0x7f), sign = _mm256_set1_epi16(0x80);
    for (int64_t b = 0; b < len; b += 32) {
        const __m512 sc = _mm512_set1_ps(k3_e8m0_to_f32(e[b / 32])), x256 = _mm512_set1_ps(256.0f);
        for (int h = 0; h < 32; h += 16) {
            const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + b + h)));
            const __m256i f16 = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, sign), 8),
                                                _mm256_slli_epi16(_mm256_and_si256(c, low7), 7));
            /* the E4M3 value exactly, then one rounding like the scalar path */
            _mm512_storeu_ps(out + b + h, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(f16), x256), sc));
        }
    }
}
