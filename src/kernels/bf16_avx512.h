/*
 * bf16_avx512.h -- the pieces of the BF16 dot products (kernels_isa.h, "BF16
 * dot products") that the AVX-512 kernels (matmul_bf16_avx512bf16.c) and the
 * AMX ones (amx_kern.inc) share, so both make the same activations and the
 * same weights bit for bit: rounding fp32 to BF16, the two orders of an
 * activation block, the strips' MXFP4 decode and the conversions between the
 * strips' vectors and the AMX unit's B tiles. Include only from files
 * compiled with AVX-512 F/BW/VL (a 16 x 16 transpose of dwords is here too).
 *
 * Words: a dword holds two BF16 values, the low half first in memory. An
 * "E/O block" (the strips' order, kernels.h) is 16 dwords for 32 columns:
 * dword 2j = (high: column 4j, low: column 4j + 2), dword 2j + 1 = (high:
 * 4j + 1, low: 4j + 3). A "B row" k of a block (TDPBF16PS's pairing) is
 * (low: column 2k, high: column 2k + 1).
 */
#ifndef K3_KERNELS_BF16_AVX512_H
#define K3_KERNELS_BF16_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#define K3B_INLINE static inline __attribute__((always_inline))

/* fp32 bits rounded so that their top 16 bits are k3_f32_to_bf16's result:
 * to nearest even, NaN made quiet (the low 16 bits are left as they fall). */
K3B_INLINE __m512i k3b_round_hi(__m512i u) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
}

/* 32 floats from x (len <= 32 of them, zeros after) as BF16 words in the
 * order idx gives: word m = column (idx[m] - 1) / 2. */
K3B_INLINE __m512i k3b_block(const float *x, int len, __m512i idx) {
    const __mmask16 m0 = len >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << len) - 1);
    const __mmask16 m1 = len >= 32 ? (__mmask16)0xffff : len > 16 ? (__mmask16)((1u << (len - 16)) - 1) : 0;
    const __m512i a = k3b_round_hi(_mm512_castps_si512(_mm512_maskz_loadu_ps(m0, x)));
    const __m512i b = k3b_round_hi(_mm512_castps_si512(_mm512_maskz_loadu_ps(m1, x + 16)));
    return _mm512_permutex2var_epi16(a, idx, b);
}

/* The word orders for k3b_block: columns in order (an AMX A tile's row), and
 * the E/O block. */
K3B_INLINE __m512i k3b_idx_natural(void) {
    return _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19,
                            17, 15, 13, 11, 9, 7, 5, 3, 1);
}
/* word 4j = column 4j + 2, 4j + 1 = 4j, 4j + 2 = 4j + 3, 4j + 3 = 4j + 1 */
K3B_INLINE __m512i k3b_idx_eo(void) {
    return _mm512_set_epi16(2 * 29 + 1, 2 * 31 + 1, 2 * 28 + 1, 2 * 30 + 1, 2 * 25 + 1, 2 * 27 + 1, 2 * 24 + 1,
                            2 * 26 + 1, 2 * 21 + 1, 2 * 23 + 1, 2 * 20 + 1, 2 * 22 + 1, 2 * 17 + 1, 2 * 19 + 1,
                            2 * 16 + 1, 2 * 18 + 1, 2 * 13 + 1, 2 * 15 + 1, 2 * 12 + 1, 2 * 14 + 1, 2 * 9 + 1,
                            2 * 11 + 1, 2 * 8 + 1, 2 * 10 + 1, 2 * 5 + 1, 2 * 7 + 1, 2 * 4 + 1, 2 * 6 + 1, 2 * 1 + 1,
                            2 * 3 + 1, 2 * 0 + 1, 2 * 2 + 1);
}

/* The BF16 of every E2M1 code, twice (vpermw reads 5 index bits, so the bit
 * above a nibble may be anything). -0 is taken as +0: a product with either
 * zero adds nothing to a sum that starts at +0. */
K3B_INLINE __m512i k3b_e2m1_table(void) {
    return _mm512_set_epi16((short)0xC0C0, (short)0xC080, (short)0xC040, (short)0xC000, (short)0xBFC0, (short)0xBF80,
                            (short)0xBF00, 0, 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0, (short)0xC0C0,
                            (short)0xC080, (short)0xC040, (short)0xC000, (short)0xBFC0, (short)0xBF80, (short)0xBF00, 0,
                            0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0);
}

/* E8M0 scales as what their power of two does to a BF16's bits, in both
 * words of a lane: the scales 2 <= e <= 252 the strips and k3_mat.bf16 take
 * (k3_bf16_mat_ok) keep every weight a normal BF16, so it is exact. Where
 * no lane's e is above 127 (weights up to 6: the usual case) a saturating
 * subtraction of (127 - e) << 7 does it and leaves 0 at 0; else the
 * exponent (e - 127) << 7 is added to the nonzero words. */
typedef struct k3b_sc {
    __m512i off; /* (127 - e) << 7, or (e - 127) << 7 where up */
    bool up;
} k3b_sc;
K3B_INLINE k3b_sc k3b_sc_of(__m512i e) {
    const bool up = _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(127)) != 0;
    const __m512i d = up ? _mm512_sub_epi32(e, _mm512_set1_epi32(127)) : _mm512_sub_epi32(_mm512_set1_epi32(127), e);
    const __m512i w = _mm512_and_si512(_mm512_slli_epi32(d, 7), _mm512_set1_epi32(0xffff));
    return (k3b_sc){_mm512_or_si512(w, _mm512_slli_epi32(w, 16)), up};
}
/* 16 lanes' scales from 16 bytes, or one for every lane */
K3B_INLINE k3b_sc k3b_scales16(const uint8_t *sc) {
    return k3b_sc_of(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc)));
}
K3B_INLINE k3b_sc k3b_scale1(uint8_t e) { return k3b_sc_of(_mm512_set1_epi32(e)); }

