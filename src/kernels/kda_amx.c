/*
 * kda_amx.c -- KDA's BF16 chunked form (kda.h) with its products on the AMX
 * tiles, the "amx" table's kernel: the bits of the vdpbf16ps one
 * (kda_avx512bf16.c) and of k3_kda_chunked_bf_ref. Everything but the
 * products is kda_bf.h's.
 *
 * A product C = A B: A packed as BF16 rows in column order (a tile row is
 * 32 k of one row), B as rows of k pairs (low: k = 2i, high: 2i + 1) of 16
 * columns; C tiles of 16 x 16, two row tiles x two column tiles at a time
 * (tmm0-3), A in tmm4-5, B in tmm6-7; every block of 32 k one TDPBF16PS,
 * which sums its even and odd pairs apart and adds them to C. Compiled with
 * the AMX flags; run only after k3_amx_init (the "amx" table holds it only
 * where the unit is granted).
 */
#include "kernels/kda_bf.h"
#include "kernels/bf16_avx512.h"
#include "kernels/kernels_isa.h"

#include "kernels/amx_tile.h"

#define TLOAD(t, p, s) AMX_HW_TLOAD(t, p, s)
#define TSTORE(t, p, s) AMX_HW_TSTORE(t, p, s)

/* B (K x N, row-major) as [N / 16][K / 2][16] dwords: row pair i of column
 * tile n = (low: row 2i, high: row 2i + 1). */
static void pack_b(int N, int K, const float *B, int64_t ldb, uint16_t *pb) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    for (int n = 0; n < N; n += 16)
        for (int i = 0; i < K / 2; i++) {
            const __m512i lo = k3b_round_hi(_mm512_castps_si512(_mm512_loadu_ps(B + (int64_t)(2 * i) * ldb + n)));
            const __m512i up = k3b_round_hi(_mm512_castps_si512(_mm512_loadu_ps(B + (int64_t)(2 * i + 1) * ldb + n)));
            _mm512_storeu_si512((void *)(pb + ((int64_t)n * (K / 2) + (int64_t)i * 16) * 2),
                                _mm512_ternarylogic_epi32(hi, up, _mm512_srli_epi32(lo, 16), 0xCA));
        }
}

/* A = Atᵀ (At: K x M, row-major) in kbf_pack_a's layout: pack_b's dword rows
 * of 16 columns of At are 16 rows of A, transposed. */
static void pack_at(int M, int K, const float *At, int64_t ldat, uint16_t *pa) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    for (int m = 0; m < M; m += 16)
        for (int k = 0; k < K; k += 32) {
            __m512i v[16];
            for (int i = 0; i < 16; i++) {
                const __m512i lo =
                    k3b_round_hi(_mm512_castps_si512(_mm512_loadu_ps(At + (int64_t)(k + 2 * i) * ldat + m)));
                const __m512i up =
                    k3b_round_hi(_mm512_castps_si512(_mm512_loadu_ps(At + (int64_t)(k + 2 * i + 1) * ldat + m)));
                v[i] = _mm512_ternarylogic_epi32(hi, up, _mm512_srli_epi32(lo, 16), 0xCA);
            }
            k3b_tr16(v);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(pa + (int64_t)(m + i) * K + k), v[i]);
        }
}

/* C = A B from the packed operands. */
static void tiles(int M, int N, int K, const uint16_t *pa, const uint16_t *pb, float *C, int64_t ldc) {
    const long lda = 2L * K, ldc4 = 4L * ldc;
    const int64_t bt = (int64_t)K * 16; /* words of a column tile of B */
    for (int n = 0; n < N; n += 32) {
        const int two_n = n + 16 < N;
        for (int m = 0; m < M; m += 32) {
            const int two_m = m + 16 < M;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k = 0; k < K; k += 32) {
                const uint16_t *a = pa + (int64_t)m * K + k, *b = pb + (int64_t)(n / 16) * bt + (int64_t)k * 16;
                TLOAD(4, a, lda);
                TLOAD(6, b, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_n) {
                    TLOAD(7, b + bt, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_m) {
                    TLOAD(5, a + (int64_t)16 * K, lda);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_n) _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *c = C + (int64_t)m * ldc + n;
            TSTORE(0, c, ldc4);
            if (two_n) TSTORE(1, c + 16, ldc4);
            if (two_m) {
                TSTORE(2, c + 16 * ldc, ldc4);
                if (two_n) TSTORE(3, c + 16 * ldc + 16, ldc4);
            }
        }
    }
}

static void kbf_mm(int M, int N, int K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                   uint16_t *pk) {
    uint16_t *pa = pk, *pb = pk + (int64_t)M * K;
    kbf_pack_a(M, K, A, lda, pa, k3b_idx_natural());
    pack_b(N, K, B, ldb, pb);
    __asm__ volatile("" ::: "memory");
    tiles(M, N, K, pa, pb, C, ldc);
    __asm__ volatile("" ::: "memory");
}

static void kbf_mm_bt(int M, int N, int K, const float *A, int64_t lda, const float *Bt, int64_t ldbt, float *C,
                      int64_t ldc, uint16_t *pk) {
    uint16_t *pa = pk, *pb = pk + (int64_t)M * K;
    kbf_pack_a(M, K, A, lda, pa, k3b_idx_natural());
    kbf_pack_bt(N, K, Bt, ldbt, pb, k3b_idx_natural());
    __asm__ volatile("" ::: "memory");
    tiles(M, N, K, pa, pb, C, ldc);
    __asm__ volatile("" ::: "memory");
}

static void kbf_mm_at(int M, int N, int K, const float *At, int64_t ldat, const float *B, int64_t ldb, float *C,
                      int64_t ldc, uint16_t *pk) {
    uint16_t *pa = pk, *pb = pk + (int64_t)M * K;
    pack_at(M, K, At, ldat, pa);
    pack_b(N, K, B, ldb, pb);
    __asm__ volatile("" ::: "memory");
    tiles(M, N, K, pa, pb, C, ldc);
    __asm__ volatile("" ::: "memory");
}

void k3_kda_chunked_bf_amx(const k3_kda_head *h, float *S, int chunk, float *work) {
    amx_tcfg cfg;
    amx_tcfg_make(&cfg, 64, 16);
    AMX_HW_TCFG(&cfg);
    kbf_run(h, S, chunk, work);
    _tile_release();
}
