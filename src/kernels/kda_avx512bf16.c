/*
 * kda_avx512bf16.c -- KDA's BF16 chunked form (kda.h) with its products on
 * vdpbf16ps, the "avx512-bf16" table's kernel: the bits of the AMX one
 * (kda_amx.c) and of k3_kda_chunked_bf_ref. Everything but the products is
 * kda_bf.h's.
 *
 * A product C = A B: lanes are 16 columns of C; A packed as BF16 rows in the
 * E/O order (bf16_avx512.h: dword 2j = k 4j (high), 4j + 2 (low); 2j + 1 =
 * 4j + 1, 4j + 3), each dword broadcast; B as the matching dword rows of 16
 * columns. vdpbf16ps adds a lane's high product, then its low one, so per
 * block of 32 k one chain walks the even k in order (E) and another the
 * odd ones (O); then C = C + (E + O), TDPBF16PS's sum.
 */
#include "kernels/kda_bf.h"
#include "kernels/bf16_avx512.h"
#include "kernels/kernels_isa.h"

#define DP(acc, a, b) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(b))

/* B (K x N) as [N / 16][K / 2][16] dwords: per block of 32 k, dword row 2j
 * = (high: k 4j, low: 4j + 2), 2j + 1 = (high: 4j + 1, low: 4j + 3). */
static void pack_b(int N, int K, const float *B, int64_t ldb, uint16_t *pb) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    for (int n = 0; n < N; n += 16)
        for (int k = 0; k < K; k += 4) {
            __m512i r[4];
            for (int i = 0; i < 4; i++)
                r[i] = k3b_round_hi(_mm512_castps_si512(_mm512_loadu_ps(B + (int64_t)(k + i) * ldb + n)));
            uint16_t *p = pb + ((int64_t)n * (K / 2) + (int64_t)(k / 2) * 16) * 2;
            _mm512_storeu_si512((void *)p, _mm512_ternarylogic_epi32(hi, r[0], _mm512_srli_epi32(r[2], 16), 0xCA));
            _mm512_storeu_si512((void *)(p + 32),
                                _mm512_ternarylogic_epi32(hi, r[1], _mm512_srli_epi32(r[3], 16), 0xCA));
        }
}

/* A = Atᵀ (At: K x M, row-major) in kbf_pack_a's layout: pack_b's dword rows
 * of 16 columns of At are 16 rows of A, transposed. */
static void pack_at(int M, int K, const float *At, int64_t ldat, uint16_t *pa) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    for (int m = 0; m < M; m += 16)
        for (int k = 0; k < K; k += 32) {
            __m512i v[16];
            for (int j = 0; j < 8; j++) {
                __m512i r[4];
                for (int i = 0; i < 4; i++)
                    r[i] = k3b_round_hi(_mm512_castps_si512(_mm512_loadu_ps(At + (int64_t)(k + 4 * j + i) * ldat + m)));
                v[2 * j] = _mm512_ternarylogic_epi32(hi, r[0], _mm512_srli_epi32(r[2], 16), 0xCA);
                v[2 * j + 1] = _mm512_ternarylogic_epi32(hi, r[1], _mm512_srli_epi32(r[3], 16), 0xCA);
            }
            k3b_tr16(v);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(pa + (int64_t)(m + i) * K + k), v[i]);
        }
}

/* C = A B from the packed operands, 4 rows x 2 column vectors at a time. */
static void dots(int M, int N, int K, const uint16_t *pa, const uint16_t *pb, float *C, int64_t ldc) {
    const int64_t bt = (int64_t)K * 16;
    for (int n = 0; n < N; n += 32) {
        const int nv = n + 16 < N ? 2 : 1;
        for (int m = 0; m < M; m += 4) {
            const int mr = M - m < 4 ? M - m : 4;
            __m512 acc[4][2];
            for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int k = 0; k < K; k += 32) {
                __m512 E[4][2], O[4][2];
                for (int i = 0; i < 4; i++) E[i][0] = E[i][1] = O[i][0] = O[i][1] = _mm512_setzero_ps();
                const uint16_t *b = pb + (int64_t)(n / 16) * bt + (int64_t)k * 16;
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                    __m512i be[2], bo[2];
                    for (int v = 0; v < nv; v++) {
                        be[v] = _mm512_loadu_si512((const void *)(b + v * bt + (2 * j) * 32));
                        bo[v] = _mm512_loadu_si512((const void *)(b + v * bt + (2 * j + 1) * 32));
                    }
                    for (int i = 0; i < mr; i++) {
                        const uint32_t *a = (const uint32_t *)(pa + (int64_t)(m + i) * K + k);
                        const __m512i ae = _mm512_set1_epi32((int)a[2 * j]), ao = _mm512_set1_epi32((int)a[2 * j + 1]);
                        for (int v = 0; v < nv; v++) {
                            E[i][v] = DP(E[i][v], ae, be[v]);
                            O[i][v] = DP(O[i][v], ao, bo[v]);
                        }
                    }
                }
                for (int i = 0; i < mr; i++)
                    for (int v = 0; v < nv; v++) acc[i][v] = _mm512_add_ps(acc[i][v], _mm512_add_ps(E[i][v], O[i][v]));
            }
            for (int i = 0; i < mr; i++)
                for (int v = 0; v < nv; v++) _mm512_storeu_ps(C + (int64_t)(m + i) * ldc + n + 16 * v, acc[i][v]);
        }
    }
}

static void kbf_mm(int M, int N, int K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                   uint16_t *pk) {
    uint16_t *pa = pk, *pb = pk + (int64_t)M * K;
    kbf_pack_a(M, K, A, lda, pa, k3b_idx_eo());
    pack_b(N, K, B, ldb, pb);
    dots(M, N, K, pa, pb, C, ldc);
}

static void kbf_mm_bt(int M, int N, int K, const float *A, int64_t lda, const float *Bt, int64_t ldbt, float *C,
                      int64_t ldc, uint16_t *pk) {
    uint16_t *pa = pk, *pb = pk + (int64_t)M * K;
    kbf_pack_a(M, K, A, lda, pa, k3b_idx_eo());
    kbf_pack_bt(N, K, Bt, ldbt, pb, k3b_idx_eo());
    dots(M, N, K, pa, pb, C, ldc);
}

static void kbf_mm_at(int M, int N, int K, const float *At, int64_t ldat, const float *B, int64_t ldb, float *C,
                      int64_t ldc, uint16_t *pk) {
    uint16_t *pa = pk, *pb = pk + (int64_t)M * K;
    pack_at(M, K, At, ldat, pa);
    pack_b(N, K, B, ldb, pb);
    dots(M, N, K, pa, pb, C, ldc);
}

void k3_kda_chunked_bf_avx512(const k3_kda_head *h, float *S, int chunk, float *work) { kbf_run(h, S, chunk, work); }