/* BF16 codes v times their scales. */
K3B_INLINE __m512i k3b_scale(__m512i v, k3b_sc s) {
    if (!s.up) return _mm512_subs_epu16(v, s.off);
    return _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7fff)), v, s.off);
}

/* Quad g of a K3_W_MXFP4_S16 block (16 lanes x 32 bits at p) as the E/O
 * vectors 4g..4g + 3: the quad's words shifted by 0, 4, 8, 12 bits index
 * the table. */
K3B_INLINE void k3b_mx4_quad_eo(const uint8_t *p, __m512i tbl, k3b_sc sc, __m512i v[4]) {
    const __m512i d = _mm512_loadu_si512((const void *)p);
    v[0] = k3b_scale(_mm512_permutexvar_epi16(d, tbl), sc);
    v[1] = k3b_scale(_mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4), tbl), sc);
    v[2] = k3b_scale(_mm512_permutexvar_epi16(_mm512_srli_epi16(d, 8), tbl), sc);
    v[3] = k3b_scale(_mm512_permutexvar_epi16(_mm512_srli_epi16(d, 12), tbl), sc);
}

/* The same quad as B rows 4g..4g + 3 (nibbles 4, 5; 0, 1; 6, 7; 2, 3 as a
 * lane's low and high word). */
K3B_INLINE void k3b_mx4_quad_b(const uint8_t *p, __m512i tbl, k3b_sc sc, __m512i b[4]) {
    const __m512i d = _mm512_loadu_si512((const void *)p), hi = _mm512_set1_epi32((int)0xffff0000);
    const __m512i i0 = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi32(d, 4), _mm512_srli_epi32(d, 16), 0xCA);
    const __m512i i1 = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi32(d, 12), d, 0xCA);
    const __m512i i2 = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi32(d, 12), _mm512_srli_epi32(d, 24), 0xCA);
    const __m512i i3 = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi32(d, 4), _mm512_srli_epi32(d, 8), 0xCA);
    b[0] = k3b_scale(_mm512_permutexvar_epi16(i0, tbl), sc);
    b[1] = k3b_scale(_mm512_permutexvar_epi16(i1, tbl), sc);
    b[2] = k3b_scale(_mm512_permutexvar_epi16(i2, tbl), sc);
    b[3] = k3b_scale(_mm512_permutexvar_epi16(i3, tbl), sc);
}

/* One stored MXFP4 row block (16 packed bytes, low nibble = even column) as
 * 32 BF16 in column order. */
K3B_INLINE __m512i k3b_mx4_row(const uint8_t *p, __m512i tbl, k3b_sc sc) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return k3b_scale(_mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), tbl), sc);
}

/* B rows 2j, 2j + 1 from E/O vectors 2j, 2j + 1, and back. */
K3B_INLINE void k3b_b_from_eo(__m512i e, __m512i o, __m512i *b0, __m512i *b1) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    *b0 = _mm512_ternarylogic_epi32(hi, o, _mm512_srli_epi32(e, 16), 0xCA);
    *b1 = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi32(o, 16), e, 0xCA);
}
K3B_INLINE void k3b_eo_from_b(__m512i b0, __m512i b1, __m512i *e, __m512i *o) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    *e = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi32(b0, 16), b1, 0xCA);
    *o = _mm512_ternarylogic_epi32(hi, b0, _mm512_srli_epi32(b1, 16), 0xCA);
}

/* 16 x 16 transpose of 32-bit elements: r[i] lane j <-> r[j] lane i. Turns
 * 16 rows of a block (32 BF16 each) into its 16 B rows. */
K3B_INLINE void k3b_tr16(__m512i r[16]) {
    __m512i a[16], c[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* c[4g + j], lane L: column 4L + j of rows 4g..4g+3 */
    for (int g = 0; g < 4; g++) {
        c[4 * g + 0] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
        c[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
        c[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
        c[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
    }
    /* row 4L + j of the result: lane L of c[4g + j] for g = 0..3 */
    for (int j = 0; j < 4; j++) {
        const __m512i u0 = _mm512_shuffle_i32x4(c[j], c[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(c[j], c[4 + j], 0xEE);
        const __m512i u2 = _mm512_shuffle_i32x4(c[8 + j], c[12 + j], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(c[8 + j], c[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
}

/* Rows [r0, r0 + 16) of a stored BF16 or MXFP4 matrix (rows past nrows and
 * columns past cols zero), block b, as B rows into r[16]. scale: MXFP4's
 * E8M0 array (NULL: BF16). */
K3B_INLINE void k3b_stored_b(const uint8_t *data, const uint8_t *scale, int64_t nrows, int64_t cols, int64_t r0,
                             int64_t b, __m512i r[16]) {
    const __m512i tbl = k3b_e2m1_table();
    const int64_t c0 = 32 * b, len = cols - c0 < 32 ? cols - c0 : 32;
    const __mmask32 m = len >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << len) - 1);
    for (int i = 0; i < 16; i++) {
        const int64_t row = r0 + i;
        if (row >= nrows) r[i] = _mm512_setzero_si512();
        else if (scale)
            r[i] = k3b_mx4_row(data + row * (cols / 2) + 16 * b, tbl, k3b_scale1(scale[row * (cols / 32) + b]));
        else r[i] = _mm512_maskz_loadu_epi16(m, (const uint16_t *)data + row * cols + c0);
    }
    k3b_tr16(r);
}

#endif /* K3_KERNELS_BF16_AVX512_H */
