/*
 * gemm_emu_amx.c -- the AMX kernels (amx_kern.inc) with every tile
 * instruction emulated in C, for tests on CPUs without the unit: the same
 * code around the tiles, so the layouts, tails and epilogues the tests check
 * are the ones the unit runs. The emulation follows the instructions'
 * definitions (Intel SDM: LDTILECFG, TILELOADD, TILESTORED, TILEZERO,
 * TDPBF16PS, TDPBSSD) and checks what the unit would fault on: a tile used
 * before a configuration, shapes that do not match. TDPBF16PS: per row of C,
 * the even and the odd products of each pair summed in two fp32 lanes by
 * fused multiply-adds over k (inputs' denormals as zero, results' flushed,
 * round to nearest even), then both added to C. TDPBSSD: exact int32 sums
 * (wrapping). Compiled with the AMX flags like gemm_amx.c, but it issues no
 * tile instruction: it runs on any CPU with AVX-512 (k3_amx_emu_possible).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common/error.h"

typedef struct emu_tile {
    uint8_t d[16][64] __attribute__((aligned(64)));
    int rows, colsb;
} emu_tile;

static _Thread_local struct {
    emu_tile t[8];
    int configured;
} g_emu;

static void emu_cfg(const void *cfg) {
    const uint8_t *c = cfg;
    K3_ASSERT(c[0] == 1); /* palette 1 */
    for (int t = 0; t < 8; t++) {
        emu_tile *x = &g_emu.t[t];
        x->colsb = c[16 + 2 * t] | c[17 + 2 * t] << 8;
        x->rows = c[48 + t];
        K3_ASSERT(x->colsb <= 64 && x->rows <= 16 && (x->rows == 0) == (x->colsb == 0));
        memset(x->d, 0, sizeof x->d);
    }
    g_emu.configured = 1;
}

static void emu_release(void) {
    K3_ASSERT(g_emu.configured);
    g_emu.configured = 0;
}

static emu_tile *emu_t(int t) {
    K3_ASSERT(g_emu.configured && t >= 0 && t < 8 && g_emu.t[t].rows > 0);
    return &g_emu.t[t];
}

static void emu_zero(int t) { memset(emu_t(t)->d, 0, sizeof g_emu.t[t].d); }

static void emu_load(int t, const void *p, int64_t stride) {
    emu_tile *x = emu_t(t);
    memset(x->d, 0, sizeof x->d);
    for (int r = 0; r < x->rows; r++) memcpy(x->d[r], (const uint8_t *)p + r * stride, (size_t)x->colsb);
}

static void emu_store(int t, void *p, int64_t stride) {
    emu_tile *x = emu_t(t);
    for (int r = 0; r < x->rows; r++) memcpy((uint8_t *)p + r * stride, x->d[r], (size_t)x->colsb);
}

/* The shape rules shared by both products: C rows = A rows, C columns = B
 * columns, A's 4-byte groups = B's rows. */
static void emu_shapes(const emu_tile *c, const emu_tile *a, const emu_tile *b) {
    K3_ASSERT(c->rows == a->rows && c->colsb == b->colsb && a->colsb / 4 == b->rows);
}

static void emu_bf16(int ci, int ai, int bi) {
    emu_tile *c = emu_t(ci);
    const emu_tile *a = emu_t(ai), *b = emu_t(bi);
    emu_shapes(c, a, b);
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ, round to nearest */
    const __mmask16 m = (__mmask16)((1u << (c->colsb / 4)) - 1);
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    for (int r = 0; r < c->rows; r++) {
        __m512 ev = _mm512_setzero_ps(), od = _mm512_setzero_ps();
        for (int k = 0; k < a->colsb / 4; k++) {
            uint32_t ad;
            memcpy(&ad, a->d[r] + 4 * k, 4);
            const __m512i bv = _mm512_load_si512(b->d[k]);
            ev = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32((int)(ad << 16))),
                                 _mm512_castsi512_ps(_mm512_slli_epi32(bv, 16)), ev);
            od = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32((int)(ad & 0xffff0000u))),
                                 _mm512_castsi512_ps(_mm512_and_si512(bv, hi)), od);
        }
        const __m512 cv = _mm512_add_ps(_mm512_load_ps((const float *)c->d[r]), _mm512_add_ps(ev, od));
        _mm512_store_ps((float *)c->d[r], _mm512_maskz_mov_ps(m, cv));
    }
    _mm_setcsr(csr);
}

static void emu_ssd(int ci, int ai, int bi) {
    emu_tile *c = emu_t(ci);
    const emu_tile *a = emu_t(ai), *b = emu_t(bi);
    emu_shapes(c, a, b);
    for (int r = 0; r < c->rows; r++)
        for (int n = 0; n < c->colsb / 4; n++) {
            uint32_t s;
            memcpy(&s, c->d[r] + 4 * n, 4);
            for (int k = 0; k < a->colsb / 4; k++)
                for (int i = 0; i < 4; i++)
                    s += (uint32_t)((int32_t)(int8_t)a->d[r][4 * k + i] * (int32_t)(int8_t)b->d[k][4 * n + i]);
            memcpy(c->d[r] + 4 * n, &s, 4);
        }
}

#define AMX_OPS k3_amx_ops_emu
#define AMX_NAME "amx-emulated"
#define TCFG(c) emu_cfg(c)
#define TRELEASE() emu_release()
#define TZERO(t) emu_zero(t)
#define TLOAD(t, p, s) emu_load(t, p, s)
#define TSTORE(t, p, s) emu_store(t, p, s)
#define TBF16(c, a, b) emu_bf16(c, a, b)
#define TSSD(c, a, b) emu_ssd(c, a, b)
#include "amx_kern.inc"
